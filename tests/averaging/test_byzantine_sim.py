"""Byzantine members in the averager, end to end (matchmaking + all-reduce + bans) on the in-memory network under
MockClock: 8 peers, 20 rounds, 2 of them malicious.

The bound (what `centered_clip` guarantees here): every honest peer ends every round within HALF the honest
spread of the honest mean of its group, the spread being the largest distance of an honest member's input to
that mean. The malicious parts are rejected by the norm check (`averaging.robust.validate_norms`), and
CenteredClip over the honest parts stays close to their mean (its bias is about tau * f / (n - f) median
distances for f in-bound outliers, and here none is left). With `mean` the same attacks move the honest peers
tens (random noise) to 1e30 (constant) spreads away, which the test asserts too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
from swarm_helpers import flat, start_averagers, step_all

from averaging.averager import Averager
from peer.p2p.net import MemoryNetwork
from peer.testing.sim_peers import start_peers

PEERS, ROUNDS, MALICIOUS = 8, 20, (2, 5)


def _honest_input(round_index: int, peer: int) -> list[torch.Tensor]:
    base = torch.Generator().manual_seed(1000 + round_index)
    noise = torch.Generator().manual_seed(round_index * 100 + peer)
    shapes = [(6, 7), (30,)]
    return [torch.randn(s, generator=base) + 0.3 * torch.randn(s, generator=noise) for s in shapes]


def _attack(kind: str, round_index: int, peer: int) -> list[torch.Tensor]:
    honest = _honest_input(round_index, peer)
    if kind == "alternate":
        kind = "flip" if round_index % 2 else "honest"
    if kind == "honest":
        return honest
    if kind == "flip":
        return [-100 * t for t in honest]
    if kind == "const":
        return [torch.full_like(t, 1e30) for t in honest]
    assert kind == "noise"
    generator = torch.Generator().manual_seed(7 + round_index * 100 + peer)
    scale = 100 * float(flat(honest).norm())
    noise = [torch.randn(t.shape, generator=generator) for t in honest]
    factor = scale / float(flat(noise).norm())
    return [n * factor for n in noise]


async def _averagers(nursery: trio.Nursery, count: int, seed: int, prefix: str, **options: Any) -> list[Averager]:
    """`count` averagers on simulated peers of a fresh in-memory network, holding the honest inputs of round 0."""
    memory = MemoryNetwork(latency=0.005, seed=seed)
    peers = await start_peers(nursery, count, memory=memory, seed=seed)
    return await start_averagers(peers, lambda i: _honest_input(0, i), trio_locks=True, prefix=prefix,
                                 matchmaking_time=2.0, **options)


def _feed(averagers: list[Averager], round_index: int, attack_of: dict[int, str]) -> dict[int, torch.Tensor]:
    """Writes each member's input of this round into its tensors (an attacker's is `_attack` of its kind in
    `attack_of`), and returns the inputs flattened, by member index."""
    inputs = {}
    for index, averager in enumerate(averagers):
        values = _attack(attack_of[index], round_index, index) if index in attack_of \
            else _honest_input(round_index, index)
        for tensor, value in zip(averager.tensors, values):
            tensor.copy_(value)
        inputs[index] = flat(values)
    return inputs


async def _run(aggregation: str, attacks: tuple[str, str]) -> tuple[list[float], dict[int, set[bytes]], list]:
    """Returns, per round, the worst honest error / honest spread; who grouped with whom; the averagers."""
    worst: list[float] = []
    met: dict[int, set[bytes]] = {i: set() for i in range(PEERS)}
    async with trio.open_nursery() as nursery:
        averagers = await _averagers(nursery, PEERS, 3, "byz", target_group_size=PEERS, aggregation=aggregation)
        attack_of = dict(zip(MALICIOUS, attacks))
        for round_index in range(ROUNDS):
            inputs = _feed(averagers, round_index, attack_of)
            results = await step_all(averagers, timeout=30)
            errors = []
            for index, result in enumerate(results):
                if index in attack_of:
                    continue
                assert result.group is not None and result.group_size >= 2, result.reason
                members = [i for i in range(PEERS) if averagers[i].peer_id in result.group]
                met[index].update(bytes(averagers[i].peer_id) for i in members if i in attack_of)
                honest = torch.stack([inputs[i] for i in members if i not in attack_of])
                mean = honest.mean(0)
                spread = float((honest - mean).norm(dim=1).max())
                errors.append(float((flat(averagers[index].tensors) - mean).norm()) / spread)
            worst.append(max(errors))
        nursery.cancel_scope.cancel()
    return worst, met, averagers


@pytest.mark.slow
@pytest.mark.parametrize("attacks", [("flip", "const"), ("noise", "alternate")])
async def test_centered_clip_keeps_every_honest_peer_near_the_honest_mean_and_bans_the_attackers(
        autojump_clock, attacks):
    worst, met, averagers = await _run("centered_clip", attacks)
    print("worst honest error / spread per round:", [round(w, 3) for w in worst])
    assert max(worst) <= 0.5, worst
    for index, averager in enumerate(averagers):
        if index not in MALICIOUS:
            assert met[index], "every honest peer grouped with the attackers at least once"
            assert met[index] <= {bytes(p) for p in averager.banned}, (index, averager.stats()["banned"])
            assert not {bytes(averagers[i].peer_id) for i in range(PEERS) if i not in MALICIOUS} \
                & {bytes(p) for p in averager.banned}, "no honest peer is ever banned"
    # once banned, the attackers are out of the honest groups
    honest = [a for i, a in enumerate(averagers) if i not in MALICIOUS]
    assert all(a.last_result.group.size == PEERS - len(MALICIOUS) for a in honest)


@pytest.mark.slow
@pytest.mark.parametrize("attacks", [("flip", "const"), ("noise", "alternate")])
async def test_mean_shows_the_damage_of_the_same_attacks(autojump_clock, attacks):
    worst, met, averagers = await _run("mean", attacks)
    assert max(worst) > 20, worst  # tens to millions of honest spreads away from the honest mean
    assert sum(w > 0.5 for w in worst) >= ROUNDS // 2  # and not only once


def _lie(averager, scale: float = -100.0) -> None:
    """Make `averager` a lying reducer: when it has reduced its part, it scales the result it serves (and
    writes) by `scale`, through the all-reduce hook that fires right after the reduction."""
    server = averager.allreduce_server

    def hook(name, info):
        if name == "reduced":
            reducer = server._rounds[info["group_id"]].core.reducer
            if reducer.result is not None:
                for chunk in reducer.result:
                    for tensor in chunk:
                        tensor.mul_(scale)

    server.hook = hook


async def test_a_lying_reducer_is_caught_its_part_keeps_local_values_and_it_is_banned(autojump_clock):
    async with trio.open_nursery() as nursery:
        averagers = await _averagers(nursery, 4, 5, "liar", target_group_size=4, aggregation="centered_clip",
                                     ban_after=2)
        liar = averagers[1]
        _lie(liar)
        honest = [a for a in averagers if a is not liar]
        for round_index in range(2):
            _feed(averagers, round_index, {})
            before = {i: flat(a.tensors).clone() for i, a in enumerate(averagers)}
            results = await step_all(averagers, timeout=30)
            for index, (averager, result) in enumerate(zip(averagers, results)):
                if averager is liar:
                    continue
                outcome = result.allreduce
                assert result.group.size == 4 and outcome.lying_peers == {liar.peer_id}
                lied = outcome.part_owners.index(liar.peer_id)
                assert not outcome.averaged[lied]
                assert all(ok for i, ok in enumerate(outcome.averaged) if i != lied)
                # every element stays near the honest values: nothing of the x(-100) lie got in
                assert float((flat(averager.tensors) - before[index]).abs().max()) < 10
        assert all(liar.peer_id in a.banned for a in honest)
        # banned: the honest peers now average among themselves
        results = await step_all(averagers, timeout=30)
        for averager, result in zip(averagers, results):
            if averager is not liar:
                assert result.finished and result.group.size == 3 and liar.peer_id not in result.group
        nursery.cancel_scope.cancel()


async def test_with_mean_a_lying_reducer_that_stays_finite_is_not_detected(autojump_clock):
    """The lie check needs validated inputs: with `mean` an honest reducer's result may be anywhere (one 1e30
    member moves it there), so only non-finite parts count as lies."""
    async with trio.open_nursery() as nursery:
        averagers = await _averagers(nursery, 3, 6, "m", target_group_size=3)
        _lie(averagers[0])
        results = await step_all(averagers, timeout=30)
        assert all(not r.allreduce.lying_peers for r in results)
        _lie(averagers[0], float("nan"))
        results = await step_all(averagers, timeout=30)
        assert all(r.allreduce.lying_peers == {averagers[0].peer_id} for r in results[1:])
        nursery.cancel_scope.cancel()


async def test_a_member_whose_parts_are_rejected_is_banned_after_ban_after_rounds(autojump_clock):
    async with trio.open_nursery() as nursery:
        averagers = await _averagers(nursery, 4, 8, "rej", target_group_size=4, aggregation="trimmed_mean",
                                     ban_after=2)
        attacker = averagers[3]
        for round_index in range(2):
            _feed(averagers, round_index, {3: "const"})
            results = await step_all(averagers, timeout=30)
            assert all(attacker.peer_id in r.allreduce.rejected_peers for r in results[:3])
            assert all(float(flat(a.tensors).abs().max()) < 100 for a in averagers[:3])
        assert all(a.banned == {attacker.peer_id} for a in averagers[:3])
        assert averagers[0].stats()["banned"] == [str(attacker.peer_id)]
        nursery.cancel_scope.cancel()
