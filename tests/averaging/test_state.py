"""State download for newcomers, from a peer that keeps training and averaging while it serves."""

from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager

import pytest
import torch
import trio
from swarm_helpers import Swarm

from averaging import state as state_wire
from averaging.allreduce_core import AllReduceConfig
from averaging.errors import (
    BadChunk,
    StateDownloadFailed,
    StateHashMismatch,
    StateSourceCorrupt,
    StateSourceError,
)
from averaging.state import (
    NoState,
    StateConfig,
    StateServer,
    install_state_server,
    load_state,
    load_state_from_peers,
)
from averaging.state_hash import Manifest, state_digest, state_manifest
from peer.p2p.identity import PeerID


class Trainer:
    """A stand-in training loop: each step adds 1 to every tensor and bumps the step counter, under the lock.
    `get_state` also remembers what it handed out, so the test can check the download against it."""

    def __init__(self, tensors, lock):
        self.tensors = tensors
        self.lock = lock
        self.step = 0
        self.handed_out = []

    def train_step(self):
        for t in self.tensors:
            t.add_(1)
        self.step += 1

    def get_state(self):
        self.handed_out.append((self.step, [t.clone() for t in self.tensors]))
        return {"step": self.step}, self.tensors


def model(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 200, generator=generator), torch.randn(5000, generator=generator),
            torch.randn(7, dtype=torch.float64, generator=generator)]


async def test_newcomer_gets_current_consistent_state_from_a_busy_peer(autojump_clock):
    swarm = Swarm("memory", config=AllReduceConfig(chunk_bytes=8192))
    lock = trio.Lock()
    async with trio.open_nursery() as nursery:
        provider, partner, newcomer = await swarm.start(nursery, 3)
        trainer = Trainer(model(1), lock)
        partner_tensors = model(2)
        install_state_server(provider.node, trainer.get_state, lock=lock)
        swarm.memory.set_link("p0", "p2", bandwidth=1_000_000)  # ~260 KB state: the download takes ~0.3 s

        stop = trio.Event()
        rounds_done = []

        async def train():
            while not stop.is_set():
                async with lock:
                    trainer.train_step()
                await trio.sleep(0.005)  # the compute time of one step

        async def average(peer, tensors):
            for number in range(1000):
                if stop.is_set():
                    return
                group = swarm.group([provider, partner], group_id=b"r%d" % number)
                result = await peer.server.run(group, tensors, lock=lock if peer is provider else None,
                                               timeout=10)
                assert result.fully_averaged
                if peer is provider:
                    rounds_done.append(trio.current_time())

        nursery.start_soon(train)
        nursery.start_soon(average, provider, trainer.tensors)
        nursery.start_soon(average, partner, partner_tensors)
        await trio.sleep(0.1)
        step_at_request = trainer.step
        started = trio.current_time()
        state = await load_state_from_peers(newcomer.node, [(provider.peer_id, provider.address)], timeout=30,
                                            config=StateConfig(block_bytes=16384))
        finished = trio.current_time()
        steps_during_download = trainer.step - step_at_request
        stop.set()
        nursery.cancel_scope.cancel()

    assert state.peer == provider.peer_id
    snapshot_step, snapshot = trainer.handed_out[-1]
    assert state.metadata == {"step": snapshot_step}
    assert snapshot_step >= step_at_request  # current values, not an old copy
    for received, expected in zip(state.tensors, snapshot):
        assert received.dtype == expected.dtype and received.shape == expected.shape
        assert torch.equal(received, expected)  # one consistent snapshot, not chunks of different steps
    # the provider kept training and averaging while the download ran: the lock was not held across it
    assert finished - started > 0.2
    assert steps_during_download >= 20
    assert any(started < t < finished for t in rounds_done)


async def test_falls_back_to_the_next_candidate(autojump_clock):
    swarm = Swarm("memory")
    async with trio.open_nursery() as nursery:
        dead, busy, good, newcomer = await swarm.start(nursery, 4)
        trainer = Trainer(model(3), None)
        install_state_server(busy.node, trainer.get_state, config=StateConfig(max_snapshots=0))
        install_state_server(good.node, trainer.get_state)
        dead.kill()
        candidates = [(p.peer_id, p.address) for p in (dead, busy, good)]
        into = [torch.zeros_like(t) for t in trainer.tensors]
        state = await load_state_from_peers(newcomer.node, candidates, into=into, timeout=30)
        assert state.peer == good.peer_id
        for target, expected in zip(into, trainer.tensors):
            assert torch.equal(target, expected)

        with pytest.raises(StateDownloadFailed) as caught:
            await load_state_from_peers(newcomer.node, candidates[:2], timeout=30)
        assert "busy" in str(caught.value) or "too many" in str(caught.value)

        with pytest.raises(StateDownloadFailed):  # other shapes than ours: refused, nothing overwritten
            wrong = [torch.zeros(3)]
            await load_state_from_peers(newcomer.node, candidates[2:], into=wrong, timeout=30)
        assert torch.equal(wrong[0], torch.zeros(3))
        nursery.cancel_scope.cancel()


