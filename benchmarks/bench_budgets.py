"""Budgets benchmark (issue 40 Targets): the issue's attacks against a fresh swarm, honest work measured meanwhile.

The attacked daemon is a `peer join --reachability public` process on 127.0.0.1 (DHT, expert server, relay, at the
product's default limits); a second `peer join --reachability private` daemon is reached only through it (its
relay). The attackers and the honest peers are RPC / DHT nodes of this process, using only the wire protocol and
the DHT any stranger reaches. The daemon's RSS is read from /proc/PID/statm every 50 ms. Attacks, in order, with
the issue's sizes:

(B) relay bandwidth flood: one identity reserved at the relay holds 4 circuits (dialed from 127.0.0.2) and pushes
    64 KiB writes through them as fast as the relay lets it; an honest dialer's small relayed call (`moe.info` on
    the private daemon) is timed one at a time before and during the flood (`relay_latency_ratio_under_flood` =
    median during / median before, each over `--latency-calls` calls).
(A) relay slots: 300 bare connections that open the relay protocol and wait, 70 identities that reserve (one IP
    group) and each hold circuits dialed from 4 more IP groups, 3 passes; then fresh honest dialers each call the
    private daemon's expert through the relay (a new circuit each).
(C) two identities each complete a handshake and announce a 1 GiB message (1 MiB sent) and a 255 MiB one that they
    keep sending slowly (64 KiB every 0.2 s); honest 8 MiB `moe.forward` calls meanwhile.
(D) 400 connections that send a byte and then one more every second; fresh honest connections (a new identity
    and handshake each) call `moe.info` meanwhile; every trickling connection must be closed (by the handshake
    deadline or by eviction): the time until the last closed is reported.
(E) 1,000 concurrent `moe.forward` calls (512 KiB each) from one identity; honest calls from another identity
    meanwhile; then `--settle` seconds without calls, and the daemon's RSS after them.
(F) DiLoCo training, clean against attacked: `--trainers` `peer train --algorithm diloco --local-experts` processes
    (digits, hidden `--train-hidden`) bootstrapped through the attacked daemon; the attacked run has 10 identities
    storing, and re-storing every 2 s, 8,000-byte junk values expiring in ten years under the run's progress key
    and both matchmaking keys a run uses (`RUN.diloco.averaging`, `RUN.gradients.averaging`), plus declarations
    under the matchmaking keys, signed and well formed, that name a listener which accepts and never answers (the
    squat). An honest DHT client stores and reads back its own entry under the matchmaking keys meanwhile.
    `outer_steps_ratio_under_junk` = attacked outer steps per second / clean, over `--train-pairs` alternating
    pairs of runs (each run: its fewest outer steps over its longest `train_seconds`); every trainer must end with
    every outer step and one hash (each attacked run counts as one honest operation). DiLoCo's outer rounds do not
    read the matchmaking keys (offers go to a coordinator over RPC; the roster comes from the progress key), so for
    this run the squat only adds records the storers must hold; the junk under the progress key is what it reads.
(O) the accountant's cost on the RPC echo benchmark (bench_rpc.py (c), 16 callers on one sealed connection, server
    in a separate process): nodes at the default limits against nodes whose accountant charges and refuses
    nothing (`NoAccounting` below: `RPCNode.accountant` and the receive budget's replaced before any connection),
    alternating windows; `budget_overhead` = median over rounds of (calls/s without / calls/s with) - 1;
    `budget_cpu_overhead` the same for CPU seconds per call (this process and the server's together).

Figures (last line, one JSON object):
  honest_success_under_attack  share of the honest calls, dials and DHT stores / reads made during (A)-(F) that
                               succeeded (target 1.0);
  rss_growth_mb                the daemon's worst RSS over its level after warm-up, before any attack (target <= 128):
                               the peak during (A)-(D) and (F), and the level `--settle` s after the call flood of (E)
                               (the issue's check point for that attack); `rss_peak_growth_mb` also counts the peak
                               while the 1,000 calls of (E) are held;
  outer_steps_ratio_under_junk (target >= 0.77), relay_latency_ratio_under_flood (target <= 3), budget_overhead
                               (target <= 0.05).

`--quick` keeps the attack sizes and shortens the rest (fewer honest calls and echo windows, 10 s settle, one pair of
20-outer-step runs): about 1.5 minutes on 2 cores, the full run about 3.

Usage: .venv/bin/python benchmarks/bench_budgets.py [--quick] [--phases OBACDEF] [--settle 30] [--trainers 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import IO, Any, Awaitable, Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import trio  # noqa: E402

from averaging.assembly import Declaration  # noqa: E402
from averaging.progress import progress_key  # noqa: E402
from dht.node import DHTNode  # noqa: E402
from moe import calls  # noqa: E402
from moe.declare import get_experts  # noqa: E402
from peer.events import JoinWatcher  # noqa: E402
from peer.p2p import framing, relay, seal  # noqa: E402
from peer.p2p.budget import Accountant, Scope  # noqa: E402
from peer.p2p.handshake import Handshake, Role  # noqa: E402
from peer.p2p.identity import Identity, PeerID  # noqa: E402
from peer.p2p.net import Address, RealNetwork  # noqa: E402
from peer.p2p.relay import RelayLimitReached, ResponseReader  # noqa: E402
from peer.p2p.relay_service import POLL_METHOD, RESERVE_METHOD  # noqa: E402
from peer.p2p.rpc import BudgetExceeded, CallContext, RPCError, RPCNode  # noqa: E402
from peer.status import STATUS_METHOD  # noqa: E402
from peer.testing import hand_rolled  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
HIDDEN = 64  # the daemons' experts (ffn): an 8 MiB input is 32,768 rows, a 512 KiB one 2,048
TEN_YEARS = 10 * 365 * 86400.0
STARTED = time.monotonic()


def say(line: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f} s] {line}", flush=True)


# ------------------------------------------------------------------------------------------ child processes


class Child:
    """A subprocess of this benchmark, its stdout and stderr in files; killed by `stop` (always called)."""

    def __init__(self, name: str, command: list[str], workdir: Path):
        self.name = name
        self.out_path = workdir / f"{name}.out"
        self.err_path = workdir / f"{name}.err"
        self._out: IO[str] = open(self.out_path, "w")
        self._err: IO[str] = open(self.err_path, "w")
        self.process = subprocess.Popen(command, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL,
                                        cwd=ROOT, text=True)
        self.pid = self.process.pid

    def lines(self) -> list[str]:
        return self.out_path.read_text().splitlines()

    def stderr_tail(self, count: int = 15) -> str:
        return "\n".join(self.err_path.read_text().splitlines()[-count:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._out.close()
        self._err.close()


def wait_for_line(child: Child, found: Callable[[str], Any], timeout: float) -> Any:
    """Poll `child`'s stdout until `found(line)` is truthy for a line (returns it); RuntimeError at `timeout` or
    when the child exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in child.lines():
            result = found(line)
            if result:
                return result
        if child.process.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{child.name} gave no expected line within {timeout} s (exit {child.process.poll()}); "
                       f"stderr:\n{child.stderr_tail()}")


