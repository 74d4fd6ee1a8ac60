"""Self-healing routing tables (the frozen-daemon defect): a frozen peer is not dead.

What users hit: `peer join` daemons were SIGSTOPped one at a time for 9 s; the trainer's client-mode DHT evicted
each after a few unanswered requests, never re-added any of them once they ran again, and, with an empty table,
had nobody left to ask. Here the same happens on the in-memory network under MockClock: `freeze(host)` makes a
host stop answering without any reset (as SIGSTOP does), `heal()` lets it answer again.

Everything is seeded (identities, message ids, network, the choice of frozen hosts), so a run is reproducible.
"""

from __future__ import annotations

import random

import trio
from dht_swarm import RunningNode, start_node, start_swarm

from dht import DHTConfig
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork

FAR = 1e9  # expiration far in the future (virtual DHT clock)


async def _servers(nursery: trio.Nursery, network: MemoryNetwork, count: int, seed: int,
                   config: DHTConfig | None = None) -> list[RunningNode]:
    return await start_swarm(nursery, [f"s{i}" for i in range(count)], network.host, random.Random(seed),
                             clock=trio.current_time, config=config or DHTConfig())


async def _client(nursery: trio.Nursery, network: MemoryNetwork, name: str, initial: list, seed: int,
                  config: DHTConfig | None = None) -> RunningNode:
    return await start_node(nursery, name, initial, network=network.host(name), client_mode=True,
                            clock=trio.current_time, config=config or DHTConfig(),
                            identity=Identity.from_seed(f"heal:{name}:{seed}".encode()), seed=seed)


async def _use_until_evicted(client: RunningNode, victim: RunningNode) -> None:
    """Read through the client (as a trainer does every step) until the frozen victim left its table."""
    with trio.fail_after(120):
        while victim.node.peer_id in client.node.routing_table_ids():
            await client.node.get("probe-key")
            await trio.sleep(0.5)


async def _recovered_within(seconds: float, client: RunningNode, servers: list[RunningNode]) -> float:
    """Virtual seconds until the client's table holds every server again and a `get` returns the stored value;
    fails the test after `seconds`."""
    started = trio.current_time()
    wanted = {s.node.peer_id for s in servers}
    with trio.fail_after(seconds):
        while True:
            record = await client.node.get("probe-key")
            if wanted <= set(client.node.routing_table_ids()) and record is not None and record.value == "v":
                return trio.current_time() - started
            await trio.sleep(0.25)


async def _three_servers_and_a_trainer(nursery: trio.Nursery, seed: int,
                                      holder: int) -> tuple[MemoryNetwork, list[RunningNode], RunningNode]:
    """Three servers on an in-memory network, `servers[holder]` storing the probe record, and a trainer's client
    joined through the first; returns (network, servers, client)."""
    network = MemoryNetwork(latency=0.005, seed=seed)
    servers = await _servers(nursery, network, 3, seed=seed)
    assert await servers[holder].node.store("probe-key", "v", FAR)
    client = await _client(nursery, network, "trainer", [servers[0].node.address], seed=seed)
    return network, servers, client


async def test_client_whose_three_servers_all_froze_finds_them_again(autojump_clock):
    async with trio.open_nursery() as nursery:
        network, servers, client = await _three_servers_and_a_trainer(nursery, seed=11, holder=1)
        assert len(client.node.routing_table_ids()) == 3
        for server in servers:  # frozen one after the other, and kept frozen: the table drains to nothing
            network.freeze(server.node.address[0])
            await _use_until_evicted(client, server)
        assert client.node.routing_table_ids() == []
        assert await client.node.get("probe-key") is None  # nobody to ask (said in one log line, not raised)
        await trio.sleep(30)  # still frozen: whatever retrying the client does has backed off to its slowest
        network.heal()
        await _recovered_within(10, client, servers)
        with trio.fail_after(10):  # lookups asked the remembered servers anyway; the healing task rejoins too
            while client.node.stats()["cut_off"]:
                await trio.sleep(0.25)
        stats = client.node.stats()
        assert stats["rebootstraps"] >= 1
        assert stats["lookups_without_peers"] >= 1
        nursery.cancel_scope.cancel()


