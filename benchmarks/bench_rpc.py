"""RPC benchmark: raw loopback TCP vs a 64 MiB tensor through the RPC, and small-call rate and latency.

The server runs in a separate process (a separate peer, as in production), the client in this one.
(a) raw: plain blocking sockets; the client sends N bytes, the server receives them all and sends them back.
(b) rpc: the same bytes as one float32 tensor through `RPCNode.call("echo")`, result checked; the same
    store-and-forward pattern, so the ratio isolates what our codec, framing and RPC cost: once over an
    `--insecure-transport` connection (`tensor_ratio_to_raw`, comparable with the figures from before the secure
    channel) and once over the default sealed one (`secure_tensor_ratio_to_raw`: AES-256-GCM both ways, twice).
(c) echo calls with 1, 16 and 256 concurrent callers on one (sealed, the default) connection: calls/s, p50 and
    p99 latency, each against a baseline measured in the same run: the same number of trio tasks echoing 8 bytes
    over plain TCP streams (one stream per caller, no codec, framing or RPC), so `echo_ratio_to_raw_N` says what
    our RPC costs over the bare event loop and socket on whatever machine and day it runs; and 16 callers over an
    insecure connection, so `secure_echo_ratio_16` says what the sealing costs small calls.
(d) relays: a third process runs a relay (`peer.p2p.relay_service.RelayService`, byte caps off: the figures are
    the relay's own cost, the caps a policy), the server process a second, non-listening peer reserved with it;
    one small call at a time directly and through the circuit (`direct_p50_ms`, `relay_p50_ms`), the tensor
    round trip through the circuit against the direct sealed one (`relay_tensor_ratio_to_direct`), and the time
    from an in-process `--reachability private` daemon's start until a trainer (its own RPC node and DHT client)
    has used one of its experts through a relay (`private_expert_ready_s`).
The last line of output is one JSON object with the figures; the `*_ratio*` ones compare across days.

Usage: python benchmarks/bench_rpc.py [--mib 64] [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch
import trio

from peer.p2p.identity import Identity, PeerID
from peer.p2p.net import RealNetwork
from peer.p2p.relay_service import RelayReservations, RelayService
from peer.p2p.rpc import RPCNode

# -------------------------------------------------------------------------------------------- server process


def serve_raw(listener: socket.socket) -> None:
    buffers: dict[int, bytearray] = {}  # reused across repeats: the best run measures the socket, not malloc
    while True:
        connection, _ = listener.accept()
        with connection:
            header = connection.recv(8, socket.MSG_WAITALL)
            if len(header) < 8:
                continue
            size = int.from_bytes(header, "little")
            buffer = buffers.setdefault(size, bytearray(size))
            view = memoryview(buffer)
            received = 0
            while received < size:
                received += connection.recv_into(view[received:], size - received)
            connection.sendall(buffer)


def serve_raw_echo(listener: socket.socket) -> None:
    """Baseline for (c): every connection echoes 8-byte messages in its own thread."""

    def echo(connection: socket.socket) -> None:
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                message = connection.recv(8, socket.MSG_WAITALL)
                if len(message) < 8:
                    return
                connection.sendall(message)

    while True:
        connection, _ = listener.accept()
        threading.Thread(target=echo, args=(connection,), daemon=True).start()


async def serve_rpc(raw_port: int, echo_port: int, relay: tuple[str, int] | None) -> None:
    async with RPCNode(Identity.generate(), RealNetwork()) as node, \
            RPCNode(Identity.generate(), RealNetwork(), secure=False) as plain, \
            RPCNode(Identity.generate(), RealNetwork()) as private, trio.open_nursery() as nursery:
        async def echo(ctx, args):
            return args

        node.register("echo", echo)
        plain.register("echo", echo)
        private.register("echo", echo)
        address = await node.listen("127.0.0.1", 0)
        plain_address = await plain.listen("127.0.0.1", 0)
        relayed = None
        if relay is not None:  # the private peer: never listens, reached through the relay process only
            relay_id, relay_port = PeerID.from_hex(relay[0]), relay[1]

            async def candidates():
                return [(relay_id, ("127.0.0.1", relay_port))]

            def changed(where):
                private.announce = where

            reservations = RelayReservations(private, candidates, on_change=changed, want=1)
            nursery.start_soon(reservations.run)
            with trio.fail_after(30):
                await reservations.wait_reserved()
            relayed = list(private.announce)
        print(json.dumps({"rpc_port": address[1], "plain_port": plain_address[1], "raw_port": raw_port,
                          "echo_port": echo_port, "relayed": relayed}), flush=True)
        await trio.sleep_forever()


async def serve_relay() -> None:
    async with RPCNode(Identity.generate(), RealNetwork()) as node, trio.open_nursery() as nursery:
        address = await node.listen("127.0.0.1", 0)
        await nursery.start(RelayService(node, limit=64).run)
        print(json.dumps({"relay": [node.peer_id.hex(), address[1]]}), flush=True)
        await trio.sleep_forever()


def server_main(relay: tuple[str, int] | None) -> None:
    torch.set_num_threads(1)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    threading.Thread(target=serve_raw, args=(listener,), daemon=True).start()
    echo_listener = socket.socket()
    echo_listener.bind(("127.0.0.1", 0))
    echo_listener.listen(512)
    threading.Thread(target=serve_raw_echo, args=(echo_listener,), daemon=True).start()
    trio.run(serve_rpc, listener.getsockname()[1], echo_listener.getsockname()[1], relay)


# -------------------------------------------------------------------------------------------- client


def raw_roundtrip(port: int, payload: bytes) -> float:
    sink = bytearray(len(payload))
    view = memoryview(sink)
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        connection.sendall(len(payload).to_bytes(8, "little"))
        connection.sendall(payload)
        received = 0
        while received < len(payload):
            received += connection.recv_into(view[received:], len(payload) - received)
        elapsed = time.perf_counter() - start
    assert sink == payload
    return elapsed


async def rpc_roundtrip(node: RPCNode, address, tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    result = await node.call(address, "echo", tensor, timeout=120)
    elapsed = time.perf_counter() - start
    assert torch.equal(result, tensor)
    return elapsed


async def echo_load(node: RPCNode, address, concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def caller() -> None:
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            await node.call(address, "echo", b"ping", timeout=10)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "calls_per_s": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
    }


async def raw_echo_load(port: int, concurrency: int, seconds: float) -> float:
    """Calls/s of `concurrency` trio tasks, each echoing 8 bytes over its own plain TCP stream."""
    count = 0
    streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(concurrency)]
    stop_at = time.perf_counter() + seconds

    async def caller(stream: trio.SocketStream) -> None:
        nonlocal count
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while time.perf_counter() < stop_at:
            await stream.send_all(b"pingpong")
            received = b""
            while len(received) < 8:
                chunk = await stream.receive_some(8 - len(received))
                if not chunk:
                    raise RuntimeError("raw echo server closed the connection")
                received += chunk
            count += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for stream in streams:
            nursery.start_soon(caller, stream)
    elapsed = time.perf_counter() - start
    for stream in streams:
        await stream.aclose()
    return count / elapsed


async def alternating_p50_ms(node: RPCNode, addresses: list, seconds: float) -> list[float]:
    """One small call at a time for `seconds`, to each address in turn (so a loaded machine's moods hit all
    alike): the median latency of each."""
    latencies: list[list[float]] = [[] for _ in addresses]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for index, address in enumerate(addresses):
            start = time.perf_counter()
            await node.call(address, "echo", b"x" * 8, timeout=10)
            latencies[index].append(time.perf_counter() - start)
    return [statistics.median(each) * 1e3 for each in latencies]


async def private_expert_ready() -> float:
    """Seconds from a private daemon's start until a trainer has used one of its experts through a relay."""
    from dht.node import DHTNode
    from moe.calls import forward
    from moe.declare import get_experts
    from peer.daemon import Daemon, DaemonConfig
    from peer.p2p.relay import is_relayed

    async with trio.open_nursery() as nursery:
        public = Daemon(DaemonConfig(host="127.0.0.1", experts="pub.[0:1]", hidden_dim=8, reachability="public"))
        await nursery.start(public.run)
        assert public.rpc is not None and public.rpc.address is not None
        bootstrap = public.rpc.address
        start = time.perf_counter()
        private = Daemon(DaemonConfig(host="127.0.0.1", experts="priv.[0:1]", hidden_dim=8,
                                      reachability="private", initial_peers=[bootstrap]))
        nursery.start_soon(private.run)
        async with RPCNode(Identity.generate(), RealNetwork()) as rpc, \
                DHTNode.open("127.0.0.1", 0, [bootstrap], client_mode=True) as dht:
            with trio.fail_after(60):
                while True:
                    location = (await get_experts(dht, ["priv.0"]))["priv.0"]
                    if location is not None and is_relayed(location.address):
                        try:
                            await forward(rpc, location.address, PeerID.from_hex(location.peer_id_hex), "priv.0",
                                          [torch.ones(2, 8)], timeout=5)
                            break
                        except Exception as error:  # noqa: BLE001 - a bench retries whatever the first try met
                            print(f"(d) not ready yet: {error}")
                    await trio.sleep(0.02)
        ready = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return ready


