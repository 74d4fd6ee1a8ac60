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
