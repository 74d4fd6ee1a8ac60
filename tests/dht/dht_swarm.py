"""Helpers for DHT tests: start many nodes in one trio run, each in its own cancel scope (cancel = kill)."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from dht import DHTNode
from peer.p2p.identity import Identity


@dataclass
class RunningNode:
    node: DHTNode
    scope: trio.CancelScope

    def kill(self) -> None:
        """Stop the node without a goodbye: its tasks are cancelled and its socket closes."""
        self.scope.cancel()


async def _run_node(host, port, initial_peers, kwargs, *, task_status=trio.TASK_STATUS_IGNORED):
    with trio.CancelScope() as scope:
        async with DHTNode.open(host, port, initial_peers, **kwargs) as node:
            task_status.started(RunningNode(node, scope))
            await trio.sleep_forever()


async def start_node(nursery: trio.Nursery, host: str, initial_peers=(), **kwargs) -> RunningNode:
    return await nursery.start(_run_node, host, 0, list(initial_peers), kwargs)


async def start_swarm(nursery: trio.Nursery, hosts: list[str], network_for, rng, **kwargs) -> list[RunningNode]:
    """The first host starts a new DHT; each later one joins through up to 3 random earlier nodes. Identities
    and node randomness come from `rng`, so a simulated run is reproducible."""
    swarm: list[RunningNode] = []
    for host in hosts:
        initial = [r.node.address for r in rng.sample(swarm, min(3, len(swarm)))]
        identity = Identity.from_seed(rng.randbytes(32))
        swarm.append(await start_node(nursery, host, initial, network=network_for(host), identity=identity,
                                      seed=rng.getrandbits(64), **kwargs))
    return swarm


async def forge_store(node: DHTNode, key, value, expiration_time: float, subkey=None,
                      signer: Identity | None = None) -> bool:
    """What a hostile peer can send: an entry signed by `signer` (unsigned when None) under any subkey, stored
    through the node's ordinary replica lookup but without the client-side checks of `DHTNode.store`."""
    from dht import records
    from dht.node import key_id_of

    key_id = key_id_of(key)
    entry = records.make_entry(key_id, subkey, value, expiration_time, signer)
    record = records.Record(entry, {}) if subkey is None else records.Record(None, {subkey: entry})
    acknowledged = await node._store_in_chunks({key_id: record})
    return acknowledged.get(key_id, False)
