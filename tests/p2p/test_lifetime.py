"""owned_nursery: the body's error comes out as itself, also while the surrounding scope is being cancelled."""

import pytest
import trio
import trio.testing

from peer.p2p.lifetime import owned_nursery


class CheckpointLost(Exception):
    pass


async def test_body_error_is_not_wrapped_and_background_tasks_are_cancelled():
    cancelled = trio.Event()

    async def background() -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    with pytest.raises(CheckpointLost):
        async with owned_nursery() as nursery:
            nursery.start_soon(background)
            await trio.testing.wait_all_tasks_blocked()
            raise CheckpointLost("x")
    assert cancelled.is_set()


async def test_body_error_during_outer_cancellation_is_not_replaced_by_cancelled():
    """What a SIGTERMed daemon does: the outer scope is cancelled, and the final checkpoint (in the body's
    cleanup) fails; the failure must reach whoever ran the daemon."""
    with pytest.raises(CheckpointLost):
        with trio.CancelScope() as scope:
            async with owned_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)  # a background task: its Cancelled ends the nursery
                try:
                    scope.cancel()
                    await trio.sleep_forever()
                finally:
                    raise CheckpointLost("final checkpoint failed")


async def test_plain_cancellation_still_unwinds():
    with trio.move_on_after(0.01) as scope:
        async with owned_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await trio.sleep_forever()
    assert scope.cancelled_caught
