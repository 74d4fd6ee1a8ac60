"""The Averager end to end (matchmaking + all-reduce + group keys) on the in-memory network under MockClock."""

import torch
import trio
from swarm_helpers import start_averagers, step_all

from peer.p2p.net import MemoryNetwork
from peer.testing.sim_peers import start_peers


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]


async def _averagers(nursery, count, *, seed=0, client_mode=frozenset(), **options):
    memory = MemoryNetwork(latency=0.005, seed=seed)
    peers = await start_peers(nursery, count, memory=memory, seed=seed, client_mode=set(client_mode))
    averagers = await start_averagers(peers, lambda index: _tensors(seed * 100 + index), trio_locks=True,
                                      **options)
    return memory, peers, averagers


def _assert_hold(averagers, expected, atol) -> None:
    """Every averager's tensors equal `expected` (within `atol`)."""
    for averager in averagers:
        for tensor, mean in zip(averager.tensors, expected):
            torch.testing.assert_close(tensor, mean, atol=atol, rtol=0)


async def test_eight_peers_groups_of_two_three_bits_hold_global_mean_after_three_rounds(autojump_clock):
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _averagers(nursery, 8, prefix="m", target_group_size=2, nbits=3)
        expected = [torch.stack([a.tensors[i] for a in averagers]).mean(0) for i in range(2)]
        for round_index in range(3):
            # the grid unfolds: 1 key (4 groups), then 2 keys (2 groups each), then 4 keys (1 group each)
            assert len({a.keys.key for a in averagers}) == 2 ** round_index
            results = await step_all(averagers, timeout=30)
            assert all(r.finished and r.group_size == 2 for r in results), [r.reason for r in results]
        _assert_hold(averagers, expected, atol=1e-5)
        nursery.cancel_scope.cancel()


async def test_one_round_four_peers_with_a_client_gives_exact_mean(autojump_clock):
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _averagers(nursery, 4, prefix="m", target_group_size=4, client_mode={2})
        expected = [torch.stack([a.tensors[i] for a in averagers]).mean(0) for i in range(2)]
        results = await step_all(averagers, timeout=30)
        assert all(r.finished and r.group_size == 4 for r in results)
        assert len({r.group.group_id for r in results}) == 1
        _assert_hold(averagers, expected, atol=1e-6)
        stats = averagers[0].stats()
        assert stats["succeeded"] == 1 and len(stats["last_group"]) == 4
        nursery.cancel_scope.cancel()


async def test_weights_give_a_weighted_mean(autojump_clock):
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _averagers(nursery, 3, prefix="w", target_group_size=3)
        weights = [1.0, 2.0, 0.5]
        expected = [sum(w * a.tensors[i] for w, a in zip(weights, averagers)) / sum(weights) for i in range(2)]
        results = {}

        async def one(index):
            results[index] = await averagers[index].step(weight=weights[index], timeout=30)

        async with trio.open_nursery() as inner:
            for index in range(3):
                inner.start_soon(one, index)
        assert all(r.finished for r in results.values())
        _assert_hold(averagers, expected, atol=1e-6)
        nursery.cancel_scope.cancel()


async def test_peer_killed_during_matchmaking_does_not_stop_the_others(autojump_clock):
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _averagers(nursery, 8, prefix="k", target_group_size=4,
                                                    matchmaking_time=5.0)
        before = {i: [t.clone() for t in a.tensors] for i, a in enumerate(averagers)}
        victim = 3
        # the victim declares (its step runs inside its own peer scope) and dies before any group is sealed
        peers[victim].nursery.start_soon(averagers[victim].step)
        await trio.sleep(0.005)
        peers[victim].kill()
        started = trio.current_time()
        results = await step_all([a for i, a in enumerate(averagers) if i != victim], timeout=30)
        assert trio.current_time() - started < 2.0  # same round window, well inside matchmaking_time
        assert all(r.finished for r in results)
        victim_id = averagers[victim].peer_id
        survivors = [i for i in range(8) if i != victim]
        for index, result in zip(survivors, results):
            assert victim_id not in result.group
            members = [i for i in survivors if averagers[i].peer_id in result.group]
            for k, tensor in enumerate(averagers[index].tensors):
                mean = torch.stack([before[i][k] for i in members]).mean(0)
                torch.testing.assert_close(tensor, mean, atol=1e-6, rtol=0)
        nursery.cancel_scope.cancel()


async def test_step_with_nobody_else_reports_no_group(autojump_clock):
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _averagers(nursery, 2, prefix="solo", target_group_size=2,
                                                    matchmaking_time=1.0)
        before = [t.clone() for t in averagers[0].tensors]
        result = await averagers[0].step(timeout=5)
        assert not result.finished and result.group is None and result.reason
        assert all(torch.equal(a, b) for a, b in zip(averagers[0].tensors, before))
        assert averagers[0].stats()["no_group"] == 1
        nursery.cancel_scope.cancel()


async def test_newcomer_loads_state_and_round_from_peers(autojump_clock):
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _averagers(nursery, 4, prefix="st", target_group_size=3, nbits=0)
        veterans, newcomer = averagers[:3], averagers[3]
        for averager in veterans:
            averager.metadata = {"step": 42}
        for _ in range(2):
            results = await step_all(veterans, timeout=30)
            assert all(r.finished for r in results)
        assert newcomer.keys.round == 0 and all(a.keys.round == 2 for a in veterans)
        downloaded = await newcomer.load_state_from_peers(timeout=10)
        assert downloaded is not None and downloaded.metadata == {"step": 42}
        assert downloaded.peer in {a.peer_id for a in veterans}
        provider = next(a for a in veterans if a.peer_id == downloaded.peer)
        for mine, theirs in zip(newcomer.tensors, provider.tensors):
            assert torch.equal(mine, theirs)
        assert newcomer.keys.round == 2 and newcomer.metadata == {"step": 42}
        # in phase, the newcomer now averages with the others
        results = await step_all(averagers, timeout=30)
        assert all(r.finished for r in results)
        nursery.cancel_scope.cancel()


async def test_nobody_serving_state_returns_none(autojump_clock):
    async with trio.open_nursery() as nursery:
        memory, peers, averagers = await _averagers(nursery, 2, prefix="nostate", target_group_size=2,
                                                    serve_state=False)
        assert await averagers[0].load_state_from_peers(timeout=5) is None
        nursery.cancel_scope.cancel()
