"""`StepClock`: a DiLoCo trainer's own clocks, read in the training thread and by the rounds in the trio thread.

Why its own object: three decisions hang on the same few timestamps. Goodput is compute time (inner steps and
what the training loop does between them) over wall time; a coordinator's window opening must end this phase
early enough to make it, which needs the wall time of an inner step; and a trainer whose loop stopped calling
`step()` must not be counted on for a round. Measuring them in one place keeps the three consistent.

The compute and blocked seconds go into the ledger's counters (`DiLoCoLedger.counts`), where `stats()` reads them.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["StepClock"]


class StepClock:
    """Timestamps of the inner steps (`time.monotonic()`), an estimate of one step's wall time, and the time by
    which this phase must end (`cut_at`, set when a round this phase goes to opened). `slowdown`: a test's slow
    machine (`DiLoCoHooks.slowdown`): each step's compute is stretched that many times, counted as compute."""

    def __init__(self, counts: dict[str, Any], slowdown: float = 1.0) -> None:
        self.counts = counts
        self.slowdown = slowdown
        self.started: float | None = None
        self.last_step_end: float | None = None
        self.last_step_seconds: float | None = None
        self.step_seconds = 0.0  # an exponential average of an inner step's wall time, between step() calls
        self.cut_at: float | None = None  # monotonic time by which this phase must end (a round opened)

    def begin_step(self) -> float:
        """An inner step begins: count the loop's work since the last one as compute, update the estimate of a
        step's wall time, stretch it under `slowdown`. Returns when the optimizer's own step begins."""
        now = time.monotonic()
        if self.started is None:
            self.started = now
        elif self.last_step_end is not None:
            last = now - self.last_step_end + (self.last_step_seconds or 0.0)
            if self.step_seconds == 0.0:
                self.step_seconds = last
            else:  # one long pause (the loop waited on something else) moves the estimate by a bounded amount
                self.step_seconds = 0.8 * self.step_seconds + 0.2 * min(last, 4.0 * self.step_seconds)
            self.counts["compute_seconds"] += now - self.last_step_end  # forward + backward since the last step
            if self.slowdown > 1.0:
                extra = (self.slowdown - 1.0) * (now - self.last_step_end)
                time.sleep(extra)
                self.counts["compute_seconds"] += extra
                now = time.monotonic()
        return now

    def computed(self, began: float) -> float:
        """The optimizer's step (begun at `began`) is done: count it as compute. Returns the time now."""
        after = time.monotonic()
        self.counts["compute_seconds"] += after - began
        self.last_step_seconds = after - began
        return after

    def end_step(self, after_compute: float, ended_phase: bool) -> None:
        """`step()` returns: a phase's end (its outer round, or the wait for one) counts as blocked time."""
        self.last_step_end = time.monotonic()
        if ended_phase:
            self.counts["blocked_seconds"] += self.last_step_end - after_compute

    def must_cut(self, now: float, steps: int, phase_steps: int) -> bool:
        """A round this phase goes to opened, and the steps left (of `phase_steps`, `steps` taken) would miss its
        window: end the phase now."""
        if self.cut_at is None or steps >= phase_steps:
            return False
        left = (phase_steps - steps) * self.step_seconds
        return now + left > self.cut_at

    def cut_within(self, seconds: float) -> None:
        """A round this phase goes to opened: its window closes in `seconds`."""
        self.cut_at = time.monotonic() + seconds

    def idle(self) -> bool:
        """Whether the training loop stopped calling `step()` (no step for much longer than a step takes); not
        before the first step (the loop will come)."""
        last = self.last_step_end
        return last is not None and time.monotonic() - last > max(2.0, 20 * self.step_seconds)

    @property
    def goodput(self) -> float | None:
        """Compute time (inner steps and what the training loop does between them) over wall time."""
        if self.started is None or self.last_step_end is None or self.last_step_end <= self.started:
            return None
        wall = self.last_step_end - self.started
        blocked = float(self.counts["blocked_seconds"])
        return max(0.0, min(1.0, 1.0 - blocked / wall))
