"""64 averaging peers on the in-memory network under MockClock, with seeded random failures.

Seeded (network, identities, failure schedule) in virtual time (MockClock), exercising the real DHT, RPC,
matchmaking and all-reduce code, not mocks. trio itself shuffles the order of runnable tasks on purpose, so two
runs can differ in detail: the assertions are about properties that hold in every order. Peers are killed
(SIGKILL: connections reset, ports closed) or frozen (a hung host: nothing in or out, no reset) in turn during
matchmaking (at a random virtual moment before its all-reduce starts) or inside the all-reduce (when a reducer
acknowledged its first chunk, seen through the all-reduce hook); each test checks where every failure landed.
"""

import random

import pytest
import torch
import trio

from averaging.averager import Averager
from peer.p2p.net import MemoryNetwork
from peer.testing.sim_peers import start_peers

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
    """Every alive peer steps; each peer in `kill`/`freeze` fails either while it looks for a group (at a random
    moment of its matchmaking) or inside the all-reduce (as its first chunk is acknowledged), in turn.
    Returns the survivors' results and, per victim, the phase its failure landed in, as observed: "matchmaking"
    (its all-reduce had not started), "all-reduce" (it had pushed data to a reducer), or "no group" (its step
    ended without one, so it failed after the step)."""
    results = {}
    landed = {}

    async def one(index):
        results[index] = await averagers[index].step(timeout=20)

    async def victim(index, frozen, moment):
        averager = averagers[index]
        server = averager.allreduce_server
        in_allreduce, pushed, step_done = trio.Event(), trio.Event(), trio.Event()
        run = server.run

        async def observed_run(*args, **kwargs):  # test-side observation point: the all-reduce starts
            in_allreduce.set()
            return await run(*args, **kwargs)

        server.run = observed_run
        server.hook = lambda name, info: pushed.set() if name == "chunk_pushed" else None

        async def stepping():
            # the victim steps inside its own peer scope, so killing the peer stops its step too
            await averager.step()
            step_done.set()

        peers[index].nursery.start_soon(stepping)
        async with trio.open_nursery() as race:
            async def until(event):
                await event.wait()
                race.cancel_scope.cancel()

            race.start_soon(until, step_done)
            if moment == "matchmaking":
                race.start_soon(until, in_allreduce)

                async def timer():
                    await trio.sleep(rng.uniform(0.0, 0.15))
                    race.cancel_scope.cancel()
                race.start_soon(timer)
            else:
                race.start_soon(until, pushed)
        if step_done.is_set():
            landed[index] = "no group"
        elif pushed.is_set():
            landed[index] = "all-reduce"
        elif not in_allreduce.is_set():
            landed[index] = "matchmaking"
        else:
            landed[index] = "all-reduce start"
        if frozen:
            memory.freeze(peers[index].name)  # its tasks keep running but nothing gets in or out
        else:
            peers[index].kill()

    moments = {index: ("matchmaking", "all-reduce")[n % 2] for n, index in enumerate(sorted({*kill, *freeze}))}
    async with trio.open_nursery() as nursery:
        for index in alive:
            if index in moments:
                nursery.start_soon(victim, index, index in freeze, moments[index])
            else:
                nursery.start_soon(one, index)
    return results, landed


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


def _check_failures_seen(results, averagers, landed):
    """A victim that failed inside its all-reduce had a group: every survivor of that group stopped waiting for it
    (it is in their failed peers). A victim that failed in matchmaking may be in a group too (it was picked before
    it died): its members also list it."""
    for index, phase in landed.items():
        victim = averagers[index].peer_id
        members = [i for i, r in results.items() if r.group is not None and victim in r.group]
        if phase == "all-reduce":
            assert members, f"peer {index} pushed data, so some survivor shared its group"
        for i in members:
            assert victim in results[i].failed_peers, (index, i, results[i])


async def _scenario(seed, rounds, failures):
    """`failures[r]` = (number killed, number frozen) in round r."""
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _swarm(nursery, seed)
        alive = set(range(PEERS))
        finished = total = 0
        phases = set()
        for round_index in range(rounds):
            killed, frozen = failures.get(round_index, (0, 0))
            victims = rng.sample(sorted(alive), killed + frozen)
            kill, freeze = set(victims[:killed]), set(victims[killed:])
            results, landed = await _round(averagers, peers, memory, alive, kill=kill, freeze=freeze, rng=rng)
            alive -= kill | freeze
            assert set(results) == alive  # every survivor's step returned
            _check_groups(results, averagers)
            _check_failures_seen(results, averagers, landed)
            phases.update(landed.values())
            if round_index == 0:  # no failures yet: everyone averages, nearly always in full groups
                unfinished = {averagers[i].peer_id.short(): r.reason for i, r in results.items() if not r.finished}
                assert not unfinished, unfinished
                # all 64 in groups of 4 in 24 of 25 runs measured; the rest had one or two groups of 3 (56 or 60)
                assert sum(r.group_size == 4 for r in results.values()) >= 0.85 * len(results)
            finished += sum(r.finished for r in results.values())
            total += len(results)
            memory.prune()
        nursery.cancel_scope.cancel()
    values = torch.stack([averagers[i].tensors[0] for i in sorted(alive)])
    assert {"matchmaking", "all-reduce"} <= phases  # the scenario failed peers in both phases of a round
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
