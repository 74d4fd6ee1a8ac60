"""Fixtures for the MoE client tests: the trainer's trio thread (a Bridge with an RPC node in it, like
`peer.client.Swarm`), and expert servers started inside that thread so tests can kill them at will."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest
import trio

from moe.beam_search import ExpertLocation
from moe.experts import Expert
from moe.server import ExpertServer
from peer.bridge import Bridge
from peer.identity import Identity, PeerID
from peer.net import MemoryNetwork, Network, RealNetwork
from peer.rpc import RPCNode


@dataclass
class ClientSwarm:
    """The attributes a mixture needs from `peer.client.Swarm`."""

    bridge: Bridge
    rpc: RPCNode
    dht: Any = None


@dataclass
class ServerHandle:
    """An expert server running in the bridge's trio thread. `kill()` cancels it (its RPC node closes, its
    connections drop); on a MemoryNetwork, `crash()` makes its host vanish without any goodbye."""

    bridge: Bridge
    address: tuple[str, int]
    peer_id: PeerID
    server: ExpertServer
    scope: trio.CancelScope
    network: Any = None
    host: str | None = None
    experts: dict[str, Expert] = field(default_factory=dict)

    def locations(self) -> dict[str, ExpertLocation]:
        return {uid: ExpertLocation(self.address[0], self.address[1], self.peer_id.hex()) for uid in self.experts}

    def kill(self) -> None:
        async def cancel() -> None:
            self.scope.cancel()

        self.bridge.run(cancel)

    def crash(self) -> None:
        async def crash() -> None:
            self.network.crash(self.host)

        self.bridge.run(crash)


async def _serve_experts(
    experts: Sequence[Expert], network: Network, host: str, dht: Any, options: dict, *, task_status
) -> None:
    with trio.CancelScope() as scope:
        async with RPCNode(Identity.generate(), network) as node:
            address = await node.listen(host, 0)
            server = ExpertServer(experts, **options)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run, node, dht)
                task_status.started((scope, address, node.peer_id, server))


async def _client_node(network: Network, box: list, *, task_status) -> None:
    async with RPCNode(Identity.generate(), network) as node:
        box.append(node)
        task_status.started()
        await trio.sleep_forever()


class Harness:
    """Builds client swarms and expert servers inside one bridge (one trio thread)."""

    def __init__(self, bridge: Bridge, network: MemoryNetwork | None = None):
        self.bridge = bridge
        self.network = network

    def _network(self, host: str) -> Network:
        return self.network.host(host) if self.network is not None else RealNetwork()

    def client(self, host: str = "client", dht: Any = None) -> ClientSwarm:
        box: list = []
        self.bridge.start_and_wait(_client_node, self._network(host), box)
        return ClientSwarm(self.bridge, box[0], dht)

    def server(self, experts: Sequence[Expert], host: str | None = None, dht: Any = None, **options: Any) -> ServerHandle:
        options.setdefault("inline_threshold", math.inf if self.network is not None else 1e-4)
        bind = host if self.network is not None else "127.0.0.1"
        scope, address, peer_id, server = self.bridge.start_and_wait(
            _serve_experts, experts, self._network(host or "server"), bind, dht, options
        )
        return ServerHandle(self.bridge, address, peer_id, server, scope, self.network, host,
                            {e.uid: e for e in experts})


@pytest.fixture
def bridge():
    with Bridge.start() as bridge:
        yield bridge


@pytest.fixture
def harness(bridge) -> Harness:
    """Servers and clients over real sockets on 127.0.0.1."""
    return Harness(bridge)


@pytest.fixture
def memory_harness(bridge) -> Harness:
    """Servers and clients on an in-memory network (hosts can be crashed), real clock."""
    return Harness(bridge, MemoryNetwork(seed=7))
