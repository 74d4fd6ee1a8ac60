"""`peer swarm up`: a whole swarm on this machine — volunteer daemons and trainers as separate processes.

Why separate processes: that is how the swarm runs for real, and it lets `--kill-one-at` SIGKILL a daemon in the
middle of training to show the trainers carrying on (the delay counts from the moment every trainer reports
training progress, so the kill lands mid-training however long the start-up takes).

The launcher owns every process it starts, and stops each one on every way out. Each child runs in its own
process group, so a Ctrl-C on the terminal reaches only the launcher, which forwards exactly one signal: the
trainers get the launcher's signal (SIGINT or SIGTERM; SIGTERM after SIGHUP) and up to `_TRAINER_GRACE_S` to
finish their step and write their result line (two signals would make them exit at once, without one), then
the daemons get SIGTERM (they checkpoint and exit). Whatever is still running after its grace period is
SIGKILLed; a second signal to the launcher SIGKILLs everything at once. The summary and its JSON line are
printed in every case, with what each trainer reported.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import trio

from peer.events import JoinWatcher
from peer.status import plural
from peer.topology import Topology

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A trainer stopping mid-step may be blocked in an averaging round (30 s timeout) or expert calls (5 s each).
_TRAINER_GRACE_S = 40.0
_STOP_GRACE_S = 10.0  # daemons: checkpoint and leave
_DRAIN_S = 5.0  # after a process exits (or is killed), for the rest of its output
_STATUS_S = 60.0  # the closing `peer status` (a few seconds; a safety net on a loaded machine)

# What the same language model reaches trained locally for the same length (experts in one process), measured
# by `benchmarks/bench_lm.py` (its defaults are this shape; `local_bpb`, benchmarks/README.md): the
# summary of `peer swarm up --task lm` quotes it beside the swarm's figure when the run has this shape. Measured,
# not computed at the end of each run, because a local run of the same length would add a minute to `make run`.
LM_LOCAL_REFERENCE = {"steps": 150, "batch_size": 8, "hidden_dim": 64, "experts_per_layer": 12, "bpb": 3.877}


@dataclass
class Managed:
    name: str
    role: str  # "volunteer" | "trainer"
    args: list[str]
    process: trio.Process | None = None
    address: str | None = None
    peer_id: str | None = None
    reachability: str | None = None  # public / private, from the join line
    status: dict[str, Any] | None = None  # its row of the closing `peer status` (volunteers)
    experts: str = ""
    joining: JoinWatcher = field(default_factory=JoinWatcher)  # reads a volunteer's `peer join` output
    ready: trio.Event = field(default_factory=trio.Event)
    spawned: trio.Event = field(default_factory=trio.Event)  # also set when the process could not be started
    done: trio.Event = field(default_factory=trio.Event)  # exited and its output read to the end
    last_line: str = ""
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    killed_at: float | None = None  # the --kill-one-at victim
    stopped_with: str | None = None  # the signal the launcher stopped it with, when it was still running
    force_killed: bool = False  # still running after its grace period: SIGKILLed
    exit_code: int | None = None
    log_path: Path | None = None


class SwarmLauncher:
    def __init__(self, topology: Topology, *, host: str = "127.0.0.1", kill_one_at: float | None = None,
                 log_dir: Path, out: TextIO = sys.stdout, python: str = sys.executable, refresh_s: float = 1.0,
                 trainer_grace_s: float = _TRAINER_GRACE_S):
        self.topology = topology
        self.host = host
        self.kill_one_at = kill_one_at
        self.log_dir = log_dir
        self.out = out
        self.python = python
        self.refresh_s = refresh_s
        self.trainer_grace_s = trainer_grace_s
        self.members: list[Managed] = []
        self.started_at = time.monotonic()
        self.training_at: float | None = None  # when every trainer had reported progress (s since start)
        self.interrupted: int | None = None  # the first signal received
        self._training = trio.Event()
        self._hurry = False  # a second signal: no more grace periods
        self._stop_scope: trio.CancelScope | None = None
        self._main_scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self._drawn_lines = 0
        self._printed_at = -math.inf

    # ------------------------------------------------------------------------------------------- lifetime

    async def run(self) -> dict[str, Any]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        with trio.open_signal_receiver(*_STOP_SIGNALS) as signals:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._watch_signals, signals)
                nursery.start_soon(self._live_view)
                try:
                    with self._main_scope:
                        await self._train()
                        await self._read_volunteer_status()
                finally:
                    with trio.CancelScope(shield=True):
                        await self._stop_all()
                nursery.cancel_scope.cancel()
        self._draw(final=True)
        summary = self.summary()
        self._print_summary(summary)
        return summary

    async def _train(self) -> None:
        """Start the volunteers (one after the other: each joins through the first), then the trainers, and wait
        for the trainers to finish."""
        async with trio.open_nursery() as timers:
            bootstrap = await self._start_volunteer(0, None)
            for index in range(1, self.topology.volunteers):
                await self._start_volunteer(index, bootstrap)
            for i in range(self.topology.trainers):
                args = self.topology.trainer_args(i, bootstrap=bootstrap)
                self._start(Managed(self.topology.trainer_name(i), "trainer", args))
            self._check_training()
            if self.kill_one_at is not None:
                timers.start_soon(self._kill_one_later, self.kill_one_at)
            for trainer in self._trainers():
                await trainer.done.wait()
            timers.cancel_scope.cancel()

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if self.interrupted is None:
                self.interrupted = signum
                self._print(f"*** {name}: stopping the swarm; trainers finish their step and report "
                            f"({name} again kills everything at once) ***")
                self._main_scope.cancel()
            else:
                self._hurry = True
                self._print(f"*** {name} again: killing every process now ***")
                if self._stop_scope is not None:
                    self._stop_scope.cancel()

    async def _start_volunteer(self, index: int, bootstrap: str | None) -> str:
        """Start volunteer `index` and wait until it announced its address (which is returned)."""
        # on loopback every peer reaches every other: only --reachability private puts one "behind NAT", reached
        # through the public volunteers' relays (and the hole punches that upgrade those circuits)
        private = self.topology.is_private(index)
        args = self.topology.volunteer_args(index, host=self.host, port=0, bootstrap=bootstrap,
                                            reachability="private" if private else None)
        member = self._start(Managed(self.topology.volunteer_name(index), "volunteer", args))
        with trio.move_on_after(120) as scope:
            await member.ready.wait()
        address = member.address
        if scope.cancelled_caught or address is None:
            raise RuntimeError(f"{member.name} did not start; see {member.log_path}")
        return address

    def _start(self, member: Managed) -> Managed:
        assert self._nursery is not None
        log_path = member.log_path = self.log_dir / f"{member.name}.log"
        self.members.append(member)
        self._nursery.start_soon(self._supervise, member, log_path)
        return member

    def _trainers(self) -> list[Managed]:
        return [m for m in self.members if m.role == "trainer"]

    async def _supervise(self, member: Managed, log_path: Path) -> None:
        try:
            with open(log_path, "w") as log:  # noqa: ASYNC230 (a local log file, opened once per child)
                # process_group=0: its own group, so the terminal's Ctrl-C reaches only the launcher (which
                # forwards one signal; a trainer that got two would exit without its result line)
                member.process = process = await trio.lowlevel.open_process(
                    [self.python, "-m", "peer.cli", *member.args], stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=log, env=_child_env(), process_group=0)
                member.spawned.set()
                buffer = b""
                assert process.stdout is not None  # opened with stdout=PIPE
                async for chunk in process.stdout:
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for raw in lines:
                        line = raw.decode("utf-8", "replace").rstrip()
                        log.write(line + "\n")
                        log.flush()
                        self._on_line(member, line)
                member.exit_code = await member.process.wait()
        finally:
            member.spawned.set()
            member.ready.set()
            member.done.set()
            self._check_training()

    def _on_line(self, member: Managed, line: str) -> None:
        if member.role == "volunteer" and not member.ready.is_set():
            joined = member.joining.feed(line)
            if joined is not None:
                member.peer_id, member.address, member.reachability = (joined.peer_id, joined.address,
                                                                        joined.reachability)
                if joined.experts:
                    uids = sorted(joined.experts, key=_grid_order)
                    hidden = f", hidden {joined.hidden_dim}" if joined.hidden_dim else ""
                    member.experts = f"{len(uids)} experts ({uids[0]}..{uids[-1]}{hidden})"
                member.ready.set()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                data = None
            if isinstance(data, dict):
                if data.get("event") == "progress":
                    member.progress = data
                    self._check_training()
                elif data.get("event") == "result":  # not a `failed_step` line: that one the trainer retries
                    member.result = data
                return
        if line:
            member.last_line = line

    def _check_training(self) -> None:
        """Training has started once every trainer reported progress (or ended: a trainer that failed at start
        must not hold the kill back forever)."""
        trainers = self._trainers()
        if (not self._training.is_set() and len(trainers) == self.topology.trainers
                and all(t.progress is not None or t.done.is_set() for t in trainers)):
            self.training_at = time.monotonic() - self.started_at
            self._training.set()

    async def _kill_one_later(self, delay: float) -> None:
        await self._training.wait()
        await trio.sleep(delay)  # counted from the trainers' first progress, so it lands mid-training
        # never the bootstrap; a public volunteer when there is one (a relay of the private ones, which then
        # move to another), so the private volunteers stay up to report what they served
        volunteers = [m for m in self.members[1:] if m.role == "volunteer" and m.killed_at is None]
        public = [m for m in volunteers if m.reachability != "private"]
        candidates = public or volunteers
        victim = candidates[-1] if candidates else None
        if victim is not None and victim.process is not None and victim.process.returncode is None:
            victim.process.send_signal(signal.SIGKILL)
            victim.killed_at = time.monotonic() - self.started_at
            self._print(f"*** SIGKILLed {victim.name} ({victim.address}) at {victim.killed_at:.1f} s, "
                        f"{victim.killed_at - (self.training_at or 0):.1f} s into training ***")

    async def _read_volunteer_status(self) -> None:
        """Once the trainers are done, one `peer status` of the swarm (the same command a user runs): for each
        volunteer still up, how it was reached (the private ones: through relays, circuits upgraded by hole
        punching or left relayed) and how many expert requests it served. Best effort: without it the summary
        only lacks those figures."""
        bootstrap = self.members[0].address if self.members else None
        if bootstrap is None:
            return
        with trio.move_on_after(_STATUS_S):
            result = await trio.run_process(
                [self.python, "-m", "peer.cli", "status", "--json", "--initial-peers", bootstrap],
                stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False, env=_child_env())
            try:
                peers = json.loads(result.stdout)["peers"]
            except (ValueError, KeyError, TypeError):
                return
            rows = {peer.get("peer_id"): peer for peer in peers if isinstance(peer, dict)}
            for member in self.members:
                row = rows.get(member.peer_id)
                if member.role == "volunteer" and member.killed_at is None and row is not None and row["reachable"]:
                    member.status = row

    async def _stop_all(self) -> None:
        """Trainers first (they need the experts to finish their step), then the daemons."""
        signum = signal.SIGTERM if self.interrupted in (None, signal.SIGHUP) else self.interrupted
        await self._stop(self._trainers(), signum, self.trainer_grace_s)
        await self._stop([m for m in self.members if m.role != "trainer"], signal.SIGTERM, _STOP_GRACE_S)

    async def _stop(self, members: list[Managed], signum: int, grace: float) -> None:
        with trio.move_on_after(0 if self._hurry else grace) as scope:
            self._stop_scope = scope
            for member in members:
                await member.spawned.wait()
                if member.process is not None and member.process.returncode is None and not member.done.is_set():
                    member.stopped_with = signal.Signals(signum).name
                    member.process.send_signal(signum)
            for member in members:
                await member.done.wait()
        self._stop_scope = None
        for member in members:
            if member.process is not None and member.process.returncode is None:
                member.force_killed = True
                member.process.kill()
        with trio.move_on_after(_DRAIN_S):
            for member in members:
                if member.process is not None:
                    member.exit_code = await member.process.wait()
                await member.done.wait()

    # ------------------------------------------------------------------------------------------- view

    async def _live_view(self) -> None:
        while True:
            self._draw()
            await trio.sleep(self.refresh_s)

    def _lines(self) -> list[str]:
        elapsed = time.monotonic() - self.started_at
        lines = [f"swarmd local swarm: {plural(self.topology.volunteers, 'volunteer')}, "
                 f"{plural(self.topology.trainers, 'trainer')}, {plural(self.topology.experts_total, 'expert')}"
                 f"{' (language model)' if self.topology.task == 'lm' else ''} — "
                 f"{elapsed:6.1f} s"]
        for member in self.members:
            if member.killed_at is not None:
                state = f"KILLED at {member.killed_at:.1f} s"
            elif member.process is None:
                state = "starting"
            elif member.process.returncode is not None:
                state = f"exited ({member.process.returncode})"
            elif member.stopped_with is not None:
                state = "stopping"
            elif member.role == "trainer" and member.progress is None:
                state = "starting"
            else:
                state = "running"
            if member.role == "volunteer":
                detail = f"{member.address or '-':<22} {state:<18} {member.reachability or '-':<8} {member.experts}"
                if member.status is not None:
                    detail += f"; {_reached_text(member.status)}"
            else:
                detail = f"{state:<10} {_progress_text(member)}"
            lines.append(f"  {member.name:<12} {detail}")
        return lines

    def _draw(self, final: bool = False) -> None:
        lines = self._lines()
        if self.out.isatty():
            if self._drawn_lines:
                self.out.write(f"\x1b[{self._drawn_lines}F\x1b[J")
            self.out.write("\n".join(lines) + "\n")
            self._drawn_lines = len(lines)
        elif final or time.monotonic() - self._printed_at >= 10.0:  # a log, not a screen: every 10 s
            self._printed_at = time.monotonic()
            self.out.write("\n".join(lines) + "\n")
        self.out.flush()

    def _print(self, text: str) -> None:
        if self.out.isatty() and self._drawn_lines:
            self.out.write(f"\x1b[{self._drawn_lines}F\x1b[J")
            self._drawn_lines = 0
        self.out.write(text + "\n")
        self.out.flush()

    # ------------------------------------------------------------------------------------------- summary

    def summary(self) -> dict[str, Any]:
        trainers = []
        for member in self.members:
            if member.role != "trainer":
                continue
            result = member.result or {}
            trainers.append({"name": member.name, "exit_code": member.exit_code,
                             "interrupted": bool(result.get("interrupted")) or member.stopped_with is not None,
                             "stopped_with": member.stopped_with, "force_killed": member.force_killed,
                             "reported": bool(result),
                             "accuracy": result.get("accuracy"), "samples_per_s": result.get("samples_per_s"),
                             "bpb": result.get("bpb"), "bpb_start": result.get("bpb_start"),
                             "prompt": result.get("prompt"), "sample": result.get("sample"),
                             "steps": result.get("steps"), "steps_planned": result.get("steps_planned"),
                             "averaging_rounds": result.get("averaging_rounds"),
                             "failed_expert_calls": result.get("failed_expert_calls"), "log": str(member.log_path)})
        accuracies = [t["accuracy"] for t in trainers if isinstance(t["accuracy"], (int, float))]
        return {
            "trainers": trainers,
            "volunteers": [{"name": m.name, "peer_id": m.peer_id, "address": m.address,
                            "private": self.topology.is_private(index), "reachability": m.reachability,
                            "killed": m.killed_at is not None,
                            **{key: (m.status or {}).get(key)
                               for key in ("reached", "requests_served", "connections", "relays")}}
                           for index, m in enumerate(m for m in self.members if m.role == "volunteer")],
            "final_accuracy": min(accuracies) if len(accuracies) == len(trainers) and trainers else None,
            "samples_per_s": sum(t["samples_per_s"] or 0 for t in trainers),
            "daemons_killed": sum(m.killed_at is not None for m in self.members),
            "interrupted": signal.Signals(self.interrupted).name if self.interrupted is not None else None,
            "all_trainers_finished": bool(trainers) and all(t["exit_code"] == 0 and not t["interrupted"]
                                                            for t in trainers),
            "training_started_at_s": None if self.training_at is None else round(self.training_at, 1),
            "leftover_processes": sum(m.process is not None and m.process.returncode is None for m in self.members),
            "pids": {m.name: m.process.pid for m in self.members if m.process is not None},
            "logs": str(self.log_dir),
            "local_bpb_reference": self._local_reference(),
        }

    def _local_reference(self) -> float | None:
        """The local figure for a run of this shape (`LM_LOCAL_REFERENCE`), or None for any other run."""
        topology, reference = self.topology, LM_LOCAL_REFERENCE
        same = (topology.task == "lm" and topology.steps == reference["steps"]
                and topology.batch_size == reference["batch_size"] and topology.hidden_dim == reference["hidden_dim"]
                and topology.grid_size == reference["experts_per_layer"])
        return float(reference["bpb"]) if same else None

    def exit_code(self) -> int:
        """128 + the signal that stopped the swarm (130 for Ctrl-C); else 0 when every trainer finished."""
        if self.interrupted is not None:
            return 128 + self.interrupted
        return 0 if self.summary()["all_trainers_finished"] else 1

    def _print_summary(self, summary: dict[str, Any]) -> None:
        self.out.write("\nsummary:\n")
        if summary["interrupted"]:
            self.out.write(f"  stopped by {summary['interrupted']}\n")
        for trainer in summary["trainers"]:
            accuracy = trainer["accuracy"]
            speed = trainer["samples_per_s"]
            self.out.write(f"  {trainer['name']}: ")
            if trainer["interrupted"] and trainer["reported"]:
                self.out.write(f"interrupted at step {trainer['steps']}/{trainer['steps_planned']}, ")
            elif trainer["force_killed"]:
                self.out.write("did not report within its grace period, killed; ")
            if isinstance(trainer["bpb"], (int, float)):
                start = trainer["bpb_start"]
                self.out.write(f"held-out {trainer['bpb']:.3f} bits per byte"
                               + (f" (from {start:.3f})" if isinstance(start, (int, float)) else ""))
            elif isinstance(accuracy, (int, float)):
                self.out.write(f"held-out accuracy {accuracy:.3f}")
            else:
                self.out.write("no result")
            if isinstance(speed, (int, float)):
                self.out.write(f", {speed:.0f} samples/s")
            if trainer["averaging_rounds"] is not None:
                self.out.write(f", {trainer['averaging_rounds']} averaging rounds")
            self.out.write(f" (exit {trainer['exit_code']})\n")
        if summary["local_bpb_reference"] is not None:
            self.out.write(f"  the same model trained locally for as many steps (benchmarks/bench_lm.py): "
                           f"{summary['local_bpb_reference']:.3f} bits per byte\n")
        samples = [t for t in summary["trainers"] if t.get("sample")]
        if samples:
            self.out.write(f"  {samples[0]['name']} continues a held-out prompt:\n"
                           f"    prompt:       {samples[0]['prompt']!r}\n    continuation: {samples[0]['sample']!r}\n")
        for volunteer in summary["volunteers"]:
            if volunteer["private"] and volunteer["reached"] is not None:
                self.out.write(f"  {volunteer['name']} (private): {_reached_text(volunteer)}\n")
        self.out.write(f"  daemons killed and survived: {summary['daemons_killed']}; logs in {summary['logs']}\n")
        self.out.write(json.dumps(summary) + "\n")
        self.out.flush()


def _reached_text(row: dict[str, Any]) -> str:
    """A volunteer's `peer status` row in words: "reached through relays, 2 circuits upgraded by hole punching,
    0 relayed; 312 requests served"."""
    how = {"relay": "reached through relays", "direct": "reached directly"}.get(row.get("reached") or "",
                                                                                  "not reachable")
    connections = row.get("connections") or {}
    if row.get("reached") == "relay":
        how += (f", {plural(connections.get('upgraded', 0), 'circuit')} upgraded by hole punching, "
                f"{connections.get('relayed', 0)} relayed")
    return f"{how}; {plural(row.get('requests_served') or 0, 'request')} served"


