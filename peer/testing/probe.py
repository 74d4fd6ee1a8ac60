"""Measuring a `WanTestbed`: round-trip time, TCP throughput and packet loss between two of its hosts.

Why: the testbed is only worth its accuracy, so the tests check it against each profile and docs/testbed.md
reports it; both use these probes. Each probe is a small program run inside a host's namespace
(`python -m peer.testing.probe <probe> ...`, standard library only, printing one JSON line) and a function here
that starts the two ends and returns the figure:

    rtts(wan, a, b)                 UDP echo round-trip times, seconds (pings paced, not waiting for replies)
    throughput(wan, sender, receiver)   TCP goodput in Mbit/s after a warm-up (the congestion control ramps up)
    loss(wan, a, b)                 fraction of paced UDP datagrams that did not arrive

`python -m peer.testing.probe table` builds testbeds and prints the accuracy table of docs/testbed.md,
`python -m peer.testing.probe congestion` its comparison of congestion controls and MTUs.
"""

from __future__ import annotations

import json
import os
import select
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peer.testing.wan import WanHost, WanTestbed

PORT = 7300
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


# ------------------------------------------------------------------------------------ the probes (in a namespace)


def _say(value: Any) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


def echo_server(port: int) -> None:
    """Echo every UDP datagram back to its sender, forever."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    _say("ready")
    while True:
        data, peer = sock.recvfrom(2048)
        sock.sendto(data, peer)


def pinger(address: str, port: int, count: int, interval: float, wait: float) -> None:
    """Send `count` numbered datagrams every `interval` s; print the round-trip times of the answered ones."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect((address, port))
    sock.setblocking(False)
    sent: dict[int, float] = {}
    rtts: list[float] = []
    start = time.monotonic()
    deadline = start + count * interval + wait
    number = 0
    while time.monotonic() < deadline and len(rtts) < count:
        now = time.monotonic()
        if number < count and now >= start + number * interval:
            sent[number] = now
            sock.send(number.to_bytes(4, "big") + bytes(60))
            number += 1
            continue
        next_send = start + number * interval if number < count else deadline
        if select.select([sock], [], [], max(0.0, min(next_send, deadline) - now))[0]:
            data = sock.recv(2048)
            arrived = time.monotonic()
            rtts.append(arrived - sent.pop(int.from_bytes(data[:4], "big"), arrived))
    _say({"rtts": rtts, "sent": count})


def sink(port: int) -> None:
    """Accept one TCP connection, read it to the end; print (seconds since the first byte, bytes so far) samples."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(1)
    _say("ready")
    connection, _ = server.accept()
    buffer = bytearray(1 << 20)
    total, first, last_sample = 0, 0.0, -1.0
    samples: list[tuple[float, int]] = []
    while True:
        received = connection.recv_into(buffer)
        now = time.monotonic()
        if not received:
            break
        if not total:
            first = now
        total += received
        if now - last_sample >= 0.01:
            samples.append((now - first, total))
            last_sample = now
    samples.append((time.monotonic() - first, total))
    _say({"samples": samples, "bytes": total})


def blaster(address: str, port: int, seconds: float, congestion: str = "") -> None:
    """Send as much as TCP takes to `address` for `seconds`, then close; `congestion` overrides the host's
    congestion control for this connection (root may pick any algorithm the kernel has)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    sock.settimeout(30)
    sock.connect((address, port))
    chunk = bytes(1 << 20)
    end = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < end:
        sent += sock.send(chunk)
    sock.close()
    _say({"bytes": sent})


