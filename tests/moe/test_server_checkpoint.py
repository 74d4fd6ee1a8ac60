"""Experts survive restarts: checkpoints on shutdown and periodically, atomic files, reload on start."""

import os

import pytest
import torch
import trio

from moe.errors import CheckpointError
from moe.experts import OptimizerConfig, make_expert
from moe.server import (
    ExpertServer,
    checkpoint_path,
    checkpointed_uids,
    choose_uids,
    load_checkpoint,
    save_checkpoint,
)
from peer.p2p.identity import Identity
from peer.p2p.net import RealNetwork
from peer.p2p.rpc import RPCNode

TIMEOUT = 30.0
CONFIG = OptimizerConfig("adam", lr=0.05, warmup_steps=3)


def experts(seed):
    return [make_expert(uid, "ffn", 8, seed=seed + i, optimizer=CONFIG) for i, uid in enumerate(["ffn.0", "ffn.1"])]


async def train_remotely(directory, seed, steps, **options):
    """Run a server from `directory`, apply `steps` backward calls to ffn.0, stop it; return its experts."""
    served = experts(seed)
    server = ExpertServer(served, checkpoint_dir=directory, **options)
    torch.manual_seed(1000 + steps)
    async with RPCNode(Identity.generate(), RealNetwork()) as node, \
            RPCNode(Identity.generate(), RealNetwork()) as client:
        address = await node.listen("127.0.0.1", 0)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, node)
            for _ in range(steps):
                await client.call(address, "moe.backward", {
                    "uid": "ffn.0", "inputs": [torch.randn(4, 8)], "grad_outputs": [torch.randn(4, 8)]},
                    timeout=TIMEOUT)
            nursery.cancel_scope.cancel()
    return served, server


async def test_restart_from_checkpoint_restores_weights_and_optimizer(tmp_path):
    first, server = await train_remotely(tmp_path, seed=0, steps=2)
    assert sorted(checkpointed_uids(tmp_path)) == ["ffn.0", "ffn.1"]
    assert server.stats()["checkpoints"]["saved"] == 2
    # a restarted server builds fresh experts (another seed) and must come back with the trained ones
    second, server2 = await train_remotely(tmp_path, seed=50, steps=0)
    assert server2.stats()["checkpoints"]["loaded"] == 2
    for a, b in zip(first, second):
        assert a.steps == b.steps
        for pa, pb in zip(a.module.parameters(), b.module.parameters()):
            assert torch.equal(pa, pb)
    # training continues exactly as if the server had never stopped (Adam moments, LR warmup position)
    continued = make_expert("ffn.0", "ffn", 8, optimizer=CONFIG)
    continued.load_state_dict(load_checkpoint(checkpoint_path(tmp_path, "ffn.0")))
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    first[0].backward([x], [g])
    continued.backward([x], [g])
    assert continued.steps == 3
    for pa, pb in zip(first[0].module.parameters(), continued.module.parameters()):
        torch.testing.assert_close(pa, pb)


async def test_periodic_checkpoint_while_serving(tmp_path):
    served = experts(0)
    server = ExpertServer(served, checkpoint_dir=tmp_path, checkpoint_interval=3600)
    async with RPCNode(Identity.generate(), RealNetwork()) as node, \
            RPCNode(Identity.generate(), RealNetwork()) as client:
        address = await node.listen("127.0.0.1", 0)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, node)
            assert await server.checkpoint() == 2  # never saved before: both written
            assert await server.checkpoint() == 0  # nothing trained since
            await client.call(address, "moe.backward", {
                "uid": "ffn.1", "inputs": [torch.randn(2, 8)], "grad_outputs": [torch.randn(2, 8)]}, timeout=TIMEOUT)
            assert await server.checkpoint() == 1  # only the expert that trained
            assert load_checkpoint(checkpoint_path(tmp_path, "ffn.1"))["steps"] == 1
            nursery.cancel_scope.cancel()


def test_atomic_save_keeps_previous_file_on_failure(tmp_path, monkeypatch):
    path = checkpoint_path(tmp_path, "ffn.7")
    save_checkpoint(path, {"model": {"w": torch.ones(2)}, "steps": 1})

    def failing_save(obj, file):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"model": {"w": torch.zeros(2)}, "steps": 2})
    assert load_checkpoint(path)["steps"] == 1
    assert os.listdir(tmp_path) == ["ffn.7.pt"]  # no temporary file left behind


def test_mismatched_or_damaged_checkpoints_fail_loudly(tmp_path):
    small = make_expert("ffn.0", "ffn", 4)
    save_checkpoint(checkpoint_path(tmp_path, "ffn.0"), small.state_dict())
    with pytest.raises(CheckpointError, match="hidden_dim"):
        ExpertServer(experts(0), checkpoint_dir=tmp_path).load_checkpoints()
    checkpoint_path(tmp_path, "ffn.0").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable"):
        ExpertServer(experts(0), checkpoint_dir=tmp_path).load_checkpoints()


async def test_choose_uids_prefers_checkpointed_experts(tmp_path):
    for uid in ["ffn.3.1", "ffn.9.9", "other.1"]:
        save_checkpoint(checkpoint_path(tmp_path, uid), make_expert(uid, "ffn", 4).state_dict())
    uids = await choose_uids("ffn.[0:4].[0:4]", 3, checkpoint_dir=tmp_path)
    assert uids[0] == "ffn.3.1" and len(set(uids)) == 3  # ffn.9.9 is outside the pattern


async def test_from_pattern_builds_experts_and_a_restart_keeps_them(tmp_path):
    server = await ExpertServer.from_pattern("ffn.[0:4]", 2, kind="ffn", hidden_dim=8, checkpoint_dir=tmp_path,
                                             seed=3, rng=__import__("random").Random(0))
    uids = sorted(server.experts)
    assert len(uids) == 2 and all(uid.startswith("ffn.") for uid in uids)
    server.save_checkpoints()
    again = await ExpertServer.from_pattern("ffn.[0:4]", 3, kind="ffn", hidden_dim=8, checkpoint_dir=tmp_path,
                                            seed=3)
    assert set(uids) < set(again.experts) and len(again.experts) == 3
    again.load_checkpoints()
    for uid in uids:  # same seed and uid: same initial weights, and the checkpoint agrees
        for pa, pb in zip(server.experts[uid].module.parameters(), again.experts[uid].module.parameters()):
            assert torch.equal(pa, pb)
