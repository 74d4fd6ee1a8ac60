"""DiLoCoOptimizer: training over slow links with many local steps between rare, compressed outer steps.

    opt = DiLoCoOptimizer(torch.optim.AdamW(model.parameters()), swarm, run_id="digits", inner_steps=500,
                          batch_size_per_step=32, compression=wire.Compression.INT8)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()                      # inner step every batch; an outer step every `inner_steps` of them
        opt.zero_grad()

Why: `CollaborativeOptimizer` sends the whole model every collective epoch; over home uplinks that is where the
time goes. DiLoCo (Douillard et al.) takes `inner_steps` local steps with the wrapped (inner) optimizer, then
averages the *pseudo-gradient* (outer parameters at the start of the round minus local parameters), weighted by
the samples behind it, and applies it to the outer parameters with an outer optimizer (default SGD with Nesterov
momentum, lr 0.7, momentum 0.9). Local parameters are then reset to the outer ones; the inner optimizer's state
stays local. Traffic drops by `inner_steps` times, and by 4 more with the INT8 codec.

One outer step (`_outer_round`, in the swarm's trio thread):
1. **Ready.** The trainer publishes, with its progress record (`averaging.progress`, epoch = outer step), that
   its round is done, then waits (at most `ready_timeout`) until every live trainer of its outer step is ready:
   they then reach the averager together and form one group: the matchmaker is told how many are ready (it
   holds out for them) and matches under a schema that includes the outer step, so trainers of different outer
   steps never share a group.
2. **Average.** The pseudo-gradients go through the existing averager (`averaging.averager.Averager`), which
   weighs them by samples; a member lost mid all-reduce is excluded and the survivors' mean renormalised (see
   `averaging.allreduce`). Only a fully averaged round is applied (one with parts left at local values is
   skipped; step 4 then downloads the outer step from a member that finished it). With a lossy codec the
   pseudo-gradient is compressed before it is sent and, with error feedback, what the codec lost is added to
   the next round's pseudo-gradient.
3. **Apply.** The outer optimizer steps on the average; local parameters are reset to the outer ones; the outer
   step number goes up and the hash of the outer state (parameters + outer optimizer state) is published.
   The codec is deterministic and the reducer of each part keeps the decoded mean it serves, so every member of
   the group holds bit-identical outer state.
4. **Agree.** Trainers compare hashes at the same outer step: the hash held by the most trainers (ties: the
   smaller hash) is the swarm's; one holding another hash downloads outer parameters, outer optimizer state and
   outer step from a holder of the swarm's (`averaging.state`). A trainer that sees others at a newer outer step
   (it was slow, or partitioned) does the same, and so does a newcomer before its first inner step.
   A trainer that sees others but finds no group (a partition) applies nothing and keeps its outer step: the
   next round's pseudo-gradient covers both rounds, and when the partition heals it re-syncs.
5. **Finish.** Steps 1-4 run at the next outer step, so a trainer that missed the *last* one would end the run
   with its own hash. `finish()` (at the end of training, before `close()`) publishes that this trainer is done
   (`fin`), waits (at most `finish_timeout`) until every live trainer of the run is done too, downloads the
   swarm's state if its hash is not the canonical one among the finished trainers (step 4's rule), and keeps
   serving its own state until all finished trainers hold the same outer step and hash, so a laggard can still
   download from it. A stop request (SIGINT) skips or cuts it short.

Overlap (`overlap=True`, the "eager / one step delayed" variant): at a round's end the pseudo-gradient is
handed to a background round and inner steps go on; the averaged update is applied one round later. Local
parameters keep their own latest progress on top of the new outer parameters (local = outer - own pending
pseudo-gradient). `stats()["outer_waits"]` counts round ends that had to wait for the background round, and
`utilization` is compute time over wall time, both from the optimizer's own clocks.

Test hooks (environment variables, never CLI flags; the `*_ENV` constants below): `SWARMD_DILOCO_HOLD_AT`,
`SWARMD_DILOCO_ANNOUNCE`, `SWARMD_DILOCO_TRACE`, `SWARMD_DILOCO_START_WITH`, and
`SWARMD_DILOCO_SCALE_PSEUDOGRADIENT=X`, which multiplies this trainer's pseudo-gradient by X before it is sent:
a Byzantine trainer, so tests can check that `aggregation="centered_clip"` keeps the honest trainers' accuracy
and bans it (tests/test_train_byzantine.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

import torch
import trio

from averaging.averager import Averager, StepResult
from averaging.collaborative import initialize_optimizer_state, local_host_towards, state_tensors
from averaging.progress import PeerProgress, ProgressTracker, SwarmProgress
from averaging.state import install_state_server, load_state_from_peers
from dht.client import SwarmHandle
from peer.p2p import wire

logger = logging.getLogger(__name__)

ALGORITHM = "diloco"
HOLD_ENV = "SWARMD_DILOCO_HOLD_AT"  # tests: "N" blocks this trainer when its part of outer step N is being sent
ANNOUNCE_ENV = "SWARMD_DILOCO_ANNOUNCE"  # tests: "1" writes a JSON line to stdout when an outer round starts
TRACE_ENV = "SWARMD_DILOCO_TRACE"  # tests: a directory where every outer step is saved (torch.save, tensors only)
START_WITH_ENV = "SWARMD_DILOCO_START_WITH"  # tests, benchmarks: "N" sets `start_with` of a `peer train` process
SCALE_ENV = "SWARMD_DILOCO_SCALE_PSEUDOGRADIENT"  # tests: "X" makes this trainer a Byzantine one (x X before sending)

T = TypeVar("T")


def state_hash(tensors: list[torch.Tensor]) -> str:
    """sha256 (hex, 32 characters kept) over the exact bytes of `tensors`: equal iff bit-identical."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def nesterov_sgd(params: list[torch.Tensor], lr: float = 0.7, momentum: float = 0.9) -> torch.optim.Optimizer:
    """The default outer optimizer of DiLoCo."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)


class ErrorFeedback:
    """Compress with `compression`, remembering what was lost so the next round sends it (error feedback).

    `compress(x)` returns what the receivers decode from `x + residual` and keeps the new residual. Since every
    round sends the residual of the one before, the sum of what was sent over n rounds differs from the sum of
    the inputs by exactly the last residual: for INT8 at most max|block| / 127 per element (the codec's bound,
    on the last round's input), independent of n."""

    def __init__(self, tensors: list[torch.Tensor], compression: wire.Compression, enabled: bool = True):
        self.compression = wire.Compression(compression)
        self.enabled = enabled and self.compression != wire.Compression.NONE
        self.residuals = [torch.zeros_like(t) for t in tensors] if self.enabled else []
        self._pending: list[torch.Tensor] = []

    def compress(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Replace `values` in place by what the codec delivers; the residual is kept until `commit()`."""
        if self.compression == wire.Compression.NONE:
            return values
        self._pending = []
        for index, value in enumerate(values):
            if self.enabled:
                value.add_(self.residuals[index])
            sent = wire.roundtrip(value, self.compression)
            if self.enabled:
                self._pending.append(value - sent)
            value.copy_(sent)
        return values

    def commit(self) -> None:
        """The compressed values were applied: their loss is what the next round adds."""
        if self.enabled and self._pending:
            for residual, pending in zip(self.residuals, self._pending):
                residual.copy_(pending)
        self._pending = []


class DiLoCoOptimizer:
    """Wraps any torch optimizer (the inner one) for DiLoCo training over a `peer.client.Swarm` (see module doc).

    `outer_optimizer`: a callable building the outer optimizer over the outer parameters (default: Nesterov SGD
    with `outer_lr`, `outer_momentum`). `compression`: the codec of the pseudo-gradients (`peer.p2p.wire`);
    `error_feedback`: carry the codec's loss to the next round. `overlap`: delayed outer update (see module doc).
    `aggregation`: how the pseudo-gradients are reduced (mean, or Byzantine-robust: `averaging.robust`).
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
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compression: wire.Compression = wire.Compression.NONE,
        error_feedback: bool = True,
        overlap: bool = False,
        target_group_size: int = 64,
        min_group_size: int = 2,
        matchmaking_time: float = 3.0,
        averaging_timeout: float = 60.0,
        ready_timeout: float = 15.0,
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
        finish_timeout: float = 10.0,
        aggregation: str = "mean",
    ):
        if inner_steps < 1 or batch_size_per_step < 1:
            raise ValueError("inner_steps and batch_size_per_step must be positive")
        self.optimizer = optimizer
        self.swarm = swarm
        self.run_id = run_id
        self.inner_steps = int(inner_steps)
        self.batch_size_per_step = int(batch_size_per_step)
        self.compression = wire.Compression(compression)
        self.overlap = overlap
        self.should_stop = should_stop  # polled during an outer round: a stop request (SIGINT) abandons it
        self.averaging_timeout = averaging_timeout
        self.ready_timeout = ready_timeout
        self.load_state_timeout = load_state_timeout
        env_start = os.environ.get(START_WITH_ENV, "")
        self.start_with = int(env_start) if env_start.isdigit() else int(start_with)
        self.start_timeout = start_timeout
        self.finish_timeout = finish_timeout
        self.outer_step = 0
        self.round_steps = 0
        self.round_samples = 0
        self.local_steps = 0

        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.outer_params = [p.detach().clone() for p in self.params]
        make_outer = outer_optimizer or (lambda ps: nesterov_sgd(ps, outer_lr, outer_momentum))
        self.outer_optimizer = make_outer(self.outer_params)
        initialize_optimizer_state(self.outer_optimizer)
        self._outer_state = [t for _, t in state_tensors(self.outer_optimizer)]  # what trainers that catch up download
        self.pseudo = [torch.zeros_like(p) for p in self.params]  # what the averager averages
        self._anchor = [p.detach().clone() for p in self.params]  # overlap: local parameters at the round start
        self.feedback = ErrorFeedback(self.pseudo, self.compression, error_feedback)
        self.hash = state_hash(self._outer_state)

        self._lock = threading.Lock()
        self._stats: dict[str, Any] = {
            "outer_steps": 0, "rounds": 0, "group_sizes": {}, "solo_steps": 0, "skipped_rounds": 0,
            "state_loads": 0, "state_load_failures": 0, "resyncs": 0, "final_resyncs": 0, "outer_waits": 0,
            "bytes_sent": 0, "bytes_received": 0, "compute_seconds": 0.0, "blocked_seconds": 0.0,
        }
        self._bytes_at_round: tuple[int, int] = (0, 0)
        self.bytes_per_outer_step = 0
        self._started: float | None = None
        self._last_step_end: float | None = None
        self._background: trio.Event | None = None  # overlap: set when the background round ended
        self._background_result: tuple[str, float] | None = None
        self._hold_at = int(os.environ[HOLD_ENV]) if os.environ.get(HOLD_ENV, "").isdigit() else None
        self._trace = os.environ.get(TRACE_ENV) or None
        self._scale = float(os.environ.get(SCALE_ENV) or 1.0)
        self._held = False
        self.last_progress: SwarmProgress | None = None

        self.averager = Averager(
            swarm.rpc, swarm.dht, self.pseudo, prefix=f"{run_id}.diloco",
            names=[f"pseudo.{i}" for i in range(len(self.pseudo))], target_group_size=target_group_size,
            min_group_size=min_group_size, matchmaking_time=matchmaking_time, allreduce_timeout=averaging_timeout,
            compression=self.compression, lock=threading.Lock(), serve_state=False,
            aggregation=aggregation,  # mean, centered_clip, trimmed_mean: see averaging.robust
        )
        self.tracker = ProgressTracker(
            swarm.dht, run_id, self.inner_steps * self.batch_size_per_step, ttl=progress_ttl,
            min_refresh=min_refresh, max_refresh=max_refresh, client_mode=not listen,
            publish_interval=publish_interval,
        )
        self.tracker.info.update({"alg": ALGORITHM, "ready": -1, "hash": self.hash, "bytes": 0, "util": None})
        host = listen_host
        if listen and host is None:
            initial_peers = getattr(swarm, "initial_peers", None)
            host = local_host_towards(initial_peers[0]) if initial_peers else "127.0.0.1"
        self._scope: trio.CancelScope | None = swarm.bridge.start_and_wait(self._serve, host if listen else None)
        self.swarm.run(self._join)  # a newcomer holds the swarm's outer state before its first inner step

    # ------------------------------------------------------------------------------------------ trio side

    async def _serve(self, listen_host: str | None, *,
                     task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            rpc = self.swarm.rpc
            if listen_host is not None and rpc.announced_address is None:
                await rpc.listen(listen_host, 0)
            state_server = None
            if rpc.announced_address is not None:
                state_server = install_state_server(rpc, self._get_state, lock=self._lock)
                self.tracker.address = rpc.announced_address
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await nursery.start(self.averager.serve)
                    assert self.averager.allreduce_server is not None
                    self.averager.allreduce_server.hook = self._on_allreduce_event
                    await nursery.start(self.tracker.run)
                    task_status.started(scope)
            finally:
                if state_server is not None:
                    state_server.uninstall()

    def _on_allreduce_event(self, name: str, info: dict[str, Any]) -> None:
        """Counts the bytes of our pushes; in tests (`HOLD_ENV`) blocks the whole trainer while its part of the
        chosen outer step is being sent, so a test can SIGKILL it at exactly that moment."""
        if name == "chunk_pushed" and self._hold_at == self.outer_step and not self._held:
            self._held = True
            sys.stdout.write('{"event": "diloco_hold", "outer_step": %d, "phase": "%s", "part": %d}\n'
                             % (self.outer_step, name, int(info.get("part", -1))))
            sys.stdout.flush()
            time.sleep(3600)  # blocks the trio thread on purpose: nothing of this trainer moves until the kill

    def _get_state(self) -> tuple[Any, list[torch.Tensor]]:
        """Called by the state server under the lock: the outer state with its step and hash."""
        return {"outer_step": self.outer_step, "hash": self.hash, "run_id": self.run_id,
                "algorithm": ALGORITHM}, self._outer_state

    def _count_traffic(self, result: StepResult) -> None:
        """Bytes of this all-reduce as they crossed the wire: the encoded chunks pushed and pulled, as the
        all-reduce counts them (tensor headers and data; the RPC envelope excluded)."""
        if result.allreduce is None:
            return
        self._stats["bytes_sent"] += result.allreduce.bytes_sent
        self._stats["bytes_received"] += result.allreduce.bytes_received

    def _canonical(self, progress: SwarmProgress, epoch: int) -> tuple[str | None, list[PeerProgress]]:
        """The swarm's hash at outer step `epoch` (held by the most trainers, me included; ties: the smaller)
        and the other trainers holding it that serve their state."""
        counts: dict[str, int] = {}
        me = self.tracker.peer_id
        for peer in progress.peers:
            value = peer.info.get("hash")
            if peer.peer_id != me and peer.epoch == epoch and isinstance(value, str) and peer.info.get("alg"):
                counts[value] = counts.get(value, 0) + 1
        if epoch == self.outer_step:
            counts[self.hash] = counts.get(self.hash, 0) + 1
        if not counts:
            return None, []
        best = min(counts, key=lambda h: (-counts[h], h))
        holders = [p for p in progress.peers if p.peer_id != me and p.epoch == epoch
                   and p.info.get("hash") == best and p.address is not None]
        return best, holders

    async def _resync(self, progress: SwarmProgress, timeout: float | None = None) -> bool:
        """Hold the swarm's outer state: download it when another trainer is at a newer outer step, or at mine
        with the hash most trainers hold (within `timeout`, default `load_state_timeout`). Returns True when the
        state was replaced."""
        newest = max((p.epoch for p in progress.peers if p.info.get("alg")), default=self.outer_step)
        epoch = max(newest, self.outer_step)
        best, holders = self._canonical(progress, epoch)
        if best is None or (epoch == self.outer_step and best == self.hash) or not holders:
            return False
        holders.sort(key=lambda p: -p.samples)
        try:
            loaded = await load_state_from_peers(
                self.swarm.rpc, [(p.peer_id, p.address) for p in holders if p.address is not None],
                into=self._outer_state, lock=self._lock,
                timeout=self.load_state_timeout if timeout is None else timeout)
        except Exception as error:  # nobody could give it: keep our state, try again at the next round
            self._stats["state_load_failures"] += 1
            logger.warning("diloco: loading the outer state failed: %s", error)
            return False
        metadata = loaded.metadata if isinstance(loaded.metadata, dict) else {}
        step = metadata.get("outer_step")
        self.outer_step = step if isinstance(step, int) and not isinstance(step, bool) else epoch
        self.hash = state_hash(self._outer_state)
        self._stats["state_loads"] += 1
        self._stats["resyncs"] += 1
        self._stats["bytes_received"] += sum(t.numel() * t.element_size() for t in self._outer_state)
        logger.info("diloco: loaded outer step %d (%s) from %s", self.outer_step, self.hash[:12], loaded.peer)
        self._publish_state()
        return True

    def _publish_state(self) -> None:
        self.tracker.new_epoch(self.outer_step)
        self.tracker.info.update({"hash": self.hash, "ready": -1})

    async def _publish_now(self) -> None:
        self._publish_state()
        await self.tracker.publish()

    async def _join(self) -> None:
        progress = await self.tracker.fetch()
        if self.start_with > 1:
            await self.tracker.publish()  # be counted by the others that wait too
            deadline = trio.current_time() + self.start_timeout
            while (len([p for p in progress.peers if p.info.get("alg")]) < self.start_with
                   and trio.current_time() < deadline):
                await trio.sleep(self.tracker.min_refresh)
                progress = await self.tracker.fetch()
        self.last_progress = progress
        if await self._resync(progress):
            self._reset_local()
        else:
            await self.tracker.publish()

    async def _wait_ready(self) -> tuple[SwarmProgress, bool]:
        """Publish that my round is done and wait until every live trainer of my outer step is too (or someone
        is past it, or `ready_timeout`). Returns (latest view, whether a newer outer step exists)."""
        self.tracker.info["ready"] = self.outer_step
        await self.tracker.publish()
        deadline = trio.current_time() + self.ready_timeout
        while True:
            progress = await self.tracker.fetch()
            peers = [p for p in progress.peers if p.info.get("alg")]
            if any(p.epoch > self.outer_step for p in peers):
                return progress, True
            waiting = [p for p in peers if p.epoch == self.outer_step and p.info.get("ready") != self.outer_step]
            if not waiting or trio.current_time() >= deadline:
                return progress, False
            await trio.sleep(self.tracker.min_refresh)

    def _match_only_my_outer_step(self) -> None:
        """Matchmake under a schema that includes the outer step: only trainers at the same outer step can form a
        group. Why: pseudo-gradients are relative to the outer parameters of one outer step; a trainer still
        matchmaking for step k (it reached the averager late) would otherwise join a group of step k+1, mix
        pseudo-gradients of two bases and leave the rounds and outer steps of its members out of phase (seen in
        the process test on a loaded machine: a group of four at steps 2 and 3, and one trainer ending at outer
        step 11). The group key stays the same, so the matchmaker's memory of who averages under it (its
        patience for stragglers) carries over from step to step."""
        matchmaker = self.averager.matchmaker
        assert matchmaker is not None, "the averager serves while the optimizer is open"
        step = hashlib.sha256(self.averager.schema + b"|diloco-outer-step|%d" % self.outer_step)
        matchmaker.schema = step.digest()[:len(self.averager.schema)]

    async def _outer_round(self, weight: float) -> tuple[str, float]:
        """Steps 1-2 of the module doc; returns (what happened, seconds): "averaged" (self.pseudo holds the
        group mean), "solo" (nobody else trains: self.pseudo is our own), "skipped" (others exist, no group:
        apply nothing) or "resynced" (we were behind: the outer state was downloaded)."""
        started = trio.current_time()
        if os.environ.get(ANNOUNCE_ENV) == "1":
            sys.stdout.write('{"event": "diloco_round", "outer_step": %d}\n' % self.outer_step)
            sys.stdout.flush()
        progress, behind = await self._wait_ready()
        self.last_progress = progress
        others = [p for p in progress.peers if p.peer_id != self.tracker.peer_id and p.info.get("alg")]
        if behind or (others and self._canonical(progress, self.outer_step)[0] != self.hash):
            if await self._resync(progress):
                return "resynced", trio.current_time() - started
        self._last_group = []
        self._match_only_my_outer_step()
        # the trainers of my outer step that said they are ready come to the averager now: the matchmaker holds
        # out for them (a first round under the key has no memory of who averages there; on a loaded machine
        # the first declarations seen then were cut into partial groups)
        # (banned peers are not waited for: our matchmaking refuses them anyway)
        banned = self.averager.strikes.banned
        ready = 1 + sum(1 for p in others if p.epoch == self.outer_step and p.info.get("ready") == self.outer_step
                        and bytes(p.peer_id) not in banned)
        result: StepResult = await self.averager.step(weight=weight, timeout=self.averaging_timeout, expected=ready)
        self._stats["rounds"] += 1
        self._count_traffic(result)
        logger.info("diloco: outer step %d: group of %d, %s%s", self.outer_step, result.group_size,
                    "averaged" if result.finished else "not averaged", f" ({result.reason})" if result.reason else "")
        if result.group is not None and result.group_size >= 2 and result.finished:
            sizes = self._stats["group_sizes"]
            sizes[result.group_size] = sizes.get(result.group_size, 0) + 1
            self.tracker.note_group(list(result.group.peer_ids))
            self._last_group = [bytes(p) for p in result.group.peer_ids]
            outcome = "averaged"
        else:
            # a group whose all-reduce did not average every part (a member lost and its part not retried, or
            # the deadline) leaves other values here than the members that finished hold: apply nothing, the
            # agreement after the round downloads the outer step from one of those
            outcome = "skipped" if others or result.group is not None else "solo"
        return outcome, trio.current_time() - started

    async def _interruptible_round(self, weight: float) -> tuple[str, float]:
        """`_outer_round`, abandoned (as a skipped round: nothing applied) within 0.1 s of `should_stop()`."""
        return await self._until_stop(("skipped", 0.0), self._outer_round, weight)

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

    async def _background_round(self, weight: float, done: trio.Event) -> None:
        try:
            self._background_result = await self._outer_round(weight)
        except Exception as error:  # the round is best effort; the next one re-syncs if we drifted
            logger.warning("diloco: background outer round failed: %s", error)
            self._background_result = ("skipped", 0.0)
        finally:
            done.set()

    async def _start_background(self, weight: float) -> None:
        done = trio.Event()
        self._background = done
        self._nursery.start_soon(self._background_round, weight, done)

    async def _wait_background(self) -> None:
        if self._background is not None:
            await self._background.wait()

    # ------------------------------------------------------------------------------------------ public API

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def lock(self) -> threading.Lock:
        """Held while the outer state is written (outer steps, downloads, snapshots served to others)."""
        return self._lock

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, batch_size: int | None = None) -> bool:
        """One inner step (after `loss.backward()`); returns True when this call ended an outer round."""
        now = time.monotonic()
        if self._started is None:
            self._started = now
        elif self._last_step_end is not None:
            self._stats["compute_seconds"] += now - self._last_step_end  # forward + backward since the last step
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
        if self.round_steps >= self.inner_steps:
            if self.overlap:
                self._end_round_overlapped()
            else:
                self._end_round()
            ended = True
        self._last_step_end = time.monotonic()
        if ended:
            self._stats["blocked_seconds"] += self._last_step_end - after_compute
        return ended

    @property
    def utilization(self) -> float | None:
        """Compute time (inner steps and what the training loop does between them) over wall time."""
        if self._started is None or self._last_step_end is None or self._last_step_end <= self._started:
            return None
        wall = self._last_step_end - self._started
        blocked = float(self._stats["blocked_seconds"])
        return max(0.0, min(1.0, 1.0 - blocked / wall))

    # ------------------------------------------------------------------------------------------ rounds

    def _pseudo_gradient(self, base: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for pseudo, start, p in zip(self.pseudo, base, self.params):
                pseudo.copy_(start).sub_(p.detach()).mul_(self._scale)
            self.feedback.compress(self.pseudo)

    def _apply_outer(self) -> None:
        """The outer optimizer steps on the (averaged) pseudo-gradient in self.pseudo."""
        with self._lock, torch.no_grad():
            before = [p.clone() for p in self.outer_params] if self._trace else None
            for outer, pseudo in zip(self.outer_params, self.pseudo):
                outer.grad = pseudo.clone()
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            self.outer_step += 1
            self.hash = state_hash(self._outer_state)
        self.feedback.commit()
        self._stats["outer_steps"] += 1
        if before is not None and self._trace is not None:
            self._save_trace(before)

    def _save_trace(self, before: list[torch.Tensor]) -> None:
        os.makedirs(self._trace or ".", exist_ok=True)
        path = os.path.join(self._trace or ".", f"{self.swarm.rpc.peer_id.hex()}.{self.outer_step}.pt")
        torch.save({"outer_step": torch.tensor(self.outer_step), "before": before,
                    "after": [p.clone() for p in self.outer_params], "averaged": [p.clone() for p in self.pseudo],
                    "own": [p.clone() for p in self._own_trace], "weight": torch.tensor(float(self._trace_weight)),
                    "group": [torch.tensor(list(g)) for g in getattr(self, "_last_group", [])],
                    "hash": self.hash}, path)

    def _reset_local(self, keep: list[torch.Tensor] | None = None) -> None:
        """Local parameters <- outer parameters (minus `keep`, our own pending pseudo-gradient, in overlap)."""
        with torch.no_grad():
            for index, (p, outer, anchor) in enumerate(zip(self.params, self.outer_params, self._anchor)):
                p.copy_(outer)
                if keep is not None:
                    p.sub_(keep[index])
                anchor.copy_(p)

    def _account_round(self) -> None:
        sent, received = self._stats["bytes_sent"], self._stats["bytes_received"]
        self.bytes_per_outer_step = (sent - self._bytes_at_round[0]) + (received - self._bytes_at_round[1])
        self._bytes_at_round = (sent, received)
        self.tracker.info.update({"bytes": int(self.bytes_per_outer_step),
                                  "util": None if self.utilization is None else round(self.utilization, 3)})

    def _end_round(self) -> None:
        weight = float(max(1, self.round_samples))
        self._pseudo_gradient(self.outer_params)
        self._own_trace = [p.clone() for p in self.pseudo] if self._trace else []
        self._trace_weight = weight
        outcome, _ = self.swarm.run(self._interruptible_round, weight)
        if outcome in ("averaged", "solo"):
            if outcome == "solo":
                self._stats["solo_steps"] += 1
            self._apply_outer()
            self._reset_local()
        elif outcome == "resynced":
            self._reset_local()
        else:
            self._stats["skipped_rounds"] += 1  # keep the local parameters: the next round covers both
        self.round_steps = self.round_samples = 0
        self._account_round()
        if self.should_stop is None or not self.should_stop():
            self.swarm.run(self._agree)

    async def _agree(self) -> None:
        """After an outer step: publish our hash and, once the others of our group published theirs (or a short
        wait passed), re-sync if the swarm's hash is another."""
        self._publish_state()
        await self.tracker.publish()
        deadline = trio.current_time() + min(self.ready_timeout, 5.0)
        group = set(getattr(self, "_last_group", []))
        while True:
            progress = await self.tracker.fetch()
            at_step = {bytes(p.peer_id) for p in progress.peers if p.epoch >= self.outer_step}
            if group <= at_step | {bytes(self.tracker.peer_id)} or trio.current_time() >= deadline:
                break
            await trio.sleep(self.tracker.min_refresh)
        self.last_progress = progress
        if await self._resync(progress):
            self._reset_local()

    async def _finish(self, timeout: float) -> bool:
        """Step 5 of the module doc; True when every live trainer of the run finished with my outer step and
        hash. Polls the run's progress records (the others publish `fin` when they get here)."""
        me = self.tracker.peer_id
        with trio.move_on_after(timeout) as scope:
            await self._wait_background()  # overlap: nothing else may write the outer state meanwhile
            self.tracker.info["fin"] = True
            await self.tracker.publish()
            while True:
                progress = await self.tracker.fetch()
                self.last_progress = progress
                others = [p for p in progress.peers if p.peer_id != me and p.info.get("alg")]
                finished = [p for p in others if p.info.get("fin")]
                # only finished trainers: their state is final, so the download is the last one
                if finished and await self._resync(dataclasses.replace(progress, peers=tuple(finished)),
                                                   timeout=max(0.0, scope.deadline - trio.current_time())):
                    self._stats["final_resyncs"] += 1
                    self._reset_local()
                    await self.tracker.publish()
                    continue
                if len(finished) == len(others) and all(
                        p.epoch == self.outer_step and p.info.get("hash") == self.hash for p in finished):
                    return True  # everyone agrees: nobody needs my state any more
                await trio.sleep(self.tracker.min_refresh)
        return False

    def _end_round_overlapped(self) -> None:
        """Overlap: apply the previous round's average (waiting for it only if it is not done), hand this
        round's pseudo-gradient to a background round, keep training."""
        blocked = False
        if self._background is not None and not self._background.is_set():
            blocked = True
            self._stats["outer_waits"] += 1
            self.swarm.run(self._wait_background)
        with torch.no_grad():
            progress_since = [anchor - p.detach() for anchor, p in zip(self._anchor, self.params)]
        if self._background is not None:
            outcome, _ = self._background_result or ("skipped", 0.0)
            if outcome in ("averaged", "solo"):
                if outcome == "solo":
                    self._stats["solo_steps"] += 1
                self._apply_outer()
            elif outcome == "skipped":
                self._stats["skipped_rounds"] += 1
            self._account_round()
            self.swarm.run(self._publish_now)
        weight = float(max(1, self.round_samples))
        with torch.no_grad():
            for pseudo, delta in zip(self.pseudo, progress_since):
                pseudo.copy_(delta).mul_(self._scale)
            self.feedback.compress(self.pseudo)
        self._own_trace = [p.clone() for p in self.pseudo] if self._trace else []
        self._trace_weight = weight
        self._reset_local(keep=progress_since)
        self.round_steps = self.round_samples = 0
        self.swarm.run(self._start_background, weight)
        if blocked:
            logger.info("diloco: an inner step waited for the outer round")

    def finish(self, timeout: float | None = None) -> bool:
        """Call once when training ends, before `close()`: a final agreement on the outer state (module doc,
        step 5), at most `timeout` seconds (default `finish_timeout`). Skipped, or cut short, once
        `should_stop()` is true. Returns True when all live trainers of the run finished with my outer step and
        hash."""
        if self._scope is None or (self.should_stop is not None and self.should_stop()):
            return False
        limit = self.finish_timeout if timeout is None else timeout
        return bool(self.swarm.run(self._until_stop, False, self._finish, limit))

    def stats(self) -> dict[str, Any]:
        """What this trainer did: outer steps, group sizes, state loads, bytes, waits, utilization."""
        stats = dict(self._stats)
        stats["group_sizes"] = dict(sorted(stats["group_sizes"].items()))
        stats["compute_seconds"] = round(stats["compute_seconds"], 3)
        stats["blocked_seconds"] = round(stats["blocked_seconds"], 3)
        stats.update({
            "algorithm": ALGORITHM, "outer_step": self.outer_step, "hash": self.hash,
            "inner_steps": self.inner_steps, "local_steps": self.local_steps,
            "bytes_per_outer_step": self.bytes_per_outer_step, "compression": self.compression.name.lower(),
            "overlap": self.overlap, "peer_id": str(self.averager.peer_id),
            "utilization": None if self.utilization is None else round(self.utilization, 4),
        })
        progress = self.last_progress
        if progress is not None:
            stats["swarm_trainers"] = len([p for p in progress.peers if p.info.get("alg")])
        return stats

    def close(self) -> None:
        """Stop publishing progress and leave averaging (the swarm itself stays open)."""
        scope, self._scope = self._scope, None
        if scope is None or getattr(self.swarm, "bridge", None) is None:
            return

        async def cancel() -> None:
            scope.cancel()
            await self.tracker.leave()

        try:
            self.swarm.bridge.run(cancel)
        except Exception as error:  # the bridge already closed: nothing left to stop
            logger.debug("diloco optimizer: close after the bridge: %s", error)

    def __enter__(self) -> "DiLoCoOptimizer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


__all__ = ["ALGORITHM", "DiLoCoOptimizer", "ErrorFeedback", "nesterov_sgd", "state_hash"]
