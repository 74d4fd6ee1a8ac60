"""An ExpertServer on 127.0.0.1 over real sockets and a plain client RPCNode, for tests that call moe.* directly
(test_server_rpc.py, test_server_bounds.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from moe.experts import Expert
from moe.server import ExpertServer
from peer.p2p.identity import Identity, PeerID
from peer.p2p.net import RealNetwork
from peer.p2p.rpc import RPCNode


@asynccontextmanager
async def serving(experts: list[Expert],
                  **server_options: Any) -> AsyncIterator[tuple[ExpertServer, RPCNode, Any, PeerID]]:
    """A server node hosting `experts` and a client node; yields (server, client, server address, server peer id)."""
    server = ExpertServer(experts, **server_options)
    async with RPCNode(Identity.generate(), RealNetwork()) as server_node, \
            RPCNode(Identity.generate(), RealNetwork()) as client:
        address = await server_node.listen("127.0.0.1", 0)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, server_node)
            yield server, client, address, server_node.peer_id
            nursery.cancel_scope.cancel()
