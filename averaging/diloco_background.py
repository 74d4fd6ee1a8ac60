"""`BackgroundContribution`: overlap's contribution, offered in the trio thread while inner steps go on.

Why its own object: with `overlap=True` a phase's end hands its pseudo-gradient to a round and returns to the
training loop at once (docs: the "eager / one step delayed" variant). The training thread then needs three
things from the trio side: whether that contribution is done (a phase's end waits for it only if not), how it
ended (an update not applied goes into the next contribution), and, at the end of a run, a way to give up one
whose round never starts. The task itself runs in the optimizer's nursery (the optimizer starts it, with the
event and cancel scope `arm` made); this object holds what the two threads share about it.
"""

from __future__ import annotations

import logging

import trio

from averaging.diloco_contribute import Contribution, Contributor

logger = logging.getLogger("averaging.diloco")  # the optimizer's own log, as before these parts had modules

__all__ = ["BackgroundContribution"]


class BackgroundContribution:
    """The last contribution handed to the background: `done` (set when it ended; None before the first),
    `outcome` (as `Contributor.contribute` returns it; "lost" when it raised), `scope` (cancelled to give it up)."""

    def __init__(self, contributor: Contributor) -> None:
        self.contributor = contributor
        self.done: trio.Event | None = None
        self.outcome = ""
        self.scope = trio.CancelScope()  # finish() gives up a background round that does not start

    @property
    def running(self) -> bool:
        """A contribution was handed over and has not ended."""
        return self.done is not None and not self.done.is_set()

    def arm(self) -> tuple[trio.Event, trio.CancelScope]:
        """A new contribution goes to the background: its done event and cancel scope, for `run`."""
        self.done = trio.Event()
        self.scope = trio.CancelScope()
        return self.done, self.scope

    async def run(self, contribution: Contribution, done: trio.Event, scope: trio.CancelScope) -> None:
        """The background task: offer `contribution` until a round takes it; `done` is set however it ends."""
        self.outcome = "lost"
        try:
            with scope:
                self.outcome = await self.contributor.contribute(contribution)
        except Exception as error:  # the round is best effort; the next contribution catches up if we drifted
            logger.warning("diloco: background outer round failed: %s", error)
            self.outcome = "lost"
        finally:
            done.set()

    async def wait(self) -> None:
        if self.done is not None:
            await self.done.wait()

    async def settle(self, within: float) -> None:
        """At the end of a run: wait at most `within` seconds for the contribution in flight, then give it up.
        Bounded because the others are finishing too and come to no more rounds, so a last contribution whose
        round has not started (its coordinator killed, say) would keep this trainer from ever finishing."""
        with trio.move_on_after(within):
            await self.wait()
        if self.running:
            logger.info("diloco: finish: the last contribution (round %s) found no round within %.0f s; "
                        "given up (the final agreement settles the state)", self.contributor.inflight_round, within)
            self.scope.cancel()
            await self.wait()
