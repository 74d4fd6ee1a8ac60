"""Our nodes on real UDP sockets (127.0.0.1): joining, storing and reading across a 32-node DHT."""

from __future__ import annotations

import random

import trio
from dht_swarm import start_swarm

from peer.p2p.net import RealNetwork


async def test_32_nodes_store_200_keys_and_read_all_from_other_nodes():
    rng = random.Random(7)
    network = RealNetwork()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, ["127.0.0.1"] * 32, lambda host: network, rng)
        nodes = [r.node for r in swarm]
        expiration = nodes[0].now() + 600
        writers = {}
        for index in range(200):
            writer = rng.choice(nodes)
            writers[index] = writer
            assert await writer.store(f"key-{index}", {"index": index, "blob": b"x" * 100}, expiration)
        found = 0
        for index in range(200):
            reader = rng.choice([n for n in nodes if n is not writers[index]])
            record = await reader.get(f"key-{index}")
            if record is not None and record.value == {"index": index, "blob": b"x" * 100}:
                found += 1
        assert found == 200
        # every node learned a good part of the DHT: no node is stranded on its initial peers
        assert min(len(n.routing_table_ids()) for n in nodes) >= 20
        nursery.cancel_scope.cancel()
