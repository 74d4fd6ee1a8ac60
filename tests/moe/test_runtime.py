"""The runtime batches queued requests per expert and keeps each caller's results and errors separate."""

import copy
import math
import threading

import pytest
import torch
import trio
import trio.testing
from torch import nn

from moe.experts import ExpertKind, OptimizerConfig, make_expert, register_expert_kind
from moe.runtime import ExpertComputeError, ExpertRuntime, RuntimeNotRunning
from moe.schema import TensorSpec


class Recorder(nn.Module):
    """Linear layer that records the batch sizes it sees and fails on a marker value."""

    def __init__(self, hidden_dim):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.batch_sizes = []

    def forward(self, x):
        self.batch_sizes.append(x.shape[0])
        if bool((x == 1234.0).any()):
            raise RuntimeError("marker value")
        return self.linear(x)


register_expert_kind(
    ExpertKind("test_recorder", lambda h, **o: Recorder(h), lambda h, **o: [TensorSpec((h,))]), replace=True
)


async def _gather(*fns):
    results = [None] * len(fns)

    async def run(i, fn):
        try:
            results[i] = await fn()
        except Exception as error:  # collected so the test can assert per-caller outcomes
            results[i] = error

    async with trio.open_nursery() as nursery:
        for i, fn in enumerate(fns):
            nursery.start_soon(run, i, fn)
    return results


@pytest.mark.parametrize("inline_threshold", [0.0, math.inf])
async def test_concurrent_requests_are_batched_and_split_back(inline_threshold):
    expert = make_expert("rec.0", "test_recorder", 8, seed=0)
    runtime = ExpertRuntime({"rec.0": expert}, min_batch_size=6, batch_timeout=60, inline_threshold=inline_threshold)
    xs = [torch.randn(n, 8) for n in (1, 2, 3)]
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        outs = await _gather(*[lambda x=x: runtime.forward("rec.0", [x]) for x in xs])
        nursery.cancel_scope.cancel()
    assert expert.module.batch_sizes[-1] == 6  # one batch for all three callers
    for x, (y,) in zip(xs, outs):
        torch.testing.assert_close(y, expert.module.linear(x).detach())
    stats = runtime.stats()
    assert stats["requests"] == 3 and stats["batches"] == 1 and stats["samples"] == 6


async def test_max_batch_size_splits_queue_oldest_first():
    expert = make_expert("rec.1", "test_recorder", 4, seed=0)
    runtime = ExpertRuntime({"rec.1": expert}, max_batch_size=5, min_batch_size=5, batch_timeout=60)
    order = []

    async def call(n):
        await runtime.forward("rec.1", [torch.full((n, 4), float(n))])
        order.append(n)

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        async with trio.open_nursery() as callers:
            for n in (3, 2, 4, 1):  # queued in this order; 3+2 fill the first batch, then 4+1
                callers.start_soon(call, n)
                await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert expert.module.batch_sizes == [2, 5, 5]  # the dry run of make_expert saw 2 rows
    assert sorted(order[:2]) == [2, 3] and sorted(order[2:]) == [1, 4]


async def test_backward_batches_apply_one_optimizer_step_like_local_training():
    expert = make_expert("ffn.1", "ffn", 8, seed=3, optimizer=OptimizerConfig("sgd", lr=0.1))
    local = copy.deepcopy(expert.module)
    runtime = ExpertRuntime({"ffn.1": expert}, min_batch_size=5, batch_timeout=60)
    xs = [torch.randn(2, 8), torch.randn(3, 8)]
    gs = [torch.randn(2, 8), torch.randn(3, 8)]
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        grads = await _gather(*[lambda x=x, g=g: runtime.backward("ffn.1", [x], [g]) for x, g in zip(xs, gs)])
        nursery.cancel_scope.cancel()
    x = torch.cat(xs).requires_grad_()
    local(x).backward(torch.cat(gs))
    torch.testing.assert_close(torch.cat([g for (g,) in grads]), x.grad)
    with torch.no_grad():
        for p in local.parameters():
            p -= 0.1 * p.grad
    assert expert.steps == 1
    for p_remote, p_local in zip(expert.module.parameters(), local.parameters()):
        torch.testing.assert_close(p_remote, p_local)


