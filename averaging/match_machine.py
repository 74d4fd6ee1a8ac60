"""One matchmaking round as state machines: named states and named timeouts in, actions out. No trio, no I/O.

Why a core of its own: the two loops of a round (a joiner waiting for its view to settle, then joining; a collector
accepting joins, probing the missing, sealing) were the policy of matchmaking, and they were written as trio loops
that awaited in the middle of their decisions. Here they are machines the driver (`averaging.matchmaking`) asks
"what now?" with the time: each answers one action, and the driver reports back how it went. So every rule reads
in one place, and a test walks a round decision by decision without sockets or a clock
(tests/averaging/test_match_machine.py).

A round, seen from one peer (docs/architecture/matchmaking.md tells the protocol and why each rule is there):

- `Planner`: the plan every peer derives from its view (`plan_groups`, full chunks only while `Patience` holds out
  for peers of recent rounds), my chunk and its collector. Shared by both machines and by the join handler, which
  redirects a join when this peer follows another collector.
- `RoundMachine` (states `Phase`): PLANNING until the view settles on a collector for my chunk, then a `Join`;
  REDIRECTED when the last answer (or a lower collector's invitation) named where to go; COLLECTING while I am my
  chunk's collector (the `CollectorMachine` runs); DONE with a group or a reason.
- `CollectorMachine`: accepts joins into its `Assembly` until it seals, probes the chunk members that have not
  joined, drops the ones gone, steps down for a lower collector, merges into one that invites it.

The timeouts, each named after what it waits for (`Timeouts`, read from `Pacing` at each decision, since the
pace is measured as the round goes):
- QUIET (`quiet`): a view unchanged this long may be acted on when it shows a full chunk; also the probe interval;
- SETTLE (`settle`): a partial chunk, or a group with room left, becomes final on a view unchanged this long;
- FOLLOWER_GRACE (`follower_grace`): after a probe found a chunk member following another collector, how long a
  collector with room leaves it to come here before sealing without it;
- WINDOW (`deadline`): the round's end, on the driver's clock; SEAL (`Assembly.seal_deadline`): the earliest
  deadline of the collector's members, on the DHT's clock.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from averaging.assembly import Assembly, Decision, Declaration, chunk_of, collector_of, plan_groups, round_salt
from peer.p2p.identity import PeerID

if TYPE_CHECKING:  # the round's state and the waits are read, never awaited (they live beside the driver)
    from averaging.match_round import MatchRound
    from averaging.match_waits import Pacing, Patience

__all__ = ["Collect", "CollectorMachine", "Join", "Phase", "Planner", "Recheck", "RoundMachine", "Seal",
           "StepDown", "Timeouts", "Wait", "GiveUp", "MAX_REDIRECTS"]

MAX_REDIRECTS = 4  # redirects followed per round: each goes to a lower peer id, so they cannot loop; this bounds them


class Phase(enum.Enum):
    PLANNING = "planning"
    REDIRECTED = "redirected"
    COLLECTING = "collecting"
    DONE = "done"


@dataclass(frozen=True)
class Timeouts:
    """The named timeouts of a round (see the module doc), as `Pacing` measures them now."""

    quiet: float
    settle: float
    follower_grace: float
    deadline: float

    @classmethod
    def of(cls, pacing: Pacing, deadline: float = math.inf) -> Timeouts:
        return cls(quiet=pacing.quiet_period, settle=pacing.settle_period,
                   follower_grace=pacing.quiet_period + 2 * pacing.rtt.value, deadline=deadline)


# ------------------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Join:
    """Send one long-poll join to `collector`; report the answer with `RoundMachine.answered`."""

    collector: Declaration


@dataclass(frozen=True)
class Collect:
    """Run the collector's machine (`CollectorMachine`) until it seals or steps down; report with `collected`."""


@dataclass(frozen=True)
class Wait:
    """Start a background probe (`avg.mm.ping`) of each of `probe` (a collector's chunk members that have not
    joined; their answers change the round), then sleep until the round changes (a view read, a join, a probe
    answer) or until `until`, and ask again."""

    until: float
    probe: tuple[Declaration, ...] = ()


@dataclass(frozen=True)
class GiveUp:
    """The round ends without a group, for `reason`."""

    reason: str


@dataclass(frozen=True)
class Recheck:
    """Ask the followers once more before sealing with room left; report with `CollectorMachine.rechecked`."""


@dataclass(frozen=True)
class Seal:
    """Seal the assembly: every held join gets the same group (or none, below the minimum size)."""


@dataclass(frozen=True)
class StepDown:
    """Stop collecting: a lower collector appeared in my chunk, or `merged_into` one that invited me (my joiners
    were redirected there). The round plans again."""

    merged_into: Declaration | None = None


# ------------------------------------------------------------------------------------------- planning