def start_daemon(name: str, args: list[str], workdir: Path, children: list[Child]) -> tuple[Child, str, str]:
    """`peer join ARGS` on 127.0.0.1; returns it, its PeerID (hex) and its HOST:PORT once it has joined."""
    child = Child(name, [sys.executable, "-m", "peer.cli", "join", "--host", "127.0.0.1", "--threads", "1",
                         "--log-level", "warning", *args], workdir)
    children.append(child)

    def joined(line: str) -> Any:
        return JoinWatcher().feed(line)

    event = wait_for_line(child, joined, 90.0)
    return child, event.peer_id, event.address


def parse_address(text: str) -> Address:
    host, port = text.rsplit(":", 1)
    return (host, int(port))


async def wait_exit(child: Child, timeout: float) -> int:
    with trio.fail_after(timeout):
        while (code := child.process.poll()) is None:
            await trio.sleep(0.2)
    return code


# ------------------------------------------------------------------------------------------ measurements


class RssSampler:
    """The attacked daemon's RSS every 50 ms, labelled with the phase running then."""

    def __init__(self, pid: int):
        self.path = f"/proc/{pid}/statm"
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.phase = "warm-up"
        self.samples: list[tuple[float, str, int]] = []

    def read(self) -> int:
        with open(self.path) as statm:
            return int(statm.read().split()[1]) * self.page

    async def run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.phase, self.read()))
            await trio.sleep(0.05)

    def peak(self, phase: str) -> int:
        return max((rss for _, label, rss in self.samples if label == phase), default=0)

    def level(self, seconds: float = 1.0) -> int:
        """Median RSS over the last `seconds`."""
        end = self.samples[-1][0]
        return int(statistics.median(rss for at, _, rss in self.samples if at >= end - seconds))


class Tally:
    """Honest operations per phase: tried, succeeded, and the first failures' messages."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.failures: list[str] = []

    async def attempt(self, phase: str, operation: Callable[[], Awaitable[Any]],
                      check: Callable[[Any], bool] = lambda result: True) -> bool:
        counts = self.counts.setdefault(phase, [0, 0])
        counts[1] += 1
        try:
            result = await operation()
            ok = check(result)
            why = f"unexpected result {str(result)[:100]}"
        except (RPCError, OSError, trio.TooSlowError, trio.BrokenResourceError, relay.RelayError) as error:
            ok, why = False, f"{type(error).__name__}: {error}"
        if ok:
            counts[0] += 1
        elif len(self.failures) < 10:
            self.failures.append(f"{phase}: {why[:300]}")
        return ok

    def line(self, phase: str) -> str:
        ok, tried = self.counts.get(phase, [0, 0])
        return f"honest {ok}/{tried} succeeded"

    def share(self) -> float:
        ok = sum(c[0] for c in self.counts.values())
        tried = sum(c[1] for c in self.counts.values())
        return ok / tried if tried else float("nan")


class NoAccounting(Accountant):
    """The accountant switched off: charges nothing and refuses nothing (the baseline of `budget_overhead`)."""

    def over(self, scopes: Iterable[Scope], resource: str, amount: float) -> tuple[Scope, float] | None:
        return None

    def take(self, scopes: Iterable[Scope], resource: str, amount: float = 1, *, peer: Any = None) -> None:
        return None

    def add(self, scopes: Iterable[Scope], resource: str, amount: float) -> None:
        return None

    def give_back(self, scopes: Iterable[Scope], resource: str, amount: float = 1) -> None:
        return None


def without_accounting(node: RPCNode) -> RPCNode:
    """`node` with its accountant off, before it listens or connects (a connection takes the node's accountant
    and receive budget when it is made)."""
    off = NoAccounting(dict(node.accountant.limits))
    node.accountant = off
    node.receive_budget = framing.ReceiveBudget(node.budget_limits.message_bytes_total,
                                                stall_timeout=node.budget_limits.message_stall_timeout,
                                                accountant=off)
    return node


# ------------------------------------------------------------------------------------------ (O) overhead


async def echo(context: CallContext, args: Any) -> Any:
    return args


async def serve_echo() -> None:
    """The server process of (O): an echo node at the default limits and one without accounting."""
    async with RPCNode(Identity.generate(), RealNetwork()) as default, \
            RPCNode(Identity.generate(), RealNetwork()) as off:
        without_accounting(off)
        ports = {}
        for name, node in (("default", default), ("off", off)):
            node.register("echo", echo)
            ports[name] = (await node.listen("127.0.0.1", 0))[1]
        print(json.dumps(ports), flush=True)
        await trio.sleep_forever()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process `pid` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def echo_window(node: RPCNode, address: Address, callers: int, seconds: float, server_pid: int | None = None
                      ) -> tuple[float, float]:
    """`callers` tasks calling echo on one connection for `seconds`: calls/s, and CPU seconds per call of this
    process and the server's together."""
    count = 0
    stop_at = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal count
        while time.perf_counter() < stop_at:
            await node.call(address, "echo", b"ping", timeout=10)
            count += 1

    cpu = time.process_time() + (cpu_seconds(server_pid) if server_pid else 0.0)
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(callers):
            nursery.start_soon(caller)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() + (cpu_seconds(server_pid) if server_pid else 0.0) - cpu
    return count / elapsed, cpu / max(count, 1)


