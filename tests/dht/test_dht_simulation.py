"""100 nodes on the in-memory network under MockClock: killed peers never stall lookups."""

from __future__ import annotations

import random

import trio

from peer.net import MemoryNetwork

from dht import DHTConfig
from dht_swarm import start_node, start_swarm


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


async def test_republish_keeps_records_alive_through_churn(autojump_clock):
    """k=5 so that losing every replica is likely without republishing: two thirds of the original nodes die in two
    waves, a quarter are replaced by newcomers, and the keys must still be readable."""
    rng = random.Random(5)
    network = MemoryNetwork(latency=0.005, seed=5)
    config = DHTConfig(k=5, republish_interval=60, maintenance_interval=20, refresh_interval=60,
                       max_timeout=1.0)
    hosts = [f"n{i}" for i in range(60)]
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, hosts, network.host, rng, config=config, clock=trio.current_time)
        expiration = trio.current_time() + 10_000
        for index in range(60):
            assert await rng.choice(swarm).node.store(f"key-{index}", index, expiration)
        alive = list(range(60))
        for wave in range(2):
            for index in rng.sample(alive[1:], 20):
                network.crash(hosts[index])
                swarm[index].kill()
                alive.remove(index)
            if wave == 1:
                for newcomer in range(15):
                    name = f"new{newcomer}"
                    initial = [swarm[i].node.address for i in rng.sample(alive, 3)]
                    swarm.append(await start_node(nursery, name, initial, network=network.host(name),
                                                  config=config, clock=trio.current_time, seed=1000 + newcomer))
                    alive.append(len(swarm) - 1)
            await trio.sleep(200)  # virtual: a few republish rounds
        readers = [swarm[i].node for i in alive]
        found = 0
        for index in range(60):
            record = await rng.choice(readers).get(f"key-{index}")
            found += record is not None and record.value == index
        assert found == 60
        nursery.cancel_scope.cancel()
