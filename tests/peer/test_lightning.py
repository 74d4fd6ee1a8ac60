"""`peer.lightning.SwarmStrategy` (issue 38): two `lightning.Trainer`s, threads of this process with a `Swarm` each
on 127.0.0.1 (the second bootstraps from the first), train a tiny module through a swarm optimizer. DiLoCo: both
end `fit` with one outer-state hash after averaging in groups of 2. Collaborative: both average their epoch's
gradients and end with the same parameters. What the strategy asks of the optimizer (samples per step with
accumulated batches, stopping on `more_steps`, `finish()` then `close()`) on a stand-in without a swarm. And the
how-to page's example runs as written, as two processes."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning: pip install -e '.[lightning]'")

from averaging.collaborative import CollaborativeOptimizer  # noqa: E402
from averaging.diloco import DiLoCoOptimizer  # noqa: E402
from averaging.optimizer import SwarmOptimizer  # noqa: E402
from averaging.state_hash import state_digest  # noqa: E402
from peer.client import Swarm  # noqa: E402
from peer.lightning import SwarmStrategy  # noqa: E402
from tests.peer.docs_scripts import examples, two_trainers  # noqa: E402
from tests.threaded import run_in_threads  # noqa: E402

# Lightning 2.6's pytree helper (batch transfer) makes an isinstance test that torch 2.13 deprecated
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")

BATCH = 8
TIMEOUT = 120.0
PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "lightning.md"


class Tiny(pl.LightningModule):
    """Regression of the sum of 8 inputs; the same initial weights on every trainer."""

    def __init__(self, lr: float = 1e-2, sgd: bool = False):
        super().__init__()
        with torch.random.fork_rng():  # the other tests' random numbers stay theirs
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.lr, self.sgd = lr, sgd

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        cls = torch.optim.SGD if self.sgd else torch.optim.AdamW
        return cls(self.parameters(), lr=self.lr)


def _loader(seed: int, batches: int) -> torch.utils.data.DataLoader:
    """Each trainer its own random data."""
    x = torch.randn(batches * BATCH, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH)


def _fit_pair(make: Callable[[Swarm], Callable[[torch.optim.Optimizer], SwarmOptimizer]], max_steps: int,
              sgd: bool = False, callbacks: Callable[[], list[Any]] = list) -> list[tuple[SwarmStrategy, Tiny]]:
    """Two trainers, each `fit` in its own thread on its own `Swarm`; returns (strategy, module) of each."""
    results: dict[int, tuple[SwarmStrategy, Tiny]] = {}
    modules = [Tiny(sgd=sgd) for _ in range(2)]  # here: torch's seeded generator is one for all threads
    with Swarm(initial_peers=[], host="127.0.0.1") as first:
        assert first.address is not None
        with Swarm(initial_peers=[first.address], host="127.0.0.1") as second:
            swarms = [first, second]

            def train(index: int) -> None:
                strategy = SwarmStrategy(make(swarms[index]))
                module = modules[index]
                trainer = pl.Trainer(strategy=strategy, max_steps=max_steps, logger=False,
                                     enable_checkpointing=False, enable_progress_bar=False,
                                     enable_model_summary=False, accelerator="cpu", callbacks=callbacks())
                trainer.fit(module, _loader(index, batches=4 * max_steps))
                results[index] = (strategy, module)

            run_in_threads(train, 2, timeout=TIMEOUT)
    assert set(results) == {0, 1}, "a trainer did not finish in time"
    return [results[0], results[1]]


class Recorder:
    """A stand-in swarm optimizer (no swarm): steps the wrapped optimizer and records what the strategy calls."""

    def __init__(self, optimizer: torch.optim.Optimizer, planned_outer: int):
        self.optimizer = optimizer
        self.planned_outer = planned_outer
        self.calls: list[Any] = []

    def step(self, batch_size: int | None = None) -> bool:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.calls.append(("step", batch_size))
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def more_steps(self, step: int, planned: int) -> bool:
        return step < self.planned_outer

    def finish(self, timeout: float | None = None) -> bool:
        self.calls.append(("finish", timeout))
        return True

    def close(self) -> None:
        self.calls.append(("close",))


def test_the_strategy_steps_the_swarm_with_accumulated_samples_stops_when_it_is_done_then_finishes_and_closes():
    made: list[Recorder] = []

    def make(opt: torch.optim.Optimizer) -> Any:
        made.append(Recorder(opt, planned_outer=3))
        return made[-1]

    strategy = SwarmStrategy(make, finish_timeout=7.0)
    module = Tiny()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(strategy=strategy, max_steps=10, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu")
    trainer.fit(module, _loader(0, batches=40))
    # two batches of 8 per step; the loop stopped when more_steps said so, not at max_steps
    assert made[0].calls == [("step", 16)] * 3 + [("finish", 7.0), ("close",)]
    assert strategy.finished is True and strategy.local_steps == 3
    assert not all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # the wrapped one stepped


def test_the_strategy_refuses_a_module_with_two_optimizers():
    class Two(Tiny):
        automatic_optimization = False  # Lightning itself refuses two optimizers otherwise

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    trainer = pl.Trainer(strategy=SwarmStrategy(lambda opt: Recorder(opt, 1)), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    with pytest.raises(Exception, match="one optimizer"):
        trainer.fit(Two(), _loader(0, batches=2))


def test_two_diloco_trainers_end_fit_with_one_outer_state():
    def diloco(swarm: Swarm) -> Callable[[torch.optim.Optimizer], SwarmOptimizer]:
        return lambda opt: DiLoCoOptimizer(opt, swarm, run_id="lightning-diloco", inner_steps=5,
                                           batch_size_per_step=BATCH, start_with=2, start_timeout=TIMEOUT)

    pair = _fit_pair(diloco, max_steps=20)
    opts = [strategy.swarm_optimizer for strategy, _ in pair]
    assert all(isinstance(opt, DiLoCoOptimizer) for opt in opts)
    assert [strategy.finished for strategy, _ in pair] == [True, True]
    assert opts[0].hash == opts[1].hash
    for strategy, _ in pair:
        stats = strategy.swarm_optimizer.stats()
        assert stats["outer_step"] > 0, stats
        assert stats["group_sizes"].get(2, 0) > 0, stats  # averaged with the other trainer
        assert stats["local_steps"] == strategy.local_steps <= 20
    # the modules end on the agreed outer parameters, so they hold one model
    assert state_digest([p.detach() for p in pair[0][1].parameters()]) == state_digest(
        [p.detach() for p in pair[1][1].parameters()])


def test_two_collaborative_trainers_average_their_epoch_and_hold_one_model():
    ready = threading.Barrier(2, timeout=TIMEOUT)  # both joined before either takes a step

    class Together(pl.Callback):
        """Start together; stop once the first epoch of the swarm ended (a collaborative run's length is the
        swarm's samples, not this trainer's steps)."""

        def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
            ready.wait()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.strategy.swarm_optimizer.epoch >= 1:
                trainer.should_stop = True

    def collaborative(swarm: Swarm) -> Callable[[torch.optim.Optimizer], SwarmOptimizer]:
        return lambda opt: CollaborativeOptimizer(opt, swarm, "lightning-collab", target_batch_size=16 * BATCH,
                                                  batch_size_per_step=BATCH, matchmaking_time=5.0)

    pair = _fit_pair(collaborative, max_steps=200, sgd=True, callbacks=lambda: [Together()])
    for strategy, _ in pair:
        stats = strategy.swarm_optimizer.stats()
        assert stats["epoch"] == 1, stats
        assert stats["group_sizes"] == {2: 1}, stats
        assert strategy.finished is True
    # one averaged gradient applied by SGD to the same start: the same parameters, byte for byte
    assert state_digest([p.detach() for p in pair[0][1].parameters()]) == state_digest(
        [p.detach() for p in pair[1][1].parameters()])


@pytest.mark.slow
def test_the_how_to_example_ends_with_one_hash_on_both_trainers(tmp_path):
    """docs/how-to/lightning.md's example, saved as a script and run as two processes (the convention of
    tests/peer/test_docs_examples.py)."""
    source = examples(PAGE).get("lightning")
    assert source, "the page lost its example"
    outputs = two_trainers(source, tmp_path)
    ends = [re.search(r"outer step (\d+) hash (\S+)", output) for output in outputs]
    assert all(ends), outputs
    assert ends[0].group(2) == ends[1].group(2), outputs
    assert all(int(end.group(1)) > 0 for end in ends), outputs
