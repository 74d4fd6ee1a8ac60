"""`StepsInFlight`: a trainer that keeps several training steps in flight through the swarm, with bounded staleness.

Why: a trainer with remote mixture layers pays one round trip per layer per forward and per backward; with two
layers and 50 ms of round trip a step waits 200 ms however little the experts compute, and a synchronous trainer
idles through all of it (measured: 0.15 of its loopback samples/s).

Why several steps rather than micro-batches of one step: micro-batches of one step run side by side, but each
still needs the step's four round trips in a row, and the optimizer step waits for the last of them: the step
takes four round trips plus everyone's compute whatever the split (measured with 50 ms, batch 64, 8 micro-batches:
205 samples/s against 266 sequential; splitting only adds calls). Only work that does not wait for the previous
step can fill the wait: step t+1 starts while step t's calls are in flight. That is the asynchronous trainer of
hivemind and SWARM, and its price is staleness, bounded here:
- at most `depth` steps are in flight; step t computes its gradients on the parameters as they were when it
  started (a snapshot, so the optimizer may update the live parameters meanwhile), and its update is applied in
  order, after step t-1's. So a gradient is applied to parameters at most `depth - 1` updates newer than those it
  was computed on (`StepResult.staleness`, checked by a test); `depth=1` is the ordinary synchronous step;
- the remote experts see the steps' calls interleaved, as they see several trainers', and step once per backward
  call they serve.

The model stays an ordinary `nn.Module`, the loss an ordinary function, the optimizer any torch optimizer (or, with
`apply=`, any update such as a swarm optimizer's `step(batch_size=...)`; with `compute=`, any function that runs
the model and returns its loss and a metric, as `peer train`'s tasks do). Each
step's thread sees its own snapshot of the parameters: the modules' classes are given a parameter lookup that
reads a thread-local table first (`torch.func.functional_call` cannot do this: it swaps the module's attributes
for the duration of the call, which steps running side by side would see).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# compute(inputs, targets) -> (loss, metric): runs the model itself (a task's loss: e.g. logits and accuracy)
ComputeFunction = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, float]]
ApplyFunction = Callable[[int], None]  # apply(batch_size): the update, gradients in the parameters' .grad
_SNAPSHOT = threading.local()  # .params: {(id(module), name): tensor} of the step running in this thread
_VIEWED: dict[type, type] = {}


def _snapshot_view(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` with a parameter lookup that returns this thread's snapshot of a parameter when it has one.
    `nn.Module.__getattr__` is where a module's parameters are found (they are not instance attributes), so
    overriding it reaches every `self.weight` in a forward."""
    viewed = _VIEWED.get(cls)
    if viewed is None:
        def __getattr__(self: nn.Module, name: str) -> object:
            table = getattr(_SNAPSHOT, "params", None)
            if table is not None:
                value = table.get((id(self), name))
                if value is not None:
                    return value
            return cls.__getattr__(self, name)

        viewed = _VIEWED[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__})
    return viewed


@dataclass(frozen=True)
class StepResult:
    """One finished step: its index (in submission order), its loss (None when it failed), the error that failed
    it, and how many updates newer the parameters it was applied to were than those it computed on; `metric` (what
    `compute=` returned beside the loss, else nan), `samples` (its batch size) and `applied` (False when
    `drain(apply=False)` dropped its update, or it failed)."""

    index: int
    loss: float | None
    error: BaseException | None
    staleness: int
    metric: float = math.nan
    samples: int = 0
    applied: bool = False


