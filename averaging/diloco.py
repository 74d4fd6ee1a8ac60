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

The optimizer drives the phases from the training thread; each part of the work it hands on has a module of its
own, so that each can be read (and changed) alone: `averaging.diloco_contribute` offers a phase's contribution
until a round takes it, `averaging.diloco_member` is a member's part in a round that started,
`averaging.diloco_sync` the verified downloads (joining, catching up), `averaging.diloco_view` what this trainer
holds and knows of the others, `averaging.diloco_background` overlap's contribution in flight,
`averaging.diloco_finish` the final agreement, `averaging.diloco_clock` the clocks behind goodput and a phase cut
short, `averaging.diloco_ledger` the figures of `stats()` and the rounds' records.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

import torch
import trio

from averaging.averager import Averager
from averaging.diloco_background import BackgroundContribution
from averaging.diloco_clock import StepClock
from averaging.diloco_contribute import Contribution, Contributor
from averaging.diloco_finish import final_agreement
from averaging.diloco_ledger import DiLoCoLedger
from averaging.diloco_member import RoundMember
from averaging.diloco_sync import StateSync
from averaging.diloco_view import SwarmView
from averaging.errors import AveragingError
from averaging.gather import GatherService
from averaging.optimizer import SwarmOptimizerBase
from averaging.outer_state import ErrorFeedback, OuterState, default_outer, nesterov_sgd
from averaging.polled import unless
from averaging.progress import PeerProgress, ProgressTracker, SwarmProgress
from averaging.quorum import QuorumPolicy
from averaging.rounds import RoundService
from averaging.state_hash import state_digest
from dht.client import SwarmHandle
from peer.p2p import wire
from peer.p2p.identity import PeerID

logger = logging.getLogger(__name__)

ALGORITHM = "diloco"

T = TypeVar("T")


state_hash = state_digest  # the outer state's hash: a manifest root, so downloads are verified block by block


# what a trainer reports in each progress line, and in its result besides
REPORTED = ("algorithm", "outer_step", "hash", "bytes_sent", "bytes_per_outer_step", "goodput", "swarm_trainers")
REPORTED_FINAL = (*REPORTED, "group_sizes", "state_loads", "resyncs", "final_resyncs", "outer_waits",
                  "bytes_received", "peer_id", "utilization", "rounds", "late_contributions", "stale_contributions",
                  "dropped_contributions", "lost_rounds", "cut_short", "coordinated", "first_contribution",
                  "compute_seconds", "blocked_seconds", "grace_window", "rtt", "distrusted")


@dataclasses.dataclass
class DiLoCoHooks:
    """What tests change in a trainer, passed to the constructor (product code reads no environment for it).

    hold_at: block this trainer's trio thread while its part of outer round N is being pushed (a test then kills
    it at exactly that moment; a line `{"event": "diloco_hold", ...}` goes to `on_event` first). on_event: gets
    every structured event (a dict; `peer train` prints them as JSON lines). trace_dir: save every outer step
    (torch.save, tensors only) there. scale_pseudo_gradient: a Byzantine trainer that sends x times its
    pseudo-gradient. slowdown: compute takes this many times longer (the trainer sleeps (slowdown - 1) times the
    measured compute of each inner step, counted as compute). full_phases: never end a phase early for a round's
    window (every phase runs its `inner_steps`): with a quorum of every trainer, rounds are then lock-step and a
    run is reproducible from its seeds, which a test comparing two runs' accuracy needs (cut phases made the
    same clean run end anywhere between 0.89 and 0.94 on a loaded machine)."""

    hold_at: int | None = None
    on_event: Callable[[dict[str, Any]], None] | None = None
    trace_dir: str | None = None
    scale_pseudo_gradient: float = 1.0
    slowdown: float = 1.0
    full_phases: bool = False


