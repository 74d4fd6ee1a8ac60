"""Issue 36, "expert declarations can be hijacked" and "`--replicate` takes over", as attacks on the DHT layout of
experts. Honest servers declare a 12-expert grid; a peer with 10 fresh identities re-declares the whole grid every
10 s, toward a dead address or toward its own server. In-memory network, MockClock."""

from __future__ import annotations

import random

import numpy as np
import trio

from dht import DHTNode
from dht.records import MAX_SUBKEYS_PER_OWNER, signed_by_subkey
from moe.beam_search import DHTGridOracle, find_best_experts
from moe.declare import (
    declaration_items,
    declare_experts,
    get_experts,
    get_prefixes,
    get_replicas,
    replica_items,
    replicas_key,
)
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from tests.dht.dht_swarm import forge_store

GRID = [f"ffn.{i}" for i in range(12)]
TTL = 30.0
REFRESH = 10.0


async def _node(network, host, initial, identity, client_mode=False, *, task_status=trio.TASK_STATUS_IGNORED):
    async with DHTNode.open(host, 4000, initial, network=network.host(host), clock=trio.current_time,
                            client_mode=client_mode, identity=identity, seed=len(host)) as dht:
        task_status.started(dht)
        await trio.sleep_forever()


async def _declare_every(dht, uids, address, period, rounds=None):
    done = 0
    while rounds is None or done < rounds:
        await declare_experts(dht, uids, address, dht.peer_id, dht.now() + TTL)
        done += 1
        await trio.sleep(period)


async def _swarm(nursery, network, count=5):
    rng = random.Random(36)
    nodes = []
    for i in range(count):
        initial = [n.address for n in nodes[-3:]]
        nodes.append(await nursery.start(_node, network, f"d{i}", initial, Identity.from_seed(rng.randbytes(32))))
    return nodes


async def test_ten_fresh_identities_cannot_take_the_grid_toward_a_dead_address_or_their_own_server(autojump_clock):
    network = MemoryNetwork(latency=0.002, seed=36)
    async with trio.open_nursery() as nursery:
        servers = await _swarm(nursery, network)
        honest = {GRID[i]: servers[i % 3] for i in range(12)}  # 3 honest daemons, 4 experts each
        addresses = {server.peer_id: (f"d{i}", 5000) for i, server in enumerate(servers[:3])}
        for server in servers[:3]:
            uids = [uid for uid, owner in honest.items() if owner is server]
            nursery.start_soon(_declare_every, server, uids, addresses[server.peer_id], REFRESH)
        await trio.sleep(1.0)
        trainer = await nursery.start(_node, network, "trainer", [servers[0].address],
                                      Identity.from_seed(b"t" * 32), True)
        # the attack: 10 fresh identities, half toward a dead address, half toward their own (lying) server,
        # re-declaring every uid every 10 s; plus forged entries naming an honest PeerID at the dead address
        attackers = []
        for n in range(10):
            identity = Identity.from_seed(bytes([n]) * 32)
            attacker = await nursery.start(_node, network, f"evil{n}", [servers[3].address], identity, True)
            target = ("127.0.0.1", 9) if n < 5 else ("evil", 6000)
            nursery.start_soon(_declare_every, attacker, GRID, target, REFRESH)
            attackers.append(attacker)
        victim = servers[0]
        for uid in GRID:
            for key, value, expiration, subkey in declaration_items([uid], ("127.0.0.1", 9), victim.peer_id,
                                                                    attackers[0].now() + 3600):
                await forge_store(attackers[0], key, value, expiration, subkey, attackers[0].identity)
        await trio.sleep(65.0)  # past two honest TTLs: every honest entry has been refreshed under attack

        found = await get_experts(trainer, GRID)
        for uid in GRID:
            assert found[uid] is not None and found[uid].peer_id_hex == honest[uid].peer_id.hex(), uid
            assert found[uid].address == addresses[honest[uid].peer_id]
        children = (await get_prefixes(trainer, ["ffn."]))["ffn."]
        assert {coord: location.peer_id_hex for coord, (_, location) in children.items()} == {
            i: honest[GRID[i]].peer_id.hex() for i in range(12)}
        # the trainer's beam search picks honest servers only, for every gate score
        oracle = DHTGridOracle(trainer, ttl=5.0)
        scores = [np.random.default_rng(1).standard_normal((8, 12))]
        chosen = await find_best_experts(oracle, "ffn", (12,), scores, 4)
        assert all(choice.location.address == addresses[honest[choice.uid].peer_id] for row in chosen for choice in row)
        # attackers appear as replicas beside the owner, one entry per identity, each signed by the PeerID it names
        replicas = await get_replicas(trainer, GRID)
        for uid in GRID:
            named = [location.peer_id_hex for location in replicas[uid]]
            assert honest[uid].peer_id.hex() in named and len(named) == len(set(named)) <= 11
        for node in servers:
            held = node.local_record(replicas_key(GRID[0]))
            for subkey, entry in (held.subkeys if held is not None else {}).items():
                assert signed_by_subkey(subkey, entry)
        nursery.cancel_scope.cancel()


async def test_a_replica_adds_itself_beside_the_owner_and_takes_over_only_when_the_owner_is_gone(autojump_clock):
    network = MemoryNetwork(latency=0.002, seed=37)
    async with trio.open_nursery() as nursery:
        servers = await _swarm(nursery, network, count=4)
        owner, replica, reader = servers[0], servers[1], servers[2]
        owner_scope = trio.CancelScope()
        nursery.start_soon(_run_in, owner_scope, _declare_every, owner, GRID[:4], ("owner", 1), REFRESH)
        await trio.sleep(1.0)
        nursery.start_soon(_declare_every, replica, GRID[:4], ("replica", 1), REFRESH)  # declares last
        await trio.sleep(25.0)
        found = await get_experts(reader, GRID[:4])
        assert {location.address for location in found.values()} == {("owner", 1)}
        replicas = await get_replicas(reader, GRID[:4])
        assert all({loc.address for loc in replicas[uid]} == {("owner", 1), ("replica", 1)} for uid in GRID[:4])
        owner_scope.cancel()  # the owner dies: its entries expire after TTL, then the replica's refresh wins
        await trio.sleep(TTL + 2 * REFRESH)
        found = await get_experts(reader, GRID[:4])
        assert {location.address for location in found.values()} == {("replica", 1)}
        nursery.cancel_scope.cancel()


async def _run_in(scope, fn, *args):
    with scope:
        await fn(*args)


async def test_one_identity_declares_at_most_the_per_owner_cap_of_a_prefix(autojump_clock):
    """A storing node keeps at most MAX_SUBKEYS_PER_OWNER coordinates of one prefix per PeerID."""
    network = MemoryNetwork(latency=0.002, seed=38)
    async with trio.open_nursery() as nursery:
        servers = await _swarm(nursery, network, count=4)
        greedy = servers[3]
        wide = [f"wide.{i}" for i in range(3 * MAX_SUBKEYS_PER_OWNER)]
        await declare_experts(greedy, wide, ("greedy", 1), greedy.peer_id, greedy.now() + 600)
        children = (await get_prefixes(servers[0], ["wide."]))["wide."]
        assert 0 < len(children) <= MAX_SUBKEYS_PER_OWNER
        # replica items name the declarer's own PeerID: anyone else's is refused before it leaves
        assert replica_items(["wide.0"], ("h", 1), greedy.peer_id, 1.0)[0][3] == bytes(greedy.peer_id)
        nursery.cancel_scope.cancel()
