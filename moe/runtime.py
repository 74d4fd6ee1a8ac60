"""The expert runtime: queues requests per expert, batches them, runs the batches off the event loop.

Why batch: many callers each send a few samples; one matrix multiply over all of them costs barely more than one
over a single caller's. So each expert has a queue for forward and one for backward requests, and one worker task
that takes the oldest queue's requests (oldest first, up to `max_batch_size` samples, optionally waiting up to
`batch_timeout` for `min_batch_size`), concatenates them, runs the expert once and hands each caller its slice.

Why a worker per expert: an expert's batches must run one at a time (backward changes the weights that forward
reads), while different experts may run in parallel, bounded by a `trio.CapacityLimiter` per device.

Threads or inline: a batch normally runs in a worker thread (`trio.to_thread.run_sync`) so the event loop keeps
serving the network while torch computes. A thread hand-off costs ~100 us here, more than a tiny batch takes
(hidden 256, batch 1: ~50 us), so the runtime keeps an estimate of each expert's cost per sample and runs batches
predicted to take under `inline_threshold` seconds on the event loop; when the expert is idle such a request
skips the queue too (computed by the caller's own task). `inline_threshold=math.inf` runs everything inline
(simulated tests under MockClock); `0` always uses threads.

Kept forwards: a forward asked to keep its graph (`forward_keeping`, `run_many(keep=True)`) returns it with the
outputs when it was computed alone (a batch of one request; merged batches recompute in their backward, as
before), and a backward given that graph (`kept=`) backpropagates through it instead of recomputing the forward.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
import trio

from moe.experts import Expert, KeptForward

T = TypeVar("T")
FORWARD = "forward"
BACKWARD = "backward"


class ExpertComputeError(RuntimeError):
    """The expert's module raised while computing a batch; every request of that batch gets this error."""

    def __init__(self, uid: str, mode: str, error: BaseException):
        super().__init__(f"expert {uid} failed in {mode}: {type(error).__name__}: {error}")
        self.uid, self.mode, self.error = uid, mode, error


class RuntimeNotRunning(RuntimeError):
    """A request arrived while the runtime is not running (before `run` started or after it stopped)."""


@dataclass(eq=False)
class _Task:
    tensors: Sequence[torch.Tensor]  # forward: inputs; backward: inputs + grad_outputs
    rows: int
    created: float
    done: trio.Event = field(default_factory=trio.Event)
    result: list[torch.Tensor] | None = None
    error: BaseException | None = None
    abandoned: bool = False  # the caller stopped waiting (cancelled) before the batch started
    keep: bool = False  # forward: keep the graph for the backward (when computed alone)
    kept: KeptForward | None = None  # forward: the graph kept; backward: the graph to use


@dataclass(eq=False)
class _Slot:
    """Per-expert state: the two queues, the worker's wake-up event, the batch lock and cost estimates."""

    expert: Expert
    queues: dict[str, collections.deque[_Task]] = field(
        default_factory=lambda: {FORWARD: collections.deque(), BACKWARD: collections.deque()}
    )
    queued_rows: dict[str, int] = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    wakeup: trio.Event = field(default_factory=trio.Event)
    lock: trio.Lock = field(default_factory=trio.Lock)
    seconds_per_row: dict[str, float | None] = field(default_factory=lambda: {FORWARD: None, BACKWARD: None})
    requests: dict[str, int] = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    batches: dict[str, int] = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    samples: dict[str, int] = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    inline_batches: int = 0
    failures: int = 0