async def overhead_client(ports: dict[str, int], server_pid: int, rounds: int, seconds: float) -> dict[str, Any]:
    async with RPCNode(Identity.generate(), RealNetwork()) as default, \
            RPCNode(Identity.generate(), RealNetwork()) as off:
        without_accounting(off)
        pairs = {"default": (default, ("127.0.0.1", ports["default"])), "off": (off, ("127.0.0.1", ports["off"]))}
        for node, address in pairs.values():  # connect, handshake and warm up outside the timings
            await echo_window(node, address, 16, 0.3)
        rates: dict[str, list[float]] = {"default": [], "off": []}
        cpu: dict[str, list[float]] = {"default": [], "off": []}
        for index in range(rounds):
            for name in (("default", "off") if index % 2 == 0 else ("off", "default")):
                rate, per_call = await echo_window(*pairs[name], 16, seconds, server_pid)
                rates[name].append(rate)
                cpu[name].append(per_call)
        return {"rates": rates,
                "overhead": statistics.median(o / d - 1 for o, d in zip(rates["off"], rates["default"])),
                "cpu_overhead": statistics.median(d / o - 1 for o, d in zip(cpu["off"], cpu["default"])),
                "cpu_us": {name: statistics.median(values) * 1e6 for name, values in cpu.items()}}


def phase_overhead(args: argparse.Namespace, workdir: Path, children: list[Child]) -> dict[str, Any]:
    server = Child("echo-server", [sys.executable, str(Path(__file__).resolve()), "--serve-echo"], workdir)
    children.append(server)
    ports = wait_for_line(server, lambda line: json.loads(line) if line.startswith("{") else None, 60.0)
    result = trio.run(overhead_client, ports, server.pid, args.overhead_rounds, args.seconds)
    server.stop()
    default, off = statistics.median(result["rates"]["default"]), statistics.median(result["rates"]["off"])
    cpu = result["cpu_us"]
    say(f"(O) echo, 16 callers, {args.overhead_rounds} alternating windows of {args.seconds:g} s: "
        f"{default:,.0f} calls/s with the accountant, {off:,.0f} without: overhead {result['overhead']:+.1%} "
        f"(target <= 5%); CPU per call (client + server) {cpu['default']:.1f} us against {cpu['off']:.1f} us: "
        f"{result['cpu_overhead']:+.1%}")
    return {"budget_overhead": round(result["overhead"], 4), "echo_calls_per_s_accounted": round(default),
            "echo_calls_per_s_unaccounted": round(off), "budget_cpu_overhead": round(result["cpu_overhead"], 4),
            "echo_cpu_us_per_call_accounted": round(cpu["default"], 1),
            "echo_cpu_us_per_call_unaccounted": round(cpu["off"], 1)}


# ------------------------------------------------------------------------------------------ attackers' tools


async def connect_from(source_ip: str, address: Address) -> trio.SocketStream:
    """A stream to `address` from `source_ip` (any of 127.0.0.0/8 is loopback: another IP group to the relay)."""
    sock = trio.socket.socket()
    try:
        await sock.bind((source_ip, 0))
        await sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def hold_circuits(relay_address: Address, target: RPCNode, count: int, source_ip: str
                        ) -> tuple[list[trio.abc.Stream], list[trio.abc.Stream]]:
    """`count` circuits to `target` (reserved at the relay) as an attacker holds them: raw connect requests from
    `source_ip` (with a made-up `source`), taken by `target` over a poll and raw accepts. Returns the accepting
    and the dialing ends that the relay spliced, held open; the rest are closed."""
    await target.call(relay_address, RESERVE_METHOD, None, timeout=10)
    dialers: list[trio.abc.Stream] = []
    tokens: list[bytes] = []
    try:
        for _ in range(count):
            stream = await connect_from(source_ip, relay_address)
            dialers.append(stream)
            await stream.send_all(relay.connect_request(target.peer_id, PeerID(os.urandom(20))))
        with trio.move_on_after(10):
            while len(tokens) < count:
                offers = await target.call(relay_address, POLL_METHOD, None, timeout=10)
                tokens += [offer["token"] for offer in offers]
                if not offers:
                    break
    except BaseException:
        await close_all(dialers)
        raise

    async def spliced(stream: trio.abc.Stream) -> bool:
        try:
            with trio.fail_after(10):
                await relay.read_message(stream, ResponseReader())
            return True
        except (relay.RelayError, trio.BrokenResourceError, trio.TooSlowError, OSError):
            await stream.aclose()
            return False

    accepted: list[trio.abc.Stream] = []
    for token in tokens:
        stream = await trio.open_tcp_stream(*relay_address)
        await stream.send_all(relay.accept_request(token))
        if await spliced(stream):
            accepted.append(stream)
    dialed: list[trio.abc.Stream] = [stream for stream in dialers if await spliced(stream)]
    return accepted, dialed


