"""`run_periodic`: the one way a peer runs background work every so many seconds.

Why one helper: declaring experts, keeping a directory entry, publishing progress, averaging replicas all run
"do one round, survive its failure, wait, again". Written by hand each time, the loops differed in what they got
wrong: one logged every failed round (a dead DHT filled the log), one logged nothing, none backed off, none
could be woken early. Here, once:
- a step runs every `interval` seconds (or, with `step_plans=True`, after the delay the step itself returns, for
  work that plans its own schedule), optionally spread by a random `jitter` so that peers started together do
  not act in lockstep;
- a step that raises is a failed round, not a dead task: each kind of failure (its exception type) is logged
  once, as a warning naming the operation; repeats go to debug level and to the `on_failure` callback
  (counters), so a broken DHT costs one line, not one line per round;
- consecutive failures back off: the retry waits `retry` seconds (default: the interval), doubling with each
  further failure up to `max_retry`; a success resets it. Work whose result expires (a declaration with a TTL)
  passes a short `retry` and a `max_retry` no longer than its interval, so a failed round is retried sooner,
  never later;
- `wake` returns an event that ends the current wait early (new work arrived); it is called before each wait,
  so it may hand out a fresh event every time;
- cancellation is the only way to stop it: the task lives in its owner's nursery and ends with it.

Nothing here knows what a step does: the DHT node's maintenance, which returns its own next delay and counts its
failures in its stats, fits the same signature (`step_plans=True`, `on_failure`, `wake`, `traceback`).
"""

from __future__ import annotations

import logging
import math
import random
from typing import Awaitable, Callable, NoReturn

import trio

logger = logging.getLogger(__name__)

Step = Callable[[], Awaitable[object]]


def next_delay(interval: float, failures: int, *, retry: float, max_retry: float) -> float:
    """Seconds to wait after a round: `interval` after a success (`failures == 0`), else the backoff for that many
    consecutive failures: `retry * 2**(failures - 1)`, at most `max_retry`."""
    if failures <= 0:
        return interval
    return min(max_retry, retry * 2.0 ** min(failures - 1, 64))


def jittered(delay: float, jitter: float, rng: random.Random | None) -> float:
    """`delay` spread uniformly over +-`jitter` of itself (no spread without an rng or with jitter 0)."""
    if rng is None or jitter <= 0 or not math.isfinite(delay):
        return delay
    return max(0.0, delay * (1.0 + jitter * (2.0 * rng.random() - 1.0)))


async def run_periodic(
    step: Step,
    interval: float,
    *,
    name: str,
    first_delay: float = 0.0,
    step_plans: bool = False,
    retry: float | None = None,
    max_retry: float | None = None,
    jitter: float = 0.0,
    rng: random.Random | None = None,
    wake: Callable[[], trio.Event] | None = None,
    on_failure: Callable[[Exception], None] | None = None,
    log: logging.Logger | None = None,
    traceback: bool = False,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Run `step` until cancelled (see the module docstring).

    The next round comes `interval` seconds after a successful one, or, with `step_plans`, as many seconds as
    the step returned (None: `interval`); otherwise what the step returns is ignored. The first round
    runs after `first_delay` seconds; `task_status.started()` comes after that first round when it runs at once
    (`first_delay == 0`, so the owner knows it happened once), else at the start. `name` says in the log what
    failed ("declaring 4 experts"); `log` is the owner's logger; `traceback=True` logs the first failure of
    each kind with its traceback (for steps where any exception is a bug)."""
    if not interval > 0:
        raise ValueError(f"the interval of {name} must be positive, got {interval!r}")
    if jitter and rng is None:
        raise ValueError(f"jitter for {name} needs an rng (seeded in simulations)")
    retry = interval if retry is None else retry
    max_retry = max(retry, interval) if max_retry is None else max_retry
    log = log or logger
    logged: set[type[BaseException]] = set()
    failures = 0
    delay = first_delay
    started = False
    if first_delay > 0:
        task_status.started()
        started = True
    while True:
        if delay > 0 or started:
            with trio.move_on_after(delay):
                if wake is None:
                    await trio.sleep_forever()
                else:
                    await wake().wait()
        try:
            planned = await step()
        except Exception as error:  # Cancelled is a BaseException and passes through: it is how this ends
            failures += 1
            if on_failure is not None:
                on_failure(error)
            if type(error) not in logged:
                logged.add(type(error))
                log.warning("%s failed (%s: %s); retrying, and later failures of this kind are logged at debug "
                            "level", name, type(error).__name__, error, exc_info=error if traceback else None)
            else:
                log.debug("%s failed again (%d in a row): %s: %s", name, failures, type(error).__name__, error)
            delay = next_delay(interval, failures, retry=retry, max_retry=max_retry)
        else:
            if failures:
                log.debug("%s succeeded again after %d failed rounds", name, failures)
            failures = 0
            if step_plans and planned is not None:
                if not isinstance(planned, (int, float)):
                    raise TypeError(f"the step of {name} must return its next delay in seconds, got {planned!r}")
                delay = max(0.0, float(planned))
            else:
                delay = interval
        delay = jittered(delay, jitter, rng)
        if not started:
            task_status.started()
            started = True


__all__ = ["Step", "jittered", "next_delay", "run_periodic"]
