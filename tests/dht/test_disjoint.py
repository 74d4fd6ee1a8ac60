"""Lookups over disjoint paths (S/Kademlia) and the vote that decides a key's value (issue 15, item 6).

The lookup core and the vote are plain objects, driven here directly; a small in-memory swarm checks the node
runs them end to end (the 10,000-node adversarial simulation is tests/dht/test_adversarial_sim.py)."""

from __future__ import annotations

import random

import trio
from dht_swarm import start_node, start_swarm

from dht import DHTConfig, records
from dht.lookup import State, Target
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork

SELF_ID = bytes(20)


def node_id(n: int) -> bytes:
    return n.to_bytes(20, "big")


def test_starting_candidates_are_dealt_round_robin_and_each_path_asks_its_own():
    target = Target(node_id(0), k=4, alpha=2, paths=3)
    for n in range(1, 10):
        target.add(node_id(n), ("10.0.0.1", n))
    assert [target.candidates[node_id(n)].path for n in range(1, 10)] == [0, 1, 2] * 3
    asked = target.next_candidates()
    assert sorted((c.path, c.node_id) for c in asked) == sorted(
        (p, node_id(n)) for p, n in [(0, 1), (0, 4), (1, 2), (1, 5), (2, 3), (2, 6)])


def test_a_contact_another_path_holds_is_ignored_by_id_and_by_address():
    target = Target(node_id(0), k=4, alpha=2, paths=2)
    target.add(node_id(1), ("10.0.0.1", 1))  # path 0
    target.add(node_id(2), ("10.0.0.1", 2))  # path 1
    target.set_state(target.candidates[node_id(1)], State.ACTIVE)
    # the peer on path 0 names path 1's peer, a fresh id at path 1's address, and a genuinely new contact
    target.on_answer(node_id(1), [(node_id(2), "10.0.0.1", 2), (node_id(7), "10.0.0.1", 2),
                                  (node_id(8), "10.0.0.8", 8)], None, False, SELF_ID)
    assert target.candidates[node_id(2)].path == 1
    assert node_id(7) not in target.candidates  # a liar cannot pull the other path's peer in under a new id
    assert target.candidates[node_id(8)].path == 0


def test_single_path_keeps_plain_kademlia_behaviour_for_shared_addresses():
    target = Target(node_id(0), k=4, alpha=2)
    target.add(node_id(1), ("127.0.0.1", 5))
    assert target.add(node_id(2), ("127.0.0.1", 5))  # one path: nothing to keep apart


def test_the_key_is_done_only_when_every_path_is():
    target = Target(node_id(0), k=2, alpha=2, paths=2)
    for n in (1, 2, 3, 4):
        target.add(node_id(n), ("10.0.0.1", n))
    for candidate in target.next_candidates():
        target.set_state(candidate, State.ACTIVE)
    for n in (1, 3):  # path 0 answered completely
        target.on_answer(node_id(n), [], None, False, SELF_ID)
    assert target.path_finished(0) and not target.path_finished(1) and not target.finished()
    for n in (2, 4):
        target.on_answer(node_id(n), [], None, False, SELF_ID)
    assert target.finished()
    assert [c.node_id for c in target.answered()] == [node_id(n) for n in (1, 2, 3, 4)]


def test_value_quorum_is_counted_per_path():
    key = node_id(0)
    target = Target(key, k=4, alpha=2, want_value=True, quorum=1, paths=2)
    for n in (1, 2, 3, 4):
        target.add(node_id(n), ("10.0.0.1", n))
    for candidate in target.next_candidates():
        target.set_state(candidate, State.ACTIVE)
    target.on_answer(node_id(1), [], records.decode(key, "v", 0.0), True, SELF_ID)
    assert target.path_finished(0) and not target.finished()
    target.on_answer(node_id(2), [], records.decode(key, "v", 0.0), True, SELF_ID)
    assert target.finished() and [len(v) for v in target.path_values] == [1, 1]


