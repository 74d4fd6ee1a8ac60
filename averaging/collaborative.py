"""CollaborativeOptimizer: many trainers, one model, no coordinator.

    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters()), swarm, run_id="digits",
                                 target_batch_size=4096, batch_size_per_step=32)
    for x, y in batches:
        loss = loss_fn(model(x), y); loss.backward()
        opt.step()                      # accumulates; every collective epoch: averages with peers, then steps
        opt.zero_grad()

What one `step()` does, from a plain synchronous training loop:
1. **Count.** In `average="gradients"` mode the batch's gradients are added to local accumulators (the wrapped
   optimizer is not stepped); in `average="parameters"` mode the wrapped optimizer steps locally at once. Either
   way the batch's samples are counted for the progress tracker (`averaging/progress.py`). This stays in the
   training thread: the step estimates the swarm's progress from the records the tracker last fetched, and the
   tracker, in the trio thread, reads the count whenever it builds a record (publishing and fetching on its own
   schedule); only a step where an epoch end is due goes through the bridge (a training step on a small model
   takes a couple of milliseconds, and three bridge round trips plus a DHT read per step cost as much).
2. **Epoch end.** When the swarm's samples in the current epoch reach `target_batch_size` (every trainer
   estimates this from the same signed DHT records, so they all stop at about the same moment), the trainer
   averages with the peers that are ready, in groups (`averaging.averager.Averager`, through the swarm's bridge):
   - gradients mode: the accumulated mean gradients, weighted by the samples behind them, and along with them the
     parameters and optimizer state (so trainers that drifted apart, e.g. after a failed round, are pulled back
     together); then the wrapped optimizer steps once with the averaged gradients;
   - parameters mode: the parameters and optimizer state.
   Then the epoch number is incremented and published.
3. **Catching up.** A trainer whose epoch is more than one behind the swarm's, or that joins a run already past
   epoch 0, downloads parameters and optimizer state from a trainer of the newest epoch (`averaging.state`; the
   progress records say who is there and where it serves) instead of averaging. One epoch behind is normal
   (another trainer noticed the end first and has moved on): it applies its own accumulated update and moves to
   the swarm's epoch.
Trainers that die simply stop publishing progress: their record belongs to an epoch the others soon leave (and
expires), so a dead partner costs at most one round that finds nobody.

Why one averager for gradients and state: one tensor list keeps the group schema simple and lets a newcomer
download a consistent snapshot (parameters and optimizer state of the same epoch) from any trainer.

Networking: the trainer is a `peer.client.Swarm` (client mode in the DHT). An averaging group needs at least one
member that accepts connections (client-mode members send and receive but cannot reduce a part), so a group made
only of client-mode trainers cannot form. By default the trainer therefore opens an RPC listener on the local
address it uses to reach its initial peers (`listen=True`); `listen=False` keeps it purely client-mode, in which
case it averages only in groups that contain some reachable trainer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch
import trio

from averaging.averager import Averager
from averaging.optimizer import SwarmOptimizerBase
from averaging.progress import PeerProgress, ProgressTracker, SwarmProgress, _Rate, estimate
from averaging.provenance import Anchors, Provenance
from averaging.schema import MISMATCHES
from averaging.state import load_state
from dht.client import SwarmHandle
from peer.p2p import wire
from peer.p2p.identity import PeerID

logger = logging.getLogger(__name__)

MODES = ("gradients", "parameters")


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state (Adam moments, SGD momentum...) as it is before the first real
    step, without changing the parameters: averaging and state downloads need every tensor to exist up front and
    to look the same on every trainer."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [(p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, (data, grad) in zip(params, saved):
            p.copy_(data)
            p.grad = grad
        for p in params:
            for value in optimizer.state[p].values():
                if torch.is_tensor(value):
                    value.zero_()


def state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for the parameters and every tensor of the optimizer state, in a fixed order."""
    named: list[tuple[str, torch.Tensor]] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            named.append((f"param.{g}.{i}", p.data))
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                if torch.is_tensor(state[key]):
                    named.append((f"state.{g}.{i}.{key}", state[key]))
    return named