def counter(port: int) -> None:
    """Count UDP datagrams until the sender's end marker (a datagram starting with b"E") arrives."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("0.0.0.0", port))
    _say("ready")
    count = 0
    while True:
        data = sock.recv(2048)
        if data[:1] == b"E":
            break
        count += 1
    _say({"received": count})


def sprayer(address: str, port: int, count: int, rate: float) -> None:
    """Send `count` small datagrams at `rate` per second, then a few end markers (one surviving is enough)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect((address, port))
    payload = b"D" + bytes(99)
    start = time.monotonic()
    for number in range(count):
        due = start + number / rate
        pause = due - time.monotonic()
        if pause > 0.002:
            time.sleep(pause)
        sock.send(payload)
    time.sleep(0.05)
    for _ in range(8):
        sock.send(b"E")
        time.sleep(0.01)
    _say({"sent": count})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    probes: dict[str, tuple[Callable[..., None], list[Callable[[str], Any]]]] = {
        "echo": (echo_server, [int]), "ping": (pinger, [str, int, int, float, float]),
              "sink": (sink, [int]), "blast": (blaster, [str, int, float, str]),
              "count": (counter, [int]), "spray": (sprayer, [str, int, int, float])}
    if args[:1] == ["table"]:
        print(accuracy_table())
        return 0
    if args[:1] == ["congestion"]:
        print(congestion_table())
        return 0
    if not args or args[0] not in probes or not 0 <= len(probes[args[0]][1]) - (len(args) - 1) <= 1:
        sys.stderr.write("usage: python -m peer.testing.probe table | congestion | <probe> <args>; probes: "
                         f"{', '.join(probes)}\n")
        return 2
    function, types = probes[args[0]]
    function(*[kind(value) for kind, value in zip(types, args[1:])])
    return 0


# ------------------------------------------------------------------------------------------ the orchestrators


def _probe(wan: WanTestbed, host: WanHost, *args: object) -> subprocess.Popen[str]:
    return wan.spawn(host, [sys.executable, "-m", "peer.testing.probe", *map(str, args)], cwd=_PACKAGE_ROOT,
                     stdout=subprocess.PIPE, text=True)


def _line(process: subprocess.Popen[str], timeout: float) -> Any:
    """The probe's next JSON line (waiting at most `timeout` seconds)."""
    assert process.stdout is not None
    if not select.select([process.stdout], [], [], timeout)[0]:
        process.kill()
        raise TimeoutError(f"probe {process.args!r} said nothing in {timeout} s")
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"probe {process.args!r} ended with status {process.wait()}")
    return json.loads(line)


