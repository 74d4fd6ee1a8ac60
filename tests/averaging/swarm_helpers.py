"""A few averaging peers in one trio run, on real sockets (127.0.0.1) or the in-memory network, each with its own
cancel scope so a test can kill one at an exact protocol moment (through the all-reduce hook)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import trio

from averaging.allreduce import AllReduceConfig, AllReduceResult, AllReduceServer, install_allreduce
from averaging.group import GroupInfo, Member
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork, RealNetwork
from peer.p2p.rpc import RPCNode


class SimPeer:
    def __init__(self, swarm: "Swarm", name: str, client_mode: bool):
        self.swarm = swarm
        self.name = name
        self.client_mode = client_mode
        self.identity = Identity.from_seed(name.encode() * 4)
        self.peer_id = self.identity.peer_id
        self.scope = trio.CancelScope()
        self.node: RPCNode | None = None
        self.server: AllReduceServer | None = None
        self.nursery: trio.Nursery | None = None
        self.address = None
        self.result: AllReduceResult | None = None
        self.error: BaseException | None = None
        self.done = trio.Event()
        self.hook: Callable[[str, dict[str, Any]], None] | None = None
        self.killed = False

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            async with RPCNode(self.identity, self.swarm.network(self.name)) as node:
                self.node = node
                self.server = install_allreduce(node, config=self.swarm.config, hook=self._on_hook)
                if not self.client_mode:
                    self.address = await node.listen(self.swarm.host(self.name), 0)
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    task_status.started()
                    await trio.sleep_forever()

    def _on_hook(self, name: str, info: dict[str, Any]) -> None:
        self.swarm.events.append((self.name, name, info))
        if self.hook is not None:
            self.hook(name, info)

    def member(self, bandwidth: float = 1.0) -> Member:
        return Member(self.peer_id, self.address, bandwidth=bandwidth, client_mode=self.client_mode)

    def start_round(self, group: GroupInfo, tensors: list[torch.Tensor], **options: Any) -> None:
        async def average() -> None:
            try:
                self.result = await self.server.run(group, tensors, **options)
            except Exception as error:  # surfaced by the test's assertions
                self.error = error
            finally:
                self.done.set()

        self.nursery.start_soon(average)

    def kill(self) -> None:
        """SIGKILL-like: on the memory network its host crashes (connections reset); its tasks are cancelled."""
        self.killed = True
        if self.swarm.memory is not None:
            self.swarm.memory.crash(self.name)
        self.scope.cancel()


class Swarm:
    def __init__(self, transport: str, *, config: AllReduceConfig | None = None, latency: float = 0.002):
        self.transport = transport
        self.memory = MemoryNetwork(latency=latency, seed=7) if transport == "memory" else None
        self.config = config or AllReduceConfig(chunk_bytes=1024)
        self.peers: list[SimPeer] = []
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def network(self, name: str):
        return self.memory.host(name) if self.memory is not None else RealNetwork()

    def host(self, name: str) -> str:
        return name if self.memory is not None else "127.0.0.1"

    async def start(self, nursery: trio.Nursery, count: int, *, clients: tuple[int, ...] = ()) -> list[SimPeer]:
        for index in range(count):
            peer = SimPeer(self, f"p{index}", client_mode=index in clients)
            await nursery.start(peer.serve)
            self.peers.append(peer)
        return self.peers

    def group(self, peers: list[SimPeer], group_id: bytes = b"round-1") -> GroupInfo:
        return GroupInfo.create(group_id, [p.member() for p in peers])


def random_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(17, 33, generator=generator),
        torch.randn(500, generator=generator),
        torch.randn(3, 4, 5, generator=generator, dtype=torch.float64),
        torch.randn(1, generator=generator),
        torch.randn(257, generator=generator),
    ]


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
