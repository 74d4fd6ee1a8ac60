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

from peer.p2p.identity import Identity
from peer.p2p.net import RealNetwork
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


async def serve_rpc(raw_port: int, echo_port: int) -> None:
    async with RPCNode(Identity.generate(), RealNetwork()) as node, \
            RPCNode(Identity.generate(), RealNetwork(), secure=False) as plain:
        async def echo(ctx, args):
            return args

        node.register("echo", echo)
        plain.register("echo", echo)
        address = await node.listen("127.0.0.1", 0)
        plain_address = await plain.listen("127.0.0.1", 0)
        print(json.dumps({"rpc_port": address[1], "plain_port": plain_address[1], "raw_port": raw_port,
                          "echo_port": echo_port}), flush=True)
        await trio.sleep_forever()


def server_main() -> None:
    torch.set_num_threads(1)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    threading.Thread(target=serve_raw, args=(listener,), daemon=True).start()
    echo_listener = socket.socket()
    echo_listener.bind(("127.0.0.1", 0))
    echo_listener.listen(512)
    threading.Thread(target=serve_raw_echo, args=(echo_listener,), daemon=True).start()
    trio.run(serve_rpc, listener.getsockname()[1], echo_listener.getsockname()[1])


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
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        server_main()
        return
    torch.set_num_threads(1)
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(server.stdout.readline())
        figures = trio.run(client_main, args, ports)
    finally:
        server.kill()
        server.wait()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
