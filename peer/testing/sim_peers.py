"""The one harness for simulated peers: an RPC node (and, unless told otherwise, a DHT node on the same
host:port) per peer, all in one trio run, on the in-memory network or real sockets on 127.0.0.1.

Each peer lives in its own cancel scope and owns a nursery for the test's tasks, so a test kills it at an exact
moment: `kill()` models SIGKILL on the in-memory network (its host crashes: connections reset, ports close at
once) or, on real sockets, closes everything without a goodbye. `setup(rpc)` runs before the peer listens
(register handlers there, so no call can arrive before them); what it returns is the peer's `service`.
Identities and DHT randomness are seeded, so a simulated run is reproducible.
"""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from dht import DHTNode
from peer.p2p.identity import Identity, PeerID
from peer.p2p.net import Address, MemoryNetwork, Network, RealNetwork
from peer.p2p.rpc import RPCNode

IdentityFor = Callable[[str, int], Identity]  # (peer name, seed) -> identity


def default_identity(name: str, seed: int) -> Identity:
    return Identity.from_seed(f"averaging-sim-{seed}-{name}".encode())


@dataclass
class SimPeer:
    name: str
    identity: Identity
    rpc: RPCNode
    dht: DHTNode | None
    scope: trio.CancelScope
    network: MemoryNetwork | None
    nursery: trio.Nursery
    address: Address | None = None  # where its RPC node listens (None: a client, it listens nowhere)
    service: Any = None  # what `setup(rpc)` returned
    killed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    def kill(self) -> None:
        """SIGKILL-like: on the memory network its host crashes (connections reset); its tasks are cancelled."""
        self.killed = True
        if self.network is not None:
            self.network.crash(self.name)
        self.scope.cancel()


async def run_peer(name: str, memory: MemoryNetwork | None, initial_peers: list[Address], seed: int, *,
                   client_mode: bool = False, with_dht: bool = True, identity: Identity | None = None,
                   setup: Callable[[RPCNode], Any] | None = None,
                   task_status: trio.TaskStatus[SimPeer] = trio.TASK_STATUS_IGNORED) -> None:
    """One peer, serving until cancelled (`kill()` cancels it); `task_status` gets its SimPeer."""
    identity = identity or default_identity(name, seed)
    network: Network = memory.host(name) if memory is not None else RealNetwork()
    host = name if memory is not None else "127.0.0.1"
    kwargs: dict[str, Any] = {"clock": trio.current_time, "seed": seed} if memory is not None else {}
    with trio.CancelScope() as scope:
        async with RPCNode(identity, network) as rpc, AsyncExitStack() as stack:
            service = setup(rpc) if setup is not None else None
            address = None if client_mode else await rpc.listen(host, 0)
            dht = None
            if with_dht:
                dht = await stack.enter_async_context(DHTNode.open(
                    host, address[1] if address else 0, initial_peers, identity=identity, network=network,
                    client_mode=client_mode, **kwargs))
            async with trio.open_nursery() as nursery:  # inside the nodes: the test's tasks end before they close
                task_status.started(SimPeer(name, identity, rpc, dht, scope, memory, nursery, address, service))
                await trio.sleep_forever()


async def start_peers(nursery: trio.Nursery, count: int, *, memory: MemoryNetwork | None, seed: int = 0,
                      client_mode: set[int] | frozenset[int] = frozenset(), first: int = 0,
                      bootstrap: list[Address] | None = None, with_dht: bool = True, prefix: str = "n",
                      identity_for: IdentityFor | None = None,
                      setup: Callable[[RPCNode], Any] | None = None) -> list[SimPeer]:
    """`count` peers named `{prefix}{index}`; with DHT nodes, the first starts the DHT (unless `bootstrap` is
    given) and later ones join through up to 3 earlier ones (seeded choice). `client_mode` holds the indexes of
    peers that listen nowhere."""
    rng = random.Random(seed)
    peers: list[SimPeer] = []
    for index in range(first, first + count):
        name = f"{prefix}{index}"
        known = [p.dht.address for p in peers if p.dht is not None and not p.dht.client_mode] + list(bootstrap or [])
        initial = rng.sample(known, min(3, len(known))) if with_dht else []
        peer_seed = seed * 1000 + index
        identity = identity_for(name, peer_seed) if identity_for is not None else None
        peer = await nursery.start(lambda task_status, name=name, initial=initial, peer_seed=peer_seed,
                                   identity=identity, index=index: run_peer(
                                       name, memory, initial, peer_seed, client_mode=index in client_mode,
                                       with_dht=with_dht, identity=identity, setup=setup, task_status=task_status))
        peers.append(peer)
    return peers
