"""What a scenario run (`peer.testing.scenario`) measured, and the figures the tests and `bench_wan` read from it.

Why a module of its own: the runner drives processes; this part only reads their JSON lines, so every rule of
the issue's "must hold" list (one outer state per outer step, the wait a frozen trainer costs, a slow trainer's
samples) is a plain function of events that a test can state in one line and a person can check by hand.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peer.testing.scenario import Planned, Scenario

APPLIED = ("averaged", "solo")  # outcomes of an outer_round event that moved the trainer's outer state by a round
LOST = ("lost", "dropped", "skipped")  # outcomes whose work was not applied by that round
# start reasons of rounds that waited out a window for a trainer that did not come. Not "quorum": that round
# started the moment a quorum was ready, after its window, so it waited for the slowest of the quorum, not for the
# missing trainer (without it, the round would have waited for every trainer: later)
WAITED_A_WINDOW = ("quorum after grace", "max wait")


@dataclass
class TrainerReport:
    """What one trainer did, as the result keeps it (JSON-ready). `finished`: not killed, exited 0 with a result
    line; `reached_end`: and its last outer step is the run's."""

    name: str
    joiner: bool
    slowdown: float
    killed: bool
    finished: bool
    reached_end: bool
    exit_code: int | None
    outer_step: int
    hash: str | None
    accuracy: float | None
    goodput: float | None
    bytes_sent: int
    bytes_received: int
    rounds: int  # outer_round events of rounds it was a member of
    averaged_rounds: int  # ... whose outcome was "averaged"
    lost_rounds: int  # outer_round events whose work was not applied (lost, dropped, skipped)
    samples_counted: int  # samples of its contributions that rounds averaged
    cut_short: int | None
    late_contributions: int | None
    stale_contributions: int | None
    dropped_contributions: int | None
    first_contribution: dict[str, Any] | None  # the trainer's own: outer steps from the state it joined at
    first_contribution_since_spawn: dict[str, Any] | None  # seconds and swarm outer steps since its process started
    peak_sent_bytes_s: float  # over 1 s windows, from its interface's counters
    peak_round_bytes_sent: int  # the most it sent in one outer round (its outer_round events' bytes_sent)
    peak_received_bytes_s: float
    compute_seconds: float | None
    blocked_seconds: float | None


