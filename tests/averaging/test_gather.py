"""The all-gather of compressed contributions (averaging/gather.py): its pure parts, and members on the in-memory
network (mock clock) agreeing on one set when a member dies before sending."""

from __future__ import annotations

import torch
import trio
import trio.testing

from averaging.gather import GatherService, combine, decide, prefer_gather
from averaging.robust import Aggregation
from peer.p2p import wire
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from tests.sim_peers import start_peers


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
