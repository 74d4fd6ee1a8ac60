"""Hugging Face `Trainer` with a swarm optimizer: `Trainer(..., **trainer_arguments(opt))`.

The `Trainer` wants a `torch.optim.Optimizer` (its learning-rate scheduler checks the type, `accelerate` wraps it)
and drives it itself: `optimizer.step()` after each accumulated batch, `model.zero_grad()`, checkpoints through
`state_dict()`. `TorchOptimizer` is that face over a `SwarmOptimizer`: its parameter groups and state are the
wrapped torch optimizer's own objects (a scheduler that sets the learning rate sets it there), and its `step()` is
the swarm optimizer's (an inner step, and an outer step with the swarm when one is due). `SwarmCallback` ends the
run the swarm's way: the loop stops when `more_steps` says the run is done, and `finish()` (DiLoCo: one final
state for every trainer) runs at the end of `train()`. Nothing here imports `transformers` until it is used, so
the core never needs it (`pip install swarmd[hf]`)."""

from __future__ import annotations

from typing import Any

import torch

from averaging.optimizer import SwarmOptimizer


class TorchOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose `step()` is `swarm.step()`; groups and state shared with the wrapped one."""

    def __init__(self, swarm: SwarmOptimizer):
        inner: torch.optim.Optimizer = swarm.optimizer
        super().__init__([p for group in inner.param_groups for p in group["params"]], dict(inner.defaults))
        self.swarm = swarm
        self.inner = inner
        self.param_groups = inner.param_groups  # the same list: a scheduler's learning rate reaches the inner one
        self.state = inner.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # no closure: one local batch
        if closure is not None:
            raise ValueError("a swarm optimizer steps on one local batch: no closure")
        self.swarm.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.swarm.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def swarm_callback(swarm: SwarmOptimizer) -> Any:
    """A `transformers.TrainerCallback`: stop when the swarm's run is done, `finish()` when training ends."""
    from transformers import TrainerCallback

    class SwarmCallback(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if state.max_steps > 0 and not swarm.more_steps(state.global_step, state.max_steps):
                control.should_training_stop = True
            return control

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            swarm.finish()
            return control

    return SwarmCallback()


def trainer_arguments(swarm: SwarmOptimizer) -> dict[str, Any]:
    """What to pass to `transformers.Trainer(...)`: the optimizer (and no scheduler: the Trainer makes its own
    over it) and the callback."""
    return {"optimizers": (TorchOptimizer(swarm), None), "callbacks": [swarm_callback(swarm)]}


__all__ = ["TorchOptimizer", "swarm_callback", "trainer_arguments"]