async def close_all(streams: Iterable[trio.abc.Stream]) -> None:
    for stream in streams:
        with trio.move_on_after(1):
            await stream.aclose()


async def sealed_session(address: Address) -> tuple[trio.SocketStream, seal.Sealer]:
    """A fresh identity's handshake with the node at `address`, by hand (`Handshake`, the sans-I/O core), so that
    it can then send whatever frames it likes, sealed with the session's keys."""
    stream = await trio.open_tcp_stream(*address)
    shake = Handshake(Identity.generate(), Role.INITIATOR)
    await stream.send_all(shake.data_to_send())
    with trio.fail_after(10):
        events = await hand_rolled.handshake_reply(stream, shake)
    await stream.send_all(shake.data_to_send())
    keys = events[0].keys
    assert keys is not None
    return stream, seal.Sealer(keys.send)


def frame(stream_id: int, payload: bytes, total: int | None = None) -> bytes:
    """One data frame: the first of a message (announcing `total` bytes) or a continuation."""
    if total is None:
        return framing.HEADER.pack(framing.HEADER.size - 4 + len(payload), 0, stream_id) + payload
    return (framing.HEADER.pack(framing.HEADER.size - 4 + framing.TOTAL.size + len(payload), framing.FIRST,
                                stream_id) + framing.TOTAL.pack(total) + payload)


async def drain(stream: trio.abc.Stream, counter: list[int] | None = None) -> None:
    """Read and drop everything until the stream ends, adding the bytes read to `counter[0]` as they come."""
    try:
        while data := await stream.receive_some(1 << 20):
            if counter is not None:
                counter[0] += len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


# ------------------------------------------------------------------------------------------ the attacks


