"""A churn schedule: signals and spawns applied to named processes at given times or when a condition holds.

Why: scenario runners must kill, freeze and restart peers while a swarm trains, reproducibly and readably, as a
list of steps rather than sleeps spread through a test. It knows nothing of training or of the testbed: a process
is a `subprocess.Popen` under a name, a spawn is a callable that returns one.

    churn = Churn([Action("stop", "v1", at=5.0),
                   Action("cont", "v1", at=8.0),
                   Action("kill", "v2", when=lambda: trainer_step() >= 100),
                   Action("spawn", "v2", start=lambda: wan.spawn(host, argv))],
                  processes={"v1": p1, "v2": p2})
    churn.run(timeout=120)          # or call churn.poll() from your own loop

Actions run in list order: each is applied once its time has come (`at`, seconds after the first `poll`) and its
condition holds (`when`), and only after the action before it was applied; so "stop then cont" can never run the
other way round. `kill` is SIGKILL, `stop` SIGSTOP, `cont` SIGCONT; signalling a process that has already exited
is recorded (outcome "exited"), not an error. A signal's `pick` chooses its target when it is applied (e.g. "the
trainer that has run longest"); when it returns None the action is recorded as "skipped" and nothing is sent.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT}


@dataclass(frozen=True)
class Action:
    """One step: `kind` ("kill", "stop", "cont" or "spawn") applied to the process named `target`; `start`
    (spawn only) returns the new process; `pick` (signals only) names the target when the action is applied
    (None: skip it), `target` is then only a label."""

    kind: str
    target: str
    at: float | None = None
    when: Callable[[], bool] | None = None
    start: Callable[[], subprocess.Popen[Any]] | None = None
    pick: Callable[[], str | None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in (*SIGNALS, "spawn"):
            raise ValueError(f"unknown churn action {self.kind!r}")
        if (self.kind == "spawn") != (self.start is not None):
            raise ValueError("a spawn, and only a spawn, needs `start`")
        if self.kind == "spawn" and self.pick is not None:
            raise ValueError("a spawn names its process: no `pick`")


@dataclass(frozen=True)
class Applied:
    """What happened: the action, when (seconds after the start), the pid it concerned, the outcome ("done",
    "exited" when the target had already exited, "skipped" when `pick` chose nobody: pid 0) and the process it
    reached (`action.target`, or what `pick` chose)."""

    action: Action
    time: float
    pid: int
    outcome: str
    target: str = ""


class Churn:
    """Applies `actions` in order to `processes` (a copy: spawns add to `self.processes`)."""

    def __init__(self, actions: Iterable[Action], processes: Mapping[str, subprocess.Popen[Any]] | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.pending = list(actions)
        self.processes: dict[str, subprocess.Popen[Any]] = dict(processes or {})
        self.applied: list[Applied] = []
        self._clock = clock
        self._started: float | None = None

    @property
    def done(self) -> bool:
        return not self.pending

    def elapsed(self) -> float:
        """Seconds since the first `poll` (0 before)."""
        return 0.0 if self._started is None else self._clock() - self._started

    def poll(self) -> list[Applied]:
        """Apply every action that is due now, in order; return what was applied."""
        if self._started is None:
            self._started = self._clock()
        applied = []
        while self.pending:
            action = self.pending[0]
            if action.at is not None and self.elapsed() < action.at:
                break
            if action.when is not None and not action.when():
                break
            self.pending.pop(0)
            applied.append(self._apply(action))
        self.applied += applied
        return applied

    def run(self, *, timeout: float | None = None, interval: float = 0.05) -> list[Applied]:
        """Poll every `interval` seconds until every action was applied; `TimeoutError` (naming what is left)
        after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            if self.done:
                return self.applied
            if deadline is not None and time.monotonic() >= deadline:
                left = ", ".join(f"{action.kind} {action.target}" for action in self.pending)
                raise TimeoutError(f"churn schedule not finished after {timeout} s: {left} pending")
            time.sleep(interval)

    def _apply(self, action: Action) -> Applied:
        if action.kind == "spawn":
            assert action.start is not None
            process = self.processes[action.target] = action.start()
            return Applied(action, self.elapsed(), process.pid, "done", action.target)
        target = action.target if action.pick is None else action.pick()
        if target is None:
            return Applied(action, self.elapsed(), 0, "skipped")
        process = self.processes[target]
        if process.poll() is not None:
            return Applied(action, self.elapsed(), process.pid, "exited", target)
        process.send_signal(SIGNALS[action.kind])
        return Applied(action, self.elapsed(), process.pid, "done", target)
