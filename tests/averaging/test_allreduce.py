"""Butterfly all-reduce in a formed group, over real sockets on 127.0.0.1 and on the in-memory network (MockClock)."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing
from swarm_helpers import Swarm, flat, random_tensors

from averaging.allreduce import run_allreduce
from averaging.allreduce_core import AllReduceConfig
from averaging.errors import GroupMismatch
from averaging.partition import Partition
from peer.p2p import wire


def weighted_mean(tensor_sets, weights):
    total = sum(weights)
    return sum(flat(ts) * w for ts, w in zip(tensor_sets, weights)) / total


async def wait_all(peers, seconds=30):
    with trio.fail_after(seconds):
        for peer in peers:
            await peer.done.wait()
    for peer in peers:
        assert peer.error is None, f"{peer.name}: {peer.error!r}"


async def average(swarm, tensor_sets, weights=None, **options):
    """One all-reduce round among fresh peers of `swarm`, one per tensor set (averaged in place), each with its
    weight in `weights` (the default where None); returns the peers, their results in `peer.result`."""
    async with trio.open_nursery() as nursery:
        peers = await swarm.start(nursery, len(tensor_sets))
        group = swarm.group(peers)
        for index, (peer, tensors) in enumerate(zip(peers, tensor_sets)):
            weight = {} if weights is None else {"weight": weights[index]}
            peer.start_round(group, tensors, timeout=30, **weight, **options)
        await wait_all(peers)
        nursery.cancel_scope.cancel()
    return peers


async def test_four_peers_get_the_exact_weighted_mean_including_a_client(transport, clock):
    swarm = Swarm(transport)
    weights = [1.0, 2.0, 0.5, 3.0]
    tensor_sets = [random_tensors(seed) for seed in range(4)]
    expected = weighted_mean(tensor_sets, weights)
    async with trio.open_nursery() as nursery:
        peers = await swarm.start(nursery, 4, clients=(1,))
        group = swarm.group(peers)
        assert [m.client_mode for m in group.members].count(True) == 1
        for peer, tensors, weight in zip(peers, tensor_sets, weights):
            peer.start_round(group, tensors, weight=weight, timeout=30)
        await wait_all(peers)
        nursery.cancel_scope.cancel()

    for peer, tensors in zip(peers, tensor_sets):
        result = peer.result
        assert result.finished and result.fully_averaged and not result.failed_peers
        assert len(result.averaged) == 3  # one part per reducing member; the client reduces nothing
        assert all(set(c) == {p.peer_id for p in peers} for c in result.contributors)
        assert torch.allclose(flat(tensors), expected, atol=1e-6, rtol=0)
    assert tensor_sets[2][2].dtype == torch.float64


@pytest.mark.parametrize("compression", [wire.Compression.FLOAT16, wire.Compression.UINT8])
async def test_compressed_round_is_close_to_the_mean(transport, clock, compression):
    swarm = Swarm(transport)
    tensor_sets = [random_tensors(seed) for seed in range(10, 13)]
    expected = weighted_mean(tensor_sets, [1, 1, 1])
    await average(swarm, tensor_sets, compression=compression)
    spread = float(max((flat(ts).max() - flat(ts).min()) for ts in tensor_sets))
    for tensors in tensor_sets:
        error = float((flat(tensors) - expected).abs().max())
        if compression == wire.Compression.FLOAT16:
            # float16 rounding on the way in and on the way back: about 2**-11 relative each
            assert error < 4e-3 * float(expected.abs().max())
        else:
            # 8 bits over each chunk's range, once on the way in and once on the way back
            assert error < 2 * spread / 510 + 1e-5
        assert error > 0  # it really was compressed


async def test_zero_weight_member_receives_the_mean_without_contributing(autojump_clock):
    swarm = Swarm("memory")
    tensor_sets = [random_tensors(seed) for seed in range(20, 23)]
    expected = weighted_mean(tensor_sets[:2], [1.0, 1.0])
    peers = await average(swarm, tensor_sets, [1.0, 1.0, 0.0])
    for peer, tensors in zip(peers, tensor_sets):
        assert peer.result.fully_averaged
        assert torch.allclose(flat(tensors), expected, atol=1e-6, rtol=0)


async def test_parts_follow_bandwidth_and_large_tensors_travel_in_several_chunks(autojump_clock):
    swarm = Swarm("memory", config=AllReduceConfig(chunk_bytes=4096))
    tensor_sets = [[torch.full((30_000,), float(i))] for i in range(3)]
    async with trio.open_nursery() as nursery:
        peers = await swarm.start(nursery, 3)
        from averaging.group import GroupInfo
        group = GroupInfo.create(b"bw", [p.member(bandwidth=b) for p, b in zip(peers, [1.0, 2.0, 1.0])])
        for peer, tensors in zip(peers, tensor_sets):
            peer.start_round(group, tensors, timeout=30)
        await wait_all(peers)
        nursery.cancel_scope.cancel()
    for tensors in tensor_sets:
        assert torch.equal(tensors[0], torch.full((30_000,), 1.0))
    partition = Partition.for_tensors(tensor_sets[0], [m.bandwidth for m in group.members], chunk_bytes=4096)
    assert [p.numel for p in partition.parts] == [7500, 15000, 7500]
    pushed = [e for e in swarm.events if e[1] == "chunk_pushed"]
    assert len(pushed) == (8 + 15 + 8) * 2  # every member pushes every part but its own, 4 KiB at a time


async def test_wrong_calls_raise_group_mismatch(autojump_clock):
    swarm = Swarm("memory")
    async with trio.open_nursery() as nursery:
        peers = await swarm.start(nursery, 3, clients=(0, 1, 2))
        group = swarm.group(peers)
        with pytest.raises(GroupMismatch):
            await run_allreduce(peers[0].node, group, [torch.zeros(3)])  # nobody can reduce
        other = swarm.group(peers[1:])
        with pytest.raises(GroupMismatch):
            await run_allreduce(peers[0].node, other, [torch.zeros(3)])  # not a member
        with pytest.raises(GroupMismatch):
            await run_allreduce(peers[0].node, group, [torch.zeros(3, dtype=torch.int64)])
        nursery.cancel_scope.cancel()


async def test_more_reducers_than_elements(autojump_clock):
    swarm = Swarm("memory")
    tensor_sets = [[torch.tensor([float(i), 2.0 * i])] for i in range(4)]
    peers = await average(swarm, tensor_sets)
    for peer, tensors in zip(peers, tensor_sets):
        assert peer.result.fully_averaged
        assert torch.equal(tensors[0], torch.tensor([1.5, 3.0]))


async def test_many_small_tensors_share_messages(autojump_clock):
    swarm = Swarm("memory", config=AllReduceConfig(chunk_bytes=16384))
    sizes = [((i * 37) % 200) + 1 for i in range(300)]
    tensor_sets = [[torch.randn(n, generator=torch.Generator().manual_seed(1000 * s + n)) for n in sizes]
                   for s in range(3)]
    expected = weighted_mean(tensor_sets, [1, 1, 1])
    await average(swarm, tensor_sets)
    for tensors in tensor_sets:
        assert torch.allclose(flat(tensors), expected, atol=1e-6, rtol=0)
    pushed = [e for e in swarm.events if e[1] == "chunk_pushed"]
    assert len(pushed) <= 3 * 2 * 3  # 3 members x 2 parts x 3 messages of 16 KiB, not one per tensor
