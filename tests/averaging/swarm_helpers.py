"""A few all-reduce peers in one trio run, on real sockets (127.0.0.1) or the in-memory network: the shared
simulated peers (peer/testing/sim_peers.py), each serving the all-reduce, so a test can kill one at an exact protocol
moment (through the all-reduce hook)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import trio

from averaging.allreduce import AllReduceServer, install_allreduce
from averaging.allreduce_core import AllReduceConfig, AllReduceResult
from averaging.averager import Averager, StepResult
from averaging.group import GroupInfo, Member
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.p2p.rpc import RPCNode
from peer.testing.sim_peers import SimPeer, start_peers


class AllReducePeer:
    """A simulated peer (peer.testing.sim_peers.SimPeer, no DHT) serving the all-reduce, with its round's outcome."""

    def __init__(self, swarm: "Swarm", peer: SimPeer):
        self.swarm = swarm
        self.peer = peer
        self.name = peer.name
        self.client_mode = peer.address is None
        self.peer_id = peer.peer_id
        self.node: RPCNode = peer.rpc
        self.server: AllReduceServer = peer.service
        self.address = peer.address
        self.result: AllReduceResult | None = None
        self.error: BaseException | None = None
        self.done = trio.Event()
        self.hook: Callable[[str, dict[str, Any]], None] | None = None
        self.killed = False  # a test may also set it for a peer it froze

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

        self.peer.nursery.start_soon(average)

    def kill(self) -> None:
        """SIGKILL-like (see SimPeer.kill)."""
        self.killed = True
        self.peer.kill()


class Swarm:
    def __init__(self, transport: str, *, config: AllReduceConfig | None = None, latency: float = 0.002):
        self.transport = transport
        self.memory = MemoryNetwork(latency=latency, seed=7) if transport == "memory" else None
        self.config = config or AllReduceConfig(chunk_bytes=1024)
        self.peers: list[AllReducePeer] = []
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    async def start(self, nursery: trio.Nursery, count: int, *, clients: tuple[int, ...] = ()) -> list[AllReducePeer]:
        for index in range(count):
            name = f"p{index}"
            hooks: list[AllReducePeer] = []  # the peer, once it exists: the hook fires only during a round

            def on_hook(event: str, info: dict[str, Any], name: str = name, hooks: list = hooks) -> None:
                self.events.append((name, event, info))
                if hooks and hooks[0].hook is not None:
                    hooks[0].hook(event, info)

            (peer,) = await start_peers(
                nursery, 1, memory=self.memory, first=index, prefix="p", client_mode=set(clients), with_dht=False,
                identity_for=lambda name, seed: Identity.from_seed(name.encode() * 4),
                setup=lambda rpc, on_hook=on_hook: install_allreduce(rpc, config=self.config, hook=on_hook))
            hooks.append(AllReducePeer(self, peer))
            self.peers.append(hooks[0])
        return self.peers

    def group(self, peers: list[AllReducePeer], group_id: bytes = b"round-1") -> GroupInfo:
        return GroupInfo.create(group_id, [p.member() for p in peers])


async def start_averagers(peers: list[SimPeer], tensors_for: Callable[[int], list[torch.Tensor]], *,
                          trio_locks: bool = False, **options: Any) -> list[Averager]:
    """One Averager per simulated peer (tensors_for(index)), each serving in its peer's nursery. `trio_locks`: each
    gets its own trio.Lock (a contended threading.Lock would be waited for in a worker thread, and MockClock's
    autojump lets virtual time run while a thread works)."""
    averagers = []
    for index, peer in enumerate(peers):
        if trio_locks:
            options["lock"] = trio.Lock()
        averager = Averager(peer.rpc, peer.dht, tensors_for(index), **options)
        await peer.nursery.start(averager.serve)
        averagers.append(averager)
    return averagers


async def step_all(averagers: list[Averager], **kwargs: Any) -> list[StepResult]:
    """Every averager steps at once; their results in order."""
    results: dict[int, StepResult] = {}

    async def one(index: int) -> None:
        results[index] = await averagers[index].step(**kwargs)

    async with trio.open_nursery() as nursery:
        for index in range(len(averagers)):
            nursery.start_soon(one, index)
    return [results[i] for i in range(len(averagers))]


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
