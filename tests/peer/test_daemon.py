"""In-process daemons on 127.0.0.1: composition, status, and replicated experts kept averaged."""

from __future__ import annotations

import dataclasses

import torch
import trio

from peer.daemon import Daemon, DaemonConfig
from peer.status import gather_status
from tests.peer.daemon_tasks import average_together


async def start(nursery, config: DaemonConfig) -> Daemon:
    daemon = Daemon(dataclasses.replace(config, host="127.0.0.1"))  # tests never bind the real interfaces
    await nursery.start(daemon.run)
    return daemon


def weights(daemon: Daemon) -> dict[str, list[torch.Tensor]]:
    return {uid: [p.detach().clone() for p in expert.module.parameters()]
            for uid, expert in daemon.expert_server.experts.items()}


async def test_replicas_of_the_same_experts_converge_to_their_mean():
    async with trio.open_nursery() as nursery:
        first = await start(nursery, DaemonConfig(experts="ffn.[0:2]", hidden_dim=8, replicate=True,
                                                  average_every=1000, seed=0))
        second = await start(nursery, DaemonConfig(experts="ffn.[0:2]", hidden_dim=8, replicate=True,
                                                   average_every=1000, seed=100,
                                                   initial_peers=[first.rpc.address]))
        before = [weights(first), weights(second)]
        assert not torch.allclose(before[0]["ffn.0"][0], before[1]["ffn.0"][0])
        results = await average_together([first, second], timeout=30)
        assert all(result is not None and result.finished and result.group_size == 2 for result in results)
        after = [weights(first), weights(second)]
        for uid in ("ffn.0", "ffn.1"):
            for index, original in enumerate(before[0][uid]):
                mean = (original + before[1][uid][index]) / 2
                assert torch.allclose(after[0][uid][index], mean, atol=1e-6)
                assert torch.allclose(after[1][uid][index], mean, atol=1e-6)
        assert first.status()["averaging"]["rounds"] == 1
        nursery.cancel_scope.cancel()


async def test_status_gathers_every_daemon_and_its_experts():
    async with trio.open_nursery() as nursery:
        first = await start(nursery, DaemonConfig(experts="ffn.[0:2]", hidden_dim=8))
        second = await start(nursery, DaemonConfig(experts="ffn.[2:3]", hidden_dim=8,
                                                   initial_peers=[first.rpc.address]))
        status = await gather_status(second.rpc, second.dht)
        assert status["peers_reachable"] == 2
        assert [entry["uid"] for entry in status["experts"]["ffn"]] == ["ffn.0", "ffn.1", "ffn.2"]
        nursery.cancel_scope.cancel()
