"""Routing-table limits against cheap Sybils and proof-of-work PeerIDs (issue 15, item 6)."""

from __future__ import annotations

import random

import pytest
import trio
from dht_swarm import start_node
from kademlia.node import Node

from dht import DHTConfig
from dht.routing import NO_LIMITS, RoutingTable, TableLimits, has_work, identity_with_work, work_bits
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork

SELF = bytes(20)


def ids(rng: random.Random, count: int, top: int = 1) -> list[bytes]:
    """Random ids whose first bit is `top` (so they share a bucket away from SELF = 0...)."""
    return [((top << 159) | rng.getrandbits(159)).to_bytes(20, "big") for _ in range(count)]


def test_one_ip_holds_at_most_its_share_of_a_bucket_and_of_the_table():
    rng = random.Random(1)
    table = RoutingTable(SELF, k=20, limits=TableLimits(per_ip_bucket=2, per_ip=3, per_prefix=None))
    for index, node_id in enumerate(ids(rng, 8) + ids(rng, 16, top=0)):  # enough to split the first bucket
        table.add(Node(node_id, f"10.0.{index}.1", 1), 0.0)
    assert len(table.buckets) > 1
    base = len(table)
    for node_id in ids(rng, 5):
        table.add(Node(node_id, "203.0.113.7", rng.randrange(1, 65535)), 0.0)
    assert len(table) == base + 2 and table.refused["table_ip_limit"] == 3
    for node_id in ids(rng, 5, top=0):  # another bucket: the IP's table-wide share (3) binds now
        table.add(Node(node_id, "203.0.113.7", rng.randrange(1, 65535)), 0.0)
    assert len(table) == base + 3
    other = ids(rng, 1)[0]
    table.add(Node(other, "198.51.100.1", 1), 0.0)  # other IPs are unaffected
    assert other in table
    # a refreshed contact is never refused, and removing one frees its slot
    present = next(n for n in table.nodes() if n.ip == "203.0.113.7" and n.long_id >> 159 == 1)
    table.add(present, 1.0)
    assert present.id in table
    table.remove(present.id)
    newcomer = ids(rng, 1)[0]
    table.add(Node(newcomer, "203.0.113.7", 9), 2.0)
    assert newcomer in table


def test_ipv6_hosts_of_one_64_share_a_limit_and_loopback_is_exempt():
    rng = random.Random(2)
    table = RoutingTable(SELF, k=20, limits=TableLimits(per_ip_bucket=1, per_ip=None, per_prefix=None))
    table.add(Node(ids(rng, 1)[0], "2001:db8::1", 1), 0.0)
    table.add(Node(ids(rng, 1)[0], "2001:db8::2", 1), 0.0)
    assert len(table) == 1
    for node_id in ids(rng, 10):
        table.add(Node(node_id, "127.0.0.1", rng.randrange(1, 65535)), 0.0)
    assert len(table) == 11  # a swarm on one machine is not a Sybil attack


def test_ids_packed_into_one_slice_of_a_bucket_are_capped():
    rng = random.Random(3)
    table = RoutingTable(SELF, k=20, limits=TableLimits(per_ip_bucket=None, per_ip=None, per_prefix=4,
                                                        prefix_bits=3))
    packed = [((0b1111 << 156) | rng.getrandbits(156)).to_bytes(20, "big") for _ in range(10)]
    for index, node_id in enumerate(packed):
        table.add(Node(node_id, f"10.0.{index}.1", 1), 0.0)
    assert len(table) == 4 and table.refused["table_prefix_limit"] == 6
    # ids spread over the rest of the range still enter (three in each of three other slices)
    spread = [((top << 157) | rng.getrandbits(157)).to_bytes(20, "big") for top in (0b100, 0b101, 0b110) * 3]
    for index, node_id in enumerate(spread):
        table.add(Node(node_id, f"10.1.{index}.1", 1), 0.0)
    assert all(node_id in table for node_id in spread) and table.refused["table_prefix_limit"] == 6