async def test_client_survives_its_servers_freezing_one_at_a_time(autojump_clock):
    """The reported sequence: each server frozen until the client evicted it, then running again."""
    async with trio.open_nursery() as nursery:
        network, servers, client = await _three_servers_and_a_trainer(nursery, seed=12, holder=2)
        for server in servers:
            network.freeze(server.node.address[0])
            await _use_until_evicted(client, server)
            await trio.sleep(9)
            network.heal()
            await _recovered_within(10, client, servers)
        assert client.node.stats()["contacts_restored"] >= 3
        nursery.cancel_scope.cancel()


async def test_server_whose_only_contact_froze_rejoins(autojump_clock):
    """Volunteers heal the same way: a server that evicted the only peer it knew asks it again later."""
    network = MemoryNetwork(latency=0.005, seed=13)
    async with trio.open_nursery() as nursery:
        first, second = await _servers(nursery, network, 2, seed=13)
        network.freeze(first.node.address[0])
        with trio.fail_after(120):
            while second.node.routing_table_ids():
                await second.node.get("anything")
                await trio.sleep(0.5)
        await trio.sleep(20)
        network.heal()
        with trio.fail_after(10):
            while first.node.peer_id not in second.node.routing_table_ids():
                await trio.sleep(0.25)
        assert await second.node.store("after", 1, FAR)
        assert (await first.node.get("after")).value == 1
        nursery.cancel_scope.cancel()


async def test_random_freezes_in_a_64_peer_swarm_heal_after_everyone_runs_again(autojump_clock):
    seed = 21
    rng = random.Random(seed)
    network = MemoryNetwork(latency=0.005, seed=seed)
    async with trio.open_nursery() as nursery:
        servers = await _servers(nursery, network, 64, seed=seed)
        hosts = [s.node.address[0] for s in servers]
        clients = [await _client(nursery, network, f"c{i}", [s.node.address for s in rng.sample(servers, 2)],
                                 seed=seed + i) for i in range(4)]
        keys = [f"key{i}" for i in range(20)]
        for index, key in enumerate(keys):
            assert await servers[index].node.store(key, index, FAR)
        before = {c.node.peer_id: len(c.node.routing_table_ids()) for c in clients}

        async def traffic(client: RunningNode, traffic_rng: random.Random) -> None:
            """Each client reads (and now and then writes) all the time, as a trainer does."""
            while True:
                if traffic_rng.random() < 0.2:
                    await client.node.store(f"w{traffic_rng.randrange(1000)}", 1, FAR)
                else:
                    await client.node.get(traffic_rng.choice(keys))
                await trio.sleep(0.25 + 0.5 * traffic_rng.random())

        async with trio.open_nursery() as load:
            for index, client in enumerate(clients):
                load.start_soon(traffic, client, random.Random(seed * 100 + index))
            for _wave in range(4):  # waves of freezes: a random half of the servers hangs for 5 to 20 s
                frozen = rng.sample(hosts, len(hosts) // 2)
                for host in frozen:
                    network.freeze(host)
                await trio.sleep(rng.uniform(5, 20))
                network.heal()
                await trio.sleep(rng.uniform(1, 3))
            load.cancel_scope.cancel()

        # everyone runs again: within a bounded virtual time each client's table is full again and works
        with trio.fail_after(60):
            for client in clients:
                while len(client.node.routing_table_ids()) < 0.9 * before[client.node.peer_id]:
                    await trio.sleep(0.5)
        for client in clients:
            found = await client.node.get_many(keys)
            assert all(found[key] is not None and found[key].value == index for index, key in enumerate(keys))
            assert await client.node.store(f"after:{client.node.peer_id}", "ok", FAR)
        nursery.cancel_scope.cancel()
