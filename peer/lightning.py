"""PyTorch Lightning with a swarm optimizer: `Trainer(strategy=SwarmStrategy(lambda opt: DiLoCoOptimizer(opt, ...)))`.

Lightning builds the module's optimizer itself (`configure_optimizers`, during `fit`'s setup), so the strategy
takes a factory, not an optimizer: `make_optimizer(torch_optimizer)` returns the `SwarmOptimizer` wrapping it
(DiLoCo or collaborative, with whatever options and `peer.client.Swarm` the caller chose; the caller owns the
swarm, as with `peer.huggingface`). A DiLoCo constructor may block (it joins the swarm, `start_with` waits for the
run's first trainers): that happens in `fit`'s setup, before the first batch.

Lightning then steps what the strategy lists as optimizers: `SwarmTorchOptimizer`, the torch face of
`peer.huggingface.TorchOptimizer` (parameter groups and state shared with the wrapped optimizer, so the module's
learning-rate schedulers and checkpoints act on it) whose `step(closure)` runs Lightning's closure (forward,
backward, gradient clipping) and then one swarm step with the batch's samples. The run ends the swarm's way: the
loop stops when `more_steps` says the run is done (DiLoCo: the swarm's outer steps for `max_steps`), `finish()`
runs when training ends (DiLoCo: every trainer ends with one outer state, or `averaging.diloco.NotAgreed` is raised
out of `fit`), and `close()` when the trainer tears down, also after an error.

Only this module imports `lightning` (`pip install swarmd[lightning]`): the core never needs it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from averaging.optimizer import SwarmOptimizer
from peer.huggingface import TorchOptimizer

try:
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.utilities.data import extract_batch_size
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("peer.lightning needs PyTorch Lightning: pip install 'swarmd[lightning]'") from error

if TYPE_CHECKING:
    import lightning.pytorch as pl

logger = logging.getLogger(__name__)

MakeOptimizer = Callable[[torch.optim.Optimizer], SwarmOptimizer]
"""Builds the swarm optimizer around the optimizer `configure_optimizers` returned."""


class SwarmTorchOptimizer(TorchOptimizer):
    """What Lightning steps: `step(closure)` evaluates the closure (Lightning's automatic optimization passes the
    forward and backward in it; manual optimization a no-op), then hands over to `on_step` (the strategy's swarm
    step), and returns the closure's loss as a torch optimizer does."""

    def __init__(self, swarm: SwarmOptimizer, on_step: Callable[[Any], None]):
        super().__init__(swarm)
        self.on_step = on_step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.on_step(loss)
        return loss


class SwarmStrategy(SingleDeviceStrategy):
    """A single-device Lightning strategy whose optimizer trains with the swarm (see the module doc).

    `make_optimizer`: builds the `SwarmOptimizer` around the module's one torch optimizer, at each `fit`.
    `batch_size`: samples per batch, reported to the swarm (throughput, collaborative epochs); None infers them
    from each batch (Lightning's `extract_batch_size`), summed over accumulated batches. `finish_timeout`: passed to
    `finish()` (None: the optimizer's own default). `device` and the rest: `SingleDeviceStrategy`'s.

    After `fit`, `swarm_optimizer` is the optimizer it trained with (closed: its `hash`, `outer_step` and `stats()`
    stay readable) and `finished` what its `finish()` returned."""

    strategy_name = "swarm"

    def __init__(self, make_optimizer: MakeOptimizer, *, batch_size: int | None = None,
                 finish_timeout: float | None = None, device: str | torch.device = "cpu", **kwargs: Any):
        super().__init__(device=device, **kwargs)
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be positive")
        self.make_optimizer = make_optimizer
        self.batch_size = batch_size
        self.finish_timeout = finish_timeout
        self.swarm_optimizer: SwarmOptimizer | None = None
        self.finished: bool | None = None
        self.local_steps = 0
        self._samples = 0  # of the batches since the last step (several with accumulate_grad_batches)
        self._inferred = True  # False once a batch's size could not be inferred (warned once)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers from `configure_optimizers`, then the one torch optimizer wrapped: a swarm
        optimizer averages one set of parameters, so a module with several optimizers is refused."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"SwarmStrategy trains with one optimizer, configure_optimizers gave "
                             f"{len(self.optimizers)}")
        self.swarm_optimizer = self.make_optimizer(self.optimizers[0])
        self.local_steps = self._samples = 0
        self.finished = None
        self.optimizers = [SwarmTorchOptimizer(self.swarm_optimizer, self._swarm_step)]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._samples += self.batch_size or self._infer_batch_size(batch)

    def _infer_batch_size(self, batch: Any) -> int:
        """The batch's size, or 0 (the optimizer's `batch_size_per_step` then counts) when Lightning finds no
        tensor in it."""
        try:
            return int(extract_batch_size(batch))
        except Exception as error:  # Lightning's MisconfigurationException or a RecursionError
            if self._inferred:
                self._inferred = False
                logger.warning("SwarmStrategy: no batch size in the batch (%s); counting the optimizer's "
                               "batch_size_per_step instead (pass batch_size= to say it)", error)
            return 0

    def _swarm_step(self, loss: Any) -> None:
        """One swarm step after Lightning's closure; stop the loop when the swarm's run is done. A `training_step`
        that returned None skips its batch under automatic optimization: no swarm step for it."""
        module = self.lightning_module
        assert module is not None and self.swarm_optimizer is not None
        samples, self._samples = self._samples, 0
        if loss is None and module.automatic_optimization:
            return
        self.swarm_optimizer.step(samples or None)
        self.local_steps += 1
        trainer = module.trainer
        if trainer.max_steps > 0 and not self.swarm_optimizer.more_steps(self.local_steps, trainer.max_steps):
            trainer.should_stop = True

    def on_train_end(self) -> None:
        """End training with the swarm (DiLoCo: the final agreement on one outer state). Raises what `finish()`
        raises (`NotAgreed`) out of `fit`, the trainer torn down first."""
        if self.swarm_optimizer is not None:
            self.finished = self.swarm_optimizer.finish(self.finish_timeout)

    def teardown(self) -> None:
        """Leave the run (the swarm itself stays open: it is the caller's), also when `fit` failed."""
        if self.swarm_optimizer is not None:
            self.swarm_optimizer.close()
        super().teardown()


__all__ = ["MakeOptimizer", "SwarmStrategy", "SwarmTorchOptimizer"]
