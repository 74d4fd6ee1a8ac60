"""Flood benchmark: a daemon's DHT storage under a store flood, against the same daemon idle.

Why: plain kademlia `store` requests (any key, no expiry, no owner) from one host used to fill a daemon's record
cap in under a minute; then honest new keys were refused and every store to a new key walked all records, so
300 datagrams/s kept the daemon busy and `peer status` against it failed. This measures what the bounded, fair
storage (dht/storage.py) leaves of that.

Setup, all on loopback: the victim is a `peer.daemon.Daemon` (DHT + RPC + peer directory, no experts, default
DHTConfig) in this process. The flooder is a separate process (this script with `--flooder`) that sends stock
`store` datagrams for unique keys (built with dht/protocol.py, a fresh random sender id each, from many source
ports of 127.0.0.1 so the per-address rate limit does not hold it back) at `--rate` datagrams/s (default
2,500/s, the rate of the reported incident; 0: as fast as it can), until the daemon's store is full and the
flooded measurements are done. The honest peer is a client-mode DHTNode on 127.0.0.2: it
stores new keys and reads them back, one at a time, once with the daemon idle and once during the flood.

Figures:
  flood rate: datagrams/s the flooder sent, and `store` requests/s the daemon served;
  records held / bytes held by the daemon at the end (bounded by DHTConfig.max_records / max_bytes);
  RSS growth of this process (the daemon's) over the flood;
  honest store / get success (each operation tried once; a datagram the kernel dropped at the flooded socket
  counts as a failure);
  honest CPU ratio: CPU time (thread time) the daemon spent serving the honest peer's requests, per request,
  flooded / idle;
  status latency ratio: `peer status` (the CLI's code path, run in this process) against the daemon, flooded /
  idle, median of a few runs;
  the same two ratios once the flood stopped with the store still full of it ("full_after_flood"): what the
  held records cost, apart from the CPU the flood itself takes while it lasts.
The last line of output is one JSON object.

Usage: python benchmarks/bench_flood.py [--rate 2500] [--honest-ops 100] [--min-flood 100000] [--random-ids]
       python benchmarks/bench_flood.py --flooder HOST:PORT [--count N] [--ports P] [--value-size B]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import random
import select
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dht import protocol as proto  # noqa: E402

HONEST_HOST = "127.0.0.2"


# ------------------------------------------------------------------------------------------------ the flooder


def flood_datagrams(seed: int, start: int, count: int, value_size: int, random_ids: bool = False) -> list[bytes]:
    """`count` stock `store` requests for unique keys, from the flooder's one node id (a stock node's own) or,
    with `random_ids`, from a fresh random id each."""
    rng = random.Random(seed * 1_000_003 + start)
    sender = hashlib.sha1(b"flooder-%d" % seed).digest()
    datagrams = []
    for i in range(start, start + count):
        key_id = hashlib.sha1(b"flood-%d-%d" % (seed, i)).digest()
        value: Any = rng.randbytes(value_size) if value_size else i
        node_id = rng.randbytes(proto.NODE_ID_BYTES) if random_ids else sender
        datagrams.append(proto.encode_request(rng.randbytes(proto.MSG_ID_BYTES), "store", [node_id, key_id, value]))
    return datagrams


def run_flooder(target: tuple[str, int], count: int, ports: int, value_size: int, seed: int,
                random_ids: bool = False, rate: float = 0.0) -> None:
    """Send at least `count` unique keys, `rate` per second (0: as fast as possible), then keep going until
    stdin closes; print the total sent as JSON. Many source ports: the daemon's rate limit is per address (IP
    and port)."""
    sockets = []
    for _ in range(ports):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((target[0], 0))
        sockets.append(sock)
    sent, stdin_open = 0, True
    batch = max(1, int(rate / 100)) if rate else 5000  # paced: a batch every 10 ms
    started = time.perf_counter()
    print(json.dumps({"started": True}), flush=True)
    while sent < count or stdin_open:
        if rate:
            ahead = started + sent / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
        for i, datagram in enumerate(flood_datagrams(seed, sent, batch, value_size, random_ids)):
            try:
                sockets[i % ports].sendto(datagram, target)
            except OSError:
                pass  # ENOBUFS and the like: a flooder does not care
        sent += batch
        if stdin_open and select.select([sys.stdin], [], [], 0)[0]:
            stdin_open = bool(sys.stdin.buffer.read1(4096))
    with contextlib.suppress(BrokenPipeError):  # whoever started us may be gone
        print(json.dumps({"sent": sent, "seconds": time.perf_counter() - started}), flush=True)


# ------------------------------------------------------------------------------------------------ the benchmark


def mean(samples: list[float]) -> float:
    """The mean, or NaN when there is no sample (a phase where no honest request reached the daemon)."""
    return statistics.mean(samples) if samples else math.nan


def rounded(value: float, digits: int = 2) -> float | None:
    """A figure for the JSON line: None where it could not be measured."""
    return None if math.isnan(value) else round(value, digits)


def ratio(a: float, b: float) -> float | None:
    return rounded(a / b if b else math.nan)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class HonestMeter:
    """Thread CPU time the victim spends in `Server.handle` for requests from the honest host (the serving is
    synchronous, so a thread-time delta around it is that request's CPU and nothing else's)."""

    def __init__(self, node: Any, host: str):
        self.samples: list[float] = []
        self.storage_work: list[int] = []
        server, storage = node._server, node._storage
        handle = server.handle

        def measured(request: proto.Request, now: float, local_now: float) -> Any:
            if request.address[0] != host:
                return handle(request, now, local_now)
            work, started = storage.work, time.thread_time()
            try:
                return handle(request, now, local_now)
            finally:
                self.samples.append(time.thread_time() - started)
                self.storage_work.append(storage.work - work)

        server.handle = measured

    def take(self) -> tuple[list[float], list[int]]:
        samples, work = self.samples, self.storage_work
        self.samples, self.storage_work = [], []
        return samples, work


async def honest_round(honest: Any, tag: str, ops: int) -> dict[str, Any]:
    import trio

    stored = read = 0
    latencies = []
    for i in range(ops):
        key = f"honest-{tag}-{i}"
        started = trio.current_time()
        if await honest.store(key, i, honest.now() + 3600):
            stored += 1
        latencies.append(trio.current_time() - started)
        record = await honest.get(key)
        if record is not None and record.value == i:
            read += 1
    return {"store_success": stored / ops, "get_success": read / ops,
            "store_p50_ms": 1000 * statistics.median(latencies)}


async def status_latency(address: tuple[str, int], repeats: int) -> tuple[float, int]:
    """Median wall time of `peer status --json` against `address` (the CLI's own coroutine), and how many runs
    saw the daemon reachable."""
    import trio

    from dht.errors import DHTError
    from peer.cli import _run_status

    times, reachable = [], 0
    for _ in range(repeats):
        args = argparse.Namespace(initial_peers=[address], json=True, timeout=3.0)
        output = io.StringIO()
        started = trio.current_time()
        try:
            with contextlib.redirect_stdout(output):
                code = await _run_status(args)
        except DHTError as error:  # the CLI prints this as its one-line error: the daemon did not answer
            print(f"peer status failed: {error}", flush=True)
            code = 1
        times.append(trio.current_time() - started)
        reachable += code == 0 and json.loads(output.getvalue())["peers_reachable"] >= 1
    return statistics.median(times), reachable


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    from dht import DHTConfig, DHTNode
    from peer.daemon import Daemon, DaemonConfig

    daemon = Daemon(DaemonConfig(host="127.0.0.1"))
    result: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        info = await nursery.start(daemon.run)
        victim = daemon.dht
        meter = HonestMeter(victim, HONEST_HOST)
        honest_config = DHTConfig(max_timeout=1.0)
        async with DHTNode.open(HONEST_HOST, 0, [info.address], client_mode=True, config=honest_config) as honest:
            idle = await honest_round(honest, "idle", args.honest_ops)
            idle_cpu, idle_work = meter.take()
            status_idle, reachable_idle = await status_latency(info.address, args.status_repeats)
            print(f"idle: honest {idle}, {len(idle_cpu)} requests, {1e6 * mean(idle_cpu):.0f} us CPU "
                  f"each; peer status {1000 * status_idle:.0f} ms", flush=True)

            rss_before = rss_mb()
            served_before = victim.stats()["requests_served"].get("store", 0)
            flooder = await trio.lowlevel.open_process(
                [sys.executable, os.path.abspath(__file__), "--flooder", f"{info.address[0]}:{info.address[1]}",
                 "--count", str(args.min_flood), "--ports", str(args.ports), "--value-size", str(args.value_size),
                 "--rate", str(args.rate), *(["--random-ids"] if args.random_ids else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            flood_started = trio.current_time()
            with trio.move_on_after(args.max_flood_seconds):
                while not victim.stats()["storage"]["stores_refused_full"]:
                    await trio.sleep(0.2)
            filled_after = trio.current_time() - flood_started
            storage = victim.stats()["storage"]
            full = storage["stores_refused_full"] > 0
            print(f"flood: store {'full' if full else 'NOT full'} after {filled_after:.1f} s: {storage}", flush=True)

            flooded = await honest_round(honest, "flood", args.honest_ops)
            flood_cpu, flood_work = meter.take()
            status_flood, reachable_flood = await status_latency(info.address, args.status_repeats)
            served = victim.stats()["requests_served"].get("store", 0) - served_before
            flood_seconds = trio.current_time() - flood_started
            await flooder.stdin.aclose()
            output = b""
            with trio.fail_after(120):
                while chunk := await flooder.stdout.receive_some():
                    output += chunk
                await flooder.wait()
            sent = json.loads(output.decode().strip().splitlines()[-1])
            rss_after = rss_mb()
            storage = victim.stats()["storage"]
            print(f"flooded: honest {flooded}, {len(flood_cpu)} requests, "
                  f"{1e6 * mean(flood_cpu):.0f} us CPU each; peer status {1000 * status_flood:.0f} ms",
                  flush=True)
            print(f"flooder sent {sent['sent']} datagrams in {sent['seconds']:.1f} s; daemon served {served} stores "
                  f"in {flood_seconds:.1f} s; dropped {victim.stats()['dropped']}", flush=True)
            # the store still full of the flood, the flood over: what the held records alone cost honest requests
            after = await honest_round(honest, "after", args.honest_ops)
            after_cpu, _ = meter.take()
            status_after, _ = await status_latency(info.address, args.status_repeats)
            print(f"after the flood, store full: honest {after}, {1e6 * mean(after_cpu):.0f} us CPU "
                  f"each; peer status {1000 * status_after:.0f} ms", flush=True)
            flooder_id = hashlib.sha1(b"flooder-%d" % args.seed).digest()
            flooder_in_table = flooder_id in victim.routing_table_ids()
            print(f"the flooder's id is in the daemon's routing table: {flooder_in_table}", flush=True)
        nursery.cancel_scope.cancel()
    config = DHTConfig()
    result.update({
        "flood_datagrams_sent": sent["sent"],
        "flood_rate_sent_per_s": round(sent["sent"] / sent["seconds"]),
        "flood_rate_served_per_s": round(served / flood_seconds),
        "store_full_after_s": round(filled_after, 1) if full else None,
        "records_held": storage["records_held"],
        "max_records": config.max_records,
        "bytes_held_mb": round(storage["bytes_held"] / 2**20, 1),
        "max_bytes_mb": round(config.max_bytes / 2**20, 1),
        "rss_growth_mb": round(rss_after - rss_before, 1),
        "honest_store_success_idle": idle["store_success"],
        "honest_store_success_flooded": flooded["store_success"],
        "honest_get_success_flooded": flooded["get_success"],
        "honest_store_p50_ms_idle": round(idle["store_p50_ms"], 2),
        "honest_store_p50_ms_flooded": round(flooded["store_p50_ms"], 2),
        "honest_cpu_us_idle": rounded(1e6 * mean(idle_cpu), 1),
        "honest_cpu_us_flooded": rounded(1e6 * mean(flood_cpu), 1),
        "honest_cpu_ratio": ratio(mean(flood_cpu), mean(idle_cpu)),
        "honest_storage_work_per_request_flooded": rounded(mean(flood_work), 1),
        "honest_cpu_ratio_full_after_flood": ratio(mean(after_cpu), mean(idle_cpu)),
        "status_latency_ratio_full_after_flood": round(status_after / status_idle, 2),
        "status_ms_idle": round(1000 * status_idle, 1),
        "status_ms_flooded": round(1000 * status_flood, 1),
        "status_latency_ratio": round(status_flood / status_idle, 2),
        "status_reachable_flooded": f"{reachable_flood}/{args.status_repeats}",
        "flooder_in_routing_table": flooder_in_table,
    })
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flooder", metavar="HOST:PORT", help="run as the flooder process against HOST:PORT")
    parser.add_argument("--count", type=int, default=100_000, help="flooder: unique keys to send at least")
    parser.add_argument("--ports", type=int, default=64, help="flooder: source ports to send from")
    parser.add_argument("--value-size", type=int, default=0, help="flooder: bytes per value (0: small ints)")
    parser.add_argument("--random-ids", action="store_true", help="flooder: a fresh sender id per datagram")
    parser.add_argument("--rate", type=float, default=2500.0,
                        help="flood datagrams per second (0: as fast as the flooder can send)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--honest-ops", type=int, default=100)
    parser.add_argument("--status-repeats", type=int, default=3)
    parser.add_argument("--min-flood", type=int, default=100_000, help="unique keys the flooder sends at least")
    parser.add_argument("--max-flood-seconds", type=float, default=120.0,
                        help="give up waiting for the daemon's store to fill after this long")
    args = parser.parse_args()
    if args.flooder:
        host, port = args.flooder.rsplit(":", 1)
        run_flooder((host, int(port)), args.count, args.ports, args.value_size, args.seed, args.random_ids,
                    args.rate)
        return
    import trio

    print(json.dumps(trio.run(benchmark, args)))


if __name__ == "__main__":
    main()