async def test_download_over_real_sockets_while_a_thread_trains():
    swarm = Swarm("real")
    lock = threading.Lock()
    trainer = Trainer(model(4), lock)
    stop = threading.Event()

    def training_thread():
        while not stop.is_set():
            with lock:
                trainer.train_step()
            time.sleep(0.0005)  # the compute time of one step

    async with trio.open_nursery() as nursery:
        provider, newcomer = await swarm.start(nursery, 2)
        install_state_server(provider.node, trainer.get_state, lock=lock)
        nursery.start_soon(trio.to_thread.run_sync, training_thread)
        try:
            with trio.fail_after(30):
                while trainer.step < 5:
                    await trio.sleep(0.01)
                state = await load_state_from_peers(newcomer.node, [(provider.peer_id, provider.address)],
                                                    timeout=30, config=StateConfig(block_bytes=65536))
        finally:
            stop.set()
        nursery.cancel_scope.cancel()

    snapshot_step, snapshot = trainer.handed_out[-1]
    assert state.metadata == {"step": snapshot_step} and snapshot_step >= 5
    for received, expected in zip(state.tensors, snapshot):
        assert torch.equal(received, expected)


# ------------------------------------------------------------------------------- parallel, verified downloads

BLOCK = 16384  # ~260 KB of state (`model`): 16 blocks
CONFIG = StateConfig(block_bytes=BLOCK)


@asynccontextmanager
async def memory_swarm(count):
    """`count` peers of a fresh simulated swarm, in a nursery cancelled when the block ends: (swarm, nursery, peers)."""
    swarm = Swarm("memory")
    async with trio.open_nursery() as nursery:
        yield swarm, nursery, await swarm.start(nursery, count)
        nursery.cancel_scope.cancel()


