"""Steps in flight (moe.pipeline.StepsInFlight): with depth 1 the trainer equals the ordinary synchronous loop
(same losses, same parameters); with depth D every update is applied to parameters at most D - 1 updates newer
than those its gradient was computed on, each step sees its own parameter snapshot, and a failed step applies
nothing while the others go on."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from moe.pipeline import StepsInFlight
from tests.moe.two_layer_grid import HIDDEN, static_model, two_servers


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _model_and_data(harness):
    _, locations = two_servers(harness, lr=0.0)  # experts that do not change: both runs see the same ones
    swarm = harness.client()
    torch.manual_seed(0)
    model = nn.Sequential(static_model(swarm, locations, k_best=3), nn.Linear(HIDDEN, 2))
    batches = [(torch.randn(6, HIDDEN), torch.randn(6, 2)) for _ in range(4)]
    return model, batches


def test_depth_one_equals_the_synchronous_loop(harness):
    model, batches = _model_and_data(harness)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        optimizer.step()
        expected.append(float(loss.detach()))
    want = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)
    trainer = StepsInFlight(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, depth=1)
    for x, y in batches:
        trainer.submit(x, y)
    results = trainer.drain()
    assert [r.index for r in results] == [0, 1, 2, 3] and all(r.staleness == 0 for r in results)
    assert [r.loss for r in results] == pytest.approx(expected, rel=1e-6)
    for got, wanted in zip(model.parameters(), want):
        torch.testing.assert_close(got.detach(), wanted, atol=1e-6, rtol=1e-5)


def test_staleness_is_bounded_by_the_depth_and_each_step_sees_its_snapshot(harness):
    model, batches = _model_and_data(harness)
    depth = 3
    head = model[1]
    release = threading.Event()
    seen: list[torch.Tensor] = []  # the head's weights as each step's forward saw them, in order
    entered = threading.Semaphore(0)

    class Gate(nn.Module):
        """Holds each step inside its forward until `depth` steps are in flight."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(head.weight.detach().clone())
            entered.release()
            release.wait(30)
            return x

    gated = nn.Sequential(Gate(), model)
    trainer = StepsInFlight(gated, torch.optim.SGD(gated.parameters(), lr=0.5), _loss, depth=depth)
    for x, y in batches[:depth]:
        trainer.submit(x, y)
    for _ in range(depth):
        assert entered.acquire(timeout=30)
    release.set()
    for x, y in batches * 2:
        trainer.submit(x, y)
    results = trainer.drain()
    assert [r.index for r in results] == list(range(depth + 8))
    assert all(r.error is None for r in results)
    assert max(r.staleness for r in results) == depth - 1 == trainer.max_staleness
    assert all(r.staleness <= depth - 1 for r in results)
    first = seen[:depth]  # the first steps all started from the same parameters, though two updates came since
    for snapshot in first[1:]:
        torch.testing.assert_close(snapshot, first[0], atol=0, rtol=0)
    assert not torch.equal(head.weight.detach(), first[0])


def test_a_failed_step_applies_nothing_and_the_others_go_on():
    model = nn.Linear(3, 1)
    calls = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("not enough experts")
        return _loss(out, target)

    trainer = StepsInFlight(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, depth=1)
    for _ in range(3):
        trainer.submit(torch.randn(4, 3), torch.randn(4, 1))
    results = trainer.drain()
    assert [r.error is not None for r in results] == [False, True, False]
    assert results[1].loss is None and "not enough" in str(results[1].error)
    with pytest.raises(ValueError):
        StepsInFlight(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, depth=0)


def test_compute_and_apply_replace_the_loss_and_the_optimizer_and_drain_can_drop_updates():
    """`compute=` runs the model itself and returns a metric beside the loss (as `peer train`'s tasks do);
    `apply=` is handed each step's batch size with the gradients in `.grad` (a swarm optimizer's step);
    `drain(apply=False)` ends a loop on an exact update: the steps still in flight apply nothing."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    applied: list[int] = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hold = threading.Event()

    def compute(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        if len(x) == 5:  # the last step: still in flight when the loop drains without applying
            hold.wait(30)
        return _loss(model(x), y), float(len(x))

    def apply(batch: int) -> None:
        assert all(p.grad is not None for p in model.parameters())
        applied.append(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    trainer = StepsInFlight(model, None, None, depth=2, compute=compute, apply=apply)
    for size in (2, 3, 4):
        trainer.submit(torch.randn(size, 3), torch.randn(size, 1))
    done = trainer.drain()
    assert [(r.samples, r.metric, r.applied) for r in done] == [(2, 2.0, True), (3, 3.0, True), (4, 4.0, True)]
    assert applied == [2, 3, 4] and trainer.finished() == []
    before = [p.detach().clone() for p in model.parameters()]
    trainer.submit(torch.randn(5, 3), torch.randn(5, 1))
    assert trainer.in_flight == 1
    def release_once_dropping() -> None:  # the held step may finish only after drain(apply=False) has begun
        while not trainer._dropping:
            threading.Event().wait(0.001)
        hold.set()

    releaser = threading.Thread(target=release_once_dropping)
    releaser.start()
    dropped = trainer.drain(apply=False)
    releaser.join(30)
    assert [(r.samples, r.applied, r.error) for r in dropped] == [(5, False, None)] and applied == [2, 3, 4]
    for got, want in zip(model.parameters(), before):
        assert torch.equal(got.detach(), want)
    assert trainer.in_flight == 0
    with pytest.raises(ValueError):
        StepsInFlight(model, optimizer, None, compute=compute, apply=apply)
    with pytest.raises(ValueError):
        StepsInFlight(model, None, _loss, compute=compute, apply=apply)


def test_a_step_finished_but_not_handed_out_is_still_in_flight():
    """A loop that runs `while done + in_flight < steps` must submit exactly `steps`: a step that finished between
    its reads of the results and of `in_flight` is counted by one of them (`peer train --steps 4` once ran 5)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    trainer = StepsInFlight(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, depth=2)
    trainer.submit(torch.randn(2, 3), torch.randn(2, 1))
    for thread in list(trainer._threads):  # the step is applied, its result not handed out
        thread.join(30)
    assert trainer.in_flight == 1
    assert [r.index for r in trainer.finished()] == [0] and trainer.in_flight == 0

    done, submitted = 0, 0
    while done + trainer.in_flight < 7:
        trainer.submit(torch.randn(2, 3), torch.randn(2, 1))
        submitted += 1
        done += len(trainer.finished())
    done += len(trainer.drain())
    assert submitted == done == 7