class ExpertRuntime:
    def __init__(
        self,
        experts: Mapping[str, Expert],
        *,
        max_batch_size: int = 4096,
        min_batch_size: int = 1,
        batch_timeout: float = 0.005,
        threads_per_device: int = 1,
        inline_threshold: float = 3e-4,
    ):
        if not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(f"need 1 <= min_batch_size ({min_batch_size}) <= max_batch_size ({max_batch_size})")
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.batch_timeout = batch_timeout
        self.inline_threshold = inline_threshold
        self._threads_per_device = threads_per_device
        self._slots = {uid: _Slot(expert) for uid, expert in experts.items()}
        self._limiters: dict[str, trio.CapacityLimiter] = {}
        self._running = False

    @property
    def experts(self) -> dict[str, Expert]:
        return {uid: slot.expert for uid, slot in self._slots.items()}

    def __contains__(self, uid: object) -> bool:
        return uid in self._slots

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve requests until cancelled. On exit no batch is running (threads are waited for, not abandoned),
        and requests still queued fail with RuntimeNotRunning."""
        if self._running:
            raise RuntimeError("this runtime is already running")
        try:
            async with trio.open_nursery() as nursery:
                for slot in self._slots.values():
                    nursery.start_soon(self._worker, slot)
                self._running = True
                task_status.started()
        finally:
            self._running = False
            for slot in self._slots.values():
                for queue in slot.queues.values():
                    while queue:
                        task = queue.popleft()
                        task.error = RuntimeNotRunning("the expert runtime stopped")
                        task.done.set()
                slot.queued_rows = {FORWARD: 0, BACKWARD: 0}

    async def forward(self, uid: str, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Outputs of expert `uid` on `inputs` (already validated against its schema)."""
        return (await self._submit(uid, FORWARD, inputs))[0]

    async def forward_keeping(
        self, uid: str, inputs: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], KeptForward | None]:
        """`forward`, and its graph for the backward when it was computed alone (None when it was merged with
        other callers' requests)."""
        return await self._submit(uid, FORWARD, inputs, keep=True)

    async def backward(
        self, uid: str, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
        kept: KeptForward | None = None,
    ) -> list[torch.Tensor]:
        """Gradients w.r.t. `inputs` (through `kept` when it is still valid); the expert takes an optimizer step
        after the batch containing this request."""
        return (await self._submit(uid, BACKWARD, [*inputs, *grad_outputs], kept=kept))[0]

    async def run_many(
        self, mode: str, requests: Sequence[tuple[str, Sequence[torch.Tensor]]], *, keep: bool = False,
        kept: Sequence[KeptForward | None] | None = None, kept_out: list[KeptForward | None] | None = None,
    ) -> list[list[torch.Tensor] | ExpertComputeError | RuntimeNotRunning]:
        """Several experts' requests of one batched call (`moe.forward_batch`): `mode` is FORWARD or BACKWARD,
        each request `(uid, tensors)` with tensors as `forward` / `backward` take them (backward: inputs then
        grad_outputs), distinct uids. Returns each request's outputs, or the error of its expert alone.

        Why not `forward` per request: the experts of an idle server are computed one after the other in ONE
        worker thread (or inline when all of them together are predicted to take under `inline_threshold`), so
        a call carrying 6 small experts costs one thread hand-off, not 6 (a hand-off costs ~100 us, and far
        more when the cores are shared). Requests for experts that are busy or must wait for `min_batch_size`
        join their queues and are batched with other callers' as usual.

        `keep` (forward): each request's graph is written to `kept_out[i]` (None where it was not kept);
        `kept` (backward): the graph of each request's forward, or None."""
        if not self._running:
            raise RuntimeNotRunning("the expert runtime is not running")
        results: list[Any] = [None] * len(requests)
        graphs: list[KeptForward | None] = list(kept) if kept is not None else [None] * len(requests)
        produced: list[KeptForward | None] = [None] * len(requests)
        direct: list[tuple[int, _Slot, Sequence[torch.Tensor], int]] = []
        queued: list[int] = []
        for _, tensors in requests:  # checked before any lock is taken: a bad request leaves none held
            if int(tensors[0].shape[0]) > self.max_batch_size:
                raise ValueError(f"{int(tensors[0].shape[0])} samples exceed max_batch_size {self.max_batch_size}")
        for index, (uid, tensors) in enumerate(requests):
            slot = self._slots[uid]
            rows = int(tensors[0].shape[0])
            if (rows >= self.min_batch_size and not slot.lock.locked() and not slot.queues[FORWARD]
                    and not slot.queues[BACKWARD]):
                slot.lock.acquire_nowait()  # never blocks; held only while the direct batches run (below)
                slot.requests[mode] += 1
                direct.append((index, slot, tensors, rows))
            else:
                queued.append(index)

        async def through_queue(index: int) -> None:
            uid, tensors = requests[index]
            try:
                results[index], produced[index] = await self._submit(uid, mode, tensors, keep=keep,
                                                                     kept=graphs[index])
            except (ExpertComputeError, RuntimeNotRunning) as error:
                results[index] = error

        held = [slot for _, slot, _, _ in direct]

        def release() -> None:
            while held:
                held.pop().lock.release()

        try:
            async with trio.open_nursery() as nursery:
                for index in queued:
                    nursery.start_soon(through_queue, index)
                if direct:
                    try:
                        outcomes = await self._execute_many(mode, direct, keep, graphs, produced)
                    finally:
                        # Released as soon as their own batches are done, not when the queued requests are: two
                        # calls that each took one expert directly and queued for the other's (one trainer's
                        # call for ffn.4-6 and ffn.7, another's for ffn.7 and ffn.4-6) each held what the other
                        # waited for, and a daemon served nothing until the callers' timeouts (5 s) cut them.
                        release()
                    for (index, _, _, _), outcome in zip(direct, outcomes):
                        results[index] = outcome
        finally:
            release()
        if kept_out is not None:
            kept_out[:] = produced
        else:
            for graph in produced:
                if graph is not None:
                    graph.release()
        return results

    async def exclusive(self, uid: str, fn: Callable[[Expert], T]) -> T:
        """Run `fn(expert)` in a thread while no batch of that expert runs (e.g. copy its state to a checkpoint)."""
        slot = self._slots[uid]
        async with slot.lock:
            return await trio.to_thread.run_sync(fn, slot.expert)

    def stats(self) -> dict[str, Any]:
        per_expert: dict[str, dict[str, Any]] = {}
        for uid, slot in self._slots.items():
            per_expert[uid] = {
                "requests": dict(slot.requests),
                "batches": dict(slot.batches),
                "samples": dict(slot.samples),
                "queued": {mode: len(queue) for mode, queue in slot.queues.items()},
                "inline_batches": slot.inline_batches,
                "failures": slot.failures,
                "optimizer_steps": slot.expert.steps,
                "skipped_steps": slot.expert.skipped_steps,
                "clipped_steps": slot.expert.clipped_steps,
            }

        def total(key: str) -> int:
            return sum(sum(e[key].values()) for e in per_expert.values())

        return {
            "experts": len(self._slots),
            "requests": total("requests"),
            "batches": total("batches"),
            "samples": total("samples"),
            "failures": sum(e["failures"] for e in per_expert.values()),
            "per_expert": per_expert,
        }

    # ------------------------------------------------------------------------------------------------ internals

    async def _submit(self, uid: str, mode: str, tensors: Sequence[torch.Tensor], *, keep: bool = False,
                      kept: KeptForward | None = None) -> tuple[list[torch.Tensor], KeptForward | None]:
        if not self._running:
            raise RuntimeNotRunning("the expert runtime is not running")
        slot = self._slots[uid]
        rows = int(tensors[0].shape[0])
        if rows > self.max_batch_size:
            raise ValueError(f"{rows} samples exceed max_batch_size {self.max_batch_size}")
        if (
            rows >= self.min_batch_size
            and not slot.lock.locked()
            and not slot.queues[FORWARD]
            and not slot.queues[BACKWARD]
            and self._runs_inline(slot, mode, rows)
        ):
            # Fast path: the expert is idle and the batch is tiny, so compute right here; the queue and worker
            # hand-offs would cost more than the computation (this is what makes batch-1 calls cheap).
            slot.requests[mode] += 1
            slot.lock.acquire_nowait()
            try:
                outputs, graph = await self._execute(slot, mode, tensors, rows, keep, kept)
            finally:
                slot.lock.release()
            await trio.lowlevel.checkpoint()
            return outputs, graph
        task = _Task(tensors, rows, trio.current_time(), keep=keep, kept=kept)
        slot.queues[mode].append(task)
        slot.queued_rows[mode] += rows
        slot.requests[mode] += 1
        slot.wakeup.set()
        try:
            await task.done.wait()
        except BaseException:
            task.abandoned = True  # the worker drops it unless its batch already started
            raise
        if task.error is not None:
            raise task.error
        assert task.result is not None
        return task.result, task.kept if mode == FORWARD else None

    def _limiter(self, device: torch.device) -> trio.CapacityLimiter:
        key = str(device)
        if key not in self._limiters:
            self._limiters[key] = trio.CapacityLimiter(self._threads_per_device)
        return self._limiters[key]

    async def _worker(self, slot: _Slot) -> None:
        while True:
            mode, wake_at = self._next_batch(slot)
            if mode is None:
                slot.wakeup = trio.Event()
                with trio.move_on_at(wake_at):
                    await slot.wakeup.wait()
                continue
            batch = self._take(slot, mode)
            if not batch:
                await trio.lowlevel.checkpoint()
                continue
            try:
                async with slot.lock:
                    await self._run_batch(slot, mode, batch)
            finally:  # cancelled mid-batch (shutdown): its callers must not wait forever
                for task in batch:
                    if not task.done.is_set():
                        task.error = RuntimeNotRunning("the expert runtime stopped")
                        task.done.set()

    def _next_batch(self, slot: _Slot) -> tuple[str | None, float]:
        """The queue to serve now: among queues that hold `min_batch_size` samples or whose oldest request has
        waited `batch_timeout`, the one with the oldest request. Otherwise (None, when to look again), so a
        batch that cannot fill up never delays a full one of the other mode."""
        now = trio.current_time()
        ready: list[tuple[float, str]] = []
        wake_at = math.inf
        for mode, queue in slot.queues.items():
            while queue and queue[0].abandoned:  # callers that gave up no longer count as waiting
                slot.queued_rows[mode] -= queue.popleft().rows
            if not queue:
                continue
            deadline = queue[0].created + self.batch_timeout
            if slot.queued_rows[mode] >= self.min_batch_size or now >= deadline:
                ready.append((queue[0].created, mode))
            else:
                wake_at = min(wake_at, deadline)
        if ready:
            return min(ready)[1], now
        return None, wake_at

    def _take(self, slot: _Slot, mode: str) -> list[_Task]:
        queue = slot.queues[mode]
        batch: list[_Task] = []
        rows = 0
        while queue and (not batch or rows + queue[0].rows <= self.max_batch_size):
            task = queue.popleft()
            slot.queued_rows[mode] -= task.rows
            if task.abandoned:
                continue
            batch.append(task)
            rows += task.rows
        return batch

    def _runs_inline(self, slot: _Slot, mode: str, rows: int) -> bool:
        estimate = slot.seconds_per_row[mode]
        return self.inline_threshold == math.inf or (estimate is not None and estimate * rows <= self.inline_threshold)

    @staticmethod
    def _compute(expert: Expert, mode: str, tensors: Sequence[torch.Tensor], keep: bool = False,
                 kept: KeptForward | None = None) -> tuple[list[torch.Tensor], float, KeptForward | None]:
        """One batch of one expert, timed (runs in a worker thread or inline): with `keep`, a forward that keeps
        its graph; a backward through `kept` when given."""
        started = time.perf_counter()
        graph = None
        if mode == FORWARD and keep:
            outputs, graph = expert.forward_keeping(tensors)
        elif mode == FORWARD:
            outputs = expert.forward(tensors)
        else:
            split = len(expert.inputs)
            outputs = expert.backward(tensors[:split], tensors[split:], kept)
        return outputs, time.perf_counter() - started, graph

    def _record(self, slot: _Slot, mode: str, rows: int, elapsed: float) -> None:
        estimate = slot.seconds_per_row[mode]
        per_row = elapsed / rows
        slot.seconds_per_row[mode] = per_row if estimate is None else 0.8 * estimate + 0.2 * per_row
        slot.batches[mode] += 1
        slot.samples[mode] += rows

    async def _execute(self, slot: _Slot, mode: str, tensors: Sequence[torch.Tensor], rows: int, keep: bool = False,
                       kept: KeptForward | None = None) -> tuple[list[torch.Tensor], KeptForward | None]:
        """Run one batch inline or in a worker thread; raises ExpertComputeError if the module fails."""
        expert = slot.expert
        try:
            if self._runs_inline(slot, mode, rows):
                slot.inline_batches += 1
                outputs, elapsed, graph = self._compute(expert, mode, tensors, keep, kept)
            else:
                outputs, elapsed, graph = await trio.to_thread.run_sync(
                    self._compute, expert, mode, tensors, keep, kept, limiter=self._limiter(expert.device))
        except Exception as error:  # the module itself failed
            slot.failures += 1
            raise ExpertComputeError(expert.uid, mode, error) from error
        self._record(slot, mode, rows, elapsed)
        return outputs, graph

    async def _execute_many(
        self, mode: str, batches: list[tuple[int, _Slot, Sequence[torch.Tensor], int]], keep: bool,
        graphs: list[KeptForward | None], produced: list[KeptForward | None],
    ) -> list[list[torch.Tensor] | ExpertComputeError]:
        """Batches of several experts (their locks held by the caller), one after the other: inline when all of
        them are predicted cheap, else in one worker thread per device. Each expert's failure is its own."""
        outcomes: list[Any] = [None] * len(batches)
        by_device: dict[str, list[int]] = {}
        for position, (_, slot, _, _) in enumerate(batches):
            by_device.setdefault(str(slot.expert.device), []).append(position)

        def compute_all(positions: list[int]) -> list[tuple[list[torch.Tensor] | None, BaseException | None, float]]:
            done: list[tuple[list[torch.Tensor] | None, BaseException | None, float]] = []
            if mode == BACKWARD and len(positions) > 1:
                # one autograd pass and fused optimizer steps over all of them (Expert.backward_many); the time
                # is shared out by rows for each expert's cost estimate
                started = time.perf_counter()
                experts = [batches[p][1].expert for p in positions]
                split = [len(e.inputs) for e in experts]
                results = Expert.backward_many(experts, [
                    (batches[p][2][:n], batches[p][2][n:]) for p, n in zip(positions, split)],
                    [graphs[batches[p][0]] for p in positions])
                elapsed = time.perf_counter() - started
                total_rows = max(1, sum(batches[p][3] for p in positions))
                for p, result in zip(positions, results):
                    if isinstance(result, Exception):
                        done.append((None, result, 0.0))
                    else:
                        done.append((result, None, elapsed * batches[p][3] / total_rows))
                return done
            for position in positions:
                index, slot, tensors, _ = batches[position]
                try:
                    outputs, elapsed, produced[index] = self._compute(slot.expert, mode, tensors, keep, graphs[index])
                    done.append((outputs, None, elapsed))
                except Exception as error:  # the module itself failed: that expert's requests only
                    done.append((None, error, 0.0))
            return done

        async def run_device(positions: list[int]) -> None:
            estimates = [batches[p][1].seconds_per_row[mode] for p in positions]
            inline = self.inline_threshold == math.inf or (
                all(e is not None for e in estimates)
                and sum(e * batches[p][3] for e, p in zip(estimates, positions) if e is not None)
                <= self.inline_threshold)
            if inline:
                for position in positions:
                    batches[position][1].inline_batches += 1
                done = compute_all(positions)
            else:
                device = batches[positions[0]][1].expert.device
                done = await trio.to_thread.run_sync(compute_all, positions, limiter=self._limiter(device))
            for position, (outputs, error, elapsed) in zip(positions, done):
                _, slot, _, rows = batches[position]
                if error is not None:
                    slot.failures += 1
                    failure = ExpertComputeError(slot.expert.uid, mode, error)
                    failure.__cause__ = error
                    outcomes[position] = failure
                else:
                    self._record(slot, mode, rows, elapsed)
                    outcomes[position] = outputs

        if len(by_device) == 1:
            await run_device(next(iter(by_device.values())))
        else:
            async with trio.open_nursery() as nursery:
                for positions in by_device.values():
                    nursery.start_soon(run_device, positions)
        await trio.lowlevel.checkpoint()
        return outcomes

    async def _run_batch(self, slot: _Slot, mode: str, batch: list[_Task]) -> None:
        rows = sum(task.rows for task in batch)
        keep, kept = False, None
        if len(batch) == 1:
            tensors = list(batch[0].tensors)
            keep, kept = batch[0].keep, batch[0].kept
        else:  # a merged batch: its forward keeps nothing, its backward recomputes
            tensors = [torch.cat([task.tensors[i] for task in batch]) for i in range(len(batch[0].tensors))]
            for task in batch:
                if task.kept is not None:
                    task.kept.release()
                    task.kept = None
        try:
            outputs, graph = await self._execute(slot, mode, tensors, rows, keep, kept)
        except ExpertComputeError as failure:  # tell every caller of this batch
            for task in batch:
                task.error = failure
                task.done.set()
            return
        await trio.lowlevel.checkpoint()
        if len(batch) == 1:
            batch[0].result = outputs
            batch[0].kept = graph
            batch[0].done.set()
            return
        sizes = [task.rows for task in batch]
        pieces = [torch.split(output, sizes) for output in outputs]
        for index, task in enumerate(batch):
            task.result = [piece[index] for piece in pieces]
            task.done.set()


__all__ = ["BACKWARD", "FORWARD", "ExpertComputeError", "ExpertRuntime", "RuntimeNotRunning"]
