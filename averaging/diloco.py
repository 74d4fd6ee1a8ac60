"""DiLoCoOptimizer: training over slow links with many local steps between rare, compressed outer steps.

    opt = DiLoCoOptimizer(torch.optim.AdamW(model.parameters()), swarm, run_id="digits", inner_steps=500,
                          batch_size_per_step=32, compression=wire.Compression.INT8, overlap=True)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()                      # inner step every batch; an outer step every `inner_steps` of them
        opt.zero_grad()

Why: `CollaborativeOptimizer` sends the whole model every collective epoch; over home uplinks that is where the
time goes. DiLoCo (Douillard et al.) takes `inner_steps` local steps with the wrapped (inner) optimizer, then
averages the *pseudo-gradient* (outer parameters at the start of the phase minus local parameters), weighted by
the samples behind it, and applies it to the outer parameters with an outer optimizer (default SGD with Nesterov
momentum, lr 0.7, momentum 0.9). Local parameters are then reset to the outer ones; the inner optimizer's state
stays local. Traffic drops by `inner_steps` times, and by 4 more with the INT8 codec.

Rounds that wait for nobody in particular (docs/outer-rounds.md): at the end of its inner phase a trainer offers
its contribution to the coordinator of the next round (`averaging.rounds`); the round starts when every expected
trainer is ready, or when a learned grace window has passed with a quorum ready. The members average their
pseudo-gradients with the butterfly all-reduce of `averaging.averager` (a member lost mid-way is excluded and
the others renormalise) and apply the same outer step, so every trainer that completed outer step N holds
bit-identical outer state for N (`hash`). A trainer that arrives after its round started is late: it offers the
same contribution to the next round from the outer state it holds, its weight discounted by staleness, as a member
behind on the round's chain (`quorum.OuterRound`), and downloads that round's result afterwards (a verified
download from the round's members); so does a joiner that the swarm outran while it downloaded. When a round's
window opens, the trainers still computing are told, and end their inner phase after their current step: a slow
machine runs fewer inner steps per outer step, its pseudo-gradient weighted by its samples, and slows nobody.

Overlap (`overlap=True`, the "eager / one step delayed" variant): at a phase's end the pseudo-gradient is handed
to a background contribution and inner steps go on; its averaged update is applied to the outer state as soon as
the round ends (in the trio thread), and local parameters move onto it at the next phase's end, keeping their
own latest progress (local = outer - own progress of the last phase). `stats()["outer_waits"]` counts phase ends
that had to wait for the background contribution.

Goodput (`stats()["goodput"]`) is time in inner steps (and what the training loop does between them) over wall
time, from the optimizer's own clocks.

Test hooks are constructor arguments (`DiLoCoHooks`), never environment variables.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import torch
import trio

from averaging.averager import Averager, StepResult
from averaging.errors import AveragingError
from averaging.gather import GatherService, combine, prefer_gather
from averaging.group import GroupInfo, Member
from averaging.optimizer import SwarmOptimizerBase
from averaging.outer_state import ErrorFeedback, OuterState, default_outer, nesterov_sgd
from averaging.progress import PeerProgress, ProgressTracker, SwarmProgress
from averaging.quorum import Dropped, Late, Offer, QuorumPolicy, Resync, Start, check_start
from averaging.rounds import Behind, Final, Holding, RoundService
from averaging.state import load_state
from averaging.state_hash import state_digest
from dht.client import SwarmHandle
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.net import Address

logger = logging.getLogger(__name__)

ALGORITHM = "diloco"

T = TypeVar("T")
Members = tuple[tuple[bytes, Address | None], ...]


state_hash = state_digest  # the outer state's hash: a manifest root, so downloads are verified block by block


# what a trainer reports in each progress line, and in its result besides
REPORTED = ("algorithm", "outer_step", "hash", "bytes_sent", "bytes_per_outer_step", "goodput", "swarm_trainers")
REPORTED_FINAL = (*REPORTED, "group_sizes", "state_loads", "resyncs", "final_resyncs", "outer_waits",
                  "bytes_received", "peer_id", "utilization", "rounds", "late_contributions", "stale_contributions",
                  "dropped_contributions", "lost_rounds", "cut_short", "coordinated", "first_contribution",
                  "compute_seconds", "blocked_seconds", "grace_window", "rtt")


@dataclasses.dataclass
class DiLoCoHooks:
    """What tests change in a trainer, passed to the constructor (product code reads no environment for it).

    hold_at: block this trainer's trio thread while its part of outer round N is being pushed (a test then kills
    it at exactly that moment; a line `{"event": "diloco_hold", ...}` goes to `on_event` first). on_event: gets
    every structured event (a dict; `peer train` prints them as JSON lines). trace_dir: save every outer step
    (torch.save, tensors only) there. scale_pseudo_gradient: a Byzantine trainer that sends x times its
    pseudo-gradient. slowdown: compute takes this many times longer (the trainer sleeps (slowdown - 1) times the
    measured compute of each inner step, counted as compute)."""

    hold_at: int | None = None
    on_event: Callable[[dict[str, Any]], None] | None = None
    trace_dir: str | None = None
    scale_pseudo_gradient: float = 1.0
    slowdown: float = 1.0


class NotAgreed(AveragingError):
    """`DiLoCoOptimizer.finish()` ran out of time before every live trainer of the run held one outer state
    (the message names the trainers still training, or holding another state): the models differ."""


@dataclasses.dataclass
class _Contribution:
    """One phase's pseudo-gradient on its way through the rounds: computed for round `base`, on the tensors
    `indices` (its fragment)."""

    base: int
    samples: int
    started: float  # trio time it was offered first
    indices: list[int]


class DiLoCoOptimizer(SwarmOptimizerBase):
    """Wraps any torch optimizer (the inner one) for DiLoCo training over a `peer.client.Swarm` (see module doc).

    `outer_optimizer`: a callable building the outer optimizer over the outer parameters (default: SGD with
    `outer_lr`, `outer_momentum`, Nesterov when the momentum is not 0; left None, the codec's
    `averaging.outer_state.default_outer`). `compression`: the codec of the pseudo-gradients (`peer.p2p.wire`);
    `error_feedback`: carry the codec's loss to the next round. `overlap`: delayed outer update (see module doc).
    `aggregation`: how the pseudo-gradients are reduced (mean, or Byzantine-robust: `averaging.robust`).
    `quorum`: when rounds start and how stale a contribution may be (`averaging.quorum.QuorumPolicy`).
    `start_with`: wait (at most `start_timeout`) until that many trainers of the run are visible before the first
    inner step, so a run's first trainers start from one state together. `fragments`: Streaming DiLoCo
    (`averaging.outer_state`): an outer round every inner_steps / fragments local steps, each on one fragment of
    the parameters, so every fragment is synchronised every `inner_steps` steps and peak traffic drops about
    `fragments` times; `outer_step` then counts fragment rounds (`fragments` per `inner_steps`). `exchange`: how a
    round's members combine their pseudo-gradients: "butterfly" all-reduce, "gather" (every member sends its
    compressed update to every other, all combine the same set: for sparse codecs; `averaging.gather`), or
    "auto" (the one that sends fewer bytes for the group and codec).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        swarm: SwarmHandle,
        run_id: str,
        *,
        inner_steps: int = 500,
        batch_size_per_step: int = 1,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        compression: wire.Compression = wire.Compression.NONE,
        error_feedback: bool = True,
        overlap: bool = False,
        quorum: QuorumPolicy | None = None,
        averaging_timeout: float = 60.0,
        load_state_timeout: float = 60.0,
        listen: bool = True,
        listen_host: str | None = None,
        progress_ttl: float = 20.0,
        min_refresh: float = 0.1,
        max_refresh: float = 2.0,
        publish_interval: float = 0.5,
        should_stop: Callable[[], bool] | None = None,
        start_with: int = 1,
        start_timeout: float = 300.0,
        finish_timeout: float | None = None,
        aggregation: str = "mean",
        fragments: int = 1,
        exchange: str = "auto",
        hooks: DiLoCoHooks | None = None,
    ):
        if exchange not in ("auto", "butterfly", "gather"):
            raise ValueError("exchange must be auto, butterfly or gather")
        if inner_steps < 1 or batch_size_per_step < 1:
            raise ValueError("inner_steps and batch_size_per_step must be positive")
        self.optimizer = optimizer
        self.swarm = swarm
        self.run_id = run_id
        self.inner_steps = int(inner_steps)
        self.batch_size_per_step = int(batch_size_per_step)
        self.compression = wire.Compression(compression)
        self.overlap = overlap
        self.policy = quorum or QuorumPolicy()
        self.should_stop = should_stop  # polled during an outer round: a stop request (SIGINT) abandons it
        self.averaging_timeout = averaging_timeout
        self.load_state_timeout = load_state_timeout
        self.start_with = int(start_with)
        self.start_timeout = start_timeout
        self.finish_timeout = finish_timeout
        self.hooks = hooks or DiLoCoHooks()
        self.round_steps = 0
        self.round_samples = 0
        self.local_steps = 0

        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        lr, momentum = default_outer(self.compression)
        lr = lr if outer_lr is None else outer_lr
        momentum = momentum if outer_momentum is None else outer_momentum
        make_outer = outer_optimizer or (lambda ps: nesterov_sgd(ps, lr, momentum))
        self._lock = threading.Lock()
        self.outer = OuterState(self.params, make_outer, compression=self.compression, error_feedback=error_feedback,
                                fragments=fragments, scale=self.hooks.scale_pseudo_gradient, lock=self._lock)
        self.fragments = len(self.outer.fragments)
        # a phase is inner_steps / fragments local steps: each fragment is synchronised every inner_steps steps
        self.phase_steps = max(1, self.inner_steps // self.fragments)
        self._samples_since = [0] * self.fragments  # samples behind each fragment's next contribution

        self._stats: dict[str, Any] = {
            "outer_steps": 0, "rounds": 0, "group_sizes": {}, "solo_steps": 0, "skipped_rounds": 0,
            "state_loads": 0, "state_load_failures": 0, "resyncs": 0, "final_resyncs": 0, "outer_waits": 0,
            "late_contributions": 0, "stale_contributions": 0, "dropped_contributions": 0, "lost_rounds": 0,
            "cut_short": 0, "bytes_sent": 0, "bytes_received": 0, "compute_seconds": 0.0, "blocked_seconds": 0.0,
        }
        self.round_records: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)
        self._bytes_at_round: tuple[int, int] = (0, 0)
        self.bytes_per_outer_step = 0
        self._created = time.monotonic()
        self._started: float | None = None
        self._last_step_end: float | None = None
        self._background: trio.Event | None = None  # overlap: set when the background contribution ended
        self._background_outcome = ""
        self._background_scope = trio.CancelScope()  # finish() gives up a background round that does not start
        self._held = False
        self._members_of: dict[int, Members] = {}  # outer step -> members of the round that produced it
        self._chain: dict[int, str] = {}  # outer step -> hash, of the recent outer states I held (RoundService)
        self._inflight_round: int | None = None  # the round a background contribution is offered to now
        self._finishing = False  # finish() was called: no more contributions
        self._cut_at: float | None = None  # monotonic time by which this phase must end (a round opened)
        self._last_step_seconds: float | None = None
        self._step_seconds = 0.0  # an exponential average of an inner step's wall time, between step() calls
        self._joined_at_step = 0
        self.first_contribution: dict[str, Any] | None = None
        self.last_progress: SwarmProgress | None = None
        self._address: Address | None = None

        self.averager = Averager(
            swarm.rpc, swarm.dht, self.outer.pseudo, prefix=f"{run_id}.diloco",
            names=[f"pseudo.{i}" for i in range(len(self.outer.pseudo))], allreduce_timeout=averaging_timeout,
            compression=self.compression, lock=threading.Lock(), serve_state=False,
            aggregation=aggregation,  # mean, centered_clip, trimmed_mean: see averaging.robust
        )
        self.rounds = RoundService(
            swarm.rpc, run_id, self.policy, holding=self._holding, expected=self._expected, on_open=self._on_open,
            address=lambda: self._address, banned=lambda: self.averager.strikes.banned, roster_ttl=progress_ttl,
            chain=lambda: self._chain,
        )
        self.exchange = exchange
        self.gather = GatherService(swarm.rpc, members_of=self.rounds.members_of_group)
        self.tracker = ProgressTracker(
            swarm.dht, run_id, self.phase_steps * self.batch_size_per_step, ttl=progress_ttl,
            min_refresh=min_refresh, max_refresh=max_refresh, client_mode=not listen,
            publish_interval=publish_interval,
        )
        self.tracker.info.update({"alg": ALGORITHM, "hash": self.hash, "bytes": 0, "util": None})
        self._scope = self._start_serving(listen, listen_host)
        self.swarm.run(self._join)  # a newcomer holds the swarm's outer state before its first inner step
        self._joined_at_step = self.outer_step

    # ------------------------------------------------------------------------------------------ trio side

    async def _serve(self, listen_host: str | None, *,
                     task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            async with self._serving_state(listen_host) as address:
                self._address = address
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        await nursery.start(self.averager.serve)
                        assert self.averager.allreduce_server is not None
                        self.averager.allreduce_server.hook = self._on_allreduce_event
                        await nursery.start(self.rounds.serve)
                        self.gather.install()
                        await nursery.start(self.tracker.run)
                        task_status.started(scope)
                finally:
                    self.gather.uninstall()

    def _emit(self, event: dict[str, Any]) -> None:
        if self.hooks.on_event is not None:
            self.hooks.on_event(event)

    def _on_allreduce_event(self, name: str, info: dict[str, Any]) -> None:
        """Counts nothing; with `hooks.hold_at`, blocks the whole trainer while its part of that outer round is
        being sent, so a test can SIGKILL it at exactly that moment."""
        if name == "chunk_pushed" and self.hooks.hold_at == self.outer_step and not self._held:
            self._held = True
            self._emit({"event": "diloco_hold", "outer_step": self.outer_step, "phase": name,
                        "part": int(info.get("part", -1))})
            time.sleep(3600)  # blocks the trio thread on purpose: nothing of this trainer moves until the kill

    def _get_state(self) -> tuple[Any, list[torch.Tensor]]:
        """Called by the state server under the lock: the outer state with its step, hash and the members of the
        round that produced it (a trainer that catches up needs them to find the next round)."""
        members = self._members_of.get(self.outer_step, ())
        return {"outer_step": self.outer_step, "hash": self.hash, "run_id": self.run_id, "algorithm": ALGORITHM,
                "members": [[p, list(a) if a is not None else None] for p, a in members]}, self._outer_state

    def _holding(self) -> Holding:
        return Holding(self.outer_step, self.hash, self._members_of.get(self.outer_step, ()))

    def _view(self, step: int) -> Members:
        """Trainers of the run at outer step `step` in the progress records (and me, when I am there)."""
        me = self.tracker.peer_id
        progress = self.tracker.progress()
        members = [(bytes(p.peer_id), p.address) for p in progress.peers
                   if p.info.get("alg") and not p.left and p.epoch == step and p.peer_id != me]
        if self.outer_step == step:
            members.append((bytes(me), self._address))
        return tuple(members)

    def _candidates(self, step: int) -> Members:
        """Who may coordinate round `step`: the members of the round that produced outer step `step`, and the
        trainers at that step in the progress records (so that trainers whose rounds split, or that started
        apart, meet again under one coordinator)."""
        merged = dict(self._view(step))
        merged.update((p, a) for p, a in self._members_of.get(step, ()) if a is not None or p not in merged)
        return tuple(merged.items())

    def _expected(self, step: int) -> dict[bytes, Address | None]:
        """Whom I expect in a round I coordinate: the members of the round that produced outer step `step`, and the
        trainers at that step in the progress records; for a round of
        an outer step I know nothing of (the first of a run), every trainer of the roster (those busy elsewhere
        say so when the window opens)."""
        if step not in self._members_of:
            return {**dict(self.rounds.roster()), **dict(self._view(step))}
        # not minus the peers my last all-reduce saw fail: a timeout on a loaded machine is no proof of death, and
        # the window's opening probes every expected trainer anyway (a dead one refuses it at once)
        return dict(self._candidates(step))

    def _on_open(self, step: int, closes_in: float) -> bool:
        """A coordinator opened round `step`, whose window closes in `closes_in` seconds. When this phase's
        contribution goes there, the phase ends early enough to make the window (`step()` checks). Returns whether
        I will offer to (or am offering to) that round; not when my loop stopped, or when my contribution cannot go
        there (another fragment's round, or further ahead than the staleness bound)."""
        last = self._last_step_end  # None: the loop has not started yet (it will come)
        idle = self._finishing or (last is not None and time.monotonic() - last > max(2.0, 20 * self._step_seconds))
        if step == self._inflight_round:
            return True  # my offer to that round is on its way (it may have met a redirect, or the network)
        # a trainer whose loop stopped calling step() is not coming; one behind the round comes from its state
        coming = not idle and (step == self._next_round() or (
            self._inflight_round is None and self.fragments == 1
            and self.outer_step < step <= self.outer_step + self.policy.max_staleness))
        if coming:
            self._cut_at = time.monotonic() + closes_in
        else:
            logger.debug("diloco: not coming to round %d (next %d, idle %s, finishing %s)", step, self._next_round(),
                         idle, self._finishing)
        return coming

    def _next_round(self) -> int:
        """The round the current phase's contribution will be offered to (in overlap, the one after the round
        the background contribution is in)."""
        inflight = self._inflight_round
        return self.outer_step if inflight is None else max(self.outer_step, inflight + 1)

    def _note_roster(self) -> None:
        """The trainers the progress records show, into the rounds' roster."""
        now = self.tracker.dht.now()
        for peer in self.tracker.progress().peers:
            if peer.left:
                self.rounds.forget(bytes(peer.peer_id))
            elif peer.info.get("alg") and now - peer.time <= self.tracker.ttl:  # a record refreshed in time
                self.rounds.note(bytes(peer.peer_id), peer.address)

    # ------------------------------------------------------------------------------------------ contributions

    async def _contribute(self, contribution: _Contribution) -> str:
        """`_offer_until_taken`, bounded as a whole. Each of its waits has its own deadline; the bound is the net
        under them: four trainers of a topk2 run once sat in this call for ten minutes with their trio thread
        idle (2 of about 13 runs of tests/test_train_sparse.py, cause not found yet), and a trainer must go on
        training rather than wait forever on its partners. Past the bound nothing is applied ("lost")."""
        if not contribution.started:
            contribution.started = trio.current_time()  # first offered now (in overlap, from the background)
        bound = 2 * (self.averaging_timeout + self.load_state_timeout)
        try:
            with trio.move_on_after(bound):
                return await self._offer_until_taken(contribution)
            logger.warning("diloco: the contribution from outer step %d found no end in %.0f s (round %s); given "
                           "up, nothing applied", contribution.base, bound, self._inflight_round)
            return "lost"
        finally:
            self._inflight_round = None

    async def _offer_until_taken(self, contribution: _Contribution) -> str:
        """Offer the pseudo-gradient in `self.pseudo` (computed for round `contribution.base`) until a round takes
        it. Returns "averaged", "solo", "lost" (a round took it but did not finish: nothing applied), "dropped"
        (too stale, or refused), or "skipped" (no coordinator answered: nothing applied)."""
        step = max(contribution.base, self.outer_step)
        deadline = trio.current_time() + self.averaging_timeout + self.load_state_timeout
        retries = 0
        while trio.current_time() < deadline:
            step = self._aligned(max(step, self.outer_step), contribution.base)
            staleness = (step - contribution.base) // self.fragments  # in rounds of its own fragment
            if staleness > self.policy.max_staleness:
                return self._drop(contribution, f"stale by {staleness} rounds (at most {self.policy.max_staleness})")
            behind = self._may_offer_behind(contribution, step)
            if self.outer_step < step and not behind:  # a fragment's contribution waits for its next round
                caught = await self._unless_others_finish(self._catch_up, step, self._candidates(step - 1), deadline)
                if isinstance(caught, str):
                    return await self._take_final_state(step)
                if not caught:
                    return "lost"
                continue
            offer = Offer(bytes(self.tracker.peer_id), step - staleness, contribution.samples, self.hash,
                          self._address, chain=self._chain_items())
            if self.tracker.last_fetch_age > self.tracker.max_refresh:
                self.last_progress = await self.tracker.fetch()  # the roster is no older than the tracker keeps it
            self._note_roster()
            progress = self.tracker.progress()
            newest, _, holders = self._canonical(list(progress.peers))
            training = any(not p.info.get("fin") for p in holders)  # finished trainers come to no more rounds
            if newest > step and training and self._may_offer_behind(contribution, newest):
                # others hold a newer outer step (a joiner the swarm outran while it downloaded, a trainer that
                # fell behind): offer to their round from the state I hold, and download its result after it
                # (`quorum.OuterRound`: a member behind on the coordinator's chain), not before it
                step = newest
                continue
            if newest > step and await self._resync(progress):
                # others hold a newer outer step on another chain (a trainer back from a partition): hold
                # theirs first, then offer (or drop)
                step = self.outer_step
                continue
            self._inflight_round = step
            verdict = await self._enter(step, offer, deadline)
            if isinstance(verdict, str):
                return await self._take_final_state(step)
            if verdict is None:
                logger.warning("diloco: no coordinator of round %d answered; the contribution waits", step)
                return "skipped"
            if isinstance(verdict, Start):
                return await self._average(verdict, contribution)
            if isinstance(verdict, Dropped):
                return self._drop(contribution, verdict.reason)
            if isinstance(verdict, Behind):
                self._stats["late_contributions"] += 1
                holding = verdict.holding
                logger.info("diloco: round %d is over; catching up to outer step %d", step, holding.step)
                if not await self._download(holding, [verdict.source, *holding.members], deadline):
                    return "lost"
                step = self.outer_step
                continue
            start = verdict.start
            self._members_of[start.step + 1] = tuple((m.peer, m.address) for m in start.members)
            if isinstance(verdict, Late):
                self._stats["late_contributions"] += 1
                if self._may_offer_behind(contribution, start.step + 1) and not self._others_finished():
                    logger.info("diloco: late for round %d (%s); offering to the next from outer step %d",
                                start.step, start.reason, self.outer_step)
                    step = start.step + 1
                    continue
                logger.info("diloco: late for round %d (%s); catching up", start.step, start.reason)
            elif isinstance(verdict, Resync):
                logger.warning("diloco: my outer state at step %d (%s) is not the round's (%s); catching up",
                               self.outer_step, self.hash[:12], start.hash[:12])
                if self.outer_step < start.step and await self._resync(self.tracker.progress()):
                    # behind, and nobody vouched for my state: take the newest one now, then offer from it
                    # (waiting for the round's result instead can wait forever: a round of one member whose
                    # coordinator is me produces nothing, and is started again, alone, at each offer)
                    step = self.outer_step
                    continue
            if not await self._catch_up(start.step + 1, self._members_of[start.step + 1], deadline):
                retries += 1
                if retries > 2:
                    return "lost"
                continue  # that round produced nothing: offered again, its coordinator starts it anew
            step = self.outer_step
        return "lost"

    async def _enter(self, step: int, offer: Offer, deadline: float) -> Final | None | str:
        """`rounds.enter`, or "finished" as soon as every other live trainer of the run has finished: they come to
        no more rounds (a trainer behind at the end of a run would wait for a round nobody starts)."""
        return await self._unless_others_finish(functools.partial(self.rounds.enter, deadline=deadline), step, offer)

    async def _unless_others_finish(self, work: Callable[..., Awaitable[T]], *args: Any) -> T | str:
        """`await work(*args)`, or "finished" as soon as every other live trainer of the run has finished (what it
        waited for, a round or an outer step, will not come)."""
        verdict: T | str = "finished"
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                nonlocal verdict
                verdict = await work(*args)
                nursery.cancel_scope.cancel()

            async def watch() -> None:
                # polled: the tracker refreshes the progress records in the background, with no event to wait on
                while not self._others_finished():  # noqa: ASYNC110
                    await trio.sleep(self.tracker.max_refresh)
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)
            nursery.start_soon(watch)
        return verdict

    async def _take_final_state(self, step: int) -> str:
        """Every other trainer finished while my contribution waited for round `step` (or for its outer step):
        nobody will start it. Hold their state instead; the contribution is skipped."""
        logger.info("diloco: every other trainer finished while my contribution waited for round %d; taking the "
                    "final state instead", step)
        await self._resync(self.tracker.progress())
        return "skipped"

    def _others_finished(self) -> bool:
        """Whether the progress records show other live trainers of the run, all of them finished."""
        others = self._other_trainers(self.tracker.progress().peers)
        return bool(others) and all(p.info.get("fin") for p in others)

    def _other_trainers(self, peers: Sequence[PeerProgress]) -> list[PeerProgress]:
        """The other trainers of the run among these progress records, live (not said goodbye)."""
        me = self.tracker.peer_id
        return [p for p in peers if p.peer_id != me and p.info.get("alg") and not p.left]

    def _may_offer_behind(self, contribution: _Contribution, step: int) -> bool:
        """Whether this contribution may go to round `step` from the older outer state I hold: the state it was
        computed on, within the staleness bound (whole-model rounds only: a fragment's round must match it)."""
        return (self.fragments == 1 and self.outer_step == contribution.base < step
                and step - contribution.base <= self.policy.max_staleness)

    def _aligned(self, step: int, base: int) -> int:
        """The first round at or after `step` that synchronises the fragment of round `base`."""
        return step + (base - step) % self.fragments

    def _drop(self, contribution: _Contribution, reason: str) -> str:
        self._stats["dropped_contributions"] += 1
        logger.warning("diloco: dropped the contribution of round %d (%d samples): %s", contribution.base,
                       contribution.samples, reason)
        self._record({"outcome": "dropped", "base": contribution.base, "samples": contribution.samples,
                      "reason": reason})
        return "dropped"

    async def _average(self, start: Start, contribution: _Contribution) -> str:
        """I am a member of `start`: average, apply, remember the round."""
        me = start.member(bytes(self.tracker.peer_id))
        assert me is not None
        problem = check_start(start, self.policy)
        if problem is not None:  # a coordinator that breaks the rules: not followed, and not asked first again
            logger.warning("diloco: round %d's start from %s breaks the rules (%s); not taken", start.step,
                           PeerID(start.coordinator).short() if start.coordinator else "?", problem)
            if start.coordinator:
                self.rounds.suspect(start.coordinator)
            self._record({"outcome": "lost", "round": start.step, "reason": f"bad start: {problem}",
                          "base": contribution.base})
            return "lost"
        began = trio.current_time()
        outcome, reason = "solo", ""
        others = [p for p, _ in self.rounds.roster() if p != bytes(self.tracker.peer_id)]
        if len(start.members) == 1 and others:
            # alone in a round while other trainers of the run are live (a partition, or they were reachable a
            # moment ago): apply nothing, so this trainer's progress is not lost in a state the others will not
            # hold; the next round's pseudo-gradient covers this one too
            logger.info("diloco: round %d had no other member while %d trainers are live; nothing applied",
                        start.step, len(others))
            self._record({"outcome": "skipped", "round": start.step, "members": 1, "reason": start.reason,
                          "waited": round(start.waited, 4), "window": round(start.window, 4),
                          "base": contribution.base})
            self.rounds.alone_in(start.step)
            return "skipped"
        if len(start.members) > 1 and self._gathers(start, contribution.indices):
            outcome, reason = await self._gather(start, contribution)
        elif len(start.members) > 1:
            group = GroupInfo.create(start.group_id, [
                Member(PeerID(m.peer), m.address, m.bandwidth) for m in start.members])
            result = await self.averager.average_in(group, weight=me.weight, timeout=self.averaging_timeout,
                                                    tensors=[self.pseudo[i] for i in contribution.indices])
            self._count_traffic(result)
            outcome = "averaged" if result.finished else "lost"
            reason = result.reason
        behind = first = False
        if outcome == "lost":
            self._stats["lost_rounds"] += 1
            logger.info("diloco: round %d did not finish (%s); nothing applied", start.step, reason)
        else:
            behind = (outcome == "averaged" and self.outer_step == contribution.base < start.step
                      and self._chain.get(contribution.base) == self.hash)
            if behind:
                # a member from an older state of the round's chain: my pseudo-gradient is in the others' outer
                # step; I download it after this round (below) instead of applying it
                self.outer.counted()
            elif self.outer_step != start.step or self.hash != start.hash:
                # moved meanwhile (a download by another path): this round's update does not fit my state
                outcome = "lost"
                self._stats["lost_rounds"] += 1
            else:
                self._apply_outer(start, contribution, me.weight)
                self._members_of[self.outer_step] = tuple((m.peer, m.address) for m in start.members)
                self._forget_old_members()
            if outcome != "lost":
                if me.staleness:
                    self._stats["stale_contributions"] += 1
                if outcome == "solo":
                    self._stats["solo_steps"] += 1
                else:
                    sizes = self._stats["group_sizes"]
                    sizes[len(start.members)] = sizes.get(len(start.members), 0) + 1
                self.tracker.note_group([m.peer for m in start.members])
                if self.first_contribution is None:
                    first = True
                    self.first_contribution = {
                        "seconds": round(time.monotonic() - self._created, 3),
                        "outer_steps": start.step - self._joined_at_step + 1, "round": start.step}
                if not behind:
                    self.rounds.held_changed()
                    self._publish_state()
        if outcome == "lost" and start.coordinator == bytes(self.tracker.peer_id):
            self.rounds.round_failed(start.step)
        self._stats["rounds"] += 1
        self._record({
            "outcome": outcome, "round": start.step, "members": len(start.members), "reason": start.reason,
            "waited": round(start.waited, 4), "window": round(start.window, 4), "base": contribution.base,
            "staleness": me.staleness, "samples": me.samples, "weight": me.weight,
            "seconds": round(trio.current_time() - began, 4),
            "since_offer": round(trio.current_time() - contribution.started, 4),
            "contributors": [{"peer": PeerID(m.peer).short(), "samples": m.samples, "staleness": m.staleness,
                              "weight": round(m.weight, 4)} for m in start.members],
            **({"behind": self.outer_step} if behind else {}),
            **({"first_contribution": self.first_contribution} if first else {}),  # also known if killed later
        })
        if behind:
            members = tuple((m.peer, m.address) for m in start.members)
            self._members_of[start.step + 1] = members
            if not await self._catch_up(start.step + 1, members, trio.current_time() + self.load_state_timeout):
                logger.info("diloco: could not download outer step %d after contributing to it from outer step %d; "
                            "the next contribution goes from here", start.step + 1, self.outer_step)
        return outcome

    def _gathers(self, start: Start, indices: list[int]) -> bool:
        """All-gather (`averaging.gather`) instead of the butterfly: with `exchange="gather"`, or with "auto" when
        it sends fewer bytes for this group and codec; never when a member cannot be called. Every member decides
        the same from the same start."""
        if self.exchange == "butterfly" or any(m.address is None for m in start.members):
            return False
        if self.exchange == "gather":
            return True
        compressed = sum(wire.data_nbytes(self.pseudo[i], self.compression) for i in indices)
        sparse = self.compression in (wire.Compression.TOPK2, wire.Compression.TOPK8)
        returned = compressed if not sparse else sum(
            wire.data_nbytes(self.pseudo[i], wire.Compression.INT8) for i in indices)
        return prefer_gather(len(start.members), compressed, returned)

    async def _gather(self, start: Start, contribution: _Contribution) -> tuple[str, str]:
        """This round by all-gather: push, agree on the set with the coordinator, combine it (robust rules on the
        decoded values); judged like the butterfly's rounds (rejected contributions are strikes)."""
        tensors = [self.pseudo[i] for i in contribution.indices]
        result = await self.gather.run(start.group_id, [(m.peer, m.address) for m in start.members], tensors,
                                       self.compression, (start.coordinator, start.coordinator_address),
                                       deadline=trio.current_time() + self.averaging_timeout)
        self._stats["bytes_sent"] += result.bytes_sent
        self._stats["bytes_received"] += result.bytes_received
        if result.contributions is None or result.chosen is None:
            return "lost", result.reason
        weights = {m.peer: m.weight for m in start.members}
        rejected = combine(result.contributions, weights, self.averager.aggregation, tensors)
        newly = self.averager.strikes.record_round(set(rejected), result.chosen)
        if newly:
            logger.warning("diloco: banning %s (contributions rejected in %d rounds)",
                           ", ".join(PeerID(p).short() for p in sorted(newly)), self.averager.strikes.ban_after)
        if len(result.contributions) - len(rejected) < 1:
            return "lost", "every contribution was rejected"
        return "averaged", ""

    def _record(self, record: dict[str, Any]) -> None:
        record = {"event": "outer_round", "outer_step": self.outer_step, "hash": self.hash, **record}
        self.round_records.append(record)
        self._emit(record)

    def _forget_old_members(self) -> None:
        for step in [s for s in self._members_of if s < self.outer_step - self.policy.max_staleness - 2]:
            del self._members_of[step]

    async def _catch_up(self, step: int, holders: Members, deadline: float) -> bool:
        """Move to outer step `step` or newer: wait until one of `holders` holds it, then download it from the
        holders at that step (checked against the hash they report). True when I hold at least `step`."""
        while self.outer_step < step and trio.current_time() < deadline:
            holding = await self.rounds.await_step(step, holders, deadline=deadline)
            if holding is None:
                logger.warning("diloco: nobody of round %d holds outer step %d yet", step - 1, step)
                return False
            sources: Sequence[tuple[bytes, Address | None]] = [
                (p, a) for p, a in holding.members if a is not None] or holders
            if await self._download(holding, sources, deadline):
                return True
        return self.outer_step >= step

    async def _download(self, holding: Holding, sources: Sequence[tuple[bytes, Address | None]],
                        deadline: float) -> bool:
        """Download the outer state `holding` describes from `sources`; True when what arrived is outer step
        `holding.step` or newer and hashes to what its provider claims."""
        me = bytes(self.tracker.peer_id)
        candidates = list(dict.fromkeys((PeerID(p), a) for p, a in sources if a is not None and p != me))
        staging = [torch.empty_like(t) for t in self._outer_state]
        try:
            # in parallel verified blocks from every holder of that hash (a source that dies or lies is dropped)
            loaded = await load_state(self.swarm.rpc, candidates, into=staging, expected_hash=holding.hash,
                                      timeout=max(0.0, min(self.load_state_timeout, deadline - trio.current_time())))
        except Exception as error:  # nobody could give it: the contribution is lost, the next one retries
            self._stats["state_load_failures"] += 1
            logger.warning("diloco: loading outer step %d failed: %s", holding.step, error)
            return False
        metadata = loaded.metadata if isinstance(loaded.metadata, dict) else {}
        step, claimed = metadata.get("outer_step"), metadata.get("hash")
        downloaded_hash = holding.hash  # every block was checked against it
        if not isinstance(step, int) or step < holding.step or claimed != downloaded_hash:
            self._stats["state_load_failures"] += 1
            logger.warning("diloco: the outer state from %s is not what it claims (step %r); ignored",
                           loaded.peer.short(), step)
            return False
        members: list[tuple[bytes, Address | None]] = []
        for item in metadata.get("members") or []:
            try:
                members.append((bytes(item[0]), (str(item[1][0]), int(item[1][1])) if item[1] else None))
            except (TypeError, ValueError, IndexError):
                continue
        self.outer.replace(staging, step, downloaded_hash)
        self._members_of[step] = tuple(members)
        self._stats["state_loads"] += 1
        self._stats["resyncs"] += 1
        self._stats["bytes_received"] += sum(t.numel() * t.element_size() for t in self._outer_state)
        logger.info("diloco: loaded outer step %d (%s) from %d holders in %.3f s", step, self.hash[:12],
                    len(loaded.sources), loaded.seconds)
        self.rounds.held_changed()
        self._publish_state()
        return True

    def _count_traffic(self, result: StepResult) -> None:
        """Bytes of this all-reduce as they crossed the wire (encoded chunks pushed and pulled)."""
        if result.allreduce is None:
            return
        self._stats["bytes_sent"] += result.allreduce.bytes_sent
        self._stats["bytes_received"] += result.allreduce.bytes_received

    def _chain_items(self) -> tuple[tuple[int, str], ...]:
        """The (outer step, hash) pairs my offers carry (`quorum.Offer.chain`)."""
        return tuple(sorted(self._chain.items()))

    def _publish_state(self) -> None:
        self.tracker.new_epoch(self.outer_step)
        self.tracker.info.update({"hash": self.hash})
        self._chain[self.outer_step] = self.hash
        for step in [s for s in self._chain if s < self.outer_step - self.policy.max_staleness]:
            del self._chain[step]

    async def _join(self) -> None:
        """Before the first inner step: wait for `start_with` trainers, then hold the swarm's newest outer state
        (the one most trainers at the newest step hold)."""
        progress = await self.tracker.fetch()
        if self.start_with > 1:
            await self.tracker.publish()  # be counted by the others that wait too
            deadline = trio.current_time() + self.start_timeout
            while (len([p for p in progress.peers if p.info.get("alg") and not p.left]) < self.start_with
                   and trio.current_time() < deadline):
                await trio.sleep(self.tracker.min_refresh)
                progress = await self.tracker.fetch()
        self.last_progress = progress
        self._note_roster()  # the trainers seen now are the first round's candidates (a later read may miss some)
        for _ in range(3):  # a download can fail when the holders moved on meanwhile: read again, fetch again
            if await self._resync(progress):
                self.outer.reset_local()  # the first inner step starts from the swarm's outer parameters
                if self._address is not None and self._nursery is not None:
                    self._nursery.start_soon(self._intend)
                return
            if not self._ahead(progress):
                break
            await trio.sleep(self.tracker.min_refresh)
            progress = self.last_progress = await self.tracker.fetch()
        await self.tracker.publish()

    async def _intend(self) -> None:
        """A joiner tells the coordinator of its first round to expect it: that round's window then cuts its first
        phase short instead of starting without it. Its first round is the one after the outer step it just
        downloaded: the others finished that step's phase already (that round may be under way), while the
        joiner's phase has only begun; asked to come to it, the joiner would make the others wait out a window
        it cannot make. It goes to the next one from the state it holds, stale by one (`_may_offer_behind`)."""
        step = self.outer_step + (1 if self.fragments == 1 else 0)
        offer = Offer(bytes(self.tracker.peer_id), self.outer_step, 0, self.hash, self._address,
                      chain=self._chain_items())
        taken = await self.rounds.intend(step, offer, timeout=self.averaging_timeout)
        logger.debug("diloco: intent for round %d %s", step, "taken" if taken else "not taken")

    def _ahead(self, progress: SwarmProgress) -> bool:
        """Whether the progress records show trainers holding a newer outer step than mine."""
        step, best, holders = self._canonical(list(progress.peers))
        return best is not None and step > self.outer_step and bool(holders)

    def _canonical(self, peers: list[PeerProgress]) -> tuple[int, str | None, list[PeerProgress]]:
        """The newest outer step among `peers` (and me), the hash most trainers at it hold (ties: mine, then the
        smaller), and the others holding that hash."""
        others = self._other_trainers(peers)
        step = max([p.epoch for p in others] + [self.outer_step])
        counts = collections.Counter(p.info.get("hash") for p in others
                                     if p.epoch == step and isinstance(p.info.get("hash"), str))
        if step == self.outer_step:
            counts[self.hash] += 1
        if not counts:
            return step, None, []
        top = max(counts.values())
        tied = sorted(str(h) for h, n in counts.items() if n == top)
        best = self.hash if self.hash in tied and step == self.outer_step else tied[0]
        return step, best, [p for p in others if p.epoch == step and p.info.get("hash") == best]

    async def _resync(self, progress: SwarmProgress, timeout: float | None = None) -> bool:
        """Download the swarm's outer state (`_canonical`) when it is not mine. True when it was replaced."""
        step, best, holders = self._canonical(list(progress.peers))
        if best is None or (step == self.outer_step and best == self.hash) or not holders:
            return False
        deadline = trio.current_time() + (self.load_state_timeout if timeout is None else timeout)
        holding = Holding(step, best, tuple((bytes(p.peer_id), p.address) for p in holders))
        sources = sorted(holding.members, key=lambda m: 0 if m[1] is not None else 1)
        return await self._download(holding, list(sources), deadline)

    async def _finish(self, timeout: float) -> str | None:
        """Step 5 of the module doc; None when every live trainer of the run finished with my outer step and
        hash, else why not (by `timeout`). Polls the run's progress records (the others publish `fin` when they
        get here)."""
        why = "the run's progress records could not be read"
        with trio.move_on_after(timeout) as scope:
            # overlap: nothing else may write the outer state meanwhile. Bounded: at the end of a run the others
            # are finishing too and come to no more rounds, so a last contribution whose round has not started
            # (its coordinator killed, say) would keep this trainer from ever saying it finished
            with trio.move_on_after(timeout / 3):
                await self._wait_background()
            if self._background is not None and not self._background.is_set():
                logger.info("diloco: finish: the last contribution (round %s) found no round within %.0f s; "
                            "given up (the final agreement settles the state)", self._inflight_round, timeout / 3)
                self._background_scope.cancel()
                await self._wait_background()
            self.tracker.info["fin"] = True
            published = await self.tracker.publish()
            while True:
                if not published:  # the others wait for this record: retried at once, not at the next refresh
                    published = await self.tracker.publish()
                progress = await self.tracker.fetch()
                self.last_progress = progress
                others = self._other_trainers(progress.peers)
                finished = [p for p in others if p.info.get("fin")]
                # only finished trainers: their state is final, so the download is the last one
                if finished and await self._resync(dataclasses.replace(progress, peers=tuple(finished)),
                                                   timeout=max(0.0, scope.deadline - trio.current_time())):
                    self._stats["final_resyncs"] += 1
                    self.outer.reset_local()
                    published = await self.tracker.publish()
                    continue
                training = [p for p in others if not p.info.get("fin")]
                apart = [p for p in finished if p.epoch != self.outer_step or p.info.get("hash") != self.hash]
                if not training and not apart:
                    return None  # everyone agrees: nobody needs my state any more
                why = "; ".join(filter(None, [
                    ", ".join(f"{p.peer_id.short()} still training at outer step {p.epoch}" for p in training[:4]),
                    ", ".join(f"{p.peer_id.short()} finished at outer step {p.epoch} with another state"
                              for p in apart[:4])]))
                await trio.sleep(self.tracker.min_refresh)
        return why

    async def _until_stop(self, default: T, work: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await work(*args)`, cancelled within 0.1 s of `should_stop()` (then `default` is returned)."""
        if self.should_stop is None:
            return await work(*args)
        outcome = default
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                # polled: the flag is set by a signal handler in another thread, which cannot set a trio.Event
                while not self.should_stop():  # type: ignore[misc]  # noqa: ASYNC110  # checked above
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()

            async def run_work() -> None:
                nonlocal outcome
                outcome = await work(*args)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(run_work)
        return outcome

    async def _background_contribution(self, contribution: _Contribution, done: trio.Event,
                                       scope: trio.CancelScope) -> None:
        self._background_outcome = "lost"
        try:
            with scope:
                self._background_outcome = await self._contribute(contribution)
        except Exception as error:  # the round is best effort; the next contribution catches up if we drifted
            logger.warning("diloco: background outer round failed: %s", error)
            self._background_outcome = "lost"
        finally:
            done.set()

    async def _start_background(self, contribution: _Contribution) -> None:
        done = trio.Event()
        self._background = done
        self._background_scope = trio.CancelScope()
        self._nursery.start_soon(self._background_contribution, contribution, done, self._background_scope)

    async def _wait_background(self) -> None:
        if self._background is not None:
            await self._background.wait()

    # ------------------------------------------------------------------------------------------ public API

    @property
    def outer_step(self) -> int:
        """Outer rounds applied (with fragments: fragment rounds)."""
        return self.outer.step

    @property
    def hash(self) -> str:
        """The hash of the outer state (`state_hash`): equal on every trainer that completed the same outer step."""
        return self.outer.hash

    @property
    def outer_params(self) -> list[torch.Tensor]:
        return self.outer.outer_params

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        return self.outer.optimizer

    @property
    def _outer_state(self) -> list[torch.Tensor]:
        return self.outer.tensors

    @property
    def pseudo(self) -> list[torch.Tensor]:
        return self.outer.pseudo

    def step(self, batch_size: int | None = None) -> bool:
        """One inner step (after `loss.backward()`); returns True when this call ended an outer round."""
        now = time.monotonic()
        if self._started is None:
            self._started = now
        elif self._last_step_end is not None:
            last = now - self._last_step_end + (self._last_step_seconds or 0.0)
            if self._step_seconds == 0.0:
                self._step_seconds = last
            else:  # one long pause (the loop waited on something else) moves the estimate by a bounded amount
                self._step_seconds = 0.8 * self._step_seconds + 0.2 * min(last, 4.0 * self._step_seconds)
            self._stats["compute_seconds"] += now - self._last_step_end  # forward + backward since the last step
            if self.hooks.slowdown > 1.0:
                extra = (self.hooks.slowdown - 1.0) * (now - self._last_step_end)
                time.sleep(extra)
                self._stats["compute_seconds"] += extra
                now = time.monotonic()
        samples = self.batch_size_per_step if batch_size is None else int(batch_size)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.local_steps += 1
        self.round_steps += 1
        self.round_samples += samples
        self.tracker.samples += samples  # read by the tracker's next publish (the trio thread)
        ended = False
        after_compute = time.monotonic()
        self._stats["compute_seconds"] += after_compute - now
        self._last_step_seconds = after_compute - now
        cut = self._must_cut(after_compute)
        if self.round_steps >= self.phase_steps or cut:
            if cut:
                self._stats["cut_short"] += 1
            self._cut_at = None
            if self.overlap:
                self._end_phase_overlapped()
            else:
                self._end_phase()
            ended = True
        self._last_step_end = time.monotonic()
        if ended:
            self._stats["blocked_seconds"] += self._last_step_end - after_compute
        return ended

    def _must_cut(self, now: float) -> bool:
        """A round this phase goes to opened, and the steps left would miss its window: end the phase now."""
        if self._cut_at is None or self.round_steps >= self.phase_steps:
            return False
        left = (self.phase_steps - self.round_steps) * self._step_seconds
        return now + left > self._cut_at

    @property
    def goodput(self) -> float | None:
        """Compute time (inner steps and what the training loop does between them) over wall time."""
        if self._started is None or self._last_step_end is None or self._last_step_end <= self._started:
            return None
        wall = self._last_step_end - self._started
        blocked = float(self._stats["blocked_seconds"])
        return max(0.0, min(1.0, 1.0 - blocked / wall))

    utilization = goodput  # the figure's older name

    # ------------------------------------------------------------------------------------------ phases

    def _apply_outer(self, start: Start, contribution: _Contribution, weight: float) -> None:
        """The outer optimizer steps on the averaged pseudo-gradient of the contribution's fragment (in the trio
        thread, as soon as the round ends, so trainers that catch up can download the new outer step at once)."""
        before = [p.clone() for p in self.outer_params] if self.hooks.trace_dir else None
        self.outer.apply(contribution.indices)
        self._stats["outer_steps"] += 1
        if before is not None:
            self._save_trace(before, start, weight)

    def _save_trace(self, before: list[torch.Tensor], start: Start, weight: float) -> None:
        directory = self.hooks.trace_dir or "."
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.swarm.rpc.peer_id.hex()}.{self.outer_step}.pt")
        torch.save({"outer_step": torch.tensor(self.outer_step), "before": before,
                    "after": [p.clone() for p in self.outer_params], "averaged": [p.clone() for p in self.pseudo],
                    "own": [p.clone() for p in self._own_trace], "weight": torch.tensor(float(weight)),
                    "group": [torch.tensor(list(m.peer)) for m in start.members], "hash": self.hash}, path)

    def _account_round(self) -> None:
        sent, received = self._stats["bytes_sent"], self._stats["bytes_received"]
        self.bytes_per_outer_step = (sent - self._bytes_at_round[0]) + (received - self._bytes_at_round[1])
        self._bytes_at_round = (sent, received)
        last = next((r for r in reversed(self.round_records) if "members" in r), None)
        first = self.first_contribution
        self.tracker.info.update({
            "bytes": int(self.bytes_per_outer_step), "util": None if self.goodput is None else round(self.goodput, 3),
            # churn as people read it (peer status, the dashboard): the last round's members and why it started,
            # the grace window now, contributions that came late, and how soon this trainer first contributed
            "mem": None if last is None else int(last["members"]),
            "why": None if last is None else str(last.get("reason", ""))[:32],
            "win": round(self.rounds.grace.window(self.rounds.rtt), 3),
            "late": int(self._stats["late_contributions"]),
            "join": None if first is None else int(first["outer_steps"]),
        })

    def _count_outcome(self, outcome: str) -> None:
        if outcome in ("skipped", "lost", "dropped"):
            self._stats["skipped_rounds"] += 1

    def _contribution(self, base: int) -> _Contribution:
        """This phase's contribution to round `base`: its fragment's pseudo-gradient (already in `pseudo`) and the
        samples behind it (every phase since that fragment last contributed)."""
        self._own_trace = [p.clone() for p in self.pseudo] if self.hooks.trace_dir else []
        fragment = base % self.fragments
        self._samples_since = [n + self.round_samples for n in self._samples_since]
        samples, self._samples_since[fragment] = self._samples_since[fragment], 0
        return _Contribution(base, max(1, samples), 0.0, list(self.outer.fragment(base)))

    def _end_phase(self) -> None:
        step_before = self.outer_step
        indices = self.outer.fragment(step_before)
        self.outer.from_outer(indices)
        contribution = self._contribution(step_before)
        outcome = self.swarm.run(self._until_stop, "skipped", self._contribute, contribution)
        self._count_outcome(outcome)
        if outcome in ("averaged", "solo") and self.outer_step == step_before + 1:
            self.outer.reset_local(indices)  # this fragment's local parameters <- its new outer parameters
        elif self.outer_step != step_before:
            self.outer.reset_local()  # the outer state moved by a download: start again from it
        elif outcome == "averaged":
            self.outer.reset_local(indices)  # counted from behind, its result not downloaded yet: progress spent
        # else: nothing applied and the outer state did not move: keep the local parameters, the next
        # pseudo-gradient of this fragment covers this phase too
        self.round_steps = self.round_samples = 0
        self._account_round()

    def _end_phase_overlapped(self) -> None:
        """Overlap: wait for the previous contribution only if it is not done, rebase the fragments whose rounds
        were applied (keeping their fresh progress), hand the due fragment's fresh progress to a background
        contribution, keep training (`averaging.outer_state`)."""
        blocked = False
        if self._background is not None and not self._background.is_set():
            blocked = True
            self._stats["outer_waits"] += 1
            self.swarm.run(self._until_stop, None, self._wait_background)
        if self._background is not None:
            self._count_outcome(self._background_outcome)
            if self._background_outcome not in ("averaged", "solo"):
                self.outer.unapplied()  # its progress goes into this fragment's next contribution
            self._account_round()
        base = self.outer_step
        self.outer.from_progress(self.outer.fragment(base))
        contribution = self._contribution(base)
        self.round_steps = self.round_samples = 0
        self.swarm.run(self._start_background, contribution)
        if blocked:
            logger.info("diloco: an inner step waited for the outer round")

    def outer_target(self, planned: int) -> int:
        """The swarm outer steps (fragment rounds with Streaming DiLoCo) that `planned` local steps amount to."""
        return planned // self.inner_steps * self.fragments

    def more_steps(self, step: int, planned: int) -> bool:
        """DiLoCo counts the swarm's outer steps, not local steps: a trainer that lost a round (it re-synced by
        download instead of averaging) is a round behind and takes one more; one that downloaded an outer step its
        rounds had not reached is ahead and stops there. Counting local steps left such a trainer waiting alone for
        a round nobody else took, or taking a solo outer step past the end. Twice `planned` bounds a trainer whose
        contributions keep missing."""
        return self.outer_step < self.outer_target(planned) and step < 2 * planned

    def shortfall(self, step: int, planned: int) -> str | None:
        target = self.outer_target(planned)
        if self.outer_step >= target:
            return None
        return (f"reached outer step {self.outer_step} of {target} in {step} local steps (the bound is twice "
                f"the planned {planned}): the swarm's rounds did not take this trainer's contributions (the "
                f"progress lines' 'why' says what they answered)")

    def report(self, final: bool = False) -> dict[str, Any]:
        stats = self.stats()
        keys = REPORTED_FINAL if final else REPORTED
        report = {key: stats.get(key) for key in keys}
        if final:  # Byzantine-robust aggregation: whom this trainer banned
            averaging = self.averager.stats()
            report.update({key: averaging[key] for key in ("aggregation", "banned", "rejected_parts")})
        return report

    def finish(self, timeout: float | None = None) -> bool:
        """Call once when training ends, before `close()`: a final agreement on the outer state, at most
        `timeout` seconds (default `finish_timeout`, or when None the time of two outer steps' inner steps plus a
        download, at least 30 s): wait for a contribution still in flight, publish that this
        trainer is done, download the state the finished trainers hold if it is not mine, and keep serving mine
        until every live trainer of the run finished with the same outer step and hash. So trainers that
        started apart (a loop of N local steps each, one of them started later) end with one state: the first
        to finish waits for the others, which take its state when they finish.

        Returns True when they all agree; False when `should_stop()` skipped or cut it short; raises `NotAgreed`
        (saying which trainers and why) when the time ran out first."""
        if self._scope is None or (self.should_stop is not None and self.should_stop()):
            return False
        limit = timeout if timeout is not None else self.finish_timeout
        if limit is None:  # long enough for a trainer that started up to an outer step later to finish too
            limit = max(30.0, 2.0 * self.inner_steps * self._step_seconds + self.load_state_timeout)
        self._finishing = True
        why = self.swarm.run(self._until_stop, "stopped", self._finish, limit)
        if self.overlap:
            self.outer.reset_local()  # the last contribution's update is applied: end on the outer parameters
        if why is None:
            return True
        if why == "stopped":
            return False
        raise NotAgreed(f"no final agreement on the outer state within {limit:.0f} s: {why}",
                        operation="diloco.finish")

    def stats(self) -> dict[str, Any]:
        """What this trainer did: outer steps, rounds (late, stale, dropped, lost), state loads, bytes, goodput."""
        stats = dict(self._stats)
        stats["group_sizes"] = dict(sorted(stats["group_sizes"].items()))
        stats["compute_seconds"] = round(stats["compute_seconds"], 3)
        stats["blocked_seconds"] = round(stats["blocked_seconds"], 3)
        goodput = self.goodput
        stats.update({
            "algorithm": ALGORITHM, "outer_step": self.outer_step, "hash": self.hash,
            "inner_steps": self.inner_steps, "fragments": self.fragments, "local_steps": self.local_steps,
            "bytes_per_outer_step": self.bytes_per_outer_step, "compression": self.compression.name.lower(),
            "overlap": self.overlap, "peer_id": str(self.averager.peer_id),
            "goodput": None if goodput is None else round(goodput, 4),
            "utilization": None if goodput is None else round(goodput, 4),
            "first_contribution": self.first_contribution,
            "grace_window": round(self.rounds.grace.window(self.rounds.rtt), 4),
            "rtt": round(self.rounds.rtt, 4), "coordinated": self.rounds.stats["coordinated"],
        })
        last = next((r for r in reversed(self.round_records) if "round" in r), None)
        if last is not None:
            stats["last_round"] = {k: last.get(k) for k in ("round", "members", "reason", "waited", "window",
                                                            "staleness", "outcome")}
        progress = self.last_progress
        if progress is not None:
            stats["swarm_trainers"] = len([p for p in progress.peers if p.info.get("alg")])
        return stats


__all__ = ["ALGORITHM", "DiLoCoHooks", "DiLoCoOptimizer", "ErrorFeedback", "nesterov_sgd", "state_hash"]