class _SharedProgressTracker(ProgressTracker):
    """A `ProgressTracker` whose epoch and sample count belong to the training thread: it reads them (one
    consistent triple under the owner's lock) whenever it builds or plans a record, instead of being told through
    `report` / `new_epoch` on the bridge, so that `CollaborativeOptimizer.step` sends nothing through the bridge
    between epoch boundaries. It also keeps what the training thread needs to estimate the swarm's progress on
    its own: the others' records (replaced whole by each fetch, never changed in place), the DHT clock anchored
    to the monotonic clock, and when the last fetch finished."""

    def __init__(self, counts: Callable[[], tuple[int, int, int]], *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._counts = counts  # () -> (epoch, samples in it, samples ever): the training thread's numbers
        # whose epoch claims may move this trainer (averaging.provenance): the others' records that claim an
        # epoch no anchor can have reached are dropped at each fetch, their claimants distrusted for good
        self.provenance = Provenance(bytes(self.peer_id), recent=self.ttl / 2)
        self.anchors = Anchors(frozenset(), frozenset())
        self._seen_total = 0
        self._anchor = (self.dht.now(), time.monotonic())
        self.fetched_monotonic = -float("inf")
        # the training thread steps in real time and absorb() may first run after many steps: measure the rate
        # on the monotonic clock from now, so the first absorbed count already yields a rate
        self._rate = _Rate(self._rate.horizon, start=time.monotonic())

    def absorb(self) -> None:
        """Take the training thread's epoch and samples (and feed the rate with the samples since last time)."""
        epoch, samples, total = self._counts()
        if total != self._seen_total:
            self._rate.update(total - self._seen_total, time.monotonic())
            self._seen_total = total
        self.epoch, self.samples = epoch, samples
        self._anchor = (self.dht.now(), time.monotonic())

    def local(self) -> PeerProgress:
        self.absorb()
        return super().local()

    def _rate_now(self) -> float:
        return self._rate.value  # fed by `absorb` from the training thread's total, on the monotonic clock

    async def fetch(self) -> SwarmProgress:
        await super().fetch()
        self.anchors, _ = self.provenance.judge(self._others.values(), (self.epoch, None), now=self.dht.now())
        self._others = {peer: r for peer, r in self._others.items() if bytes(peer) not in self.provenance.distrusted}
        self.fetched_monotonic = time.monotonic()
        return self.progress()

    async def _due_work(self) -> float:
        self.absorb()  # plan the publish on the current numbers, not the ones of the last wake-up
        return await super()._due_work()

    def wake(self) -> None:
        """Re-plan the background publish and fetch now (the training thread's numbers changed)."""
        self._wake.set()

    def estimate_from_thread(self, epoch: int, samples: int) -> SwarmProgress:
        """The swarm's progress as `progress()` would give it, computed in the calling (training) thread from the
        last fetched records and the given local numbers."""
        dht_time, monotonic = self._anchor
        now = dht_time + (time.monotonic() - monotonic)
        reports = dict(self._others)
        reports[self.peer_id] = PeerProgress(self.peer_id, epoch, samples, self._rate.value, now, self.client_mode)
        return estimate(reports.values(), target=self.target, now=now, max_extrapolation=self.ttl / 2)


class CollaborativeOptimizer(SwarmOptimizerBase):
    """Wraps any torch optimizer for collaborative training over a `peer.client.Swarm` (see module doc).

    `target_batch_size`: samples the whole swarm processes per epoch (one averaged update per epoch in gradients
    mode). `batch_size_per_step`: samples behind one `step()` unless `step(batch_size=...)` says otherwise.
    Averaging options: `target_group_size`, `min_group_size`, `matchmaking_time`, `averaging_timeout`,
    `compression` (a `peer.p2p.wire.Compression`), `aggregation` (Byzantine-robust reduction:
    `averaging.robust`). Progress options: `progress_ttl`, `min_refresh`, `max_refresh`.
    """

    tracker: _SharedProgressTracker

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        swarm: SwarmHandle,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int,
        *,
        average: str = "gradients",
        target_group_size: int = 4,
        min_group_size: int = 2,
        matchmaking_time: float = 3.0,
        averaging_timeout: float = 30.0,
        load_state_timeout: float = 30.0,
        compression: wire.Compression = wire.Compression.NONE,
        listen: bool = True,
        listen_host: str | None = None,
        progress_ttl: float = 20.0,
        min_refresh: float = 0.1,
        max_refresh: float = 2.0,
        load_state_on_join: bool = True,
        aggregation: str = "mean",
        warn_after_epochs: int = 5,
    ):
        if average not in MODES:
            raise ValueError(f"average must be one of {MODES}, not {average!r}")
        if target_batch_size < 1 or batch_size_per_step < 1:
            raise ValueError("target_batch_size and batch_size_per_step must be positive")
        self.optimizer = optimizer
        self.swarm = swarm
        self.run_id = run_id
        self.mode = average
        self.target_batch_size = int(target_batch_size)
        self.batch_size_per_step = int(batch_size_per_step)
        self.averaging_timeout = averaging_timeout
        self.load_state_timeout = load_state_timeout
        self.epoch = 0
        self.warn_after_epochs = int(warn_after_epochs)
        self._unaveraged = 0  # epochs ended in a row without averaging while other trainers were live
        self._last_reason: str | None = None  # why the last averaging attempt found no group
        self.local_samples = 0
        self.local_steps = 0
        self._total_samples = 0
        # epoch and samples are written by the training thread and read by the tracker in the trio thread
        self._counts_lock = threading.Lock()
        self._last_hint = -float("inf")  # monotonic time the tracker was last woken from the training thread

        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        initialize_optimizer_state(optimizer)
        named = state_tensors(optimizer)
        self._grads: list[torch.Tensor] = []
        if self.mode == "gradients":
            self._grads = [torch.zeros_like(p) for p in self.params]
            named = [(f"grad.{i}", g) for i, g in enumerate(self._grads)] + named
        self._names = [name for name, _ in named]
        self._tensors = [tensor for _, tensor in named]
        self._state = self._tensors[len(self._grads):]  # parameters + optimizer state: what newcomers download

        self._stats: dict[str, Any] = {
            "epochs": 0, "averaging_rounds": 0, "averaging_attempts": 0, "averaging_failures": 0,
            "group_sizes": {}, "peers_averaged_with": set(), "state_loads": 0, "state_load_failures": 0,
            "local_transitions": 0, "averaging_seconds": 0.0, "not_averaging": None,
            "state_load_sources": 0,  # holders of the state the last download fetched from
        }
        self.last_progress: SwarmProgress | None = None
        self._scope: trio.CancelScope | None = None
        # a threading lock (the averager's default, made here so its type is known): the training thread takes
        # it with a plain `with` around optimizer steps
        self._lock = threading.Lock()
        self.averager = Averager(
            swarm.rpc, swarm.dht, self._tensors, prefix=f"{run_id}.{self.mode}", names=self._names,
            target_group_size=target_group_size, min_group_size=min_group_size,
            matchmaking_time=matchmaking_time, allreduce_timeout=averaging_timeout, compression=compression,
            lock=self._lock, aggregation=aggregation,  # mean, centered_clip, trimmed_mean: see averaging.robust
            serve_state=False,  # this optimizer serves parameters + optimizer state (not gradients) with its epoch
        )
        self.tracker = _SharedProgressTracker(
            self._counts, swarm.dht, run_id, self.target_batch_size, ttl=progress_ttl, min_refresh=min_refresh,
            max_refresh=max_refresh, client_mode=not listen,
        )
        self._scope = self._start_serving(listen, listen_host)
        self.last_progress = swarm.run(self._current)
        if load_state_on_join and self.last_progress.epoch > self.epoch:
            self._catch_up(self.last_progress)

    # ------------------------------------------------------------------------------------------ trio side

    async def _serve(self, listen_host: str | None, *,
                     task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            # others catching up download parameters + optimizer state (and our epoch) from us
            async with self._serving_state(listen_host), trio.open_nursery() as nursery:
                await nursery.start(self.averager.serve)
                await nursery.start(self.tracker.run)
                task_status.started(scope)

    def _get_state(self) -> tuple[Any, list[torch.Tensor]]:
        """Called by the state server under the averaging lock: a consistent (epoch, tensors) pair."""
        return {"epoch": self.epoch, "run_id": self.run_id, "mode": self.mode}, self._state

    async def _note_group(self, peer_ids: list[bytes], finished: bool) -> None:
        self.tracker.note_group(peer_ids)
        if finished:  # their records now vouch for epochs (averaging.provenance), read in this thread
            self.tracker.provenance.saw_contribute(bytes(p) for p in peer_ids)

    async def _current(self) -> SwarmProgress:
        return self.tracker.progress()

    def _counts(self) -> tuple[int, int, int]:
        with self._counts_lock:
            return self.epoch, self.local_samples, self._total_samples

    def _hint_tracker(self, *, now: bool = False) -> None:
        """Wake the tracker's background loop to re-plan on the new numbers: `now` (an epoch move others must see),
        else at most every `min_refresh` (no round trip, see `Bridge.run_soon`)."""
        moment = time.monotonic()
        if now or moment - self._last_hint >= self.tracker.min_refresh:
            self._last_hint = moment
            run_soon = getattr(self.swarm.bridge, "run_soon", None)
            if run_soon is not None:
                run_soon(self.tracker.wake)

    async def _average(self, weight: float) -> Any:
        """One averaging round for the epoch being ended. While the round has nobody else in view, the swarm's
        records are re-read (`left_behind`): when every other trainer is already in a later epoch (they ended
        this one without seeing us: two trainers that start together race here), the round is abandoned at once
        instead of holding the training thread for the whole matchmaking window while they train on, which on
        a fast machine left a trainer a round behind for the rest of its run."""
        epoch = self.epoch

        async def left_behind() -> bool:
            return (await self.tracker.fetch()).epoch > epoch

        return await self.averager.step(weight=weight, timeout=self.averaging_timeout, left_behind=left_behind)

    async def _load_state(self, progress: SwarmProgress) -> Any:
        """Download parameters + optimizer state from the trainers of the newest epoch, in parallel verified
        blocks (`averaging.state.load_state`): there is no agreed hash here, so the state is the one the most
        advanced trainer (most samples) holds, fetched from every candidate holding the same."""
        me = self.averager.peer_id
        anchors = self.tracker.anchors  # with anchors, only they serve: a liar's state is never the one taken
        holders = [p for p in progress.peers if p.address is not None and p.peer_id != me
                   and (not anchors.peers or bytes(p.peer_id) in anchors.peers)]
        newest = max((p.epoch for p in holders), default=progress.epoch)
        providers = sorted((p for p in holders if p.epoch == newest), key=lambda p: -p.samples)
        candidates = [(p.peer_id, p.address) for p in providers if p.address is not None]
        if not candidates:
            return None
        return await load_state(self.swarm.rpc, candidates, into=self._state, lock=self.averager.lock,
                                timeout=self.load_state_timeout)

    # ------------------------------------------------------------------------------------------ public API

    def step(self, batch_size: int | None = None) -> bool:
        """Account one local batch (after `loss.backward()`); returns True when this call ended an epoch (an
        averaged update was applied, or state was loaded from peers)."""
        samples = self.batch_size_per_step if batch_size is None else int(batch_size)
        if self.mode == "gradients":
            with torch.no_grad():
                for p, acc in zip(self.params, self._grads):
                    if p.grad is not None:
                        acc.add_(p.grad, alpha=samples)
        else:
            with self._lock:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with self._counts_lock:
            self.local_samples += samples
            self._total_samples += samples
        self.local_steps += 1
        # Between epoch boundaries a step stays in this thread: the estimate is computed here from the records
        # the tracker last fetched, and the tracker picks up the new count in the background
        progress = self.tracker.estimate_from_thread(self.epoch, self.local_samples)
        self.last_progress = progress
        if progress.epoch > self.epoch + 1:
            self._catch_up(progress)
            return True
        if not (progress.epoch > self.epoch or progress.target_reached):
            self._hint_tracker()
            return False
        # an epoch boundary is due: decide on the swarm's records, not on extrapolation; and never conclude
        # "alone" from an old view (one bridge round trip that also hands the tracker the new count)
        fresh = progress
        if time.monotonic() - self.tracker.fetched_monotonic > self.tracker.min_refresh or progress.num_peers < 2:
            fresh = self.swarm.run(self.tracker.fetch)
        self.last_progress = fresh
        if fresh.epoch > self.epoch + 1:
            self._catch_up(fresh)
            return True
        if fresh.epoch > self.epoch or fresh.target_reached:
            self._end_epoch(fresh)
            return True
        self._hint_tracker()
        return False

    def more_steps(self, step: int, planned: int) -> bool:
        """A collaborative run is `planned` local steps: the swarm's epochs follow from everyone's samples."""
        return step < planned

    def shortfall(self, step: int, planned: int) -> str | None:
        return None if step >= planned else f"took {step} of {planned} local steps"

    def finish(self, timeout: float | None = None) -> bool:
        """Leave the run at once (`close()`), so the others stop counting this trainer's samples toward their
        epochs while it evaluates. There is no final state to agree on: each epoch ended averaged or downloaded.
        True unless already closed; `timeout` is unused (the goodbye record's store is bounded by the tracker)."""
        if self._scope is None:
            return False
        self.close()
        return True

    def report(self, final: bool = False) -> dict[str, Any]:
        stats = self.stats()
        if not final:
            return {"epoch": self.epoch, "averaging_rounds": stats["averaging_rounds"],
                    "swarm_trainers": stats.get("swarm_trainers")}
        report = {key: stats[key] for key in ("epoch", "averaging_rounds", "averaging_attempts", "group_sizes",
                                               "peers_averaged_with", "state_loads", "peer_id")}
        averaging = self.averager.stats()  # Byzantine-robust aggregation: whom this trainer banned
        report.update({key: averaging[key] for key in ("aggregation", "banned", "rejected_parts")})
        return report

    def stats(self) -> dict[str, Any]:
        """What this trainer did: epochs, averaging rounds, group sizes, who it averaged with, state loads."""
        stats = dict(self._stats)
        stats["peers_averaged_with"] = sorted(stats["peers_averaged_with"])
        stats["group_sizes"] = dict(sorted(stats["group_sizes"].items()))  # group size -> rounds
        stats["averaging_seconds"] = round(stats["averaging_seconds"], 3)
        stats["epoch"] = self.epoch
        stats["peer_id"] = str(self.averager.peer_id)
        stats["distrusted"] = sorted(str(PeerID(p)) for p in self.tracker.provenance.distrusted)
        progress = self.last_progress
        if progress is not None:
            stats["swarm_epoch"] = progress.epoch
            stats["swarm_trainers"] = progress.num_peers
        return stats

    # ------------------------------------------------------------------------------------------ epochs

    def _end_epoch(self, progress: SwarmProgress) -> None:
        """Average with whoever is ready (unless the swarm already moved on or nobody else is training),
        apply the update, move to the next epoch."""
        others_in_epoch = progress.epoch == self.epoch and progress.num_peers > 1
        if self.mode == "gradients" and self.local_samples > 0:
            with torch.no_grad():
                for acc in self._grads:
                    acc.div_(self.local_samples)
        averaged = False
        if others_in_epoch:
            averaged = self._average_once(weight=max(1.0, float(self.local_samples)))
        else:
            self._stats["local_transitions"] += 1
        if self.mode == "gradients":
            with self._lock, torch.no_grad():
                for p, acc in zip(self.params, self._grads):
                    p.grad = acc.clone()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                for acc in self._grads:
                    acc.zero_()
        self._watch_alone(progress, averaged, others_in_epoch)
        new_epoch = max(self.epoch + 1, progress.epoch)
        logger.info("epoch %d -> %d (averaged: %s, local samples %d)", self.epoch, new_epoch, averaged,
                    self.local_samples)
        self._move_to(new_epoch)

    def _watch_alone(self, progress: SwarmProgress, averaged: bool, others_in_epoch: bool) -> None:
        """Nothing silent: after `warn_after_epochs` epochs in a row without averaging while other trainers of
        the run are live, log ONE warning with the reason this trainer knows (another model, epochs that never
        overlap, or what matchmaking answered); averaging again re-arms it."""
        me = self.averager.peer_id
        others = [p.peer_id for p in progress.peers if p.peer_id != me]
        if averaged or not others:
            self._unaveraged = 0
            return
        self._unaveraged += 1
        if self._unaveraged != self.warn_after_epochs:
            return
        mismatched = [MISMATCHES.seen[bytes(p)] for p in others if bytes(p) in MISMATCHES.seen]
        if mismatched:
            reason = f"they train a different model ({mismatched[0]})"
        elif not others_in_epoch:
            reason = (f"their epochs never overlap with mine (swarm at epoch {progress.epoch}, me at {self.epoch}): "
                      f"each epoch ends before the others are seen (a fast model: raise target_batch_size)")
        else:
            reason = f"no group formed ({self._last_reason or 'no peer in view'})"
        message = (f"run {self.run_id!r}: not averaged for {self._unaveraged} epochs while {len(others)} other "
                   f"trainer(s) are live: {reason}")
        self._stats["not_averaging"] = message
        logger.warning("collaborative optimizer: %s", message)

    def _average_once(self, weight: float) -> bool:
        self._stats["averaging_attempts"] += 1
        started = time.monotonic()
        try:
            result = self.swarm.run(self._average, weight)
        except Exception as error:  # averaging is best effort: the local update still applies
            logger.warning("averaging failed: %s", error)
            self._stats["averaging_failures"] += 1
            return False
        finally:
            self._stats["averaging_seconds"] += time.monotonic() - started
        if result.group is None or result.group_size < 2:
            self._stats["averaging_failures"] += 1
            self._last_reason = result.reason
            logger.info("no averaging group this epoch: %s", result.reason)
            return False
        self._stats["averaging_rounds"] += 1
        sizes = self._stats["group_sizes"]
        sizes[result.group_size] = sizes.get(result.group_size, 0) + 1
        me = self.averager.peer_id
        self._stats["peers_averaged_with"].update(str(p) for p in result.group.peer_ids if p != me)
        group = list(result.group.peer_ids)
        self.swarm.run(self._note_group, group, result.finished)
        if not result.finished:
            logger.info("averaging round partial: %s", result.reason)
        return True

    def _catch_up(self, progress: SwarmProgress) -> None:
        """Too far behind the swarm (or just joined): take a peer's parameters and optimizer state."""
        loaded = None
        try:
            loaded = self.swarm.run(self._load_state, progress)
        except Exception as error:  # nobody could give it: keep training from where we are
            logger.warning("loading state from peers failed: %s", error)
        epoch = progress.epoch
        if loaded is not None:
            self._stats["state_loads"] += 1
            metadata = loaded.metadata if isinstance(loaded.metadata, dict) else {}
            if isinstance(metadata.get("epoch"), int) and not isinstance(metadata.get("epoch"), bool):
                epoch = max(epoch, metadata["epoch"])
            self._stats["state_load_sources"] = len(loaded.sources)
            logger.info("loaded state of epoch %d (%s) from %d holders, metadata from %s", epoch,
                        loaded.root[:12], len(loaded.sources), loaded.peer)
        else:
            self._stats["state_load_failures"] += 1
        if self.mode == "gradients":
            for acc in self._grads:
                acc.zero_()
        self._move_to(max(self.epoch, epoch))

    def _move_to(self, epoch: int) -> None:
        if epoch > self.epoch:
            self._stats["epochs"] += epoch - self.epoch
        with self._counts_lock:
            self.epoch = epoch
            self.local_samples = 0
        # others must stop counting our samples of the old epoch at once; alone, the move can wait for the
        # tracker's next planned wake-up (a lone trainer may end an epoch every step)
        progress = self.last_progress
        self._hint_tracker(now=progress is not None and progress.num_peers > 1)


__all__ = ["CollaborativeOptimizer", "MODES", "initialize_optimizer_state", "state_tensors"]
