"""The all-gather of compressed contributions (averaging/gather.py): its pure parts, and members on the in-memory
network (mock clock) agreeing on one set when a member dies before sending."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from averaging.gather import GatherService, combine, decide, far_from, prefer_gather
from averaging.robust import Aggregation
from peer.p2p import wire
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.testing.sim_peers import start_peers


def test_decide_keeps_what_every_reporter_holds_in_member_order():
    members = [b"a" * 20, b"b" * 20, b"c" * 20]
    assert decide(members, {members[0]: members, members[1]: members}) == members
    assert decide(members, {members[0]: members[:2], members[1]: members}) == members[:2]
    assert decide(members, {}) == members  # nobody reported: whatever the members hold (they check it)


def test_prefer_gather_only_when_it_sends_fewer_bytes():
    # a sparse codec (1/108 of fp32) against the butterfly returning the dense mean at int8 (1/4)
    assert prefer_gather(4, compressed_bytes=10, returned_bytes=270)
    assert prefer_gather(27, compressed_bytes=10, returned_bytes=270)
    assert not prefer_gather(28, compressed_bytes=10, returned_bytes=270)  # too many members
    # a dense codec: the butterfly sends (n - 1) / n twice, the gather n - 1 times
    assert not prefer_gather(2, compressed_bytes=250, returned_bytes=250)
    assert not prefer_gather(4, compressed_bytes=250, returned_bytes=250)
    assert not prefer_gather(1, compressed_bytes=1, returned_bytes=1000)


def test_combine_is_a_weighted_mean_and_robust_rules_reject_outliers():
    a, b, c = b"a" * 20, b"b" * 20, b"c" * 20
    contributions = [(a, [torch.ones(3)]), (b, [torch.full((3,), 3.0)]), (c, [torch.full((3,), 1e6)])]
    into = [torch.zeros(3)]
    assert combine(contributions[:2], {a: 1.0, b: 3.0}, Aggregation("mean"), into) == []
    assert torch.allclose(into[0], torch.full((3,), 2.5))
    rejected = combine(contributions, {a: 1.0, b: 1.0, c: 1.0}, Aggregation("centered_clip"), into)
    assert rejected == [c] and torch.allclose(into[0], torch.full((3,), 2.0), atol=0.1)  # near the two others
    nan = [(a, [torch.full((3,), float("nan"))]), (b, [torch.ones(3)])]
    assert combine(nan, {a: 1.0, b: 1.0}, Aggregation("mean"), into) == [a]


async def _members(count: int, memory: MemoryNetwork, nursery: trio.Nursery):
    services: dict[bytes, GatherService] = {}
    started = {}

    def members_of(group: bytes):
        return started.get(group)

    peers = await start_peers(nursery, count, memory=memory, prefix="g", with_dht=False,
                              identity_for=lambda name, seed: Identity.from_seed(name.encode() * 4),
                              setup=lambda rpc: services.setdefault(
                                  bytes(rpc.peer_id), GatherService(rpc, members_of=members_of).install()))
    return peers, services, started


async def test_members_agree_on_one_set_when_one_dies_before_sending(autojump_clock):
    memory = MemoryNetwork(latency=0.01, seed=3)
    async with trio.open_nursery() as nursery:
        peers, services, started = await _members(4, memory, nursery)
        members = [(bytes(p.peer_id), p.address) for p in peers]
        group = b"g" * 16
        coordinator = members[0]
        started[group] = [m for m, _ in members]  # the coordinator (peer 0) started this round
        peers[3].kill()  # dead before it sends anything
        values = {bytes(p.peer_id): [torch.randn(300, generator=torch.Generator().manual_seed(i))]
                  for i, p in enumerate(peers)}
        results = {}

        async def member(index: int) -> None:
            peer = members[index][0]
            results[peer] = await services[peer].run(group, members, values[peer], wire.Compression.INT8,
                                                     coordinator, deadline=trio.current_time() + 60)

        async with trio.open_nursery() as rounds:
            for index in range(3):
                rounds.start_soon(member, index)
        chosen = {tuple(r.chosen or ()) for r in results.values()}
        assert chosen == {tuple(m for m, _ in members[:3])}, chosen  # the dead member left out, by everyone
        outs = []
        for result in results.values():
            assert result.contributions is not None
            into = [torch.zeros(300)]
            combine(result.contributions, {m: 1.0 for m, _ in members}, Aggregation("mean"), into)
            outs.append(into[0])
            assert bytes(members[3][0]) in result.failed
        assert all(torch.equal(outs[0], o) for o in outs)  # bit-identical everywhere
        expected = sum(wire.roundtrip(values[m][0], wire.Compression.INT8) for m, _ in members[:3]) / 3
        assert torch.allclose(outs[0], expected, atol=1e-6)
        nursery.cancel_scope.cancel()


def test_combine_rejects_updates_far_from_the_robust_result_and_counts_refused_ones():
    generator = torch.Generator().manual_seed(5)
    direction = torch.randn(400, generator=generator)
    honest = [direction + 0.6 * torch.randn(400, generator=generator) for _ in range(6)]
    names = [bytes([i]) * 20 for i in range(8)]
    weights = {n: 1.0 for n in names}
    attacks = {
        "sign flip x4": [-4 * honest[0], -4 * honest[1]],
        "mass on 3 coordinates": [torch.zeros(400).index_fill_(0, torch.tensor([0, 1, 2]), 30.0)] * 2,
        "consistent bias": [h + 3 * torch.randn(400, generator=torch.Generator().manual_seed(9)) for h in honest[:2]],
    }
    clean = [torch.zeros(400)]
    assert combine([(n, [h]) for n, h in zip(names, honest)], weights, Aggregation("centered_clip"), clean) == []
    for name, bad in attacks.items():
        contributions = [(n, [x]) for n, x in zip(names, honest + bad)]
        into = [torch.zeros(400)]
        assert combine(contributions, weights, Aggregation("centered_clip"), into) == names[6:], name
        assert torch.equal(into[0], clean[0]), name  # combined again without them: as if they had not sent
        mean = [torch.zeros(400)]
        assert combine(contributions, weights, Aggregation("mean"), mean) == [], name
        assert float((mean[0] - clean[0]).norm()) > 0.3 * float(clean[0].norm()), name  # what the mean takes in
    # a contribution refused on arrival (listed with no tensors) is rejected, and changes nothing
    into = [torch.zeros(400)]
    refused = [(n, [h]) for n, h in zip(names, honest)] + [(names[7], [])]
    assert combine(refused, weights, Aggregation("mean"), into) == [names[7]]


def _nan_scale(update: bytes) -> bytes:
    """A top-k update whose first chunk's first level is NaN (the buffer is the message's last bytes)."""
    blob = bytearray(update)
    (tensor,) = wire.decode(bytearray(update))
    offset = len(blob) - wire.data_nbytes(wire.compressed(tensor, wire.Compression.TOPK2))
    blob[offset:offset + 4] = bytes.fromhex("0000c07f")  # float32 NaN, little-endian
    return bytes(blob)


async def test_a_malformed_push_is_refused_counted_against_its_sender_and_the_others_agree(autojump_clock):
    memory = MemoryNetwork(latency=0.01, seed=4)
    async with trio.open_nursery() as nursery:
        peers, services, started = await _members(4, memory, nursery)
        members = [(bytes(p.peer_id), p.address) for p in peers]
        liar = members[3][0]
        group = b"h" * 16
        started[group] = [m for m, _ in members]
        values = {m: [torch.randn(5000, generator=torch.Generator().manual_seed(i))]
                  for i, (m, _) in enumerate(members)}
        honest_push = services[liar]._push
        sent_by_liar: list[bytes] = []

        async def hostile_push(group, peer, address, update, *rest):  # the liar: NaN in a scale of each push
            sent_by_liar.append(_nan_scale(update))
            await honest_push(group, peer, address, sent_by_liar[-1], *rest)

        services[liar]._push = hostile_push
        results = {}

        async def member(index: int) -> None:
            peer = members[index][0]
            results[peer] = await services[peer].run(group, members, values[peer], wire.Compression.TOPK2,
                                                     members[0], deadline=trio.current_time() + 60)

        async with trio.open_nursery() as rounds:
            for index in range(4):
                rounds.start_soon(member, index)
        assert sent_by_liar
        with pytest.raises(wire.MalformedTensor):
            wire.decode(bytearray(sent_by_liar[0]))
        honest = [m for m, _ in members[:3]]
        outs = []
        for peer in honest:
            result = results[peer]
            assert result.chosen == honest and result.refused == [liar]
            into = [torch.zeros(5000)]
            assert combine(result.contributions, {m: 1.0 for m, _ in members}, Aggregation("mean"), into) == [liar]
            outs.append(into[0])
        assert all(torch.equal(outs[0], o) for o in outs)  # nobody else's round failed: one result
        assert all(services[p].stats["rejected"] == 1 for p in honest)
        nursery.cancel_scope.cancel()


def test_far_from_flags_distances_that_stand_out_of_a_tight_group_and_spares_honest_spread():
    tight = [0.93, 1.0, 1.01, 0.97, 1.03, 0.99]  # honest top-k updates of one round (measured spread)
    assert far_from(tight) == []
    assert far_from(tight + [1.3, 1.25]) == [6, 7]  # a consistent bias the norm check lets through
    assert far_from(tight + [1.1]) == []  # within the floor: honest noise
    wide = [0.6, 0.8, 1.0, 1.3, 1.6, 0.9]  # dense updates scatter more: the limit widens with them
    assert far_from(wide) == [] and far_from(wide + [4.0]) == [6]
    assert far_from([1.0, 1.2, 2.9]) == [] and far_from([1.0, 1.2, 3.7]) == [2]  # 3 or 4: 3x the median
    assert far_from([1.0, 9.0]) == []  # no majority