def _progress_text(member: Managed) -> str:
    progress = member.progress
    if not progress:
        return member.last_line[:90]
    parts = []
    if "step" in progress:
        total = progress.get("steps")
        bar = _bar(progress["step"], total) + " " if isinstance(total, int) and total > 0 else ""
        parts.append(f"{bar}step {progress['step']}" + (f"/{total}" if total else ""))
    for key, label, fmt in (("loss", "loss", "{:.3f}"), ("accuracy", "acc", "{:.3f}"),
                            ("samples_per_s", "samples/s", "{:.0f}"), ("step_s", "s/step", "{:.2f}"),
                            ("experts_alive", "experts", "{}"), ("failed_calls", "failed calls", "{}"),
                            ("epoch", "epoch", "{}")):
        value = progress.get(key)
        if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    return "  ".join(parts)


def _bar(done: int, total: int, width: int = 16) -> str:
    """A trainer's progress bar in the live view: `[######----------]`."""
    filled = max(0, min(width, round(width * done / total)))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _grid_order(uid: str) -> tuple[str | int, ...]:
    """`ffn.9` before `ffn.10`: uids ordered by their grid coordinates."""
    name, *coords = uid.split(".")
    return (name, *(int(c) if c.isdigit() else 0 for c in coords))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # several peers share this machine's cores
    return env
