"""Issue 36, "a reducer chooses how much it reduces" and "a lying reducer": the share of the vector a reducer
takes is capped by the group, whatever bandwidth it declares; a reducer returning a wrong averaged part is
caught by cross-reduction and banned, and clean runs ban no one (in-memory network, MockClock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from swarm_helpers import Swarm, random_tensors

from averaging.group import GroupInfo
from averaging.partition import MAX_SHARE_RATIO, Partition, share_weights


def test_a_huge_bandwidth_claim_is_capped_at_twice_the_median_share():
    partition = Partition([1000, 1000], [4, 4], [1.0, 1e9, 1.0, 1.0], chunk_bytes=4096)
    sizes = [partition.part_of(m).numel for m in range(4)]
    assert sizes == [400, 800, 400, 400]  # 2 / (1 + 2 + 1 + 1) of the vector, not all of it
    assert share_weights([1.0, 1e9]) == [1.0, 2.0]  # two reducers: the smaller claim sets the cap
    assert share_weights([0.0, 3.0, 1e9, 3.0]) == [0.0, 3.0, 6.0, 3.0]  # no part for a zero claim
    assert share_weights([5.0]) == [5.0]
    ordinary = [1.0, 1.5, 0.8, 1.2]
    assert share_weights(ordinary) == ordinary  # claims within 2x of the median are unchanged
    with pytest.raises(ValueError):
        share_weights([1.0, 2.0], max_ratio=0.5)


@pytest.fixture
def clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_reducer_declaring_1e9_reduces_no_more_than_its_capped_share(clock):
    swarm = Swarm("memory")
    tensor_sets = [random_tensors(seed) for seed in range(4)]
    async with trio.open_nursery() as nursery:
        peers = await swarm.start(nursery, 4)
        liar = peers[2]
        group = GroupInfo.create(b"bw", [p.member(bandwidth=1e9 if p is liar else 1.0) for p in peers])
        for peer, tensors in zip(peers, tensor_sets):
            peer.start_round(group, tensors, timeout=30)
        with trio.fail_after(60):
            for peer in peers:
                await peer.done.wait()
        nursery.cancel_scope.cancel()
    total = sum(t.numel() for t in tensor_sets[0])
    partition = Partition.for_tensors(tensor_sets[0], [m.bandwidth for m in group.members])
    reduced_by_liar = [partition.parts[info["part"]].numel for name, event, info in swarm.events
                       if event == "reduced" and name == liar.name]
    assert len(reduced_by_liar) == 1
    assert reduced_by_liar[0] <= MAX_SHARE_RATIO / (MAX_SHARE_RATIO + 3) * total + 1  # 2/5, not all
    for peer in peers:
        assert peer.error is None and peer.result.fully_averaged
        assert peer.result.part_owners.count(liar.peer_id) == 1 and len(peer.result.part_owners) == 4
