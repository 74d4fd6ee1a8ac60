import threading

import pytest
import trio
import trio.testing

from averaging.locking import check_lock, hold


async def test_a_lock_held_by_a_training_thread_is_awaited_without_blocking_trio():
    lock = threading.Lock()
    holding = threading.Event()
    release = threading.Event()

    def training_step():
        with lock:
            holding.set()
            release.wait()

    order = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, training_step)
        await trio.to_thread.run_sync(holding.wait)

        async def averager_write():
            async with hold(lock):
                order.append("averager wrote")

        nursery.start_soon(averager_write)
        await trio.testing.wait_all_tasks_blocked()
        order.append("trio still runs")  # the event loop is not blocked by the contended lock
        release.set()
    assert order == ["trio still runs", "averager wrote"]
    assert not lock.locked()


async def test_uncontended_and_trio_locks_and_none():
    lock = threading.Lock()
    async with hold(lock):
        assert lock.locked()
    assert not lock.locked()
    trio_lock = trio.Lock()
    async with hold(trio_lock):
        assert trio_lock.locked()
    async with hold(None):
        pass


def test_reentrant_locks_are_refused():
    with pytest.raises(TypeError):
        check_lock(threading.RLock())
