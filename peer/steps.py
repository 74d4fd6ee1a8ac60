"""How `peer train` runs its training steps: one after the other, or several in flight through the swarm.

Why two ways behind one interface: with remote experts a step waits on a round trip per layer for its forward and
again for its backward, and a synchronous trainer idles through every wait (with 50 ms round trips it trained at
0.17-0.24 of its loopback speed). `moe.pipeline.StepsInFlight` keeps up to `--steps-in-flight` steps going, each
on a snapshot of the parameters, their updates applied in order (bounded staleness: `depth - 1` updates), which
`benchmarks/bench_moe_pipeline.py` measured at 0.73 of loopback with 50 ms. A trainer whose every parameter is
local (`--local-experts`, `--model`) has nothing to wait on, and its steps run one after the other, without a
thread or a snapshot per step. The runner sees one interface (`submit`, `drain`, `in_flight`) and the same
`StepResult`s either way, so its loop never branches on which one it drives.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from moe.errors import NotEnoughExperts
from moe.pipeline import ApplyFunction, ComputeFunction, StepResult, StepsInFlight


class StepRunner(Protocol):
    """`submit` a batch and get back the results of the steps that finished meanwhile (in order); `drain` waits
    for the rest (`apply=False` drops their updates); `in_flight` counts steps submitted and not finished."""

    @property
    def in_flight(self) -> int: ...

    def submit(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[StepResult]: ...

    def drain(self, apply: bool = True) -> list[StepResult]: ...


class SequentialSteps:
    """One step at a time, in the caller's thread: the forward and backward, then the update. A step without
    enough expert answers (`NotEnoughExperts`) applies nothing and is reported in its result; any other error
    propagates, as from a plain training loop."""

    in_flight = 0

    def __init__(self, model: nn.Module, compute: ComputeFunction, apply: ApplyFunction):
        self.model, self.compute, self.apply = model, compute, apply
        self._index = 0

    def submit(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[StepResult]:
        index, self._index = self._index, self._index + 1
        try:
            loss, metric = self.compute(inputs, targets)
            torch.autograd.backward(loss)
        except NotEnoughExperts as error:
            self.model.zero_grad(set_to_none=True)
            return [StepResult(index, None, error, 0, samples=len(inputs))]
        self.apply(len(inputs))
        return [StepResult(index, float(loss.detach()), None, 0, metric, len(inputs), applied=True)]

    def drain(self, apply: bool = True) -> list[StepResult]:
        return []


class PipelinedSteps:
    """Up to `depth` steps in flight (`moe.pipeline.StepsInFlight`): `submit` returns at once while fewer are in
    flight, else waits for the oldest."""

    def __init__(self, model: nn.Module, compute: ComputeFunction, apply: ApplyFunction, depth: int):
        self.steps = StepsInFlight(model, None, None, depth, compute=compute, apply=apply)

    @property
    def in_flight(self) -> int:
        return self.steps.in_flight

    def submit(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[StepResult]:
        self.steps.submit(inputs, targets)
        return self.steps.finished()

    def drain(self, apply: bool = True) -> list[StepResult]:
        return self.steps.drain(apply=apply)


def step_runner(model: nn.Module, compute: ComputeFunction, apply: ApplyFunction, depth: int) -> StepRunner:
    """The runner for `--steps-in-flight depth`: sequential for 1, pipelined above."""
    if depth <= 1:
        return SequentialSteps(model, compute, apply)
    return PipelinedSteps(model, compute, apply, depth)


__all__ = ["PipelinedSteps", "SequentialSteps", "StepRunner", "step_runner"]
