"""Taking the training code's tensor lock from trio.

Training loops are ordinary threads (through `peer.p2p.bridge`), the averager is trio: the lock they share must be a
`threading.Lock` (training writes `with lock:`). Trio code takes it with `async with hold(lock)`, which never blocks
the event loop: an uncontended lock is taken at once, a contended one is waited for in a worker thread. A plain
`threading.Lock` (not an RLock) is required because the worker thread that acquires it is not the thread that
releases it. Pure-trio users may pass a `trio.Lock` instead, or None when nothing else touches the tensors.

Averaging code holds the lock only for short copies (writing one averaged part back, taking one snapshot), never
across network transfers, so training and state downloads are not stalled by a slow round (hivemind issue #445).
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager
from typing import AsyncIterator, Union

import trio

TensorLock = Union[threading.Lock, trio.Lock, None]

_THREAD_LOCK_TYPE = type(threading.Lock())


def check_lock(lock: object) -> None:
    """Refuse lock types `hold` cannot use correctly (an RLock would be released by the wrong thread)."""
    if lock is None or isinstance(lock, (trio.Lock, _THREAD_LOCK_TYPE)):
        return
    raise TypeError(f"the tensor lock must be a threading.Lock, a trio.Lock or None, not {type(lock).__name__}")


@asynccontextmanager
async def hold(lock: TensorLock) -> AsyncIterator[None]:
    check_lock(lock)
    if lock is None:
        await trio.lowlevel.checkpoint()
        yield
        return
    if isinstance(lock, trio.Lock):
        async with lock:
            yield
        return
    if not lock.acquire(blocking=False):
        # Cancellation is deferred until the worker has the lock, so the lock is always released below.
        await trio.to_thread.run_sync(lock.acquire)
    try:
        yield
    finally:
        lock.release()
