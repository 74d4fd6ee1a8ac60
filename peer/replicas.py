"""Replicated experts: volunteers serving the same experts keep their weights together by averaging them.

Why: when the only server of an expert dies, its training is lost. With `peer join --replicate`, several
volunteers serve the same uids (one of them is declared in the DHT at a time; when it dies another's declaration
takes over), and each daemon's averager periodically averages the experts' parameters with the other replicas, so
whichever replica serves next starts from (nearly) the same weights.

How, without stalling the experts: the averager works on its own copies. Each round snapshots the parameters
(a short copy while no batch of that expert runs), averages the copies with the group over the network, then adds
the group's correction (averaged copy - snapshot) to the live parameters (again a short exclusive copy), so the
optimizer steps taken during the round are kept.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Awaitable, Callable, Sequence

import torch
import trio

from averaging.averager import Averager, StepResult
from dht.client import DHTClient
from moe.experts import Expert
from peer.p2p.periodic import run_periodic
from peer.p2p.rpc import RPCNode

logger = logging.getLogger(__name__)

Exclusive = Callable[[str, Callable[[Expert], Any]], Awaitable[Any]]


def replica_prefix(uids: Sequence[str]) -> str:
    """The averaging key of a set of experts: replicas of exactly the same experts meet under it."""
    return "replicas." + hashlib.sha1(",".join(sorted(uids)).encode()).hexdigest()[:16]


class ReplicaAverager:
    def __init__(self, rpc: RPCNode, dht: DHTClient, experts: dict[str, Expert], exclusive: Exclusive, *,
                 interval: float = 30.0, matchmaking_time: float = 3.0, target_group_size: int = 4,
                 timeout: float = 60.0):
        self.uids = sorted(experts)
        self.experts = experts
        self.exclusive = exclusive
        self.interval = interval
        self.timeout = timeout
        self._live = {uid: [p for p in experts[uid].module.parameters()] for uid in self.uids}
        names = [f"{uid}/{i}" for uid in self.uids for i in range(len(self._live[uid]))]
        self.copies = [p.detach().clone() for uid in self.uids for p in self._live[uid]]
        self.averager = Averager(rpc, dht, self.copies, prefix=replica_prefix(self.uids), names=names,
                                 target_group_size=target_group_size, matchmaking_time=matchmaking_time,
                                 allreduce_timeout=timeout, lock=trio.Lock(), serve_state=False)
        self.rounds = 0
        self.failures = 0
        self.last: StepResult | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Average every `interval` seconds until cancelled (the first round one interval after the start)."""
        async with self.averager:
            task_status.started()
            await run_periodic(self.average_once, self.interval, name="averaging expert replicas",
                               first_delay=self.interval, on_failure=self._round_failed, log=logger)

    def _round_failed(self, error: Exception) -> None:
        self.failures += 1

    async def average_once(self) -> StepResult:
        """One round: snapshot, average the copies with the other replicas, apply the correction. Raises when
        the averaging step failed (`run` counts it, logs it once per kind and retries)."""
        snapshots = await self._snapshot()
        # a failed round raises out of here before `_apply`: the live weights stay as they are
        result = await self.averager.step(timeout=self.timeout)
        self.last = result
        if result.group is None or result.group_size < 2:
            return result
        await self._apply(snapshots)
        self.rounds += 1
        return result

    async def _snapshot(self) -> list[torch.Tensor]:
        snapshots: list[torch.Tensor] = []
        position = 0
        for uid in self.uids:
            live = self._live[uid]
            copies = self.copies[position:position + len(live)]
            position += len(live)

            def copy_out(expert: Expert, live: list[torch.nn.Parameter] = live,
                         copies: list[torch.Tensor] = copies) -> list[torch.Tensor]:
                with torch.no_grad():
                    for source, target in zip(live, copies):
                        target.copy_(source)
                return [c.clone() for c in copies]

            snapshots.extend(await self.exclusive(uid, copy_out))
        return snapshots

    async def _apply(self, snapshots: list[torch.Tensor]) -> None:
        position = 0
        for uid in self.uids:
            live = self._live[uid]
            pairs = list(zip(live, self.copies[position:position + len(live)], snapshots[position:]))
            position += len(live)

            def add_correction(expert: Expert,
                               pairs: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = pairs) -> None:
                with torch.no_grad():
                    for parameter, averaged, snapshot in pairs:
                        parameter.add_(averaged - snapshot)

            await self.exclusive(uid, add_correction)

    def stats(self) -> dict[str, Any]:
        last = self.last
        return {
            "rounds": self.rounds,
            "failures": self.failures,
            "last_group_size": last.group_size if last is not None and last.group is not None else None,
            "key": self.averager.prefix,
        }
