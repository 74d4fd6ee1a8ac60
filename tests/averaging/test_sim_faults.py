"""64 averaging peers on the in-memory network under MockClock, with seeded random failures.

Seeded (network, identities, failure schedule) in virtual time (MockClock), exercising the real DHT, RPC,
matchmaking and all-reduce code, not mocks. trio itself shuffles the order of runnable tasks on purpose, so two
runs can differ in detail: the assertions are about properties that hold in every order. Peers are killed
(SIGKILL: connections reset, ports closed) or frozen (a hung host: nothing in or out, no reset) at random moments
of a round, i.e. during matchmaking or during the all-reduce.
"""

import random

import pytest
import torch
import trio

from averaging.averager import Averager
from peer.p2p.net import MemoryNetwork
from tests.sim_peers import start_peers

PEERS = 64


async def _swarm(nursery, seed):
    memory = MemoryNetwork(latency=0.003, seed=seed)
    peers = await start_peers(nursery, PEERS, memory=memory, seed=seed)
    averagers = []
    for index, peer in enumerate(peers):
        tensors = [torch.full((6,), float(index)), torch.arange(4, dtype=torch.float32) * index]
        averager = Averager(peer.rpc, peer.dht, tensors, prefix="sim", target_group_size=4, nbits=6,
                            matchmaking_time=3.0, allreduce_timeout=10.0, lock=trio.Lock())
        await peer.nursery.start(averager.serve)
        averagers.append(averager)
    return memory, peers, averagers


async def _round(averagers, peers, memory, alive, *, kill=(), freeze=(), rng=None):
    """Every alive peer steps; peers in `kill`/`freeze` fail at a random moment of the round."""
    results = {}

    async def one(index):
        results[index] = await averagers[index].step(timeout=20)

    async def fail_later(index, frozen):
        await trio.sleep(rng.uniform(0.0, 0.15))
        if frozen:
            memory.freeze(peers[index].name)  # its tasks keep running but nothing gets in or out
        else:
            peers[index].kill()

    async with trio.open_nursery() as nursery:
        for index in alive:
            if index in kill or index in freeze:
                # the victim steps inside its own peer scope, so killing the peer stops its step too
                peers[index].nursery.start_soon(averagers[index].step)
                nursery.start_soon(fail_later, index, index in freeze)
            else:
                nursery.start_soon(one, index)
    return results


def _check_groups(results, averagers):
    """Members of one group got the same group; no peer is in two groups; a failed step says why."""
    seen = {}
    for index, result in results.items():
        if not result.finished:
            assert result.reason
        if result.group is None:
            continue
        assert averagers[index].peer_id in result.group
        assert seen.setdefault(result.group.group_id, result.group) == result.group
    members = [p for g in seen.values() for p in g.peer_ids]
    assert len(members) == len(set(members))


async def _scenario(seed, rounds, failures):
    """`failures[r]` = (number killed, number frozen) in round r."""
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _swarm(nursery, seed)
        alive = set(range(PEERS))
        finished = total = 0
        for round_index in range(rounds):
            killed, frozen = failures.get(round_index, (0, 0))
            victims = rng.sample(sorted(alive), killed + frozen)
            kill, freeze = set(victims[:killed]), set(victims[killed:])
            results = await _round(averagers, peers, memory, alive, kill=kill, freeze=freeze, rng=rng)
            alive -= kill | freeze
            assert set(results) == alive  # every survivor's step returned
            _check_groups(results, averagers)
            if round_index == 0:  # no failures yet: everyone averages, nearly always in full groups
                assert all(r.finished for r in results.values())
                assert sum(r.group_size == 4 for r in results.values()) >= 0.9 * len(results)
            finished += sum(r.finished for r in results.values())
            total += len(results)
            memory.prune()
        nursery.cancel_scope.cancel()
    values = torch.stack([averagers[i].tensors[0] for i in sorted(alive)])
    return finished / total, float(values.max() - values.min())


async def test_64_peers_with_peers_killed_mid_round_keep_averaging(autojump_clock):
    success, spread = await _scenario(seed=1, rounds=4, failures={1: (3, 0)})
    assert success >= 0.95
    assert spread < 0.2 * PEERS  # started 63 apart; four rounds of groups of 4 mix the survivors


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4])
async def test_64_peers_kills_and_freezes_over_many_rounds(autojump_clock, seed):
    success, spread = await _scenario(seed=seed, rounds=8, failures={1: (2, 0), 2: (1, 1), 3: (2, 1), 5: (1, 0)})
    assert success >= 0.85
    assert spread < 0.05 * PEERS