class Planner:
    """The plan every peer derives from what it sees: `plan_groups` over the view (minus the excluded), full chunks
    only while `patience` holds out for peers of recent rounds."""

    def __init__(self, peer_id: PeerID, target: int, patience: Patience):
        self.peer_id = peer_id
        self.target = target
        self.patience = patience

    def chunk(self, state: MatchRound, now: float) -> list[Declaration]:
        visible = [d for p, d in state.view.items() if p not in state.excluded] + [state.me]
        plan = plan_groups(visible, self.target, salt=round_salt(state.key, visible),
                           full_only=self.patience.patient(state, now))
        return chunk_of(plan, self.peer_id)

    def collector(self, state: MatchRound, now: float) -> Declaration | None:
        return collector_of(self.chunk(state, now))

    @staticmethod
    def quiet_for(state: MatchRound, now: float, chunk: list[Declaration]) -> float:
        """How long the part of the view that matters to me has been still: no peer appeared (the view may still
        be filling) and my chunk kept its members. Peers leaving the view for groups sealed elsewhere do not
        count unless they move my chunk: in a first round of 64 peers every seal withdraws a few declarations,
        and a peer whose full chunk none of them touched waited out every withdrawal, half a second, while its
        collector, short of it, handed its joiners over and sealed 2."""
        members = tuple(d.peer_id for d in chunk)
        if members != state.chunk:
            state.chunk, state.chunk_since = members, now
        return now - max(state.last_change, state.chunk_since)


# ------------------------------------------------------------------------------------------- a joiner's round


class RoundMachine:
    """One round from one peer's side: when to join whom, when to collect, when to give up. `stats` is the
    matchmaker's counters (shared): redirects, rejects and no_group are counted here."""

    def __init__(self, state: MatchRound, planner: Planner, pacing: Pacing, *, deadline: float,
                 stats: dict[str, int]):
        self.state = state
        self.planner = planner
        self.pacing = pacing
        self.deadline = deadline
        self.stats = stats
        self.phase = Phase.PLANNING
        self.redirects = 0
        self._redirect: Declaration | None = None  # where the next join goes (REDIRECTED)
        self._joining: Declaration | None = None
        self.result: Decision | None = None  # DONE with a group: the decision that carries it

    @property
    def peer_id(self) -> PeerID:
        return self.planner.peer_id

    def next_action(self, now: float) -> Join | Collect | Wait | GiveUp:
        state = self.state
        if state.invited_by is not None and state.assembly is None:  # a lower collector asked me to merge into it
            self._redirect, state.invited_by = state.invited_by, None
            self.phase = Phase.REDIRECTED
        if self.phase is Phase.REDIRECTED and state.assembly is None and self._redirect is not None:
            self._joining, self._redirect = self._redirect, None
            return Join(self._joining)
        chunk = self.planner.chunk(state, now)  # one plan per pass: it sorts the whole view
        collector = collector_of(chunk)
        if state.assembly is not None or (collector is not None and collector.peer_id == self.peer_id):
            self.phase = Phase.COLLECTING
            return Collect()
        self.phase = Phase.PLANNING
        timeouts = Timeouts.of(self.pacing, self.deadline)
        if now >= timeouts.deadline:
            self.stats["no_group"] += 1
            self.phase = Phase.DONE
            return GiveUp("no group before the deadline")
        if collector is None:  # alone, or only client-mode peers around: wait for a reachable one
            return Wait(min(timeouts.deadline, now + timeouts.quiet))
        quiet_for = self.planner.quiet_for(state, now, chunk)
        full = len(chunk) >= self.planner.target
        patient = self.planner.patience.patient(state, now)
        # under a crowded key, declarations trimmed from a full shard reappear in the next one a few quiet
        # periods late: a full chunk waits as long as a partial one, or the latecomers end in partial groups
        quiet_enough = timeouts.settle if state.crowded else timeouts.quiet
        settled = (full and not patient and quiet_for >= quiet_enough) or state.join_arrived \
            or (not patient and quiet_for >= timeouts.settle)
        if not settled:
            return Wait(min(timeouts.deadline, now + timeouts.quiet / 2))
        self._joining = collector
        return Join(collector)

    def answered(self, decision: Decision | None, now: float) -> bool:
        """The join sent by the last `Join` was answered with `decision` (None: the collector was unreachable,
        and the join excluded it). True when it is my group (DONE, `result`)."""
        collector, state = self._joining, self.state
        if collector is None:
            raise RuntimeError("answered() without a Join in flight")
        self._joining = None
        redirected, self.phase = self.phase is Phase.REDIRECTED, Phase.PLANNING
        if decision is not None and decision.kind == "group" and decision.group is not None \
                and self.peer_id in decision.group:
            self.result, self.phase = decision, Phase.DONE
            return True
        if redirected:  # where a redirect or an invitation sent me: only a rejection says more than "plan again"
            if decision is not None and decision.kind == "reject":
                state.exclude_busy([*decision.busy, collector.peer_id], self.peer_id)
            return False
        if decision is None:
            state.last_change = now  # plan again without it
            return False
        if decision.kind == "redirect" and decision.redirect is not None and self.redirects < MAX_REDIRECTS \
                and decision.redirect.peer_id < collector.peer_id:
            self.redirects += 1
            self.stats["redirects"] += 1
            self._redirect, self.phase = decision.redirect, Phase.REDIRECTED
            state.excluded.add(collector.peer_id)  # it follows someone else this round
            return False
        # a collector that already left (its withdrawal not visible yet) or a full one: plan again at once
        self.stats["rejects"] += 1
        state.exclude_busy([*decision.busy, collector.peer_id], self.peer_id)
        return False

    def collected(self, sealed: bool, now: float) -> None:
        """The collector's machine ended: sealed (DONE) or stepped down (plan again)."""
        if sealed:
            self.phase = Phase.DONE
        else:
            self.phase = Phase.PLANNING
            self.state.last_change = now


