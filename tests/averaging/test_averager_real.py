"""The Averager over real sockets on 127.0.0.1 (real clock): 4 peers, one of them in client mode."""

import torch
import trio
from swarm_helpers import start_averagers, step_all

from peer.testing.sim_peers import start_peers


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 16, generator=generator), torch.randn(33, generator=generator),
            torch.randn(8, generator=generator).double()]


async def _averagers(nursery, count, *, client_mode=frozenset(), **options):
    peers = await start_peers(nursery, count, memory=None, client_mode=set(client_mode))
    return peers, await start_averagers(peers, _tensors, **options)


async def test_four_peers_on_loopback_with_a_client_average_exactly():
    async with trio.open_nursery() as nursery:
        peers, averagers = await _averagers(nursery, 4, client_mode={3}, prefix="real", target_group_size=4)
        expected = [torch.stack([a.tensors[i] for a in averagers]).mean(0) for i in range(3)]
        results = await step_all(averagers, timeout=30)
        assert all(r.finished and r.group_size == 4 for r in results), [r.reason for r in results]
        assert len({r.group.group_id for r in results}) == 1
        assert results[0].group.member(averagers[3].peer_id).client_mode
        for averager in averagers:
            for tensor, mean in zip(averager.tensors, expected):
                torch.testing.assert_close(tensor, mean, atol=1e-6, rtol=0)
        nursery.cancel_scope.cancel()


async def test_four_peers_on_loopback_one_killed_during_matchmaking():
    async with trio.open_nursery() as nursery:
        peers, averagers = await _averagers(nursery, 4, prefix="realkill", target_group_size=4,
                                            matchmaking_time=10.0)
        victim = averagers[1]
        peers[1].nursery.start_soon(victim.step)
        # wait until the victim's declaration is visible to the others, then kill it
        key = victim.keys.key
        while True:
            record = await peers[0].dht.get(key, latest=True)
            if record is not None and bytes(victim.peer_id) in record.subkeys:
                break
            await trio.lowlevel.checkpoint()
        peers[1].kill()
        survivors = [averagers[i] for i in (0, 2, 3)]
        before = [[t.clone() for t in a.tensors] for a in survivors]
        results = await step_all(survivors, timeout=30)
        assert all(r.finished and r.group_size == 3 for r in results), [r.reason for r in results]
        assert all(victim.peer_id not in r.group for r in results)
        for averager in survivors:
            for k, tensor in enumerate(averager.tensors):
                torch.testing.assert_close(tensor, torch.stack([b[k] for b in before]).mean(0), atol=1e-6, rtol=0)
        nursery.cancel_scope.cancel()
