"""`peer swarm up`: a whole swarm on this machine — volunteer daemons and trainers as separate processes.

Why separate processes: that is how the swarm runs for real, and it lets `--kill-one-at` SIGKILL a daemon in the
middle of training to show the trainers carrying on. The launcher owns every process it starts: on exit, Ctrl-C
included, each one is stopped (SIGTERM, then SIGKILL after a grace period), so none is left behind.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import trio

from peer.topology import Topology

_LISTENING = re.compile(r"^peer ([0-9a-f]{40}) listening on (\S+)$")
_SERVING = re.compile(r"^serving (\d+) experts: (.*)$")
_STOP_GRACE_S = 10.0


@dataclass
class Managed:
    name: str
    role: str  # "volunteer" | "trainer"
    args: list[str]
    process: trio.Process | None = None
    address: str | None = None
    experts: str = ""
    ready: trio.Event = field(default_factory=trio.Event)
    spawned: trio.Event = field(default_factory=trio.Event)
    last_line: str = ""
    progress: dict | None = None
    result: dict | None = None
    killed_at: float | None = None
    exit_code: int | None = None
    log_path: Path | None = None


class SwarmLauncher:
    def __init__(self, topology: Topology, *, host: str = "127.0.0.1", kill_one_at: float | None = None,
                 log_dir: Path, out: TextIO = sys.stdout, python: str = sys.executable, refresh_s: float = 1.0):
        self.topology = topology
        self.host = host
        self.kill_one_at = kill_one_at
        self.log_dir = log_dir
        self.out = out
        self.python = python
        self.refresh_s = refresh_s
        self.members: list[Managed] = []
        self.started_at = time.monotonic()
        self._drawn_lines = 0
        self._printed_at = -math.inf

    # ------------------------------------------------------------------------------------------- lifetime

    async def run(self) -> dict[str, Any]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        try:
            async with trio.open_nursery() as nursery:
                bootstrap = await self._start_volunteer(nursery, 0, None)
                for index in range(1, self.topology.volunteers):
                    await self._start_volunteer(nursery, index, bootstrap.address)
                for i in range(self.topology.trainers):
                    args = self.topology.trainer_args(i, bootstrap=bootstrap.address)
                    self._start(nursery, Managed(self.topology.trainer_name(i), "trainer", args))
                nursery.start_soon(self._live_view)
                if self.kill_one_at is not None:
                    nursery.start_soon(self._kill_one_later)
                for trainer in self.members:
                    if trainer.role == "trainer":
                        await self._wait_exit(trainer)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._stop_all()
        self._draw(final=True)
        summary = self.summary()
        self._print_summary(summary)
        return summary

    async def _start_volunteer(self, nursery: trio.Nursery, index: int, bootstrap: str | None) -> Managed:
        args = self.topology.volunteer_args(index, host=self.host, port=0, bootstrap=bootstrap)
        member = self._start(nursery, Managed(self.topology.volunteer_name(index), "volunteer", args))
        with trio.move_on_after(120) as scope:
            await member.ready.wait()
        if scope.cancelled_caught or member.address is None:
            raise RuntimeError(f"{member.name} did not start; see {member.log_path}")
        return member

    def _start(self, nursery: trio.Nursery, member: Managed) -> Managed:
        member.log_path = self.log_dir / f"{member.name}.log"
        self.members.append(member)
        nursery.start_soon(self._supervise, member)
        return member

    async def _supervise(self, member: Managed) -> None:
        with open(member.log_path, "w") as log:
            member.process = await trio.lowlevel.open_process(
                [self.python, "-m", "peer.cli", *member.args], stdout=subprocess.PIPE, stderr=log,
                env=_child_env())
            member.spawned.set()
            buffer = b""
            async for chunk in member.process.stdout:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    line = raw.decode("utf-8", "replace").rstrip()
                    log.write(line + "\n")
                    log.flush()
                    self._on_line(member, line)
            member.exit_code = await member.process.wait()
            member.ready.set()

    def _on_line(self, member: Managed, line: str) -> None:
        match = _LISTENING.match(line)
        if match and member.role == "volunteer":
            member.address = match.group(2)
        serving = _SERVING.match(line)
        if serving and member.role == "volunteer":
            uids = sorted(serving.group(2).split(", "), key=_grid_order)
            member.experts = f"{len(uids)} experts ({uids[0]}..{uids[-1]})"
        if line.startswith("others join with") and member.role == "volunteer":
            member.ready.set()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                data = None
            if isinstance(data, dict):
                if data.get("event") == "progress":
                    member.progress = data
                else:
                    member.result = data
                return
        if line:
            member.last_line = line

    async def _wait_exit(self, member: Managed) -> None:
        await member.spawned.wait()
        member.exit_code = await member.process.wait()

    async def _kill_one_later(self) -> None:
        await trio.sleep(self.kill_one_at)  # counted from the trainers' start, so it lands mid-training
        volunteers = [m for m in self.members if m.role == "volunteer" and m.killed_at is None]
        victim = volunteers[-1] if len(volunteers) > 1 else None
        if victim is not None and victim.process is not None and victim.process.returncode is None:
            victim.process.send_signal(signal.SIGKILL)
            victim.killed_at = time.monotonic() - self.started_at
            self._print(f"*** SIGKILLed {victim.name} ({victim.address}) at {victim.killed_at:.1f} s ***")

    async def _stop_all(self) -> None:
        running = [m for m in self.members if m.process is not None and m.process.returncode is None]
        for member in running:
            member.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(_STOP_GRACE_S):
            for member in running:
                await member.process.wait()
        for member in running:
            if member.process.returncode is None:
                member.process.kill()
                await member.process.wait()
            member.exit_code = member.process.returncode

    # ------------------------------------------------------------------------------------------- view

    async def _live_view(self) -> None:
        while True:
            self._draw()
            await trio.sleep(self.refresh_s)

    def _lines(self) -> list[str]:
        elapsed = time.monotonic() - self.started_at
        lines = [f"swarmd local swarm: {self.topology.volunteers} volunteers, {self.topology.trainers} trainers, "
                 f"{self.topology.grid_size} experts — {elapsed:6.1f} s"]
        for member in self.members:
            if member.killed_at is not None:
                state = f"KILLED at {member.killed_at:.1f} s"
            elif member.process is None:
                state = "starting"
            elif member.process.returncode is not None:
                state = f"exited ({member.process.returncode})"
            else:
                state = "running"
            if member.role == "volunteer":
                detail = f"{member.address or '-':<22} {state:<18} {member.experts}"
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
                             "accuracy": result.get("accuracy"), "samples_per_s": result.get("samples_per_s"),
                             "steps": result.get("steps"), "averaging_rounds": result.get("averaging_rounds"),
                             "failed_expert_calls": result.get("failed_expert_calls"), "log": str(member.log_path)})
        accuracies = [t["accuracy"] for t in trainers if isinstance(t["accuracy"], (int, float))]
        return {
            "trainers": trainers,
            "final_accuracy": min(accuracies) if len(accuracies) == len(trainers) and trainers else None,
            "samples_per_s": sum(t["samples_per_s"] or 0 for t in trainers),
            "daemons_killed": sum(m.killed_at is not None for m in self.members),
            "all_trainers_finished": all(t["exit_code"] == 0 for t in trainers),
            "leftover_processes": sum(m.process is not None and m.process.returncode is None for m in self.members),
            "logs": str(self.log_dir),
        }

    def _print_summary(self, summary: dict[str, Any]) -> None:
        self.out.write("\nsummary:\n")
        for trainer in summary["trainers"]:
            accuracy = trainer["accuracy"]
            speed = trainer["samples_per_s"]
            if isinstance(accuracy, (int, float)):
                self.out.write(f"  {trainer['name']}: held-out accuracy {accuracy:.3f}")
            else:
                self.out.write(f"  {trainer['name']}: no result")
            if isinstance(speed, (int, float)):
                self.out.write(f", {speed:.0f} samples/s")
            if trainer["averaging_rounds"] is not None:
                self.out.write(f", {trainer['averaging_rounds']} averaging rounds")
            self.out.write(f" (exit {trainer['exit_code']})\n")
        self.out.write(f"  daemons killed and survived: {summary['daemons_killed']}; logs in {summary['logs']}\n")
        self.out.write(json.dumps(summary) + "\n")
        self.out.flush()


def _progress_text(member: Managed) -> str:
    progress = member.progress
    if not progress:
        return member.last_line[:90]
    parts = []
    if "step" in progress:
        total = progress.get("steps")
        parts.append(f"step {progress['step']}" + (f"/{total}" if total else ""))
    for key, label, fmt in (("loss", "loss", "{:.3f}"), ("accuracy", "acc", "{:.3f}"),
                            ("samples_per_s", "samples/s", "{:.0f}"), ("experts_alive", "experts", "{}"),
                            ("epoch", "epoch", "{}")):
        value = progress.get(key)
        if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    return "  ".join(parts)


def _grid_order(uid: str) -> tuple:
    """`ffn.9` before `ffn.10`: uids ordered by their grid coordinates."""
    name, *coords = uid.split(".")
    return (name, *(int(c) if c.isdigit() else 0 for c in coords))


def _child_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # several peers share this machine's cores
    return env