class LyingServer(StateServer):
    """Serves the honest manifest but flips a byte in every block from the `honest_blocks`+1-th on."""

    def __init__(self, *args, honest_blocks=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.honest_blocks = honest_blocks

    def _block_reply(self, snapshot, index):
        parts = super()._block_reply(snapshot, index)
        if self.blocks_served <= self.honest_blocks:
            return parts
        parts = [p.clone() for p in parts]
        parts[0][0] ^= 0xFF
        return parts


class LyingManifestServer(StateServer):
    """Claims the root it should have, with block digests that do not hash to it."""

    async def _on_open(self, context, args):
        reply = await super()._on_open(context, args)
        digests = reply["manifest"]["digests"]
        reply["manifest"]["digests"] = bytes(32) + digests[32:]
        return reply


def serve(peer, tensors, server_class=StateServer, metadata=None, **kwargs):
    return server_class(peer.node, lambda: (metadata or {"step": 7}, tensors), **kwargs).install()


def where(peers):
    return [(p.peer_id, p.address) for p in peers]


def serve_over_links(swarm, holders, newcomer, tensors, *, bandwidth):
    """Every holder serves `tensors` over a link of `bandwidth` bytes/s to the newcomer: their servers."""
    servers = [serve(h, tensors) for h in holders]
    for holder in holders:
        swarm.memory.set_link(holder.name, newcomer.name, bandwidth=bandwidth)
    return servers


async def test_parallel_download_from_three_holders_is_bit_exact_and_faster(autojump_clock):
    tensors = model(10)
    expected = state_manifest(tensors, BLOCK).root
    async with memory_swarm(4) as (swarm, nursery, (*holders, newcomer)):
        servers = serve_over_links(swarm, holders, newcomer, tensors, bandwidth=1_000_000)

        started = trio.current_time()
        alone = await load_state(newcomer.node, where(holders[:1]), expected_hash=expected, timeout=30,
                                 config=CONFIG)
        one_source = trio.current_time() - started

        into = [torch.zeros_like(t) for t in tensors]
        started = trio.current_time()
        state = await load_state(newcomer.node, where(holders), into=into, expected_hash=expected, timeout=30,
                                 config=CONFIG)
        three_sources = trio.current_time() - started

    blocks = state_manifest(tensors, BLOCK).num_blocks
    assert blocks == 16
    assert alone.blocks_from == {holders[0].peer_id: blocks}
    assert set(state.sources) == {h.peer_id for h in holders}
    assert all(state.blocks_from[h.peer_id] > 0 for h in holders), state.blocks_from
    assert sum(state.blocks_from.values()) == blocks
    assert state.blocks_fetched < blocks + 2 * len(holders)  # the end game asks for a few blocks twice at most
    assert state.root == expected and state.metadata == {"step": 7} and state.peer == holders[0].peer_id
    assert not state.failures
    for received, copied, original in zip(state.tensors, into, tensors):
        assert received.dtype == original.dtype and received.shape == original.shape
        assert torch.equal(received.view(-1).view(torch.uint8), original.view(-1).view(torch.uint8))
        assert torch.equal(copied.view(-1).view(torch.uint8), original.view(-1).view(torch.uint8))
    assert three_sources < 0.5 * one_source, (three_sources, one_source)
    assert all(not s._snapshots for s in servers)  # every snapshot was closed (or fully served)


async def test_a_source_killed_mid_download_leaves_its_blocks_to_the_others(autojump_clock):
    tensors = model(11)
    expected = state_manifest(tensors, BLOCK).root
    async with memory_swarm(4) as (swarm, nursery, (*holders, newcomer)):
        servers = serve_over_links(swarm, holders, newcomer, tensors, bandwidth=500_000)
        victim, victim_server = holders[0], servers[0]

        async def kill_after_three_blocks():
            while victim_server.blocks_served < 3:
                await trio.sleep(0.001)
            victim.kill()

        nursery.start_soon(kill_after_three_blocks)
        state = await load_state(newcomer.node, where(holders), expected_hash=expected, timeout=30,
                                 config=CONFIG)

    blocks = state_manifest(tensors, BLOCK).num_blocks
    assert victim.killed and 3 <= victim_server.blocks_served < blocks
    assert state.blocks_from[victim.peer_id] >= 1  # what it delivered before dying was kept
    assert sum(state.blocks_from.values()) == blocks
    assert state.blocks_fetched < 2 * blocks
    assert [f.peer for f in state.failures] == [victim.peer_id]
    assert isinstance(state.failures[0], StateSourceError) and state.failures[0].operation == "state.block"
    for received, original in zip(state.tensors, tensors):
        assert torch.equal(received, original)


async def test_a_lying_source_is_dropped_and_named_and_the_honest_ones_finish(autojump_clock):
    tensors = model(12)
    expected = state_manifest(tensors, BLOCK).root
    async with memory_swarm(5) as (swarm, nursery, (liar, manifest_liar, honest, other_liar, newcomer)):
        serve(liar, tensors, LyingServer, honest_blocks=1)
        serve(manifest_liar, tensors, LyingManifestServer)
        serve(honest, tensors)
        serve(other_liar, tensors, LyingServer)

        into = [torch.zeros_like(t) for t in tensors]
        state = await load_state(newcomer.node, where([liar, manifest_liar, honest]), into=into,
                                 expected_hash=expected, timeout=30, config=CONFIG)
        assert state.root == expected
        for copied, original in zip(into, tensors):
            assert torch.equal(copied, original)
        blamed = {f.peer: f for f in state.failures}
        assert set(blamed) == {liar.peer_id, manifest_liar.peer_id}
        assert all(isinstance(f, StateSourceCorrupt) for f in blamed.values())
        assert blamed[liar.peer_id].operation == "state.block" and "digest" in str(blamed[liar.peer_id])
        assert blamed[manifest_liar.peer_id].operation == "state.open"
        assert PeerID(liar.peer_id).short() in str(blamed[liar.peer_id])
        assert state.peer == honest.peer_id  # a liar's metadata is not taken
        assert state.blocks_from[honest.peer_id] >= state_manifest(tensors, BLOCK).num_blocks - 1

        # without an agreed hash the liar's (honest) manifest wins the root, and still its bytes are refused
        state = await load_state(newcomer.node, where([other_liar, honest]), timeout=30, config=CONFIG)
        assert state.root == expected and [f.peer for f in state.failures] == [other_liar.peer_id]

        into = [torch.zeros_like(t) for t in tensors]
        with pytest.raises(StateDownloadFailed) as caught:
            await load_state(newcomer.node, where([other_liar, manifest_liar]), into=into, expected_hash=expected,
                             timeout=30, config=CONFIG)
        assert all(isinstance(f, StateSourceCorrupt) for f in caught.value.failures)
        assert {f.peer for f in caught.value.failures} == {other_liar.peer_id, manifest_liar.peer_id}
        assert "does not match its digest" in str(caught.value)
        assert all(not t.any() for t in into)  # nothing written


async def test_no_holder_of_the_expected_hash_fails_fast_and_writes_nothing(autojump_clock):
    tensors, others = model(13), model(14)
    async with memory_swarm(3) as (swarm, nursery, (a, b, newcomer)):
        serve(a, tensors)
        serve(b, others)
        into = [torch.zeros_like(t) for t in tensors]
        started = trio.current_time()
        with pytest.raises(StateDownloadFailed) as caught:
            await load_state(newcomer.node, where([a, b]), into=into, expected_hash=state_digest(model(15)),
                             timeout=30)
        assert trio.current_time() - started < 1.0
        assert "no source holds the expected state" in str(caught.value)
        assert {f.peer for f in caught.value.failures} == {a.peer_id, b.peer_id}
        assert all(isinstance(f, StateHashMismatch) for f in caught.value.failures)
        assert all(not t.any() for t in into)


async def test_without_a_hash_the_first_answering_candidates_root_is_fetched_from_all_its_holders(autojump_clock):
    newest, older = model(16), model(17)
    async with memory_swarm(6) as (swarm, nursery, (dead, a1, b1, a2, b2, newcomer)):
        serve(a1, newest, metadata={"epoch": 5})
        serve(a2, newest, metadata={"epoch": 5, "note": "second"})
        serve(b1, older, metadata={"epoch": 4})
        serve(b2, older, metadata={"epoch": 4})
        dead.kill()
        state = await load_state(newcomer.node, where([dead, a1, b1, a2, b2]), timeout=30, config=CONFIG)

    assert state.root == state_manifest(newest, BLOCK).root
    assert state.metadata == {"epoch": 5} and state.peer == a1.peer_id  # the first in order among the holders
    assert set(state.sources) == {a1.peer_id, a2.peer_id}
    assert all(state.blocks_from[p] > 0 for p in (a1.peer_id, a2.peer_id))
    assert {f.peer: type(f) for f in state.failures} == {
        dead.peer_id: StateSourceError, b1.peer_id: StateHashMismatch, b2.peer_id: StateHashMismatch}
    for received, original in zip(state.tensors, newest):
        assert torch.equal(received, original)


async def test_malformed_state_requests_get_typed_errors(autojump_clock):
    tensors = model(18)
    async with memory_swarm(2) as (swarm, nursery, (holder, caller)):
        server = serve(holder, tensors)

        async def call(method, args):
            return await caller.node.call(holder.address, method, args, timeout=5, peer_id=holder.peer_id)

        for args in ([], {"block_bytes": 3}, {"block_bytes": 1 << 40}, {"block_bytes": True}):
            with pytest.raises(BadChunk):
                await call(state_wire.OPEN, args)
        header = await call(state_wire.OPEN, {"block_bytes": BLOCK})
        manifest = Manifest.from_wire(header["manifest"])
        for args in (None, {"id": "1", "block": 0}, {"id": header["id"], "block": -1},
                     {"id": header["id"], "block": manifest.num_blocks}, {"id": header["id"], "block": 1.0},
                     {"id": header["id"], "block": True}):
            with pytest.raises(BadChunk):
                await call(state_wire.BLOCK, args)
        with pytest.raises(NoState):
            await call(state_wire.BLOCK, {"id": header["id"] + 100, "block": 0})
        reply = await call(state_wire.BLOCK, {"id": header["id"], "block": manifest.num_blocks - 1})
        assert manifest.verify_block(manifest.num_blocks - 1, [bytes(p.numpy()) for p in reply])
        await call(state_wire.CLOSE, {"id": header["id"]})
        await call(state_wire.CLOSE, "garbage")
        assert not server._snapshots


async def test_without_a_hash_the_next_state_is_fetched_when_every_holder_of_the_first_one_dies(autojump_clock):
    newest, older = model(19), model(20)
    async with memory_swarm(3) as (swarm, nursery, (best, second, newcomer)):
        best_server = serve(best, newest, metadata={"epoch": 5})
        serve(second, older, metadata={"epoch": 5, "samples": "fewer"})
        swarm.memory.set_link(best.name, newcomer.name, bandwidth=500_000)

        async def kill_after_two_blocks():
            while best_server.blocks_served < 2:
                await trio.sleep(0.001)
            best.kill()

        nursery.start_soon(kill_after_two_blocks)
        state = await load_state(newcomer.node, where([best, second]), timeout=30, config=CONFIG)

    assert best.killed
    assert state.root == state_manifest(older, BLOCK).root and state.peer == second.peer_id
    assert state.metadata == {"epoch": 5, "samples": "fewer"} and state.sources == [second.peer_id]
    assert [(f.peer, type(f)) for f in state.failures] == [
        (second.peer_id, StateHashMismatch), (best.peer_id, StateSourceError)]
    for received, original in zip(state.tensors, older):
        assert torch.equal(received, original)