# ------------------------------------------------------------------------------------------- a collector


class CollectorMachine:
    """The collector's side of a round: its `Assembly` accepts joins (the join handler feeds it) until it seals.
    Each `next_action` is one pass over the round: seal when `Assembly.should_seal` says so (a group with room
    left only on a settled view, and after a `Recheck` of the followers unless full or at the seal deadline);
    otherwise wait, probing the chunk members that have not joined (at most once a QUIET each); drop the ones gone from
    the view and the client-mode ones (they cannot be probed) once SETTLE passed, and wait. After each wait: merge
    into a lower collector that invited me, step down for a lower one in my chunk while nobody joined, or seal
    alone when everyone in view is dead or taken."""

    def __init__(self, state: MatchRound, planner: Planner, pacing: Pacing, *, min_size: int):
        self.state = state
        self.planner = planner
        self.pacing = pacing
        if state.assembly is None:
            state.assembly = Assembly(state.me, key=state.key, target_group_size=planner.target,
                                      min_group_size=min_size)
        self.assembly: Assembly = state.assembly
        self._probed: dict[PeerID, float] = {}
        self._waited = False

    def next_action(self, now: float) -> Seal | Recheck | Wait | StepDown:
        """The next action; after a `Recheck`, ask again at once if a follower is on its way here, else `Seal`."""
        state, assembly = self.state, self.assembly
        timeouts = Timeouts.of(self.pacing)
        if self._waited:
            self._waited = False
            after = self._after_wait(now, timeouts)
            if after is not None:
                return after
        chunk = self.planner.chunk(state, now)
        assembly.set_expected(chunk, state.merging)
        quiet_for = self.planner.quiet_for(state, now, chunk)
        patient = state.patient = self.planner.patience.patient(state, now)
        # a group with room left is final only on a view quiet for as long as a joiner waits before joining a
        # partial chunk (SETTLE); and a peer dropped because it followed another collector may be turned away
        # there (full) and come here next: leave it FOLLOWER_GRACE too
        settled = quiet_for >= timeouts.settle and now - state.last_drop >= timeouts.follower_grace
        if assembly.should_seal(now + state.offset, settled and not patient):
            if assembly.full or now + state.offset >= assembly.seal_deadline:
                return Seal()
            return Recheck()
        probe: list[Declaration] = []
        if quiet_for >= timeouts.quiet:
            for peer_id in sorted(assembly.waiting_for):
                declaration = state.view.get(peer_id)
                if declaration is None:  # it left the view
                    assembly.drop(peer_id)
                elif declaration.can_collect:
                    if now - self._probed.get(peer_id, -math.inf) >= timeouts.quiet:
                        self._probed[peer_id] = now
                        probe.append(declaration)
                elif quiet_for >= timeouts.settle:
                    assembly.drop(peer_id)  # a client-mode peer cannot be probed: don't wait forever
        self._waited = True
        return Wait(min(assembly.seal_deadline - state.offset, now + timeouts.quiet / 2), tuple(probe))

    def _after_wait(self, now: float, timeouts: Timeouts) -> Seal | StepDown | None:
        state, assembly = self.state, self.assembly
        if state.invited_by is not None and not assembly.closed:
            # a lower collector counts me in and has room for my joiners too: merge into it (`Prober.answer`)
            into = state.invited_by
            assembly.merge_into(into)
            state.assembly = None
            return StepDown(merged_into=into)
        if len(assembly.joined) == 1 and not assembly.closed:
            collector = self.planner.collector(state, now)
            if collector is not None and collector.peer_id != self.planner.peer_id:
                state.assembly = None  # step down; joins arriving from now on get redirected
                return StepDown()
            if state.nobody_left() and now - state.last_change >= timeouts.settle:
                return Seal()  # everyone I can see is dead or taken: waiting out the window helps nobody
        return None
