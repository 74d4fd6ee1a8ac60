"""`Contributor`: a DiLoCo phase's contribution on its way to the outer round that takes it.

Why its own object: between the end of a phase and an applied outer step lies the whole of the rounds' protocol
seen from a trainer (docs/outer-rounds.md): offer to the round's coordinator (`averaging.rounds`), follow its
verdict (a start, late, behind on the chain, another chain, dropped), catch up by download between tries, give
up past a bound. It runs the same in the blocking and the overlapped mode (there in the background); what a
member does once a round started is `averaging.diloco_member`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Awaitable, Callable, TypeVar

import trio

from averaging.diloco_ledger import DiLoCoLedger
from averaging.diloco_member import RoundMember
from averaging.diloco_sync import StateSync
from averaging.diloco_view import SwarmView
from averaging.outer_state import OuterState
from averaging.polled import unless
from averaging.progress import ProgressTracker
from averaging.quorum import Dropped, Late, Offer, QuorumPolicy, Resync, Start
from averaging.rounds import Behind, Final, RoundService

logger = logging.getLogger("averaging.diloco")  # the optimizer's own log, as before these parts had modules

__all__ = ["Contribution", "Contributor"]

T = TypeVar("T")


@dataclasses.dataclass
class Contribution:
    """One phase's pseudo-gradient on its way through the rounds: computed for round `base`, on the tensors
    `indices` (its fragment)."""

    base: int
    samples: int
    started: float  # trio time it was offered first
    indices: list[int]


class Contributor:
    """Prepares each phase's contribution (its fragment and the samples behind it) and offers it until a round
    takes it, within 2 x (`averaging_timeout` + `load_state_timeout`). `inflight_round`: the round a contribution
    is offered to now (None between contributions)."""

    def __init__(self, *, outer: OuterState, view: SwarmView, sync: StateSync, member: RoundMember,
                 tracker: ProgressTracker, rounds: RoundService, ledger: DiLoCoLedger, policy: QuorumPolicy,
                 averaging_timeout: float, load_state_timeout: float):
        self.outer = outer
        self.view = view
        self.sync = sync
        self.member = member
        self.tracker = tracker
        self.rounds = rounds
        self.ledger = ledger
        self.policy = policy
        self.averaging_timeout = averaging_timeout
        self.load_state_timeout = load_state_timeout
        self.fragments = len(outer.fragments)
        self.inflight_round: int | None = None
        # the run's last outer step, once the training loop told it (`DiLoCoOptimizer.more_steps`): nothing is
        # offered from it or past it, since nobody would apply such a round. Overlap's eager contribution went one
        # round past the end in every run, and under churn that round could hang: two trainers at the last outer
        # step sat a minute in it while a third, finished, gave up waiting to agree with them
        self.final_step: int | None = None
        self._samples_since = [0] * self.fragments  # samples behind each fragment's next contribution

    def prepare(self, base: int, phase_samples: int) -> Contribution:
        """This phase's contribution to round `base`: its fragment's pseudo-gradient (already in `outer.pseudo`)
        and the samples behind it (every phase since that fragment last contributed; this one had
        `phase_samples`)."""
        self.member.own_trace = [p.clone() for p in self.outer.pseudo] if self.member.trace_dir else []
        fragment = base % self.fragments
        self._samples_since = [n + phase_samples for n in self._samples_since]
        samples, self._samples_since[fragment] = self._samples_since[fragment], 0
        return Contribution(base, max(1, samples), 0.0, list(self.outer.fragment(base)))

    def ended(self) -> bool:
        """Whether I hold the run's last outer step (`final_step`): no contribution is due any more."""
        return self.final_step is not None and self.outer.step >= self.final_step

    def next_round(self) -> int:
        """The round the current phase's contribution will be offered to (in overlap, the one after the round
        the background contribution is in)."""
        inflight = self.inflight_round
        return self.outer.step if inflight is None else max(self.outer.step, inflight + 1)

    async def contribute(self, contribution: Contribution) -> str:
        """`_offer_until_taken`, bounded as a whole. Each of its waits has its own deadline; the bound is the net
        under them: four trainers of a topk2 run once sat in this call for ten minutes with their trio thread
        idle (2 of about 13 runs of tests/peer/test_train_sparse.py: two pairs of trainers, each late for the
        other's round, started the next rounds with members from behind alone, whose members waited a
        `load_state_timeout` each time for a result nobody could apply; `quorum.OuterRound` no longer starts such
        a round), and a trainer must go on training rather than wait forever on its partners. Past the bound
        nothing is applied ("lost")."""
        if not contribution.started:
            contribution.started = trio.current_time()  # first offered now (in overlap, from the background)
        bound = 2 * (self.averaging_timeout + self.load_state_timeout)
        try:
            with trio.move_on_after(bound):
                return await self._offer_until_taken(contribution)
            logger.warning("diloco: the contribution from outer step %d found no end in %.0f s (round %s); given "
                           "up, nothing applied", contribution.base, bound, self.inflight_round)
            return "lost"
        finally:
            self.inflight_round = None

    async def _offer_until_taken(self, contribution: Contribution) -> str:
        """Offer the pseudo-gradient in `outer.pseudo` (computed for round `contribution.base`) until a round takes
        it. Returns "averaged", "solo", "lost" (a round took it but did not finish: nothing applied), "dropped"
        (too stale, or refused), or "skipped" (no coordinator answered: nothing applied)."""
        step = max(contribution.base, self.outer.step)
        deadline = trio.current_time() + self.averaging_timeout + self.load_state_timeout
        retries = 0
        while trio.current_time() < deadline:
            if self.ended():  # a download brought me to the run's last outer step: no round is due after it
                logger.info("diloco: outer step %d is the run's last; the contribution from outer step %d is not "
                            "offered", self.outer.step, contribution.base)
                return "skipped"
            step = self.aligned(max(step, self.outer.step), contribution.base)
            staleness = (step - contribution.base) // self.fragments  # in rounds of its own fragment
            if staleness > self.policy.max_staleness:
                return self._drop(contribution, f"stale by {staleness} rounds (at most {self.policy.max_staleness})")
            behind = self.may_offer_behind(contribution, step)
            if self.outer.step < step and not behind:  # a fragment's contribution waits for its next round
                caught = await self._unless_others_finish(self.sync.catch_up, step, self.view.candidates(step - 1),
                                                          deadline)
                if isinstance(caught, str):
                    return await self._take_final_state(step)
                if not caught:
                    return "lost"
                continue
            offer = Offer(bytes(self.tracker.peer_id), step - staleness, contribution.samples, self.outer.hash,
                          self.view.address, chain=self.view.chain_items())
            if self.tracker.last_fetch_age > self.tracker.max_refresh:
                # the roster is no older than the tracker keeps it
                self.view.last_progress = await self.tracker.fetch()
            self.view.note_roster()
            progress = self.tracker.progress()
            past = self.view.moved_past(step, progress)
            if past is not None and self.may_offer_behind(contribution, past):
                # others hold a newer outer step (a joiner the swarm outran while it downloaded, a trainer that
                # fell behind, a round held without me): offer to their round from the state I hold, and
                # download its result after it (`quorum.OuterRound`: a member behind on the coordinator's chain),
                # not before it
                step = past
                continue
            newest, _, _ = self.view.canonical(list(progress.peers))
            if newest > step and await self.sync.resync(progress):
                # others hold a newer outer step on another chain (a trainer back from a partition): hold
                # theirs first, then offer (or drop)
                step = self.outer.step
                continue
            self.inflight_round = step
            verdict = await self._enter(step, offer, deadline)
            if verdict == "passed":
                # the round I was queued in was held without me (its coordinator was frozen when the others
                # offered, and they went to the next one): a trainer once waited there `max_wait`, then alone.
                # The loop's top offers on to their round from behind, or takes their state
                self.ledger.counts["late_contributions"] += 1
                logger.info("diloco: round %d was held without me; offering on", step)
                continue
            if isinstance(verdict, str):
                return await self._take_final_state(step)
            if verdict is None:
                logger.warning("diloco: no coordinator of round %d answered; the contribution waits", step)
                return "skipped"
            if isinstance(verdict, Start):
                return await self.member.average(verdict, contribution)
            if isinstance(verdict, Dropped):
                return self._drop(contribution, verdict.reason)
            if isinstance(verdict, Behind):
                self.ledger.counts["late_contributions"] += 1
                holding = verdict.holding
                if not self.sync.vouched(holding):  # a candidate's word alone moves nobody: offer on
                    retries += 1
                    if retries > 2:
                        return "lost"
                    continue
                logger.info("diloco: round %d is over; catching up to outer step %d", step, holding.step)
                if not await self.sync.download(holding, [verdict.source, *holding.members], deadline):
                    return "lost"
                step = self.outer.step
                continue
            start = verdict.start
            self.view.members_of[start.step + 1] = tuple((m.peer, m.address) for m in start.members)
            if isinstance(verdict, Late):
                self.ledger.counts["late_contributions"] += 1
                if self.may_offer_behind(contribution, start.step + 1) and not self.view.others_finished():
                    logger.info("diloco: late for round %d (%s); offering to the next from outer step %d",
                                start.step, start.reason, self.outer.step)
                    step = start.step + 1
                    continue
                logger.info("diloco: late for round %d (%s); catching up", start.step, start.reason)
            elif isinstance(verdict, Resync):
                logger.warning("diloco: my outer state at step %d (%s) is not the round's (%s); catching up",
                               self.outer.step, self.outer.hash[:12], start.hash[:12])
                if self.outer.step < start.step and await self.sync.resync(self.tracker.progress()):
                    # behind, and nobody vouched for my state: take the newest one now, then offer from it
                    # (waiting for the round's result instead can wait forever: a round of one member whose
                    # coordinator is me produces nothing, and is started again, alone, at each offer)
                    step = self.outer.step
                    continue
            if not await self.sync.catch_up(start.step + 1, self.view.members_of[start.step + 1], deadline):
                retries += 1
                if retries > 2:
                    return "lost"
                continue  # that round produced nothing: offered again, its coordinator starts it anew
            step = self.outer.step
        return "lost"

    async def _enter(self, step: int, offer: Offer, deadline: float) -> Final | None | str:
        """`rounds.enter`, or "finished" as soon as every other live trainer of the run has finished: they come to
        no more rounds (a trainer behind at the end of a run would wait for a round nobody starts); or "passed"
        as soon as the others hold an outer step past `step`: they held that round without me, and the
        coordinator I am queued with would start it with nobody else, after `max_wait`."""
        enter = functools.partial(self._unless_others_finish,
                                  functools.partial(self.rounds.enter, deadline=deadline), step, offer)
        return await unless(lambda: self.view.moved_past(step) is not None, self.tracker.max_refresh, "passed", enter)

    async def _unless_others_finish(self, work: Callable[..., Awaitable[T]], *args: Any) -> T | str:
        """`await work(*args)`, or "finished" as soon as every other live trainer of the run has finished (what it
        waited for, a round or an outer step, will not come). Polled: the tracker refreshes the progress records
        in the background, with no event to wait on."""
        return await unless(self.view.others_finished, self.tracker.max_refresh, "finished", work, *args)

    async def _take_final_state(self, step: int) -> str:
        """Every other trainer finished while my contribution waited for round `step` (or for its outer step):
        nobody will start it. Hold their state instead; the contribution is skipped."""
        logger.info("diloco: every other trainer finished while my contribution waited for round %d; taking the "
                    "final state instead", step)
        await self.sync.resync(self.tracker.progress())
        return "skipped"

    def may_offer_behind(self, contribution: Contribution, step: int) -> bool:
        """Whether this contribution may go to round `step` from the older outer state I hold: the state it was
        computed on, within the staleness bound (whole-model rounds only: a fragment's round must match it), and
        a round that makes an outer step of the run (`final_step`): a trainer late for the run's last round once
        offered on to the round after it, which nobody holds, and sat there 20 s (goodput 0.14) until the others
        had finished; it takes the last round's result instead."""
        return (self.fragments == 1 and self.outer.step == contribution.base < step
                and step - contribution.base <= self.policy.max_staleness
                and (self.final_step is None or step < self.final_step))

    def aligned(self, step: int, base: int) -> int:
        """The first round at or after `step` that synchronises the fragment of round `base`."""
        return step + (base - step) % self.fragments

    def _drop(self, contribution: Contribution, reason: str) -> str:
        self.ledger.counts["dropped_contributions"] += 1
        logger.warning("diloco: dropped the contribution of round %d (%d samples): %s", contribution.base,
                       contribution.samples, reason)
        self.ledger.record(self.outer, {"outcome": "dropped", "base": contribution.base,
                                        "samples": contribution.samples, "reason": reason})
        return "dropped"