class NotAgreed(AveragingError):
    """`DiLoCoOptimizer.finish()` ran out of time before every live trainer of the run held one outer state
    (the message names the trainers still training, or holding another state): the models differ."""



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

    It owns its parts (module doc) and the nursery their trio-side tasks run in (`_serve`).
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

        self.ledger = DiLoCoLedger(self.hooks.on_event)
        self.clock = StepClock(self.ledger.counts, self.hooks.slowdown)
        self._held = False
        self._finishing = False  # finish() was called: no more contributions

        self.averager = Averager(
            swarm.rpc, swarm.dht, self.outer.pseudo, prefix=f"{run_id}.diloco",
            names=[f"pseudo.{i}" for i in range(len(self.outer.pseudo))], allreduce_timeout=averaging_timeout,
            compression=self.compression, lock=threading.Lock(), serve_state=False,
            aggregation=aggregation,  # mean, centered_clip, trimmed_mean: see averaging.robust
        )
        self.rounds = RoundService(  # its callbacks read the view, made below (they are called once it serves)
            swarm.rpc, run_id, self.policy, holding=lambda: self.view.holding(),
            expected=lambda step: self.view.expected(step), on_open=self._on_open,
            address=lambda: self.view.address, roster_ttl=progress_ttl,
            banned=lambda: {*self.averager.strikes.banned, *self.view.distrusted},  # its all-reduce's and my view's
            chain=lambda: self.view.chain,
        )
        self.exchange = exchange
        self.gather = GatherService(swarm.rpc, members_of=self.rounds.members_of_group)
        self.tracker = ProgressTracker(
            swarm.dht, run_id, self.phase_steps * self.batch_size_per_step, ttl=progress_ttl,
            min_refresh=min_refresh, max_refresh=max_refresh, client_mode=not listen,
            publish_interval=publish_interval, foreign=self._of_another_model,
        )
        self.view = SwarmView(self.outer, self.tracker, self.rounds, self.policy.max_staleness)
        self.sync = StateSync(swarm.rpc, self.outer, self.view, self.tracker, self.rounds, self.ledger,
                              load_state_timeout)
        member = RoundMember(
            rpc=swarm.rpc, outer=self.outer, view=self.view, sync=self.sync, tracker=self.tracker,
            rounds=self.rounds, averager=self.averager, gather=self.gather, ledger=self.ledger, policy=self.policy,
            compression=self.compression, exchange=exchange, averaging_timeout=averaging_timeout,
            load_state_timeout=load_state_timeout, trace_dir=self.hooks.trace_dir,
        )
        self.contributor = Contributor(
            outer=self.outer, view=self.view, sync=self.sync, member=member, tracker=self.tracker,
            rounds=self.rounds, ledger=self.ledger, policy=self.policy, averaging_timeout=averaging_timeout,
            load_state_timeout=load_state_timeout,
        )
        self.background = BackgroundContribution(self.contributor)  # overlap: the contribution in flight
        self.tracker.info.update({"alg": ALGORITHM, "hash": self.hash, "bytes": 0, "util": None,
                                  "schema": self.averager.schema.hex()})
        self._scope = self._start_serving(listen, listen_host)
        self.swarm.run(self._join)  # a newcomer holds the swarm's outer state before its first inner step
        self.ledger.joined_at_step = self.outer_step

    def _of_another_model(self, record: PeerProgress) -> bool:
        """A trainer of this run whose progress record declares another model (names, shapes or dtypes): never a
        round member, a state source or a trainer to wait for. Named once, with what differs (the averager's
        `avg.mm.schema` answers say it), as matchmaking names such peers."""
        theirs = record.info.get("schema")
        if not isinstance(theirs, str) or theirs == self.averager.schema.hex():
            return False  # the same model, or a trainer that does not say
        matchmaker = self.averager.matchmaker
        if matchmaker is not None:
            matchmaker.schemas.notice_peer(record.peer_id, record.address, theirs, where="diloco")
        return True

    # ------------------------------------------------------------------------------------------ trio side

    async def _serve(self, listen_host: str | None, *,
                     task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            async with self._serving_state(listen_host) as address:
                self.view.address = address
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

    def _on_allreduce_event(self, name: str, info: dict[str, Any]) -> None:
        """Counts nothing; with `hooks.hold_at`, blocks the whole trainer while its part of that outer round is
        being sent, so a test can SIGKILL it at exactly that moment."""
        if name == "chunk_pushed" and self.hooks.hold_at == self.outer_step and not self._held:
            self._held = True
            self.ledger.emit({"event": "diloco_hold", "outer_step": self.outer_step, "phase": name,
                              "part": int(info.get("part", -1))})
            time.sleep(3600)  # blocks the trio thread on purpose: nothing of this trainer moves until the kill

    def _get_state(self) -> tuple[Any, list[torch.Tensor]]:
        """Called by the state server under the lock: the outer state with its step, hash and the members of the
        round that produced it (a trainer that catches up needs them to find the next round)."""
        members = self.view.members_of.get(self.outer_step, ())
        return {"outer_step": self.outer_step, "hash": self.hash, "run_id": self.run_id, "algorithm": ALGORITHM,
                "members": [[p, list(a) if a is not None else None] for p, a in members]}, self._outer_state

    def _on_open(self, step: int, closes_in: float) -> bool:
        """A coordinator opened round `step`, whose window closes in `closes_in` seconds. When this phase's
        contribution goes there, the phase ends early enough to make the window (`step()` checks). Returns whether
        I will offer to (or am offering to) that round; not when my loop stopped, or when my contribution cannot go
        there (another fragment's round, or further ahead than the staleness bound)."""
        idle = self._finishing or self.clock.idle()
        if step == self.contributor.inflight_round:
            return True  # my offer to that round is on its way (it may have met a redirect, or the network)
        # a trainer whose loop stopped calling step() is not coming; one behind the round comes from its state
        coming = not idle and (step == self.contributor.next_round() or (
            self.contributor.inflight_round is None and self.fragments == 1
            and self.outer_step < step <= self.outer_step + self.policy.max_staleness))
        if coming:
            if not self.hooks.full_phases:
                self.clock.cut_within(closes_in)
        else:
            logger.debug("diloco: not coming to round %d (next %d, idle %s, finishing %s)", step,
                         self.contributor.next_round(), idle, self._finishing)
        return coming

    async def _join(self) -> None:
        """Before the first inner step: hold the swarm's outer state (`StateSync.join`). A trainer that downloaded
        it starts from its outer parameters, and tells its first round to expect it (`StateSync.intend`)."""
        if await self.sync.join(self.start_with, self.start_timeout):
            self.outer.reset_local()  # the first inner step starts from the swarm's outer parameters
            if self.view.address is not None and self._nursery is not None:
                self._nursery.start_soon(self.sync.intend, self.fragments, self.averaging_timeout)

    async def _until_stop(self, default: T, work: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await work(*args)`, cancelled within 0.1 s of `should_stop()` (then `default` is returned)."""
        if self.should_stop is None:
            return await work(*args)
        return await unless(self.should_stop, 0.1, default, work, *args)

    async def _start_background(self, contribution: Contribution) -> None:
        self._nursery.start_soon(self.background.run, contribution, *self.background.arm())

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

    @property
    def _background(self) -> trio.Event | None:
        """Overlap: set when the background contribution ended (None before the first)."""
        return self.background.done

    @property
    def round_records(self) -> collections.deque[dict[str, Any]]:
        """The last outer rounds' records (`DiLoCoLedger`), as `on_event` got them."""
        return self.ledger.round_records

    @property
    def first_contribution(self) -> dict[str, Any] | None:
        return self.ledger.first_contribution

    @property
    def bytes_per_outer_step(self) -> int:
        return self.ledger.bytes_per_outer_step

    @property
    def last_progress(self) -> SwarmProgress | None:
        return self.view.last_progress

    def step(self, batch_size: int | None = None) -> bool:
        """One inner step (after `loss.backward()`); returns True when this call ended an outer round."""
        began = self.clock.begin_step()
        samples = self.batch_size_per_step if batch_size is None else int(batch_size)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.local_steps += 1
        self.round_steps += 1
        self.round_samples += samples
        self.tracker.samples += samples  # read by the tracker's next publish (the trio thread)
        after_compute = self.clock.computed(began)
        cut = self.clock.must_cut(after_compute, self.round_steps, self.phase_steps)
        ended = self.round_steps >= self.phase_steps or cut
        if ended:
            if cut:
                self.ledger.counts["cut_short"] += 1
            self.clock.cut_at = None
            if self.overlap:
                self._end_phase_overlapped()
            else:
                self._end_phase()
        self.clock.end_step(after_compute, ended)
        return ended

    @property
    def goodput(self) -> float | None:
        """Compute time (inner steps and what the training loop does between them) over wall time."""
        return self.clock.goodput

    utilization = goodput  # the figure's older name

    # ------------------------------------------------------------------------------------------ phases

    def _account_round(self) -> None:
        self.ledger.account_round(self.tracker, self.rounds.grace.window(self.rounds.rtt), self.goodput)

    def _end_phase(self) -> None:
        step_before = self.outer_step
        indices = self.outer.fragment(step_before)
        self.outer.from_outer(indices)
        contribution = self.contributor.prepare(step_before, self.round_samples)
        outcome = self.swarm.run(self._until_stop, "skipped", self.contributor.contribute, contribution)
        self.ledger.count_outcome(outcome)
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
        background = self.background
        if background.running:
            self.ledger.counts["outer_waits"] += 1
            self.swarm.run(self._until_stop, None, background.wait)
            logger.info("diloco: an inner step waited for the outer round")
        if background.done is not None:
            self.ledger.count_outcome(background.outcome)
            if background.outcome not in ("averaged", "solo"):
                self.outer.unapplied()  # its progress goes into this fragment's next contribution
            self._account_round()
        if self.contributor.ended():  # the run's last outer step is held: this phase's progress goes nowhere
            self.round_steps = self.round_samples = 0
            background.done = None  # accounted above, once
            return
        base = self.outer_step
        self.outer.from_progress(self.outer.fragment(base))
        contribution = self.contributor.prepare(base, self.round_samples)
        self.round_steps = self.round_samples = 0
        self.swarm.run(self._start_background, contribution)

    def outer_target(self, planned: int) -> int:
        """The swarm outer steps (fragment rounds with Streaming DiLoCo) that `planned` local steps amount to."""
        return planned // self.inner_steps * self.fragments


    def more_steps(self, step: int, planned: int) -> bool:
        """DiLoCo counts the swarm's outer steps, not local steps: a trainer that lost a round (it re-synced by
        download instead of averaging) is a round behind and takes one more; one that downloaded an outer step its
        rounds had not reached is ahead and stops there. Counting local steps left such a trainer waiting alone for
        a round nobody else took, or taking a solo outer step past the end. Twice `planned` bounds a trainer whose
        contributions keep missing. The target is also the contributions' end: none is offered from it
        (`Contributor.final_step`)."""
        target = self.outer_target(planned)
        self.contributor.final_step = target
        return self.outer_step < target and step < 2 * planned

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
            limit = max(30.0, 2.0 * self.inner_steps * self.clock.step_seconds + self.load_state_timeout)
        self._finishing = True
        agree = functools.partial(final_agreement, outer=self.outer, tracker=self.tracker, view=self.view,
                                  sync=self.sync, ledger=self.ledger, background=self.background)
        why = self.swarm.run(self._until_stop, "stopped", agree, limit)
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
        stats = self.ledger.counters()
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
            # provenance: whose progress claims this trainer ignores (claims no credible round reached)
            "distrusted": sorted(str(PeerID(p)) for p in self.view.distrusted),
        })
        last = self.ledger.last_round()
        if last is not None:
            stats["last_round"] = last
        progress = self.last_progress
        if progress is not None:
            stats["swarm_trainers"] = len([p for p in progress.peers if p.info.get("alg")])
        return stats


__all__ = ["ALGORITHM", "DiLoCoHooks", "DiLoCoOptimizer", "ErrorFeedback", "nesterov_sgd", "state_hash"]