def test_each_paths_records_come_closest_replica_first_whatever_order_they_answered_in():
    key = node_id(0)
    target = Target(key, k=8, alpha=4, want_value=True, paths=1)
    for n in (1, 2, 3, 4):
        target.add(node_id(n), ("10.0.0.1", n))
    for candidate in target.next_candidates():
        target.set_state(candidate, State.ACTIVE)
    for n in (3, 1, 4, 2):  # the farther replicas answer first
        target.on_answer(node_id(n), [], records.decode(key, f"v{n}", 0.0), True, SELF_ID)
    target.add_local(5, records.decode(key, "mine", 0.0))  # this node's own copy, by its distance (5)
    assert [r.value for r in target.path_records()[0]] == ["v1", "v2", "v3", "v4", "mine"]


def test_a_frugal_quick_get_keeps_no_more_queries_active_than_replicas_it_still_lacks():
    key = node_id(0)
    target = Target(key, k=8, alpha=3, want_value=True, quorum=3, frugal=True)
    for n in range(1, 9):
        target.add(node_id(n), ("10.0.0.1", n))
    target.add_local(1 << 150, records.decode(key, "mine", 0.0))  # this node's own copy is one of the 3
    asked = target.next_candidates()
    assert [c.node_id for c in asked] == [node_id(1), node_id(2)]  # alpha is 3, but only 2 replicas are missing
    for candidate in asked:
        target.set_state(candidate, State.ACTIVE)
    assert target.next_candidates() == []
    target.on_answer(node_id(1), [], records.decode(key, "v", 0.0), True, SELF_ID)
    assert target.next_candidates() == []  # one replica still missing, and one query is on its way for it
    target.on_answer(node_id(2), [], None, False, SELF_ID)  # it had nothing: its slot goes to the next peer
    assert [c.node_id for c in target.next_candidates()] == [node_id(3)]
    target.set_state(target.candidates[node_id(3)], State.ACTIVE)
    target.on_slow(node_id(3))  # gone quiet: a slow query frees its slot too
    assert [c.node_id for c in target.next_candidates()] == [node_id(4)]
    # a default quick get, and a lookup without a quorum (a store's, or latest=True), keep alpha queries active
    for full in (Target(key, k=8, alpha=3, want_value=True, quorum=3), Target(key, k=8, alpha=3, want_value=True),
                 Target(key, k=8, alpha=3, want_value=True, frugal=True)):
        for n in range(1, 9):
            full.add(node_id(n), ("10.0.0.1", n))
        full.add_local(1 << 150, records.decode(key, "mine", 0.0))
        assert len(full.next_candidates()) == 3


# ------------------------------------------------------------------------------------------------- the vote


KEY = node_id(99)


def unsigned(value, expiration) -> records.Record:
    return records.record_for_store(KEY, value, expiration)


def signed(identity: Identity, value, expiration) -> records.Record:
    return records.record_for_store(KEY, value, expiration, identity=identity)


def test_a_forged_later_unsigned_value_on_a_minority_of_paths_loses():
    honest, forged = unsigned("v2", 200.0), unsigned("forged", 1e9)
    paths = [[honest, honest, forged], [honest, honest], [forged, forged, honest]]
    assert records.resolve(paths, 0.0).value == "v2"
    # the plain merge would have taken the forged value (its expiration is later)
    merged = None
    for record in (r for found in paths for r in found):
        merged = records.merge(merged, record, 0.0)
    assert merged.value == "forged"


def test_the_most_recent_value_of_a_majority_wins_over_a_stale_one():
    old, new = unsigned("v1", 100.0), unsigned("v2", 200.0)
    assert records.resolve([[new], [new, old], [old, old, new], [new]], 0.0).value == "v2"
    assert records.resolve([[old], [old], [new]], 0.0).value == "v1"  # stale on most paths: the vote decides


def test_without_a_majority_the_claim_of_most_paths_wins():
    a, b, c = unsigned("a", 100.0), unsigned("b", 300.0), unsigned("c", 200.0)
    assert records.resolve([[a], [a], [b], [c], []], 0.0).value == "a"
    assert records.resolve([[a], [c]], 0.0).value == "c"  # a tie: the most recent
    assert records.resolve([[a, a, a], [b], [b, b], [a]], 0.0).value == "a"  # two paths each: more replicas win


def test_a_value_signed_by_a_liar_cannot_take_over_an_unsigned_key():
    liar = Identity.from_seed(b"liar")
    honest, claimed = unsigned("v2", 200.0), signed(liar, "mine", 1e9)
    assert records.resolve([[honest], [honest, honest, claimed], [claimed]], 0.0).value == "v2"


