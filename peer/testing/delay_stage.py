"""The user-space delay stage of the WAN testbed: one-way delay, jitter and loss per (source, destination) pair.

Why it exists: this kernel has no `sch_netem`, so nothing in `tc` can delay packets. The testbed routes every
packet that should be impaired into a TUN device in its "internet" namespace (policy routing on the incoming
veth); this process reads each packet from the TUN, drops it with the pair's loss probability or holds it in a
heap until its release time, and writes it back into the TUN, from where the kernel routes it to the destination
host as if it had just arrived (see `peer.testing.wan` and docs/testbed.md).

Release time of a packet of pair (s, d) arriving at `t`: `max(previous release of (s, d), t + delay + U(-jitter,
+jitter))`: jitter never reorders packets of one pair (TCP would read reordering as loss), packets of different
pairs are independent. Each pair has its own random generator seeded from (seed, s, d), so a pair's losses and
jitter depend only on the seed and that pair's own packet sequence, not on other traffic.

Configuration is one JSON document given on the command line (inline, or `@path` to read a file), never the
environment:

    {"tun": "wan0",                        name of the TUN device to create (in the current namespace)
     "seed": 1,
     "pairs": [["10.99.1.2", "10.99.2.2", 0.025, 0.005, 0.0], ...],   src, dst, delay s, jitter s, loss 0..1
     "nice": -10,                          optional: scheduling priority (the network must not starve under load)
     "watch_stdin": true}                  optional: exit when stdin reaches EOF (the parent died)

Packets of pairs not listed pass through at once. Non-IPv4 packets are dropped. It prints `ready` once the TUN
exists, a JSON line of counters on SIGUSR1 and on exit (SIGTERM/SIGINT or EOF on stdin); on SIGHUP it reads the
`@path` configuration again (its pairs; the testbed adds hosts that way) and prints `reloaded`.

The loop is built for packet rate: one `select` per wake-up, then every readable packet read in a batch
(non-blocking), then every due packet written; per packet it keeps only a heap entry (release, sequence, bytes).
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import ipaddress
import json
import os
import random
import resource
import select
import signal
import struct
import sys
import time
from typing import Any

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PR_SET_TIMERSLACK = 29
BATCH = 512  # packets read per wake-up at most, so releases are not starved by a flood of arrivals
IDLE_WAIT = 0.5  # seconds to wait when nothing is held (stdin EOF and signals still wake it at once)
LATE_BUCKET = 1e-4  # lateness histogram: 0.1 ms buckets
LATE_BUCKETS = 200  # up to 20 ms; later packets count in the last bucket


def open_tun(name: str) -> int:
    """Create TUN device `name` (raw IP packets, no packet-info header) and return its non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def pair_key(source: str, destination: str) -> bytes:
    """The 8 bytes at offset 12 of an IPv4 header (source and destination address) for a pair."""
    return ipaddress.IPv4Address(source).packed + ipaddress.IPv4Address(destination).packed


class Stopped(Exception):
    """Raised by the SIGTERM/SIGINT handler to leave the loop at once (even from inside `select`)."""