class StepsInFlight:
    """Submit steps with `submit(inputs, targets)`: it returns at once while fewer than `depth` steps are in
    flight, else waits for the oldest to finish. `drain()` waits for all and returns the results not yet returned.
    A failed step (e.g. `moe.errors.NotEnoughExperts`) applies no update and is reported in its result; the steps
    after it go on. `finished()` returns the results so far without waiting.

    `compute(inputs, targets) -> (loss, metric)` replaces `loss_fn(model(inputs), targets)`, and `apply(batch_size)`
    replaces `optimizer.step(); optimizer.zero_grad()` (it finds the step's gradients in the parameters' `.grad`
    and must clear them). Both run in the step's thread: the update under the trainer's lock, one at a time, in
    submission order."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: LossFunction | None,
                 depth: int = 2, *, compute: ComputeFunction | None = None, apply: ApplyFunction | None = None):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if (loss_fn is None) == (compute is None):
            raise ValueError("give exactly one of loss_fn and compute")
        if (optimizer is None) == (apply is None):
            raise ValueError("give exactly one of optimizer and apply")
        self.model, self.optimizer, self.loss_fn, self.depth = model, optimizer, loss_fn, depth
        self._compute, self._apply = compute, apply
        self._dropping = False  # drain(apply=False): updates not applied yet are dropped
        self._keys: list[tuple[int, str]] = []
        self._params: list[nn.Parameter] = []
        for module in model.modules():
            if module._parameters and type(module) not in _VIEWED.values():
                module.__class__ = _snapshot_view(type(module))
            for name, param in module._parameters.items():
                if param is not None:
                    self._keys.append((id(module), name))
                    self._params.append(param)
        self._lock = threading.Condition()
        self._submitted = 0
        self._applied = 0  # steps whose update (or failure) has been applied, in order
        self._returned = 0  # steps whose result finished() or drain() has handed out
        self._threads: list[threading.Thread] = []
        self._results: list[StepResult] = []
        self.max_staleness = 0

    @property
    def in_flight(self) -> int:
        """Steps submitted whose result has not been handed out yet (by `finished` or `drain`). Why not "not
        applied yet": a loop that counts the results it got plus `in_flight` must never see a step that finished
        between its two reads as neither, or it submits one step past its end (`peer train --steps 4` ran 5)."""
        with self._lock:
            return self._submitted - self._returned

    def submit(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        with self._lock:
            while self._submitted - self._applied >= self.depth:
                self._lock.wait()
            index = self._submitted
            self._submitted += 1
            snapshot = {key: p.detach().clone().requires_grad_(p.requires_grad)
                        for key, p in zip(self._keys, self._params)}
            started_at = self._applied
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=self._step, args=(index, started_at, snapshot, inputs, targets),
                                  name=f"step-{index}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def finished(self) -> list[StepResult]:
        """The results of the steps finished since the last call (or `drain`), in order, without waiting."""
        with self._lock:
            results, self._results = self._results, []
            self._returned += len(results)
        return results

    def drain(self, apply: bool = True) -> list[StepResult]:
        """Wait for every step in flight and return the results not returned yet. `apply=False` drops the updates
        of the steps not applied yet (their results say `applied=False`): for a loop that must end on an exact
        update, e.g. a DiLoCo trainer whose swarm has taken its last outer step."""
        if not apply:
            with self._lock:
                self._dropping = True
        try:
            for thread in list(self._threads):
                thread.join()
        finally:
            with self._lock:
                self._dropping = False
        self._threads = []
        return self.finished()

    def _step(self, index: int, started_at: int, snapshot: dict[tuple[int, str], torch.Tensor], inputs: torch.Tensor,
              targets: torch.Tensor) -> None:
        loss_value: float | None = None
        metric = math.nan
        error: BaseException | None = None
        applied = False
        _SNAPSHOT.params = snapshot
        try:
            if self._compute is not None:
                loss, metric = self._compute(inputs, targets)
            else:
                assert self.loss_fn is not None
                loss = self.loss_fn(self.model(inputs), targets)
            torch.autograd.backward(loss)  # into the snapshot; every remote layer's backward runs
            loss_value = float(loss.detach())
        except Exception as caught:  # reported in the step's result; later steps go on
            error = caught
        finally:
            _SNAPSHOT.params = None
        with self._lock:
            while self._applied != index:  # updates in submission order
                self._lock.wait()
            try:
                if error is None and not self._dropping:
                    for param, key in zip(self._params, self._keys):
                        grad = snapshot[key].grad
                        param.grad = None if grad is None else grad.to(param.dtype)
                    if self._apply is not None:
                        self._apply(len(inputs))
                    else:
                        assert self.optimizer is not None
                        self.optimizer.step()
                        self.optimizer.zero_grad(set_to_none=True)
                    applied = True
            except Exception as caught:
                error, loss_value = caught, None
            finally:
                staleness = self._applied - started_at
                self.max_staleness = max(self.max_staleness, staleness)
                self._results.append(StepResult(index, loss_value, error, staleness, metric, len(inputs), applied))
                self._applied += 1
                self._lock.notify_all()


__all__ = ["ApplyFunction", "ComputeFunction", "LossFunction", "StepResult", "StepsInFlight"]
