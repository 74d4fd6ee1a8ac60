"""`unless`: await a piece of work, or give it up as soon as a polled condition holds.

Why polled: the conditions DiLoCo gives work up on have no event to wait on. A stop request (SIGINT) is a flag
set by a signal handler in another thread, which cannot set a `trio.Event`; "every other trainer finished" is
read from progress records that the tracker refreshes in the background. Both are checked every `every` seconds
in a task beside the work, in a nursery this call owns, so giving up is a cancellation (nothing outlives it).
The rounds' client uses it too, for an offer's first call (at most an acknowledgement timeout): a coordinator's
opening elsewhere is a dict entry, and a look every 50 ms costs less than an event kept beside it."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, TypeVar

import trio

T = TypeVar("T")
D = TypeVar("D")

__all__ = ["unless"]


async def unless(condition: Callable[[], bool], every: float, default: D,
                 work: Callable[..., Awaitable[T]], *args: Any) -> T | D:
    """`await work(*args)`, cancelled within `every` seconds of `condition()` holding (then `default`). An error
    of the work is raised as itself, not in the nursery's exception group, so callers catch it by its type (a
    final agreement's `NotAgreed`, for one, reached `peer train` wrapped and printed a traceback)."""
    outcome: T | D = default
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            while not condition():  # noqa: ASYNC110  # polled: see the module doc
                await trio.sleep(every)
            nursery.cancel_scope.cancel()

        async def run_work() -> None:
            nonlocal outcome, failure
            try:
                outcome = await work(*args)
            except Exception as error:
                failure = error
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        nursery.start_soon(run_work)
    if failure is not None:
        raise failure
    return outcome