async def test_a_failing_batch_fails_its_callers_and_the_runtime_keeps_serving():
    expert = make_expert("rec.2", "test_recorder", 4, seed=0)
    runtime = ExpertRuntime({"rec.2": expert}, min_batch_size=2, batch_timeout=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        bad, also_in_batch = await _gather(
            lambda: runtime.forward("rec.2", [torch.full((1, 4), 1234.0)]),
            lambda: runtime.forward("rec.2", [torch.zeros(1, 4)]),
        )
        assert isinstance(bad, ExpertComputeError) and "marker value" in str(bad)
        assert isinstance(also_in_batch, ExpertComputeError)
        (y,) = await runtime.forward("rec.2", [torch.zeros(2, 4)])
        assert y.shape == (2, 4)
        nursery.cancel_scope.cancel()
    assert runtime.stats()["failures"] == 1


async def test_cancelled_caller_is_dropped_before_its_batch_runs():
    expert = make_expert("rec.3", "test_recorder", 4, seed=0)
    runtime = ExpertRuntime({"rec.3": expert}, min_batch_size=3, batch_timeout=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        with trio.move_on_after(0.05):
            await runtime.forward("rec.3", [torch.zeros(2, 4)])  # waits for min_batch_size, then gives up
        (y,) = await runtime.forward("rec.3", [torch.zeros(3, 4)])
        nursery.cancel_scope.cancel()
    assert expert.module.batch_sizes[1:] == [3]  # the abandoned 2 rows never ran


async def test_stopping_the_runtime_fails_queued_requests_and_rejects_new_ones():
    expert = make_expert("rec.4", "test_recorder", 4, seed=0)
    runtime = ExpertRuntime({"rec.4": expert}, min_batch_size=10, batch_timeout=60)
    outcome = []

    async def caller():
        try:
            await runtime.forward("rec.4", [torch.zeros(1, 4)])
        except RuntimeNotRunning:
            outcome.append("stopped")

    async with trio.open_nursery() as outer:
        outer.start_soon(caller)
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            outer.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert outcome == ["stopped", "stopped"]  # one arrived before run, one was queued at shutdown


async def test_exclusive_does_not_overlap_batches():
    expert = make_expert("ffn.2", "ffn", 4, seed=0)
    runtime = ExpertRuntime({"ffn.2": expert}, inline_threshold=0.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        state, _ = await _gather(
            lambda: runtime.exclusive("ffn.2", lambda e: e.state_dict()),
            lambda: runtime.backward("ffn.2", [torch.ones(1, 4)], [torch.ones(1, 4)]),
        )
        nursery.cancel_scope.cancel()
    assert state["steps"] in (0, 1) and expert.steps == 1


async def test_inline_runs_after_measuring_a_cheap_expert():
    expert = make_expert("ffn.3", "ffn", 8, seed=0)
    runtime = ExpertRuntime({"ffn.3": expert}, inline_threshold=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        for _ in range(3):
            await runtime.forward("ffn.3", [torch.ones(1, 8)])
        nursery.cancel_scope.cancel()
    # the first batch has no estimate yet and runs in a thread; the rest are cheap enough to run inline
    assert runtime.stats()["per_expert"]["ffn.3"]["inline_batches"] == 2


async def test_a_full_batch_is_not_held_back_by_an_older_one_that_cannot_fill(autojump_clock):
    expert = make_expert("ffn.4", "ffn", 4, seed=0)
    runtime = ExpertRuntime({"ffn.4": expert}, min_batch_size=4, batch_timeout=10.0, inline_threshold=math.inf)
    finished = {}

    async def call(name, coroutine):
        await coroutine
        finished[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        start = trio.current_time()
        async with trio.open_nursery() as callers:
            callers.start_soon(call, "backward", runtime.backward("ffn.4", [torch.ones(1, 4)], [torch.ones(1, 4)]))
            await trio.sleep(1.0)
            callers.start_soon(call, "forward", runtime.forward("ffn.4", [torch.ones(4, 4)]))
        nursery.cancel_scope.cancel()
    assert finished["forward"] - start == pytest.approx(1.0)  # full: served at once, although younger
    assert finished["backward"] - start == pytest.approx(10.0)  # alone: served when its batch_timeout expired


async def test_a_batched_call_frees_its_direct_experts_before_its_queued_ones_are_served():
    """`run_many` computes idle experts at once under their locks and queues the busy ones. Held until the queued
    ones were served, those locks deadlocked two calls that each took one expert directly and queued for the
    other's: a daemon of test_train's dead-daemon scenario served nothing until its callers' 5 s timeouts. Here
    e1 is computed directly while e2 is busy (an exclusive section that waits for the test): another caller of
    e1 must be served meanwhile."""
    experts = {uid: make_expert(uid, "ffn", 4, seed=i) for i, uid in enumerate(("e1", "e2"))}
    runtime = ExpertRuntime(experts, inline_threshold=math.inf)
    busy, release = threading.Event(), threading.Event()

    def hold(expert):
        busy.set()
        release.wait(30)

    x = torch.randn(2, 4)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        nursery.start_soon(runtime.exclusive, "e2", hold)
        await trio.to_thread.run_sync(busy.wait, 30)
        batched, batched_done = [], trio.Event()

        async def call_both():
            batched.extend(await runtime.run_many("forward", [("e1", [x]), ("e2", [x])]))
            batched_done.set()

        nursery.start_soon(call_both)
        await trio.testing.wait_all_tasks_blocked()  # it computed e1 and waits for e2
        try:
            with trio.fail_after(10):  # a deadlock waits for the exclusive section, i.e. forever here
                (alone,) = await runtime.forward("e1", [x])
            assert not batched  # the batched call still waits for e2
        finally:
            release.set()
        with trio.fail_after(10):
            await batched_done.wait()
        nursery.cancel_scope.cancel()
    torch.testing.assert_close(alone, experts["e1"].module(x).detach())
    torch.testing.assert_close(batched[0][0], alone)
    torch.testing.assert_close(batched[1][0], experts["e2"].module(x).detach())