class Stage:
    """The heap and the per-pair state; `run` is the event loop."""

    def __init__(self, tun_fd: int, pairs: list[list[Any]], seed: int, watch_fd: int | None = None):
        self.fd = tun_fd
        self.watch_fd = watch_fd
        self.seed = seed
        # key -> [delay, jitter, loss, last release, rng]: a list, so the hot loop updates it in place
        self.pairs: dict[bytes, list[Any]] = {}
        self.configure(pairs)
        self.heap: list[tuple[float, int, bytes]] = []
        self.counts = {"received": 0, "released": 0, "lost": 0, "passed": 0, "not_ipv4": 0, "write_errors": 0,
                       "max_held": 0}
        self.late_histogram = [0] * (LATE_BUCKETS + 1)
        self.late_max = 0.0
        self.started = time.monotonic()

    def configure(self, pairs: list[list[Any]]) -> None:
        """Set the pairs' parameters (also on SIGHUP, while packets are held): a pair already known keeps its
        last release time and its random generator, so reconfiguring never reorders or replays a pair."""
        for source, destination, delay, jitter, loss in pairs:
            key = pair_key(source, destination)
            state = self.pairs.get(key)
            if state is None:
                state = self.pairs[key] = [0.0, 0.0, 0.0, 0.0, random.Random(f"{self.seed}:{source}:{destination}")]
            state[0:3] = [float(delay), float(jitter), float(loss)]

    def stats(self) -> dict[str, Any]:
        """Counters, lateness (how long after its release time each packet was written: the stage's own error)
        and the CPU time this process used."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        histogram = self.late_histogram
        total = sum(histogram)

        def percentile(fraction: float) -> float:
            if not total:
                return 0.0
            rank, seen = fraction * total, 0
            for bucket, count in enumerate(histogram):
                seen += count
                if seen >= rank:
                    return (bucket + 1) * LATE_BUCKET
            return LATE_BUCKETS * LATE_BUCKET

        return {**self.counts, "held": len(self.heap), "late_p50_s": percentile(0.5),
                "late_p99_s": percentile(0.99), "late_max_s": self.late_max,
                "cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": time.monotonic() - self.started}

    def run(self) -> None:
        fd, heap, pairs, counts = self.fd, self.heap, self.pairs, self.counts
        histogram, top = self.late_histogram, LATE_BUCKETS
        read, write, now_of, push, pop = os.read, os.write, time.monotonic, heapq.heappush, heapq.heappop
        watched = [fd] if self.watch_fd is None else [fd, self.watch_fd]
        sequence = 0
        size = 65536 + 64
        while True:
            now = now_of()
            wait = heap[0][0] - now if heap else IDLE_WAIT
            if wait > 0:
                ready = select.select(watched, [], [], wait)[0]
                if self.watch_fd is not None and self.watch_fd in ready and not os.read(self.watch_fd, 4096):
                    return
                now = now_of()
            for _ in range(BATCH):
                try:
                    packet = read(fd, size)
                except BlockingIOError:
                    break
                counts["received"] += 1
                if packet[0] >> 4 != 4:
                    counts["not_ipv4"] += 1
                    continue
                pair = pairs.get(packet[12:20])
                if pair is None:
                    counts["passed"] += 1
                    release = now
                else:
                    if pair[2] and pair[4].random() < pair[2]:
                        counts["lost"] += 1
                        continue
                    release = now + pair[0]
                    if pair[1]:
                        release += (2.0 * pair[4].random() - 1.0) * pair[1]
                    if release < pair[3]:
                        release = pair[3]
                    pair[3] = release
                sequence += 1
                push(heap, (release, sequence, packet))
            if len(heap) > counts["max_held"]:
                counts["max_held"] = len(heap)
            now = now_of()
            while heap and heap[0][0] <= now:
                release, _, packet = pop(heap)
                try:
                    write(fd, packet)
                except OSError:
                    counts["write_errors"] += 1
                    continue
                counts["released"] += 1
                late = now - release
                bucket = int(late / LATE_BUCKET)
                histogram[bucket if bucket < top else top] += 1
                if late > self.late_max:
                    self.late_max = late


def load_config(argument: str) -> dict[str, Any]:
    """The JSON document itself, or `@path` naming a file that holds it."""
    if argument.startswith("@"):
        with open(argument[1:]) as file:
            argument = file.read()
    config: dict[str, Any] = json.loads(argument)
    return config


def _tighten_timers() -> None:
    """Ask for 1 µs timer slack (default 50 µs): release times are then kept to what the scheduler allows."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _print_json(stats: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(stats) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m peer.testing.delay_stage '<json config>' | @config.json\n")
        return 2
    config = load_config(args[0])
    if "nice" in config:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, int(config["nice"]))
        except PermissionError:
            pass
    _tighten_timers()
    stage = Stage(open_tun(config["tun"]), config.get("pairs", []), int(config.get("seed", 0)),
                  watch_fd=sys.stdin.fileno() if config.get("watch_stdin") else None)

    def on_stop(signum: int, frame: object) -> None:
        raise Stopped

    def on_reload(signum: int, frame: object) -> None:
        stage.configure(load_config(args[0]).get("pairs", []))
        sys.stdout.write("reloaded\n")
        sys.stdout.flush()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGUSR1, lambda signum, frame: _print_json(stage.stats()))
    signal.signal(signal.SIGHUP, on_reload)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        stage.run()
    except Stopped:
        pass
    _print_json(stage.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