def test_without_limits_a_table_takes_anyone():
    rng = random.Random(4)
    table = RoutingTable(SELF, k=20, limits=NO_LIMITS)
    for node_id in ids(rng, 20):
        table.add(Node(node_id, "203.0.113.7", 1), 0.0)
    assert len(table) == 20


def test_proof_of_work_ids():
    identity = identity_with_work(6)
    assert work_bits(identity.peer_id) >= 6 and has_work(identity.peer_id, 6)
    assert has_work(b"\x00" * 20, 0)
    lazy = next(i for i in (Identity.from_seed(bytes([n])) for n in range(64)) if work_bits(i.peer_id) == 0)
    table = RoutingTable(SELF, k=20, limits=TableLimits(difficulty=6))
    table.add(Node(lazy.peer_id, "10.0.0.1", 1), 0.0)
    table.add(Node(identity.peer_id, "10.0.0.2", 1), 0.0)
    assert lazy.peer_id not in table and identity.peer_id in table
    assert table.refused["table_insufficient_work"] == 1


async def test_a_swarm_with_proof_of_work_ignores_nodes_without_it(autojump_clock):
    network = MemoryNetwork(latency=0.002, seed=9)
    config = DHTConfig(id_difficulty=4)
    worked = [identity_with_work(4) for _ in range(4)]
    lazy = next(i for i in (Identity.from_seed(b"lazy" + bytes([n])) for n in range(64))
                if work_bits(i.peer_id) < 4)
    async with trio.open_nursery() as nursery:
        first = await start_node(nursery, "w0", network=network.host("w0"), config=config, identity=worked[0])
        others = [await start_node(nursery, f"w{i}", [first.node.address], network=network.host(f"w{i}"),
                                   config=config, identity=worked[i]) for i in range(1, 4)]
        # the lazy node runs without the requirement itself, so it can ask; nobody lets it into a table
        intruder = await start_node(nursery, "lazy", [first.node.address], network=network.host("lazy"),
                                    identity=lazy)
        assert await others[0].node.store("k", "v", others[0].node.now() + 60)
        assert (await intruder.node.get("k")).value == "v"  # it may read, as any client may
        for running in [first, *others]:
            assert lazy.peer_id not in running.node.routing_table_ids()
            assert len(running.node.routing_table_ids()) == 3
        assert first.node.stats()["dropped"]["table_insufficient_work"] >= 1
        with pytest.raises(ValueError, match="bits of work"):
            await start_node(nursery, "lazy2", network=network.host("lazy2"), config=config, identity=lazy)
        nursery.cancel_scope.cancel()


def test_refresh_moves_only_a_contact_held_at_that_address_and_keeps_the_ip_counts():
    rng = random.Random(7)
    table = RoutingTable(SELF, k=4, limits=TableLimits(per_ip_bucket=None, per_ip=4, per_prefix=None))
    first, second, third = ids(rng, 3)
    for index, node_id in enumerate((first, second, third)):
        table.add(Node(node_id, "203.0.113.7", 100 + index), 0.0)
    bucket = table.buckets[table.bucket_index(int.from_bytes(first, "big"))]
    assert list(bucket.nodes) == [first, second, third]
    assert table.refresh(first, ("203.0.113.7", 100), 5.0)
    assert list(bucket.nodes) == [second, third, first] and bucket.swarmd_touched == 5.0
    # another port, an unknown id: not the held contact, so nothing moves or is added
    assert not table.refresh(second, ("203.0.113.7", 999), 6.0)
    assert not table.refresh(ids(rng, 1)[0], ("203.0.113.7", 100), 6.0)
    assert list(bucket.nodes) == [second, third, first] and bucket.swarmd_touched == 5.0
    # refreshing and re-adding held contacts counts none of them twice against the IP's share of 4
    table.add(Node(second, "203.0.113.7", 101), 7.0)
    fourth = ids(rng, 1)[0]
    table.add(Node(fourth, "203.0.113.7", 103), 7.0)
    assert fourth in table and len(table) == 4
    table.add(Node(ids(rng, 1)[0], "203.0.113.7", 104), 7.0)
    assert len(table) == 4 and table.refused["table_ip_limit"] == 1
