"""Fixtures for the MoE client tests: the trainer's trio thread (a Bridge with an RPC node in it, like
`peer.client.Swarm`), and expert servers started inside that thread so tests can kill them at will."""

from __future__ import annotations

import math
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest
import trio

from dht import DHTNode
from moe.declare import ExpertLocation
from moe.experts import Expert
from moe.server import ExpertServer
from peer.p2p.bridge import Bridge
from peer.p2p.identity import Identity, PeerID
from peer.p2p.net import MemoryNetwork, Network, RealNetwork
from peer.p2p.rpc import RPCNode
from peer.testing.peer_processes import ExpertServerProcess, PhaseKill, ProcessGroup


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
    experts: Sequence[Expert], network: Network, host: str, dht_peers: list | None, options: dict, *, task_status
) -> None:
    """One peer: RPC on host:port, and (when `dht_peers` is a list) a DHT node on the same port joining those
    peers, in which the server declares its experts."""
    with trio.CancelScope() as scope:
        async with RPCNode(Identity.generate(), network) as node:
            address = await node.listen(host, 0)
            server = ExpertServer(experts, **options)
            async with AsyncExitStack() as stack:
                dht = None
                if dht_peers is not None:
                    dht = await stack.enter_async_context(DHTNode.open(
                        host, address[1], list(dht_peers), identity=node.identity, network=network,
                    ))
                    dht_peers.append(dht.address)
                async with trio.open_nursery() as nursery:
                    await nursery.start(server.run, node, dht)
                    task_status.started((scope, address, node.peer_id, server))


async def _client_node(network: Network, dht_peers: list | None, box: list, *, task_status) -> None:
    async with RPCNode(Identity.generate(), network) as node, AsyncExitStack() as stack:
        box.append(node)
        if dht_peers is not None:
            box.append(await stack.enter_async_context(DHTNode.open(
                "127.0.0.1" if isinstance(network, RealNetwork) else "client", 0, list(dht_peers),
                identity=node.identity, network=network, client_mode=True,  # one PeerID, as in peer.client.Swarm
            )))
        task_status.started()
        await trio.sleep_forever()


@asynccontextmanager
async def _expert_peer(network: Network, host: str, experts: Sequence[Expert], **options: Any):
    """An expert server inside the current trio run (for MockClock tests): yields its location table. Compute
    runs inline on the event loop, so virtual time never passes while torch works."""
    options.setdefault("inline_threshold", math.inf)
    async with RPCNode(Identity.generate(), network) as node:
        address = await node.listen(host, 0)
        server = ExpertServer(experts, **options)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, node)
            yield {e.uid: ExpertLocation(address[0], address[1], node.peer_id.hex()) for e in experts}
            nursery.cancel_scope.cancel()


async def _bootstrap_node(network: Network, box: list, *, task_status) -> None:
    host = "127.0.0.1" if isinstance(network, RealNetwork) else "dht"
    async with DHTNode.open(host, 0, [], network=network) as node:
        box.append(node.address)
        task_status.started()
        await trio.sleep_forever()


class Harness:
    """Builds client swarms and expert servers inside one bridge (one trio thread). With `dht=True` every server
    also runs a DHT node (the first one starts the DHT) and declares its experts there; clients join it in
    client mode."""

    def __init__(self, bridge: Bridge, network: MemoryNetwork | None = None, dht: bool = False):
        self.bridge = bridge
        self.network = network
        self.dht_peers: list | None = [] if dht else None

    def _network(self, host: str) -> Network:
        return self.network.host(host) if self.network is not None else RealNetwork()

    def dht_bootstrap(self) -> tuple[str, int]:
        """A full (non-client) DHT node in the bridge for others to join, e.g. server processes started in
        parallel; returns its address."""
        box: list = []
        self.bridge.start_and_wait(_bootstrap_node, self._network("dht"), box)
        self.dht_peers.append(box[0])
        return box[0]

    def client(self, host: str = "client") -> ClientSwarm:
        box: list = []
        self.bridge.start_and_wait(_client_node, self._network(host), self.dht_peers, box)
        return ClientSwarm(self.bridge, box[0], box[1] if len(box) > 1 else None)

    def server(self, experts: Sequence[Expert], host: str | None = None, **options: Any) -> ServerHandle:
        options.setdefault("inline_threshold", math.inf if self.network is not None else 1e-4)
        bind = host if self.network is not None else "127.0.0.1"
        scope, address, peer_id, server = self.bridge.start_and_wait(
            _serve_experts, experts, self._network(host or "server"), bind, self.dht_peers, options
        )
        return ServerHandle(self.bridge, address, peer_id, server, scope, self.network, host,
                            {e.uid: e for e in experts})


@pytest.fixture
def expert_peer():
    """`async with expert_peer(network, host, experts) as locations:` an expert server in the test's own trio run
    (MockClock tests); compute runs inline, so virtual time never passes while torch works."""
    return _expert_peer


@pytest.fixture
def bridge():
    with Bridge.start() as bridge:
        yield bridge


@pytest.fixture
def harness(bridge) -> Harness:
    """Servers and clients over real sockets on 127.0.0.1."""
    return Harness(bridge)


@pytest.fixture
def dht_harness(bridge) -> Harness:
    """Servers declaring their experts in a DHT over real sockets on 127.0.0.1; clients find them there."""
    return Harness(bridge, dht=True)


@pytest.fixture
def memory_harness(bridge) -> Harness:
    """Servers and clients on an in-memory network (hosts can be crashed), real clock."""
    return Harness(bridge, MemoryNetwork(seed=7))


class ServerProcesses(ProcessGroup):
    """Expert servers in child processes (peer/testing/expert_server_process.py); all killed at teardown."""

    def start(self, uids: Sequence[str], *args: str, timeout: float = 120.0) -> tuple[ExpertServerProcess, dict]:
        process = self.launch(uids, *args)
        return process, self.wait_ready(process, timeout)

    def launch(self, uids: Sequence[str], *args: str, phase_hooks: bool = False) -> ExpertServerProcess:
        """Start a server process without waiting (start several at once, then `wait_ready` each).
        `phase_hooks`: the process accepts `kill_in` (a SIGKILL inside a forward or a backward)."""
        process = ExpertServerProcess(uids, *args, phase_hooks=phase_hooks)
        self.add(process)
        return process

    @staticmethod
    def wait_ready(process: ExpertServerProcess, timeout: float) -> dict:
        process.wait_ready(timeout)
        return {"address": process.address, "peer_id": process.peer_id}

    @staticmethod
    def kill_in(process: ExpertServerProcess, phase: str, timeout: float = 60.0) -> PhaseKill:
        """Arm a `phase_hooks` process (ready already): SIGKILLed inside its next `phase` computation."""
        return PhaseKill(process, phase, timeout)


@pytest.fixture
def server_processes():
    processes = ServerProcesses()
    try:
        yield processes
    finally:
        processes.close()