class Attacks:
    def __init__(self, args: argparse.Namespace, victim: Address, victim_id: PeerID, private_uid: str,
                 rss: RssSampler, tally: Tally, stack: AsyncExitStack):
        self.args, self.victim, self.victim_id, self.private_uid = args, victim, victim_id, private_uid
        self.rss, self.tally, self.stack = rss, tally, stack
        self.baseline = 0
        self.figures: dict[str, Any] = {}
        self.private: Address = victim
        self.private_id: PeerID = victim_id
        self.rss_checks: dict[str, int] = {}  # phase -> the RSS that counts for it (rss_growth_mb)

    async def node(self) -> RPCNode:
        return await self.stack.enter_async_context(RPCNode(Identity.generate(), RealNetwork()))

    async def forward(self, node: RPCNode, rows: int, address: Address | None = None,
                      peer_id: PeerID | None = None, uid: str = "ffn.0", timeout: float = 60) -> list[torch.Tensor]:
        return await calls.forward(node, address or self.victim, peer_id or self.victim_id, uid,
                                   [torch.randn(rows, HIDDEN)], timeout=timeout)

    async def relayed_info(self, node: RPCNode) -> Any:
        return await node.call(self.private, calls.INFO, {"uid": self.private_uid}, timeout=20,
                               peer_id=self.private_id)

    async def status(self) -> dict[str, Any]:
        async with RPCNode(Identity.generate(), RealNetwork()) as node:
            result: dict[str, Any] = await node.call(self.victim, STATUS_METHOD, None, timeout=20)
            return result

    def begin(self, phase: str) -> None:
        self.rss.phase = phase

    def growth_mb(self, rss: int) -> float:
        return (rss - self.baseline) / MIB

    # ---------------------------------------------------------------------------------------------- setup

    async def warm_up(self, dht: DHTNode) -> None:
        with trio.fail_after(60):
            while True:
                location = (await get_experts(dht, [self.private_uid]))[self.private_uid]
                if location is not None and relay.is_relayed(location.address):
                    self.private, self.private_id = location.address, PeerID.from_hex(location.peer_id_hex)
                    break
                await trio.sleep(0.2)
        self.honest = await self.node()
        self.flooder = await self.node()
        for node in (self.honest, self.flooder):  # connections, the runtime and the allocator warmed up
            for _ in range(3):
                await self.forward(node, 2048)
        for _ in range(3):
            await self.forward(self.honest, 8 * MIB // (4 * HIDDEN))
            await self.relayed_info(self.honest)
        await trio.sleep(1.0)
        self.baseline = self.rss.level(0.8)
        self.figures["rss_baseline_mb"] = round(self.baseline / MIB, 1)
        say(f"warm-up: the attacked daemon's RSS {self.baseline / MIB:.1f} MB; the private daemon's expert is "
            f"reached through its relay")

    # --------------------------------------------------------------------------------- (B) relay bandwidth

    async def relay_flood(self) -> None:
        phase = "B relay flood"
        self.begin(phase)
        dialer = await self.node()
        attacker = await self.node()
        accepted, dialed = await hold_circuits(self.victim, attacker, 4, "127.0.0.2")

        async def latencies() -> list[float]:
            await self.tally.attempt(phase, lambda: self.relayed_info(dialer))  # the circuit is up (or comes up)
            times = []
            for _ in range(self.args.latency_calls):
                start = time.perf_counter()
                if await self.tally.attempt(phase, lambda: self.relayed_info(dialer)):
                    times.append(time.perf_counter() - start)
            return times

        quiet = await latencies()
        moved = [0]

        async def push(stream: trio.abc.Stream) -> None:
            chunk = b"\0" * 65536
            try:
                while True:
                    await stream.send_all(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

        async with trio.open_nursery() as flood:
            for stream in dialed:
                flood.start_soon(push, stream)
            for stream in accepted:
                flood.start_soon(drain, stream, moved)
            await trio.sleep(2.0)
            flood_start, moved_start = time.monotonic(), moved[0]
            flooded = await latencies()
            rate = (moved[0] - moved_start) / (time.monotonic() - flood_start)
            flood.cancel_scope.cancel()
        await close_all(accepted + dialed)
        quiet_ms, flooded_ms = statistics.median(quiet) * 1e3, statistics.median(flooded) * 1e3
        ratio = flooded_ms / quiet_ms
        self.rss_checks[phase] = self.rss.peak(phase)
        say(f"(B) relay flood: {len(dialed)} circuits pushing {rate / 1e6:.1f} MB/s through the relay; honest relayed "
            f"call median {quiet_ms:.2f} ms quiet, {flooded_ms:.2f} ms flooded (p90 "
            f"{sorted(flooded)[int(0.9 * (len(flooded) - 1))] * 1e3:.2f} ms): ratio {ratio:.2f} (target <= 3); "
            f"{self.tally.line(phase)}")
        self.figures.update(relay_latency_ratio_under_flood=round(ratio, 3), relay_quiet_ms=round(quiet_ms, 3),
                            relay_flooded_ms=round(flooded_ms, 3), relay_flood_mb_per_s=round(rate / 1e6, 1))

    # ------------------------------------------------------------------------------------ (A) relay slots

    async def relay_slots(self) -> None:
        phase = "A relay slots"
        self.begin(phase)
        bare = []
        for _ in range(300):
            stream = await trio.open_tcp_stream(*self.victim)
            await stream.send_all(relay.MAGIC)
            bare.append(stream)
        attackers = [await self.node() for _ in range(70)]
        reserved: list[RPCNode] = []
        refused = 0
        for attacker in attackers:
            try:
                await attacker.call(self.victim, RESERVE_METHOD, None, timeout=10)
                reserved.append(attacker)
            except RelayLimitReached:
                refused += 1
        held: list[trio.abc.Stream] = []

        async def attack(index: int, attacker: RPCNode) -> None:
            try:
                accepted, dialed = await hold_circuits(self.victim, attacker, 1, f"127.0.0.{2 + index % 4}")
                held.extend(accepted + dialed)
            except (RPCError, OSError):
                pass  # refused or evicted: the relay holds its line

        with trio.fail_after(240):
            for _ in range(3):
                async with trio.open_nursery() as nursery:
                    for index, attacker in enumerate(reserved):
                        nursery.start_soon(attack, index, attacker)
        relay_stats = (await self.status())["relay"] or {}
        circuits, evicted = relay_stats.get("circuits"), relay_stats.get("circuits_evicted")
        for _ in range(self.args.dials):  # fresh dialers: each needs a new circuit while the relay is full
            async with RPCNode(Identity.generate(), RealNetwork()) as dialer:
                await self.tally.attempt(phase, lambda: self.forward(dialer, 4, self.private, self.private_id,
                                                                     self.private_uid, timeout=30))
        await close_all(bare + held)
        for attacker in attackers:
            attacker.close_connections("attack over")
        self.rss_checks[phase] = self.rss.peak(phase)
        say(f"(A) relay slots: 300 bare streams, 70 identities ({len(reserved)} reserved, {refused} refused), "
            f"{len(held) // 2} circuits spliced (the relay holds {circuits}, evicted {evicted}); fresh dials through "
            f"the relay to the private daemon: {self.tally.line(phase)}")
        self.figures.update(relay_reserved_by_attackers=len(reserved), relay_circuits_spliced=len(held) // 2,
                            relay_circuits_evicted=evicted)

    # -------------------------------------------------------------------------------- (C) large messages

    async def large_messages(self) -> None:
        phase = "C 1 GiB announcements"
        self.begin(phase)
        sessions = [await sealed_session(self.victim) for _ in range(2)]
        sent = [0]
        async with trio.open_nursery() as attack:
            for stream, sealer in sessions:
                attack.start_soon(drain, stream)
                megabyte = b"\0" * MIB
                await stream.send_all(b"".join(bytes(r) for r in sealer.seal(frame(1, megabyte, GIB))))
                await stream.send_all(b"".join(bytes(r) for r in sealer.seal(frame(3, megabyte, 255 * MIB))))

                async def trickle(stream: trio.SocketStream, sealer: seal.Sealer) -> None:
                    chunk = frame(3, b"\0" * 65536)
                    try:
                        while True:
                            await stream.send_all(b"".join(bytes(r) for r in sealer.seal(chunk)))
                            sent[0] += 65536
                            await trio.sleep(0.2)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass

                attack.start_soon(trickle, stream, sealer)
            rows = 8 * MIB // (4 * HIDDEN)
            every = self.args.slow_seconds / self.args.large_calls  # the honest calls spread over the attack
            for _ in range(self.args.large_calls):
                await trio.sleep(every)
                await self.tally.attempt(phase, lambda: self.forward(self.honest, rows),
                                         lambda outputs: tuple(outputs[0].shape) == (rows, HIDDEN))
            attack.cancel_scope.cancel()
        await close_all(stream for stream, _ in sessions)
        peak = self.rss.peak(phase)
        self.rss_checks[phase] = peak
        say(f"(C) 2 identities announcing 1 GiB (and 255 MiB sent slowly, {2 + sent[0] / MIB:.1f} MiB in all): "
            f"honest 8 MiB forward calls {self.tally.line(phase)}; RSS peak {self.growth_mb(peak):+.1f} MB")

    # ---------------------------------------------------------------------------------------- (D) slowloris

    async def trickling(self) -> None:
        phase = "D trickling connections"
        self.begin(phase)
        opened = time.monotonic()
        closed_after: list[float] = []
        streams: list[trio.SocketStream] = []
        for _ in range(400):
            stream = await trio.open_tcp_stream(*self.victim)
            await stream.send_all(b"\0")
            streams.append(stream)

        async def watch(stream: trio.SocketStream) -> None:
            await drain(stream)
            closed_after.append(time.monotonic() - opened)

        async def trickle() -> None:
            while True:
                await trio.sleep(1.0)
                for stream in streams:
                    try:
                        await stream.send_all(b"\0")
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass

        async with trio.open_nursery() as attack:
            for stream in streams:
                attack.start_soon(watch, stream)
            attack.start_soon(trickle)
            for _ in range(self.args.fresh_connections):  # a new identity and handshake each time
                async with RPCNode(Identity.generate(), RealNetwork()) as fresh:
                    await self.tally.attempt(phase, lambda: fresh.call(self.victim, calls.INFO, {"uid": "ffn.0"},
                                                                       timeout=30))
            with trio.move_on_after(60):
                while len(closed_after) < len(streams):
                    await trio.sleep(0.1)
            attack.cancel_scope.cancel()
        await close_all(streams)
        self.rss_checks[phase] = self.rss.peak(phase)
        last = max(closed_after, default=float("nan"))
        say(f"(D) 400 trickling connections: {len(closed_after)} closed by the daemon, the last {last:.1f} s after "
            f"they opened (handshake deadline 5 s); fresh honest connections {self.tally.line(phase)}")
        self.figures.update(trickle_closed=len(closed_after), trickle_last_closed_s=round(last, 1))

    # -------------------------------------------------------------------------------------- (E) call flood

    async def call_flood(self) -> None:
        phase = "E call flood"
        self.begin(phase)
        outcomes = {"ok": 0, "refused": 0, "failed": 0}
        named = []

        async def flood_one() -> None:
            try:
                await self.forward(self.flooder, 2048, timeout=120)
                outcomes["ok"] += 1
            except BudgetExceeded as error:
                outcomes["refused"] += 1
                named.append("requests_per_peer" in str(error) and self.flooder.peer_id.short() in str(error))
            except RPCError:
                outcomes["failed"] += 1

        start = time.monotonic()
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for _ in range(1000):
                    nursery.start_soon(flood_one)
                await trio.sleep(0.5)
                for _ in range(self.args.flood_honest_calls):  # honest calls from another peer, during the flood
                    await self.tally.attempt(phase, lambda: self.forward(self.honest, 2048, timeout=120),
                                             lambda outputs: tuple(outputs[0].shape) == (2048, HIDDEN))
        flood_seconds = time.monotonic() - start
        peak = self.rss.peak(phase)
        after = "E after the call flood"
        self.begin(after)
        await trio.sleep(self.args.settle)
        level = self.rss.level(1.0)
        self.rss_checks[after] = level
        self.figures.update(call_flood_ok=outcomes["ok"], call_flood_refused=outcomes["refused"],
                            call_flood_refusals_name_limit_and_peer=all(named) and bool(named),
                            rss_call_flood_peak_growth_mb=round(self.growth_mb(peak), 1),
                            rss_after_call_flood_growth_mb=round(self.growth_mb(level), 1))
        say(f"(E) 1,000 concurrent forward calls from one identity in {flood_seconds:.1f} s: {outcomes['ok']} "
            f"served, {outcomes['refused']} refused (budget.exceeded), {outcomes['failed']} failed otherwise; "
            f"honest calls {self.tally.line(phase)}; RSS {self.growth_mb(peak):+.1f} MB at its peak, "
            f"{self.growth_mb(level):+.1f} MB {self.args.settle:g} s after")

    # ------------------------------------------------------------------------------------ (F) junk + squat

    async def training(self, workdir: Path, children: list[Child], bootstrap: str) -> None:
        """`--train-pairs` pairs of runs, a clean one then an attacked one, each with its own run id (the junk of
        one attacked run stays on the storers for a day: it must not meet the next clean run)."""
        phase = "F junk + squat"
        stores = {"ok": 0, "tried": 0}
        runs: dict[str, list[dict[str, Any]]] = {"clean": [], "junk": []}
        async with trio.open_nursery() as background, AsyncExitStack() as nodes:
            tarpit = await background.start(self.tarpit)
            attackers = [await nodes.enter_async_context(DHTNode.open(
                "127.0.0.1", 0, [self.victim], client_mode=True, identity=Identity.generate())) for _ in range(10)]
            honest = await nodes.enter_async_context(DHTNode.open(
                "127.0.0.1", 0, [self.victim], client_mode=True, identity=Identity.generate()))
            for pair in range(self.args.train_pairs):
                runs["clean"].append(await self.training_run("F clean run", f"bench-budgets-clean-{pair}", workdir,
                                                             children, bootstrap))
                self.begin(phase)
                run_id = f"bench-budgets-junk-{pair}"
                junk_keys = [progress_key(run_id), f"{run_id}.diloco.averaging", f"{run_id}.gradients.averaging"]
                matchmaking_keys = junk_keys[1:]
                started = trio.Event()

                async def squat(index: int, dht: DHTNode, junk_keys: list[str], matchmaking_keys: list[str],
                                started: trio.Event) -> None:
                    junk = os.urandom(8000)
                    while True:
                        now = dht.now()
                        items: list[tuple[Any, ...]] = [(key, junk, now + TEN_YEARS, f"junk.{index}")
                                                        for key in junk_keys]
                        declaration = Declaration(dht.peer_id, tarpit, 1e9, False, os.urandom(32), 0,
                                                  now + TEN_YEARS, now)
                        items += [(key, declaration.to_wire(), now + TEN_YEARS, bytes(dht.peer_id))
                                  for key in matchmaking_keys]
                        with trio.move_on_after(10):
                            for ok in await dht.store_many(items, signed=True):
                                stores["tried"] += 1
                                stores["ok"] += ok
                        if index == 0:
                            started.set()
                        await trio.sleep(self.args.junk_refresh)

                async def honest_stores(matchmaking_keys: list[str]) -> None:
                    me = bytes(honest.peer_id)
                    while True:
                        await trio.sleep(2.0)
                        for key in matchmaking_keys:
                            store = functools.partial(honest.store, key, [], honest.now() + 30, subkey=me,
                                                      signed=True)
                            await self.tally.attempt(phase, store, bool)
                            await self.tally.attempt(phase, functools.partial(honest.get, key, latest=True),
                                                     lambda record: record is not None and me in record.subkeys)

                async with trio.open_nursery() as attack:
                    for index, dht in enumerate(attackers):
                        attack.start_soon(squat, index, dht, junk_keys, matchmaking_keys, started)
                    with trio.fail_after(30):
                        await started.wait()
                    attack.start_soon(honest_stores, matchmaking_keys)
                    runs["junk"].append(await self.training_run(phase, run_id, workdir, children, bootstrap,
                                                                relabel=False))
                    attack.cancel_scope.cancel()
            background.cancel_scope.cancel()
        self.rss_checks[phase] = self.rss.peak(phase)

        def rate(kind: str) -> float:  # outer steps over seconds, summed over the runs of a kind
            return float(sum(run["steps"] for run in runs[kind]) / sum(run["seconds"] for run in runs[kind]))

        clean, attacked = rate("clean"), rate("junk")
        ratio = attacked / clean
        cpu = {kind: round(sum(run["attackers_cpu_s"] for run in runs[kind]) / len(runs[kind]), 1) for kind in runs}
        say(f"(F) DiLoCo under junk and squat: {attacked:.3f} outer steps/s against {clean:.3f} clean "
            f"({self.args.train_pairs} run(s) each): ratio {ratio:.2f} (target >= 0.77); attacked runs' outer "
            f"steps {[run['outer_steps'] for run in runs['junk']]}, hashes {[run['hashes'] for run in runs['junk']]}; "
            f"junk stores acknowledged {stores['ok']}/{stores['tried']}; this process's CPU per run (the attackers' "
            f"and honest DHT clients') {cpu['junk']} s attacked, {cpu['clean']} s clean; honest DHT stores and "
            f"reads {self.tally.line(phase)}")
        self.figures.update(outer_steps_ratio_under_junk=round(ratio, 3), clean_outer_steps_per_s=round(clean, 4),
                            junk_outer_steps_per_s=round(attacked, 4),
                            junk_run_outer_steps=[run["outer_steps"] for run in runs["junk"]],
                            junk_run_hashes=[run["hashes"] for run in runs["junk"]],
                            junk_attackers_cpu_s_per_run=cpu["junk"],
                            junk_stores_acknowledged=f"{stores['ok']}/{stores['tried']}")

    async def tarpit(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """A listener that accepts and never answers: where the squatters' declarations point."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]

        async def hold(stream: trio.SocketStream) -> None:
            await drain(stream)

        task_status.started(("127.0.0.1", port))
        await trio.serve_listeners(hold, listeners)

    async def training_run(self, phase: str, run_id: str, workdir: Path, children: list[Child], bootstrap: str,
                           relabel: bool = True) -> dict[str, Any]:
        if relabel:
            self.begin(phase)
        args = self.args
        trainers = []
        cpu_start = time.process_time()
        try:
            for index in range(args.trainers):
                trainer = Child(f"{run_id}-{index}", [
                    sys.executable, "-m", "peer.cli", "train", "--algorithm", "diloco", "--local-experts",
                    "--hidden-dim", str(args.train_hidden), "--grid-size", "4", "--k-best", "2", "--batch-size", "32",
                    "--inner-steps", str(args.inner_steps), "--steps", str(args.outer_steps * args.inner_steps),
                    "--start-with", str(args.trainers), "--initial-peers", bootstrap, "--threads", "1",
                    "--reachability", "public", "--seed", str(index), "--run-id", run_id, "--log-every", "1000000"],
                    workdir)
                children.append(trainer)
                trainers.append(trainer)
            for trainer in trainers:
                await wait_exit(trainer, 300)
            results = []
            for trainer in trainers:
                lines = [json.loads(line) for line in trainer.lines() if line.startswith('{"event": "result"')]
                if not lines:
                    raise RuntimeError(f"{trainer.name} gave no result; stderr:\n{trainer.stderr_tail()}")
                results.append(lines[-1])
        finally:
            for trainer in trainers:
                trainer.stop()
        cpu = time.process_time() - cpu_start
        outer_steps = [int(result.get("outer_step", 0)) for result in results]
        seconds = max(float(result["train_seconds"]) for result in results)
        hashes = len({result.get("hash") for result in results})
        if phase.startswith("F junk"):  # an honest trainer's run: all its outer steps, one state for all
            ok = min(outer_steps) >= args.outer_steps and hashes == 1
            counts = self.tally.counts.setdefault(phase, [0, 0])
            counts[0] += ok
            counts[1] += 1
            if not ok:
                self.tally.failures.append(f"{phase}: outer steps {outer_steps}, {hashes} hashes")
        say(f"({phase}) {args.trainers} trainers: outer steps {outer_steps}, {hashes} hash(es), longest train "
            f"{seconds:.1f} s: {min(outer_steps) / seconds:.3f} outer steps/s; this process's CPU {cpu:.1f} s")
        return {"steps": min(outer_steps), "seconds": seconds, "outer_steps": outer_steps, "hashes": hashes,
                "attackers_cpu_s": cpu}


async def attack_phases(attacks: "Attacks", args: argparse.Namespace, stack: AsyncExitStack, workdir: Path,
                        children: list[Child], victim: str) -> None:
    dht = await stack.enter_async_context(DHTNode.open("127.0.0.1", 0, [parse_address(victim)], client_mode=True))
    await attacks.warm_up(dht)
    for phase in args.phases:
        if phase == "B":
            await attacks.relay_flood()
        elif phase == "A":
            await attacks.relay_slots()
        elif phase == "C":
            await attacks.large_messages()
        elif phase == "D":
            await attacks.trickling()
        elif phase == "E":
            await attacks.call_flood()
        elif phase == "F":
            await attacks.training(workdir, children, victim)


async def attack_all(args: argparse.Namespace, victim_pid: int, victim: str, victim_id: str, private_uid: str,
                     workdir: Path, children: list[Child]) -> dict[str, Any]:
    rss = RssSampler(victim_pid)
    tally = Tally()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rss.run)
        try:
            async with AsyncExitStack() as stack:
                attacks = Attacks(args, parse_address(victim), PeerID.from_hex(victim_id), private_uid, rss, tally,
                                  stack)
                await attack_phases(attacks, args, stack, workdir, children, victim)
        finally:
            nursery.cancel_scope.cancel()
    figures = attacks.figures
    worst_phase, worst = max(attacks.rss_checks.items(), key=lambda item: item[1], default=("-", attacks.baseline))
    peak = max(rss for _, label, rss in rss.samples if label != "warm-up")
    figures.update(honest_success_under_attack=round(tally.share(), 4),
                   rss_growth_mb=round(attacks.growth_mb(worst), 1), rss_growth_worst_phase=worst_phase,
                   rss_peak_growth_mb=round(attacks.growth_mb(peak), 1),
                   honest_by_phase={phase: f"{ok}/{tried}" for phase, (ok, tried) in tally.counts.items()})
    if tally.failures:
        figures["honest_failures"] = tally.failures
    return figures


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run (about 3 minutes): fewer honest calls, "
                        "shorter windows and training runs; the attack sizes stay the issue's")
    parser.add_argument("--phases", default="OBACDEF", help="which parts to run, in this order (default: OBACDEF)")
    parser.add_argument("--seconds", type=float, default=None, help="(O) seconds per echo window (2; quick 1)")
    parser.add_argument("--overhead-rounds", type=int, default=None, help="(O) alternating rounds (7; quick 3)")
    parser.add_argument("--latency-calls", type=int, default=None, help="(B) calls timed each way (40; quick 20)")
    parser.add_argument("--settle", type=float, default=None, help="(E) seconds after the flood (30; quick 10)")
    parser.add_argument("--trainers", type=int, default=3, help="(F) trainer processes (3)")
    parser.add_argument("--outer-steps", type=int, default=None, help="(F) outer steps per run (30; quick 20)")
    parser.add_argument("--inner-steps", type=int, default=20, help="(F) inner steps per outer step (20)")
    parser.add_argument("--train-hidden", type=int, default=64, help="(F) the digits model's hidden size (64)")
    parser.add_argument("--train-pairs", type=int, default=None, help="(F) clean + attacked run pairs (2; quick 1)")
    parser.add_argument("--junk-refresh", type=float, default=2.0,
                        help="(F) seconds between an attacker's stores (2; honest trainers publish every 0.5 s)")
    parser.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo:
        trio.run(serve_echo)
        return
    quick = args.quick
    for name, full, small in (("seconds", 2.0, 1.0), ("overhead_rounds", 7, 3), ("latency_calls", 40, 20),
                              ("settle", 30.0, 10.0), ("outer_steps", 30, 20), ("train_pairs", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.dials = 3 if quick else 5
    args.large_calls = 3 if quick else 5
    args.slow_seconds = 5.0 if quick else 15.0  # (C): how long the two identities keep sending slowly
    args.fresh_connections = 3 if quick else 5
    args.flood_honest_calls = 5 if quick else 10
    torch.set_num_threads(1)
    figures: dict[str, Any] = {}
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="bench-budgets-") as directory:
        workdir = Path(directory)
        try:
            if "O" in args.phases:
                figures.update(phase_overhead(args, workdir, children))
            attacks = [phase for phase in args.phases if phase in "ABCDEF"]
            if attacks:
                args.phases = attacks
                victim, victim_id, address = start_daemon(
                    "victim", ["--reachability", "public", "--experts", "ffn.[0:2]", "--hidden-dim", str(HIDDEN),
                               "--max-batch-size", "32768"], workdir, children)
                start_daemon("private", ["--reachability", "private", "--initial-peers", address,
                                         "--experts", "priv.[0:1]", "--hidden-dim", str(HIDDEN)], workdir, children)
                say(f"the attacked daemon {victim_id[:8]} listens at {address} (pid {victim.pid}); a private daemon "
                    f"reserved at its relay")
                figures.update(trio.run(attack_all, args, victim.pid, address, victim_id, "priv.0", workdir,
                                        children))
        finally:
            for child in children:
                child.stop()
    order = ["honest_success_under_attack", "rss_growth_mb", "outer_steps_ratio_under_junk",
             "relay_latency_ratio_under_flood", "budget_overhead"]
    figures = {**{key: figures[key] for key in order if key in figures}, **figures}
    figures["quick"] = quick
    figures["wall_s"] = round(time.monotonic() - STARTED, 1)
    if "honest_success_under_attack" in figures:
        say(f"honest operations that succeeded during the attacks: {figures['honest_success_under_attack']} "
            f"(target 1.0); the daemon's worst RSS growth {figures['rss_growth_mb']} MB at "
            f"{figures['rss_growth_worst_phase']!r} (target <= 128)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
