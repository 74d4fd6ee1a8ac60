"""Many stock `kademlia` nodes spread over several child processes, so groups of them can die without warning.

WHY groups of processes: the benchmark kills nodes the way a crash does (SIGKILL: the socket vanishes, nothing is
said to anyone). One process per node would cost 64 interpreters on a 2-core machine; one process for all would
not let a subset die. A few nodes per process is the middle ground: the benchmark kills whole processes, and
because stock node ids are random, a process's nodes are scattered over the id space like any random subset.

The child process and its JSON-lines driver are `tests/dht/stock_node.py` (asyncio lives only in the child).
"""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

_STOCK_NODE_DIR = Path(__file__).resolve().parent.parent / "tests" / "dht"
if str(_STOCK_NODE_DIR) not in sys.path:
    sys.path.insert(0, str(_STOCK_NODE_DIR))

from stock_node import StockNodeError, StockNodes  # noqa: E402  (path set just above)

__all__ = ["StockCluster", "StockNodeError"]


class StockCluster:
    """`nodes` stock servers numbered 0..nodes-1, `per_process` of them in each child process."""

    def __init__(self, groups: list[StockNodes], per_process: int):
        self.groups = groups
        self.per_process = per_process
        self.alive: list[bool] = [True] * sum(len(g.ports) for g in groups)

    @classmethod
    @asynccontextmanager
    async def open(
        cls, nodes: int, *, per_process: int = 8, seed: int = 0, ksize: int = 20, alpha: int = 3
    ) -> AsyncIterator["StockCluster"]:
        async with AsyncExitStack() as stack:
            groups = []
            for first in range(0, nodes, per_process):
                count = min(per_process, nodes - first)
                groups.append(
                    await stack.enter_async_context(
                        StockNodes.open(count, seed=f"{seed}-{first}", ksize=ksize, alpha=alpha)
                    )
                )
            yield cls(groups, per_process)

    def _locate(self, node: int) -> tuple[StockNodes, int]:
        return self.groups[node // self.per_process], node % self.per_process

    def address(self, node: int) -> tuple[str, int]:
        group, index = self._locate(node)
        return group.addresses[index]

    def group_of(self, node: int) -> list[int]:
        """Every node sharing `node`'s process (they die together)."""
        first = node // self.per_process * self.per_process
        return list(range(first, first + len(self.groups[node // self.per_process].ports)))

    async def bootstrap(self, node: int, peers: list[tuple[str, int]], *, timeout: float = 30.0) -> list[tuple]:
        group, index = self._locate(node)
        return await group.bootstrap(index, peers, timeout=timeout)

    async def set(self, node: int, key: Any, value: Any, *, timeout: float = 60.0) -> tuple[bool, float]:
        group, index = self._locate(node)
        return await group.set(index, key, value, timeout=timeout)

    async def get(self, node: int, key: Any, *, timeout: float = 60.0) -> tuple[Any, float]:
        group, index = self._locate(node)
        return await group.get(index, key, timeout=timeout)

    def kill_process_of(self, node: int) -> list[int]:
        """SIGKILL the process holding `node`; returns the nodes that died with it."""
        group, _ = self._locate(node)
        group.kill()
        victims = self.group_of(node)
        for victim in victims:
            self.alive[victim] = False
        return victims