@dataclass
class ScenarioResult:
    """A finished run: the scenario, the plan, what was applied to whom, each trainer's report and events.
    `rtt_s`, `up_bytes_s`: the trainers' path RTT and uplink rate by their profile (the first trainer's host)."""

    scenario: Scenario
    plan: list[Planned]
    applied: list[dict[str, Any]]
    trainers: dict[str, TrainerReport]
    events: dict[str, list[dict[str, Any]]]
    seconds: float
    rtt_s: float
    up_bytes_s: float | None
    workdir: str

    @property
    def finished(self) -> list[TrainerReport]:
        return [t for t in self.trainers.values() if t.finished]

    def mean(self, key: str, names: list[str] | None = None) -> float | None:
        """Mean of a report field over the finished trainers (or `names` of them) that have it."""
        values = [getattr(t, key) for t in self.finished if (names is None or t.name in names)
                  and getattr(t, key) is not None]
        return sum(values) / len(values) if values else None

    @property
    def goodput(self) -> float | None:
        return self.mean("goodput")

    @property
    def accuracy(self) -> float | None:
        return self.mean("accuracy")

    # ------------------------------------------------------------------------------------------ agreement

    def hashes_by_step(self, names: list[str] | None = None) -> dict[int, dict[str, list[str]]]:
        """{outer step: {hash: [trainers]}} from every applied outer_round event and every result line (of all
        trainers, killed ones too: a trainer that completed a step before it died held that step's state)."""
        table: dict[int, dict[str, list[str]]] = {}
        for name, events in self.events.items():
            if names is not None and name not in names:
                continue
            for event in events:
                applied = event.get("event") == "outer_round" and event.get("outcome") in APPLIED
                if (applied or event.get("event") == "result") and isinstance(event.get("hash"), str):
                    holders = table.setdefault(int(event["outer_step"]), {}).setdefault(event["hash"], [])
                    if name not in holders:
                        holders.append(name)
        return dict(sorted(table.items()))

    def hash_conflicts(self, names: list[str] | None = None) -> dict[int, dict[str, list[str]]]:
        """The outer steps at which trainers held different states (empty: they always agreed)."""
        return {step: held for step, held in self.hashes_by_step(names).items() if len(held) > 1}

    # ------------------------------------------------------------------------------------------ rounds

    def rounds(self) -> list[dict[str, Any]]:
        """Every round as its members reported it: round, members, reason, waited, window (one coordinator's
        start: every member reports the same; two starts of one round number are two entries) and, per member,
        outcome, since_offer, staleness, samples."""
        table: dict[tuple[Any, ...], dict[str, Any]] = {}
        for name, events in self.events.items():
            for event in events:
                if event.get("event") != "outer_round" or "round" not in event:
                    continue
                key = (event["round"], event.get("reason"), event.get("waited"), event.get("window"))
                entry = table.setdefault(key, {
                    "round": event["round"], "members": event.get("members"), "reason": event.get("reason"),
                    "waited": event.get("waited"), "window": event.get("window"), "by": {}})
                entry["by"][name] = {k: event.get(k) for k in ("outcome", "since_offer", "staleness", "samples")}
        return [table[key] for key in sorted(table, key=lambda k: (k[0], str(k[1:])))]

    def round_rtts(self) -> dict[str, Any]:
        """How many RTTs a round costs beyond its transfer: per round, (its time from ready to applied - its
        transfer time) / RTT, over the rounds every member of which averaged.

        Time from ready to applied: the smallest `since_offer` among the round's members, i.e. the member that
        offered last (the round cannot start before the last expected offer; the others' since_offer also holds
        the wait for it). Transfer time: the bytes that member sent in the round, estimated as its `bytes_sent`
        (all-reduce or gather payloads, as encoded) divided by its averaged rounds, over its uplink rate (the
        profile's `up`; both ends of a same-profile pair have the same rate). RTT: the profile's. Returns the
        median and max over rounds and the per-round figures."""
        if not self.up_bytes_s or not self.rtt_s:
            return {"median": None, "max": None, "rounds": []}
        per_round = []
        for entry in self.rounds():
            members = entry["by"]
            if not members or any(m["outcome"] != "averaged" or m["since_offer"] is None for m in members.values()):
                continue
            last, info = min(members.items(), key=lambda item: item[1]["since_offer"])
            report = self.trainers[last]
            sent_per_round = report.bytes_sent / max(1, report.averaged_rounds)
            transfer = sent_per_round / self.up_bytes_s
            per_round.append({"round": entry["round"], "since_offer": info["since_offer"],
                              "transfer_s": round(transfer, 4),
                              "rtts": round((info["since_offer"] - transfer) / self.rtt_s, 2)})
        values = [r["rtts"] for r in per_round]
        return {"median": statistics.median(values) if values else None, "max": max(values, default=None),
                "rounds": per_round}

    def waits(self, names: list[str]) -> list[dict[str, Any]]:
        """The rounds `names` took part in, with how long each waited after its window opened and why it
        started (to judge what a frozen or slow trainer cost the others). A start refused as breaking the rules
        carries no window (its figures were not trusted) and is left out."""
        return [{"round": e["round"], "reason": e["reason"], "waited": e["waited"], "window": e["window"],
                 "members": e["members"]}
                for e in self.rounds() if any(n in e["by"] for n in names) and e["window"] is not None]

    def contributions(self, name: str) -> list[dict[str, Any]]:
        """`name`'s outer_round events (also dropped ones: those say why)."""
        return [e for e in self.events.get(name, []) if e.get("event") == "outer_round"]

    # ------------------------------------------------------------------------------------------ output

    def summary(self) -> dict[str, Any]:
        """The JSON-ready digest: run figures, per trainer reports, the plan and what was applied."""
        return {
            "scenario": dataclasses.asdict(self.scenario), "seconds": round(self.seconds, 2),
            "goodput": self.goodput, "accuracy": self.accuracy, "hash_conflicts": self.hash_conflicts(),
            "outer_steps_checked": len(self.hashes_by_step()), "workdir": self.workdir,
            "trainers": {name: dataclasses.asdict(report) for name, report in self.trainers.items()},
            "plan": [dataclasses.asdict(p) for p in self.plan], "applied": self.applied,
        }