def test_signed_values_take_the_owners_newest_entry_from_any_path():
    owner = Identity.from_seed(b"owner")
    old, new = signed(owner, "v1", 100.0), signed(owner, "v2", 200.0)
    assert records.resolve([[old], [old], [new]], 0.0).value == "v2"  # one path with the newest suffices


def test_subkeys_merge_across_paths_and_plain_values_stay_stock():
    first = records.record_for_store(KEY, 1, 100.0, subkey="a")
    second = records.record_for_store(KEY, 2, 100.0, subkey="b")
    result = records.resolve([[first], [second]], 0.0)
    assert sorted(result.subkeys) == ["a", "b"] and result.entry is None
    plain = records.decode(KEY, "plain", 0.0)
    resolved = records.resolve([[plain], [plain]], 0.0)
    assert resolved.stock and records.encode(resolved) == "plain"
    assert records.resolve([[], []], 0.0) is None


# ------------------------------------------------------------------------------------------------ end to end


async def test_a_swarm_reads_and_writes_over_disjoint_paths_and_the_validator_filters(autojump_clock):
    rng = random.Random(5)
    network = MemoryNetwork(latency=0.005, seed=5)
    config = DHTConfig(disjoint_paths=3)
    hosts = [f"n{i}" for i in range(30)]
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, hosts, network.host, rng, config=config)
        expiration = swarm[0].node.now() + 3600
        for index in range(20):
            assert await rng.choice(swarm).node.store(f"key-{index}", f"old-{index}", expiration)
            assert await rng.choice(swarm).node.store(f"key-{index}", f"new-{index}", expiration + 1)
        for index in range(20):
            reader = rng.choice(swarm).node
            assert (await reader.get(f"key-{index}", latest=True)).value == f"new-{index}"
            assert (await reader.get(f"key-{index}")).value == f"new-{index}"
        assert await swarm[1].node.store("bad", "refused", expiration)
        # with d*k = 60 replicas every server holds it; a client reader holds nothing and asks the network
        reader = (await start_node(nursery, "reader", [swarm[0].node.address], network=network.host("reader"),
                                   config=config, client_mode=True,
                                   validator=lambda key_id, record: record.value != "refused")).node
        assert (await reader.get("key-0")).value == "new-0"
        assert await reader.get("bad", latest=True) is None
        assert reader.stats()["dropped"]["rejected_record"] >= 1
        nursery.cancel_scope.cancel()


def test_an_update_most_replicas_got_beats_the_stale_value_beside_it_but_one_liar_per_path_does_not_count():
    old, new, forged = unsigned("v1", 100.0), unsigned("v2", 200.0), unsigned("forged", 1e9)
    paths = [[new] * 10 + [old] * 6 + [forged], [new] * 9 + [old] * 7, [old] * 8 + [new] * 5 + [forged]]
    assert records.resolve(paths, 0.0).value == "v2"  # v2 is seen on all three paths, v1 too: the newest wins
    assert records.resolve([[new] * 4 + [forged]] * 3, 0.0).value == "v2"  # a fifth of a path is not "seen"


def test_only_each_paths_closest_replicas_vote_so_far_replicas_an_earlier_writer_reached_do_not_outvote_them():
    """One stale read of the 10,000-node simulation, in small: the latest write reached the key's closest
    replicas of every path, the first write had also spread farther out, where the reader's windows ended."""
    old, new = unsigned("v1", 100.0), unsigned("v2", 200.0)
    subkeyed = records.Record(None, {b"s": records.Entry("far", 300.0)})  # a subkey only a far replica holds
    paths = [[new, old, new, new, new] + [old] * 13, [new] * 4 + [old] * 12,
             [new] * 3 + [old] * 7 + [subkeyed], [new] * 3 + [old] * 2 + [new] * 2 + [old] * 8]
    assert records.resolve(paths, 0.0).value == "v1"  # every replica votes: v1 is seen on all four paths
    result = records.resolve(paths, 0.0, voters=5)
    assert result.value == "v2"  # among the closest five v2 is seen on every path, v1 on two of the four
    assert result.subkeys[b"s"].value == "far"  # subkeys still merge over every replica
    assert records.resolve([[new, old, old], [new, old, old], [old]], 0.0).value == "v1"
    assert records.resolve([[new, old, old], [new, old, old], [old]], 0.0, voters=1).value == "v2"
