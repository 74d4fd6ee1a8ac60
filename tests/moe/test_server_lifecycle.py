"""Stopping a server answers its waiting callers and removes its methods; simulated on the in-memory network."""

import math

import pytest
import torch
import trio

from moe.errors import ServerShuttingDown
from moe.experts import make_expert
from moe.server import ExpertServer
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.p2p.rpc import RPCNode, UnknownMethod


async def test_stopping_fails_queued_requests_with_a_typed_error_then_unregisters(autojump_clock):
    network = MemoryNetwork(latency=0.002, seed=1)
    # min_batch_size 8 with a long batch_timeout: a 1-row request waits in the queue until the server stops
    server = ExpertServer([make_expert("ffn.0", "ffn", 4, seed=0)], min_batch_size=8, batch_timeout=1000,
                          inline_threshold=math.inf)
    outcome = []
    async with RPCNode(Identity.from_seed(b"s" * 32), network.host("server")) as node, \
            RPCNode(Identity.from_seed(b"c" * 32), network.host("client")) as client:
        address = await node.listen("server", 7000)

        async def waiting_caller():
            try:
                await client.call(address, "moe.forward", {"uid": "ffn.0", "inputs": [torch.ones(1, 4)]}, timeout=60)
            except ServerShuttingDown as error:
                outcome.append(error)

        async with trio.open_nursery() as callers:
            with trio.CancelScope() as serving:
                async with trio.open_nursery() as nursery:
                    await nursery.start(server.run, node)
                    # a full batch is served at once while the lone request keeps waiting
                    reply = await client.call(address, "moe.forward",
                                              {"uid": "ffn.0", "inputs": [torch.ones(8, 4)]}, timeout=60)
                    assert reply["outputs"][0].shape == (8, 4)
                    callers.start_soon(waiting_caller)
                    await trio.sleep(5)
                    serving.cancel()
        assert len(outcome) == 1 and "shutting down" in str(outcome[0])
        with pytest.raises(UnknownMethod):
            await client.call(address, "moe.info", {"uid": "ffn.0"}, timeout=60)
    stats = server.stats()
    assert not stats["running"] and stats["errors"]["shutting_down"] == 1 and stats["requests"]["forward"] == 1


async def test_server_can_restart_on_the_same_node(autojump_clock):
    network = MemoryNetwork(latency=0.002, seed=2)
    server = ExpertServer([make_expert("ffn.0", "ffn", 4, seed=0)], inline_threshold=math.inf)
    async with RPCNode(Identity.from_seed(b"s" * 32), network.host("server")) as node, \
            RPCNode(Identity.from_seed(b"c" * 32), network.host("client")) as client:
        address = await node.listen("server", 7000)
        for _ in range(2):
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run, node)
                info = await client.call(address, "moe.info", {"uid": "ffn.0"}, timeout=60)
                assert info["hidden_dim"] == 4
                nursery.cancel_scope.cancel()
