"""Relays, private peers and dialers as separate RPC nodes on one network, in memory (named hosts) or on 127.0.0.1
(tests/p2p/test_relay.py, test_relay_budgets.py): `Net.relay` runs a `RelayService`, `Net.private` a peer that never
listens and is reached only through the relays it reserves with (serving `register_echo`'s echo, which records
its callers in `served`), `Net.dialer` a plain node.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork, RealNetwork
from peer.p2p.relay_service import RelayReservations, RelayService
from peer.p2p.rpc import RPCNode


def register_echo(node: RPCNode, served: list | None = None) -> None:
    async def echo(context, args):
        if served is not None:
            served.append((context.peer_id, args))
        return {"args": args, "caller": bytes(context.peer_id)}

    node.register("echo", echo)


class Net:
    """Relays, private peers and dialers on one network: in memory (named hosts) or on 127.0.0.1."""

    def __init__(self, kind: str):
        self.memory = MemoryNetwork(latency=0.001, seed=3) if kind == "memory" else None

    def network(self, name: str):
        return self.memory.host(name) if self.memory else RealNetwork()

    def host(self, name: str) -> str:
        return name if self.memory else "127.0.0.1"

    @asynccontextmanager
    async def relay(self, name: str, service_class=RelayService, node_options: dict | None = None, **options):
        async with RPCNode(Identity.generate(), self.network(name), **(node_options or {})) as node:
            await node.listen(self.host(name), 0)
            service = service_class(node, **{"limit": 8, **options})
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run)
                yield node, service
                nursery.cancel_scope.cancel()

    @asynccontextmanager
    async def private(self, name: str, relays: list, served: list | None = None, want: int = 2):
        """A peer that never listens: reached only through the relays it reserves with."""
        async with RPCNode(Identity.generate(), self.network(name)) as node:
            register_echo(node, served)

            async def candidates():
                return [(relay_node.peer_id, relay_node.address) for relay_node in relays if relay_node.address]

            def changed(address):
                node.announce = address

            reservations = RelayReservations(node, candidates, on_change=changed, want=want)
            async with trio.open_nursery() as nursery:
                await nursery.start(reservations.run)
                yield node, reservations
                nursery.cancel_scope.cancel()

    @asynccontextmanager
    async def dialer(self, name: str, **options):
        async with RPCNode(Identity.generate(), self.network(name), **options) as node:
            yield node
