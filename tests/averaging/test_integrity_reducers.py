"""Issue 36, "a reducer chooses how much it reduces" and "a lying reducer": the share of the vector a reducer
takes is capped by the group, whatever bandwidth it declares; a reducer returning a wrong averaged part is
caught by cross-reduction and banned, and clean runs ban no one (in-memory network, MockClock)."""

from __future__ import annotations

import random

import pytest
import torch
import trio
import trio.testing
from swarm_helpers import Swarm, random_tensors

from averaging.allreduce import PULL
from averaging.allreduce_core import AllReduceConfig
from averaging.group import GroupInfo
from averaging.partition import MAX_SHARE_RATIO, Partition, chunk_views, share_weights
from averaging.robust import Aggregation, Strikes


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


def _small(generator: torch.Generator, base: list[torch.Tensor], noise: float) -> list[torch.Tensor]:
    return [b + noise * torch.randn(b.shape, generator=generator) for b in base]


def _cross_checked_config() -> AllReduceConfig:
    return AllReduceConfig(chunk_bytes=256, aggregation=Aggregation("centered_clip"), cross_check_rate=1.0)


async def _round(peers, group, tensor_sets, timeout=30.0):
    for peer, tensors in zip(peers, tensor_sets):
        peer.done = trio.Event()
        peer.result = peer.error = None
        peer.start_round(group, tensors, timeout=timeout)
    with trio.fail_after(120):
        for peer in peers:
            await peer.done.wait()
    for peer in peers:
        assert peer.error is None, f"{peer.name}: {peer.error!r}"


async def test_a_reducer_returning_a_wrong_part_is_caught_banned_and_its_part_keeps_local_values(clock):
    swarm = Swarm("memory", config=_cross_checked_config())
    generator = torch.Generator().manual_seed(36)
    base = [torch.randn(40, generator=generator), torch.randn(6, 5, generator=generator)]
    async with trio.open_nursery() as nursery:
        peers = await swarm.start(nursery, 4)
        liar = peers[1]
        honest_pull = liar.server._on_pull

        async def lying_pull(context, args):
            reply = await honest_pull(context, args)
            return [t + 0.05 for t in reply]  # a small bias: well within the plausibility bound

        liar.node.unregister(PULL)
        liar.node.register(PULL, lying_pull)
        strikes = {p.name: Strikes() for p in peers}
        for round_number in range(3):
            group = swarm.group(peers, f"lie-{round_number}".encode())
            tensor_sets = [_small(generator, base, 0.1) for _ in peers]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            await _round(peers, group, tensor_sets)
            partition = Partition.for_tensors(tensor_sets[0], [m.bandwidth for m in group.members],
                                              chunk_bytes=swarm.config.chunk_bytes)
            liar_part = partition.part_of(group.index_of(liar.peer_id))
            for peer, tensors, original in zip(peers, tensor_sets, originals):
                if peer is liar:
                    continue
                result = peer.result
                assert result.lying_peers == {liar.peer_id}, peer.name
                assert not result.averaged[liar_part.index]
                assert sum(result.averaged) == len(result.averaged) - 1  # every honest part averaged
                for chunk in liar_part.chunks:  # the lied-about part keeps this member's own values
                    for now, before in zip(chunk_views(tensors, chunk), chunk_views(original, chunk)):
                        assert torch.equal(now, before)
                strikes[peer.name].record_round(result.rejected_peers | result.lying_peers, group.peer_ids)
        nursery.cancel_scope.cancel()
    for peer in peers:
        if peer is not liar:
            assert strikes[peer.name].banned == {liar.peer_id}, peer.name  # 3 strikes: banned by every honest one


@pytest.mark.parametrize("rounds", [pytest.param(30, id="30"), pytest.param(200, id="200", marks=pytest.mark.slow)])
async def test_clean_rounds_of_3_to_8_members_with_noise_ban_no_one(clock, rounds):
    swarm = Swarm("memory", config=_cross_checked_config())
    generator = torch.Generator().manual_seed(500)
    chooser = random.Random(500)
    async with trio.open_nursery() as nursery:
        peers = await swarm.start(nursery, 8)
        strikes = {p.name: Strikes() for p in peers}
        checked = 0
        for round_number in range(rounds):
            members = chooser.sample(peers, chooser.randint(3, 8))
            group = swarm.group(members, f"clean-{round_number}".encode())
            base = [torch.randn(40, generator=generator), torch.randn(6, 5, generator=generator)]
            tensor_sets = [_small(generator, base, chooser.choice([0.05, 0.3, 1.0])) for _ in members]
            await _round(members, group, tensor_sets)
            for peer in members:
                result = peer.result
                assert result.fully_averaged and not result.lying_peers, (round_number, peer.name)
                strikes[peer.name].record_round(result.rejected_peers | result.lying_peers, group.peer_ids)
            checked += sum(1 for name, event, info in swarm.events if event == "reducer_lied")
        nursery.cancel_scope.cancel()
    assert checked == 0
    verdicts = [v.verdict for p in peers for v in p.server._verdicts.values()]
    assert verdicts.count(True) >= min(rounds, 200) * 2 and False not in verdicts  # the checks did run
    assert all(not s.banned for s in strikes.values())
