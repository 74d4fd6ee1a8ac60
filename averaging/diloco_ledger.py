"""`DiLoCoLedger`: what a DiLoCo trainer counted and recorded, for `DiLoCoOptimizer.stats()` and its progress lines.

Why one owner of the figures: every part of the optimizer counts something (its clock the compute and blocked
seconds, the offers the late and dropped contributions, a round's member the group sizes and bytes, the
downloads the state loads), and the progress lines, the run's result and the structured events read it all.
Kept here, the names and meanings of the figures live in one place instead of beside every increment."""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

from averaging.averager import StepResult
from averaging.outer_state import OuterState
from averaging.progress import ProgressTracker

__all__ = ["DiLoCoLedger"]

OUTCOMES_SKIPPED = ("skipped", "lost", "dropped")  # a contribution that applied nothing


class DiLoCoLedger:
    """The counters (`counts`, the core of `stats()`), the outer rounds' records (the last 1000, each also an
    event for `on_event`), the first contribution, and the bytes of the last outer step."""

    def __init__(self, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.counts: dict[str, Any] = {
            "outer_steps": 0, "rounds": 0, "group_sizes": {}, "solo_steps": 0, "skipped_rounds": 0,
            "state_loads": 0, "state_load_failures": 0, "unvouched_states": 0, "resyncs": 0, "final_resyncs": 0,
            "outer_waits": 0, "late_contributions": 0, "stale_contributions": 0, "dropped_contributions": 0,
            "lost_rounds": 0, "cut_short": 0, "bytes_sent": 0, "bytes_received": 0, "compute_seconds": 0.0,
            "blocked_seconds": 0.0,
        }
        self.round_records: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)
        self.bytes_per_outer_step = 0
        self._bytes_at_round: tuple[int, int] = (0, 0)
        self._bytes_at_record: tuple[int, int] = (0, 0)
        self.first_contribution: dict[str, Any] | None = None
        self.created = time.monotonic()
        self.joined_at_step = 0  # the outer step this trainer held when it joined (set once it has)
        self._on_event = on_event

    def emit(self, event: dict[str, Any]) -> None:
        """Hand a structured event to `DiLoCoHooks.on_event` (`peer train` prints them as JSON lines)."""
        if self._on_event is not None:
            self._on_event(event)

    def record(self, outer: OuterState, record: dict[str, Any]) -> None:
        """Keep an outer round's record (stamped with the outer state held now, and the bytes this trainer sent
        and received since the record before: the round's own traffic, which Streaming DiLoCo's peak per sync is
        read from) and emit it."""
        sent, received = self.counts["bytes_sent"], self.counts["bytes_received"]
        record = {"event": "outer_round", "outer_step": outer.step, "hash": outer.hash,
                  "bytes_sent": sent - self._bytes_at_record[0], "bytes_received": received - self._bytes_at_record[1],
                  **record}
        self._bytes_at_record = (sent, received)
        self.round_records.append(record)
        self.emit(record)

    def count_outcome(self, outcome: str) -> None:
        """A contribution ended: one that applied nothing counts as a skipped round."""
        if outcome in OUTCOMES_SKIPPED:
            self.counts["skipped_rounds"] += 1

    def add_traffic(self, sent: int, received: int) -> None:
        self.counts["bytes_sent"] += sent
        self.counts["bytes_received"] += received

    def count_traffic(self, result: StepResult) -> None:
        """Bytes of this all-reduce as they crossed the wire (encoded chunks pushed and pulled)."""
        if result.allreduce is None:
            return
        self.add_traffic(result.allreduce.bytes_sent, result.allreduce.bytes_received)

    def note_first(self, round_step: int) -> bool:
        """A contribution of this trainer was taken by round `round_step`: remember it when it is the first one
        (how soon a joiner contributed: seconds since it was created, outer steps since the one it joined at).
        True when it was the first."""
        if self.first_contribution is not None:
            return False
        self.first_contribution = {"seconds": round(time.monotonic() - self.created, 3),
                                   "outer_steps": round_step - self.joined_at_step + 1, "round": round_step}
        return True

    def account_round(self, tracker: ProgressTracker, window: float, goodput: float | None) -> None:
        """A phase ended: the bytes of the outer step behind it, and the figures the progress record shows (the
        grace window `window` now, this trainer's `goodput`)."""
        sent, received = self.counts["bytes_sent"], self.counts["bytes_received"]
        self.bytes_per_outer_step = (sent - self._bytes_at_round[0]) + (received - self._bytes_at_round[1])
        self._bytes_at_round = (sent, received)
        last = next((r for r in reversed(self.round_records) if "members" in r), None)
        first = self.first_contribution
        tracker.info.update({
            "bytes": int(self.bytes_per_outer_step), "util": None if goodput is None else round(goodput, 3),
            # churn as people read it (peer status, the dashboard): the last round's members and why it started,
            # the grace window now, contributions that came late, and how soon this trainer first contributed
            "mem": None if last is None else int(last["members"]),
            "why": None if last is None else str(last.get("reason", ""))[:32],
            "win": round(window, 3),
            "late": int(self.counts["late_contributions"]),
            "join": None if first is None else int(first["outer_steps"]),
        })

    def counters(self) -> dict[str, Any]:
        """A copy of the counters as `stats()` shows them (group sizes sorted, seconds rounded)."""
        stats = dict(self.counts)
        stats["group_sizes"] = dict(sorted(stats["group_sizes"].items()))
        stats["compute_seconds"] = round(stats["compute_seconds"], 3)
        stats["blocked_seconds"] = round(stats["blocked_seconds"], 3)
        return stats

    def last_round(self) -> dict[str, Any] | None:
        """The main figures of the last round this trainer took part in (None before any)."""
        last = next((r for r in reversed(self.round_records) if "round" in r), None)
        if last is None:
            return None
        return {k: last.get(k) for k in ("round", "members", "reason", "waited", "window", "staleness", "outcome")}
