"""100 nodes on the in-memory network under MockClock: killed peers never stall lookups."""

from __future__ import annotations

import random

import pytest
import trio
from dht_swarm import start_node, start_swarm

from dht import DHTConfig
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork

SEED = 3  # a run where, without republishing, 8 of the 60 keys are lost


async def test_lookups_finish_within_deadline_after_a_fifth_of_the_nodes_crash(autojump_clock):
    rng = random.Random(11)
    network = MemoryNetwork(latency=0.005, seed=11)
    hosts = [f"n{i}" for i in range(100)]
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, hosts, network.host, rng)
        expiration = swarm[0].node.now() + 3600
        for index in range(100):
            assert await rng.choice(swarm).node.store(f"key-{index}", index, expiration)
        victims = rng.sample(range(1, 100), 20)
        for index in victims:
            network.crash(hosts[index])
            swarm[index].kill()
        survivors = [r.node for i, r in enumerate(swarm) if i not in victims]
        durations = []
        for index in range(100):
            reader = rng.choice(survivors)
            started = trio.current_time()
            with trio.fail_after(2.0):  # far below the stock package's 5 s per dead peer
                record = await reader.get(f"key-{index}")
            durations.append(trio.current_time() - started)
            assert record is not None and record.value == index
        # a lookup never waits out a full request timeout on a dead peer while live ones can answer
        durations.sort()
        assert durations[94] < 0.25, durations[90:]
        for index in range(50):
            reader = rng.choice(survivors)
            with trio.fail_after(3.0):
                record = await reader.get(f"key-{index}", latest=True)
            assert record.value == index
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_republish_keeps_records_alive_through_churn(autojump_clock):
    """k=6 and two thirds of the original nodes die (in waves of 5), a sixth are replaced by newcomers: without
    republishing about 10% of the keys would lose every replica; with it all must stay readable."""
    rng = random.Random(SEED)
    network = MemoryNetwork(latency=0.005, seed=SEED)
    config = DHTConfig(k=6, republish_interval=30, maintenance_interval=10, refresh_interval=60,
                       max_timeout=1.0)
    hosts = [f"n{i}" for i in range(60)]
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, hosts, network.host, rng, config=config, clock=trio.current_time)
        expiration = trio.current_time() + 10_000
        for index in range(60):
            assert await rng.choice(swarm).node.store(f"key-{index}", index, expiration)
        alive = list(range(60))
        for wave in range(8):
            for index in rng.sample(alive[1:], 5):
                network.crash(swarm[index].node.address[0])
                swarm[index].kill()
                alive.remove(index)
            if wave in (3, 4):
                for newcomer in range(5):
                    name = f"new{wave}-{newcomer}"
                    initial = [swarm[i].node.address for i in rng.sample(alive, 3)]
                    swarm.append(await start_node(nursery, name, initial, network=network.host(name),
                                                  config=config, clock=trio.current_time,
                                                  seed=rng.getrandbits(64),
                                                  identity=Identity.from_seed(rng.randbytes(32))))
                    alive.append(len(swarm) - 1)
            await trio.sleep(70)  # virtual: at least one republish round
        readers = [swarm[i].node for i in alive]
        found = 0
        for index in range(60):
            record = await rng.choice(readers).get(f"key-{index}")
            found += record is not None and record.value == index
        assert found == 60
        nursery.cancel_scope.cancel()
