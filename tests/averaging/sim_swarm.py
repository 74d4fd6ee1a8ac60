"""Helpers for averaging scenario tests: peers (RPC node + DHT node on one host:port) in one trio run.

Each peer lives in its own cancel scope; `kill()` models SIGKILL on the in-memory network (its connections are
reset and its ports close at once) or, on real sockets, closes everything without a goodbye.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import trio

from dht import DHTNode
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork, Network, RealNetwork
from peer.p2p.rpc import RPCNode


@dataclass
class SimPeer:
    name: str
    identity: Identity
    rpc: RPCNode
    dht: DHTNode
    scope: trio.CancelScope
    network: MemoryNetwork | None
    nursery: trio.Nursery
    extra: dict = field(default_factory=dict)

    @property
    def peer_id(self):
        return self.identity.peer_id

    def kill(self) -> None:
        if self.network is not None:
            self.network.crash(self.name)
        self.scope.cancel()


async def _run_peer(name, network, memory, initial_peers, seed, client_mode, *, task_status):
    identity = Identity.from_seed(f"averaging-sim-{seed}-{name}".encode())
    with trio.CancelScope() as scope:
        async with RPCNode(identity, network) as rpc:
            host = name if memory is not None else "127.0.0.1"
            if client_mode:
                port = 0
            else:
                _, port = await rpc.listen(host, 0)
            clock = trio.current_time if memory is not None else None
            kwargs = {"clock": clock} if clock is not None else {}
            async with DHTNode.open(host, port, initial_peers, identity=identity, network=network,
                                    client_mode=client_mode, seed=seed if memory is not None else None,
                                    **kwargs) as dht:
                async with trio.open_nursery() as nursery:
                    task_status.started(SimPeer(name, identity, rpc, dht, scope, memory, nursery))
                    await trio.sleep_forever()


async def start_peers(nursery: trio.Nursery, count: int, *, memory: MemoryNetwork | None, seed: int = 0,
                      client_mode: set[int] = frozenset(), first: int = 0,
                      bootstrap: list | None = None) -> list[SimPeer]:
    """`count` peers; the first starts the DHT (unless `bootstrap` is given), later ones join through up to 3
    earlier ones (seeded choice)."""
    rng = random.Random(seed)
    peers: list[SimPeer] = []
    for index in range(first, first + count):
        name = f"n{index}"
        network: Network = memory.host(name) if memory is not None else RealNetwork()
        known = [p.dht.address for p in peers if not p.dht.client_mode] + list(bootstrap or [])
        initial = rng.sample(known, min(3, len(known)))
        peer = await nursery.start(_run_peer, name, network, memory, initial, seed * 1000 + index,
                                   index in client_mode)
        peers.append(peer)
    return peers
