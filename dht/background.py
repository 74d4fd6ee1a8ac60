"""`BackgroundTasks`: how the DHT node and its collaborators start work that outlives the call that starts it.

Why one place: a query still waiting after its lookup finished, a bucket-head ping, a capability probe's answer,
a welcome or read-repair store all run in the background, in the nursery the node owns (`DHTNode.open`), so
that leaving the node cancels them all (cancellation is the only shutdown path). A bug in one of them must not
take the node down -- a DHT node never lets an exception out -- so each runs under the same guard: the failure
is logged once per kind (with its traceback: any exception here is a bug) and counted in stats()["dropped"].
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

import trio

# the node's log: DHT lines keep the name they always had (`dht.node`), wherever the code now lives
logger = logging.getLogger("dht.node")


class BackgroundTasks:
    """Starts guarded tasks in the node's nursery (owned by `DHTNode.open`, which cancels them on the way out)."""

    def __init__(self, nursery: trio.Nursery, dropped: Counter[str]):
        self._nursery = nursery
        self._dropped = dropped

    def spawn(self, function: Callable[..., Any], *args: Any) -> None:
        """Start `function(*args)` in the background; an exception it raises is logged once per kind and
        counted as `internal_error:<type>`, never propagated."""

        async def guarded() -> None:
            try:
                await function(*args)
            except Exception as error:  # Cancelled is a BaseException and passes through
                kind = f"internal_error:{type(error).__name__}"
                if not self._dropped[kind]:
                    logger.exception("DHT background task %s failed", getattr(function, "__name__", function))
                self._dropped[kind] += 1

        self._nursery.start_soon(guarded)