async def client_main(args: argparse.Namespace, ports: dict) -> dict:
    size = args.mib * 1024 * 1024
    tensor = torch.rand(size // 4)
    payload = tensor.numpy().tobytes()
    raw_times = [await trio.to_thread.run_sync(raw_roundtrip, ports["raw_port"], payload)
                 for _ in range(args.repeats)]
    raw_gbps = 2 * size / min(raw_times) / 1e9
    figures: dict = {"raw_gbytes_per_s": round(raw_gbps, 3), "tensor_mib": args.mib}
    print(f"(a) raw loopback socket, {args.mib} MiB each way: {raw_gbps:.2f} GB/s "
          f"(best of {args.repeats}: {min(raw_times) * 1e3:.1f} ms)")
    async with RPCNode(Identity.generate(), RealNetwork()) as node, \
            RPCNode(Identity.generate(), RealNetwork(), secure=False) as plain_node:
        address = ("127.0.0.1", ports["rpc_port"])
        plain_address = ("127.0.0.1", ports["plain_port"])
        for client, where in ((node, address), (plain_node, plain_address)):
            await client.call(where, "echo", None, timeout=10)  # connect + handshake outside the timings
        for label, client, where, key in (("insecure", plain_node, plain_address, "tensor"),
                                          ("sealed", node, address, "secure_tensor")):
            times = [await rpc_roundtrip(client, where, tensor) for _ in range(args.repeats)]
            gbps = 2 * size / min(times) / 1e9
            figures[f"{key}_gbytes_per_s"] = round(gbps, 3)
            figures[f"{key}_ratio_to_raw"] = round(gbps / raw_gbps, 3)
            print(f"(b) {args.mib} MiB float32 tensor through RPC echo, {label}: {gbps:.2f} GB/s "
                  f"(best of {args.repeats}: {min(times) * 1e3:.1f} ms) = {gbps / raw_gbps:.0%} of raw")
        for concurrency in (1, 16, 256):
            raw_rate = await raw_echo_load(ports["echo_port"], concurrency, args.seconds)
            stats = await echo_load(node, address, concurrency, args.seconds)
            ratio = stats["calls_per_s"] / raw_rate
            print(f"(c) echo, {concurrency:3d} concurrent callers: {stats['calls_per_s']:8.0f} calls/s, "
                  f"p50 {stats['p50_ms']:.2f} ms, p99 {stats['p99_ms']:.2f} ms; plain TCP echo with as many "
                  f"trio tasks {raw_rate:8.0f} calls/s: ratio {ratio:.2f}")
            figures[f"raw_echo_calls_per_s_{concurrency}"] = round(raw_rate)
            figures[f"echo_ratio_to_raw_{concurrency}"] = round(ratio, 3)
            figures[f"echo_calls_per_s_{concurrency}"] = round(stats["calls_per_s"])
            figures[f"echo_p50_ms_{concurrency}"] = round(stats["p50_ms"], 3)
            figures[f"echo_p99_ms_{concurrency}"] = round(stats["p99_ms"], 3)
            if concurrency == 16:
                plain = await echo_load(plain_node, plain_address, concurrency, args.seconds)
                secure_ratio = stats["calls_per_s"] / plain["calls_per_s"]
                print(f"(c) echo, 16 callers over an insecure connection: {plain['calls_per_s']:8.0f} calls/s, "
                      f"p50 {plain['p50_ms']:.2f} ms: sealed/insecure {secure_ratio:.2f}")
                figures["plain_echo_calls_per_s_16"] = round(plain["calls_per_s"])
                figures["secure_echo_ratio_16"] = round(secure_ratio, 3)
        relayed = tuple(ports["relayed"])
        await node.call(relayed, "echo", None, timeout=10)  # the circuit and its handshake outside the timings
        direct_p50, relay_p50 = await alternating_p50_ms(node, [address, relayed], args.seconds)
        print(f"(d) one small call at a time: direct p50 {direct_p50:.3f} ms, through a relay {relay_p50:.3f} ms "
              f"(target <= {1.5 * direct_p50 + 0.5:.3f} ms)")
        direct_times, times = [], []
        for _ in range(args.repeats):  # alternating, as the small calls
            direct_times.append(await rpc_roundtrip(node, address, tensor))
            times.append(await rpc_roundtrip(node, relayed, tensor))
        relay_gbps = 2 * size / min(times) / 1e9
        tensor_ratio = min(direct_times) / min(times)
        print(f"(d) {args.mib} MiB tensor through a relay: {relay_gbps:.2f} GB/s = {tensor_ratio:.0%} of direct "
              f"sealed (target >= 40%)")
        figures.update(direct_p50_ms=round(direct_p50, 3), relay_p50_ms=round(relay_p50, 3),
                       relay_tensor_gbytes_per_s=round(relay_gbps, 3),
                       relay_tensor_ratio_to_direct=round(tensor_ratio, 3))
    ready = await private_expert_ready()
    print(f"(d) a private daemon's expert used by a trainer through a relay {ready:.2f} s after its start "
          f"(target <= 5 s)")
    figures["private_expert_ready_s"] = round(ready, 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--relay", nargs=2, help=argparse.SUPPRESS)  # the relay's PeerID (hex) and port
    args = parser.parse_args()
    if args.serve_relay:
        trio.run(serve_relay)
        return
    if args.serve:
        server_main((args.relay[0], int(args.relay[1])) if args.relay else None)
        return
    torch.set_num_threads(1)
    relay = subprocess.Popen([sys.executable, __file__, "--serve-relay"], stdout=subprocess.PIPE, text=True)
    server = None
    try:
        relay_id, relay_port = json.loads(relay.stdout.readline())["relay"]
        server = subprocess.Popen([sys.executable, __file__, "--serve", "--relay", relay_id, str(relay_port)],
                                  stdout=subprocess.PIPE, text=True)
        ports = json.loads(server.stdout.readline())
        figures = trio.run(client_main, args, ports)
    finally:
        for process in (server, relay):
            if process is not None:
                process.kill()
                process.wait()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
