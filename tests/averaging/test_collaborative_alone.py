"""Nothing silent (issue 38): two collaborative trainers of one run with different models each log ONE line
naming the difference (matchmaking asks the other for its schema), never group, and after `warn_after_epochs`
epochs without averaging each logs one warning giving that reason; a trainer's throughput is published whatever
loop drives it (tests/averaging/test_progress.py has the DiLoCo-style direct count)."""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from averaging.collaborative import CollaborativeOptimizer
from averaging.schema import MISMATCHES
from peer.client import Swarm


def test_mismatched_models_are_named_once_and_warned_about(bootstrap, caplog):
    caplog.set_level(logging.WARNING)
    MISMATCHES.seen.clear()
    errors: list[BaseException] = []
    stats: dict[int, dict] = {}
    ready = threading.Barrier(2, timeout=60)
    # both stay in the run until both are done: on busy cores one side reached epoch 4 and left while the other was
    # at its second epoch, which then saw no other live trainer and rightly had nothing to warn about
    done = threading.Barrier(2, timeout=120)

    def train(index: int, width: int) -> None:
        try:
            with Swarm([bootstrap]) as swarm:
                model = nn.Linear(4, width)
                opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, "mismatch",
                                             target_batch_size=64, batch_size_per_step=8, matchmaking_time=1.0,
                                             warn_after_epochs=2)
                ready.wait()
                x = torch.randn(8, 4)
                while opt.epoch < 4:
                    model(x).pow(2).mean().backward()
                    opt.step()
                stats[index] = opt.stats()
                done.wait()
                opt.close()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=train, args=(i, w)) for i, w in enumerate((1, 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    named = [r.getMessage() for r in caplog.records if "not averaging with it" in r.getMessage()]
    assert len(named) == 2, named  # one line per side, not one per round
    assert all("shape [" in line and "there" in line and "here" in line for line in named), named
    assert {s["averaging_rounds"] for s in stats.values()} == {0}
    warned = [r.getMessage() for r in caplog.records if "not averaged for" in r.getMessage()]
    assert len(warned) == 2 and all("different model" in line for line in warned), warned
    assert MISMATCHES.summary() is not None
    MISMATCHES.seen.clear()