def _stop(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait()


def rtts(wan: WanTestbed, a: WanHost, b: WanHost, *, count: int = 30, interval: float = 0.02,
         port: int = PORT) -> list[float]:
    """Round-trip times (seconds) of `count` UDP pings from `a` to an echo on `b`; lost pings are left out."""
    server = _probe(wan, b, "echo", port)
    try:
        _line(server, 20)
        client = _probe(wan, a, "ping", b.address, port, count, interval, 2.0)
        result = _line(client, 30 + count * interval)
        client.wait()
        samples: list[float] = result["rtts"]
        return samples
    finally:
        _stop(server)


def throughput(wan: WanTestbed, sender: WanHost, receiver: WanHost, *, seconds: float = 3.0, warmup: float = 1.0,
               congestion: str = "", port: int = PORT + 1) -> float:
    """TCP goodput in Mbit/s from `sender` to `receiver`, over a bulk transfer of `seconds`, the first `warmup`
    seconds after the first byte left out (slow start / BBR's start-up); `congestion` overrides the sender's
    congestion control for the transfer."""
    server = _probe(wan, receiver, "sink", port)
    try:
        _line(server, 20)
        client = _probe(wan, sender, "blast", receiver.address, port, seconds, congestion)
        result = _line(server, 60 + seconds)
        client.wait(timeout=30)
    finally:
        _stop(server)
    samples: list[tuple[float, int]] = [(float(at), int(total)) for at, total in result["samples"]]
    start = next((sample for sample in samples if sample[0] >= warmup), samples[-1])
    end = samples[-1]
    if end[0] - start[0] < 0.5:
        raise RuntimeError(f"the transfer lasted {end[0]:.2f} s, too little to measure after a {warmup} s warm-up")
    return (end[1] - start[1]) * 8 / (end[0] - start[0]) / 1e6


def loss(wan: WanTestbed, a: WanHost, b: WanHost, *, count: int = 20000, rate: float = 10000,
         port: int = PORT + 2) -> float:
    """The fraction of `count` UDP datagrams sent from `a` to `b` at `rate` per second that did not arrive."""
    server = _probe(wan, b, "count", port)
    try:
        _line(server, 20)
        client = _probe(wan, a, "spray", b.address, port, count, rate)
        result = _line(server, 60 + count / rate)
        client.wait(timeout=30)
    finally:
        _stop(server)
    received: int = result["received"]
    return 1 - received / count


# --------------------------------------------------------------------------------------------- the doc's table


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def accuracy_table(seed: int = 1) -> str:
    """Measure every profile between two hosts of it, and the mixed pairs home-lan (the asymmetric access link)
    and home-intercontinental; return the markdown table of docs/testbed.md. About two minutes."""
    from peer.testing.wan import WanTestbed, link

    rows = ["| pair | quantity | profile | measured | error |", "|---|---|---|---|---|"]

    def row(pair: str, quantity: str, expected: float, measured: float, unit: str) -> None:
        error = f"{(measured - expected) / expected:+.1%}" if expected else "n/a"
        rows.append(f"| {pair} | {quantity} | {expected:.4g} {unit} | {measured:.4g} {unit} | {error} |")

    pairs = [("lan", "lan"), ("home", "home"), ("intercontinental", "intercontinental"), ("home", "lan"),
             ("home", "intercontinental")]
    for first, second in pairs:
        with WanTestbed(seed=seed) as wan:
            a, b = wan.add_host("a", first), wan.add_host("b", second)
            name = f"{first}–{second}"
            there, back = link(a.profile, b.profile), link(b.profile, a.profile)
            samples = sorted(rtts(wan, a, b, count=200, interval=0.01))
            nominal = 1000 * (there.delay_s + back.delay_s)
            row(name, "RTT median", nominal, 1000 * statistics.median(samples), "ms")
            if there.jitter_s:
                deciles = statistics.quantiles(samples, n=10)
                rows[-1] = rows[-1].replace("RTT median", f"RTT median (p10–p90 {1000 * deciles[0]:.1f}–"
                                            f"{1000 * deciles[-1]:.1f} ms)")
            for sender, receiver in ((a, b), (b, a)):
                path = link(sender.profile, receiver.profile)
                before = cpu_seconds(wan.stage_pid or 0)
                mbit = throughput(wan, sender, receiver, seconds=5.0, warmup=1.5 + 4 * path.delay_s)
                stage_cpu = (cpu_seconds(wan.stage_pid or 0) - before) / 5.0
                row(name, f"{sender.name}→{receiver.name} goodput (stage CPU {stage_cpu:.0%})",
                    path.rate_mbit or 0.0, mbit, "Mbit/s")
            if there.loss:
                row(name, "loss a→b (100000 datagrams)", 100 * there.loss, 100 * loss(wan, a, b, count=100000), "%")
            stats = wan.stage_stats()
            if stats["released"]:
                rows.append(f"| {name} | stage lateness p50 / p99 / max | 0 | {1000 * stats['late_p50_s']:.1f} / "
                            f"{1000 * stats['late_p99_s']:.1f} / {1000 * stats['late_max_s']:.1f} ms | |")
    return "\n".join(rows)


def congestion_table(seed: int = 1, seconds: float = 10.0) -> str:
    """Goodput of CUBIC, BBR and Reno between two intercontinental hosts (150 ms RTT, 0.1% loss, 100 Mbit/s) at
    the testbed's MTU and at Ethernet's 1500 bytes, with the stage's CPU: why the testbed picks BBR and a
    jumbo MTU."""
    from peer.testing.wan import MTU, WanTestbed

    rows = ["| MTU | congestion control | goodput | stage CPU |", "|---|---|---|---|"]
    for mtu in (MTU, 1500):
        with WanTestbed(seed=seed, mtu=mtu) as wan:
            a, b = wan.add_host("a", "intercontinental"), wan.add_host("b", "intercontinental")
            for congestion in ("cubic", "bbr", "reno"):
                before = cpu_seconds(wan.stage_pid or 0)
                mbit = throughput(wan, a, b, seconds=seconds, warmup=2.0, congestion=congestion)
                stage_cpu = (cpu_seconds(wan.stage_pid or 0) - before) / seconds
                rows.append(f"| {mtu} | {congestion} | {mbit:.1f} Mbit/s | {stage_cpu:.0%} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
