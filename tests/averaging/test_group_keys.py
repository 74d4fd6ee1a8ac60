"""Moshpit group keys: the grid makes repeated small-group rounds reach the exact global mean."""

import random
from collections import defaultdict

import pytest

from averaging.assembly import Declaration, plan_groups, round_salt
from averaging.group_keys import GroupKeyManager, bits_for_group_size
from peer.p2p.identity import PeerID


def _declaration(peer_id: bytes, round: int) -> Declaration:
    return Declaration(PeerID(peer_id), ("h", 1), 1.0, False, b"s" * 8, round, 10.0, 0.0)


def _simulate(num_peers: int, group_size: int, nbits: int, rounds: int, seed: int) -> list[float]:
    """Every peer matchmakes under its key; groups are the plan every peer derives; members average exactly."""
    rng = random.Random(seed)
    ids = [bytes(rng.getrandbits(8) for _ in range(20)) for _ in range(num_peers)]
    values = {peer: rng.uniform(-10, 10) for peer in ids}
    keys = {peer: GroupKeyManager("run", target_group_size=group_size, nbits=nbits) for peer in ids}
    for _ in range(rounds):
        by_key = defaultdict(list)
        for peer in ids:
            by_key[keys[peer].key].append(_declaration(peer, keys[peer].round))
        for key, declarations in by_key.items():
            for chunk in plan_groups(declarations, group_size, salt=round_salt(key, declarations)):
                members = sorted(d.peer_id for d in chunk)
                mean = sum(values[p] for p in members) / len(members)
                group_round = max(d.round for d in chunk)
                for peer in members:
                    values[peer] = mean
                    keys[peer].on_group(members, peer, group_round)
    return [values[p] for p in ids], sum(values.values()) / num_peers


@pytest.mark.parametrize("seed", range(5))
def test_eight_peers_groups_of_two_three_bits_reach_global_mean_in_three_rounds(seed):
    rng = random.Random(seed)
    ids = [bytes(rng.getrandbits(8) for _ in range(20)) for _ in range(8)]
    initial = {peer: rng.uniform(-10, 10) for peer in ids}
    global_mean = sum(initial.values()) / 8
    values = dict(initial)
    keys = {peer: GroupKeyManager("run", target_group_size=2, nbits=3) for peer in ids}
    for _round_index in range(3):
        by_key = defaultdict(list)
        for peer in ids:
            by_key[keys[peer].key].append(_declaration(peer, keys[peer].round))
        for key, declarations in by_key.items():
            for chunk in plan_groups(declarations, 2, salt=round_salt(key, declarations)):
                assert len(chunk) == 2
                members = sorted(d.peer_id for d in chunk)
                mean = sum(values[p] for p in members) / 2
                for peer in members:
                    values[peer] = mean
                    keys[peer].on_group(members, peer, max(d.round for d in chunk))
    assert all(abs(v - global_mean) < 1e-9 for v in values.values())
    # the grid is now perfect: every key holds exactly one group of two
    counts = defaultdict(int)
    for peer in ids:
        counts[keys[peer].key] += 1
    assert sorted(counts.values()) == [2, 2, 2, 2]


def test_sixteen_peers_groups_of_four_two_dimensions():
    values, mean = _simulate(16, 4, nbits=4, rounds=2, seed=3)
    assert all(abs(v - mean) < 1e-9 for v in values)


def test_imperfect_population_still_converges():
    values, mean = _simulate(11, 2, nbits=3, rounds=30, seed=7)
    assert max(abs(v - mean) for v in values) < 1e-3


def test_key_names_the_averaged_dimension_and_the_other_coordinates():
    keys = GroupKeyManager("m", target_group_size=2, nbits=3, coordinates=[1, 0, 1])
    assert keys.key == "m.averaging.*01"
    keys.on_group([b"a", b"b"], b"a", group_round=0)
    assert keys.coordinates == [0, 0, 1] and keys.round == 1
    assert keys.key == "m.averaging.0*1"
    keys.on_failure()
    assert keys.round == 2 and keys.key == "m.averaging.00*"


def test_group_round_pulls_a_straggler_into_phase():
    keys = GroupKeyManager("m", target_group_size=2, nbits=2)
    keys.on_group([b"a", b"b"], b"b", group_round=6)
    assert keys.round == 7


def test_single_key_without_bits():
    keys = GroupKeyManager("m", target_group_size=4)
    assert keys.key == "m.averaging" and keys.dimension is None
    keys.on_group([b"a", b"b"], b"b", group_round=0)
    assert keys.key == "m.averaging" and keys.round == 1


def test_single_key_regroups_every_round():
    """With one key, the round-salted order puts different peers together each round, so it mixes too."""
    values, mean = _simulate(16, 4, nbits=0, rounds=16, seed=1)
    assert max(abs(v - mean) for v in values) < 1e-3


def test_invalid_configuration_is_refused():
    assert bits_for_group_size(2) == 1 and bits_for_group_size(4) == 2 and bits_for_group_size(5) == 3
    with pytest.raises(ValueError):
        GroupKeyManager("m", target_group_size=4, nbits=3)
    with pytest.raises(ValueError):
        GroupKeyManager("m", target_group_size=2, nbits=2, coordinates=[0, 2])
