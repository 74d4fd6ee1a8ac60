"""`owned_nursery()`: the nursery an object keeps its background tasks in, wrapped around its users' code.

Why one helper: every long-lived object (the RPC node, the DHT node) is used as `async with Thing.open() as
thing: ...` and owns a nursery for its tasks. Three things must hold for all of them, and are easy to get
subtly wrong one by one:
- when the body ends, for whatever reason, the background tasks are cancelled (cancellation is the only
  shutdown path);
- an error raised by the body comes out as itself, not wrapped in an ExceptionGroup by the nursery;
- an error raised by the body while the surrounding scope is being cancelled (a daemon whose final checkpoint
  fails during SIGTERM's cancellation) is not replaced by the nursery's own `Cancelled` on the way out.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio


def _only_cancellations(error: BaseException) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return all(_only_cancellations(inner) for inner in error.exceptions)
    return isinstance(error, trio.Cancelled)


@asynccontextmanager
async def owned_nursery() -> AsyncIterator[trio.Nursery]:
    """Yield a nursery for background tasks; cancel them when the body ends; re-raise the body's error."""
    failure: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                yield nursery
            except BaseException as error:  # re-raised below, outside the nursery: no ExceptionGroup wrapping
                failure = error
            finally:
                nursery.cancel_scope.cancel()
    except BaseException as exit_error:
        if failure is not None and not _only_cancellations(failure) and _only_cancellations(exit_error):
            raise failure from None  # the body's error matters more than the cancellation unwinding around it
        raise
    if failure is not None:
        raise failure
