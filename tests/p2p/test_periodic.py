"""peer.p2p.periodic.run_periodic: the one periodic-task runner (schedule, failures, backoff, wake, jitter)."""

from __future__ import annotations

import logging
import random

import pytest
import trio
import trio.testing

from peer.p2p.periodic import jittered, next_delay, run_periodic


class Flaky:
    """A step that plays `outcomes` in turn (raise an error, or return a planned delay), and records when it ran."""

    def __init__(self, outcomes: list[BaseException | float | None]):
        self.outcomes = list(outcomes)
        self.times: list[float] = []

    async def __call__(self) -> float | None:
        self.times.append(trio.current_time())
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


async def run_for(seconds: float, step, interval: float, **kwargs) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_periodic(step, interval, task_status=task_status, **kwargs))
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()


async def test_runs_at_once_then_every_interval(autojump_clock):
    step = Flaky([])
    start = trio.current_time()
    await run_for(35, step, 10.0, name="test round")
    assert [t - start for t in step.times] == [0, 10, 20, 30]


async def test_started_comes_after_the_first_round(autojump_clock):
    step = Flaky([])
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_periodic(step, 10.0, name="x", task_status=task_status))
        assert len(step.times) == 1
        nursery.cancel_scope.cancel()


async def test_first_delay_waits_before_the_first_round(autojump_clock):
    step = Flaky([])
    start = trio.current_time()
    await run_for(26, step, 10.0, name="x", first_delay=5.0)
    assert [t - start for t in step.times] == [5, 15, 25]


async def test_step_may_plan_its_own_next_delay(autojump_clock):
    step = Flaky([3.0, 1.0, None])
    start = trio.current_time()
    await run_for(20, step, 10.0, name="x", step_plans=True)
    assert [t - start for t in step.times] == [0, 3, 4, 14]


async def test_what_a_step_returns_is_ignored_unless_it_plans(autojump_clock):
    step = Flaky([3.0, 1.0])
    start = trio.current_time()
    await run_for(25, step, 10.0, name="x")
    assert [t - start for t in step.times] == [0, 10, 20]


async def test_failures_back_off_up_to_the_cap_and_reset_on_success(autojump_clock):
    step = Flaky([OSError("down")] * 5 + [None, OSError("down")])
    failures: list[Exception] = []
    start = trio.current_time()
    await run_for(40, step, 10.0, name="x", retry=1.0, max_retry=4.0, on_failure=failures.append)
    gaps = [b - a for a, b in zip(step.times, step.times[1:])]
    # failures at 0, 1, 3, 7, 11 (waits 1, 2, 4, 4 capped), success at 15, next round 25 fails, retried after 1
    assert [t - start for t in step.times[:8]] == [0, 1, 3, 7, 11, 15, 25, 26]
    assert gaps[:5] == [1, 2, 4, 4, 4]
    assert len(failures) == 6 and all(isinstance(f, OSError) for f in failures)


async def test_each_kind_of_failure_is_logged_once_naming_the_operation(autojump_clock, caplog):
    step = Flaky([OSError("down"), OSError("down"), KeyError("k"), OSError("down"), KeyError("k")])
    with caplog.at_level(logging.DEBUG, logger="peer.p2p.periodic"):
        await run_for(60, step, 10.0, name="declaring 3 experts")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all("declaring 3 experts" in r.getMessage() for r in warnings)
    assert {"OSError", "KeyError"} == {r.getMessage().split("(")[1].split(":")[0] for r in warnings}
    assert sum("failed again" in r.getMessage() for r in caplog.records) == 3


async def test_wake_runs_the_next_round_early(autojump_clock):
    step = Flaky([])
    events: list[trio.Event] = []

    def wake() -> trio.Event:
        events.append(trio.Event())
        return events[-1]

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_periodic(step, 10.0, name="x", wake=wake,
                                                             task_status=task_status))
        await trio.sleep(2)
        events[-1].set()
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert [t - start for t in step.times] == [0, 2]


async def test_cancellation_is_not_a_failure(autojump_clock):
    failures: list[Exception] = []

    async def slow() -> None:
        await trio.sleep(100)

    await run_for(5, slow, 1.0, name="x", on_failure=failures.append)
    assert failures == []


async def test_jitter_spreads_rounds_reproducibly(autojump_clock):
    runs = []
    for _ in range(2):
        step = Flaky([])
        start = trio.current_time()
        await run_for(100, step, 10.0, name="x", jitter=0.2, rng=random.Random(5))
        runs.append([t - start for t in step.times])
    assert runs[0] == pytest.approx(runs[1])
    gaps = [b - a for a, b in zip(runs[0], runs[0][1:])]
    assert all(8.0 <= gap <= 12.0 for gap in gaps) and len(set(gaps)) > 1


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="rng"):
        trio.run(lambda: run_periodic(Flaky([]), 1.0, name="x", jitter=0.1))
    with pytest.raises(ValueError, match="positive"):
        trio.run(lambda: run_periodic(Flaky([]), 0.0, name="x"))


def test_delay_helpers():
    assert next_delay(10.0, 0, retry=1.0, max_retry=8.0) == 10.0
    assert [next_delay(10.0, n, retry=1.0, max_retry=8.0) for n in range(1, 6)] == [1, 2, 4, 8, 8]
    assert next_delay(10.0, 10_000, retry=1.0, max_retry=8.0) == 8.0
    assert jittered(10.0, 0.5, None) == 10.0
    assert 5.0 <= jittered(10.0, 0.5, random.Random(1)) <= 15.0
