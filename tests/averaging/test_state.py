"""State download for newcomers, from a peer that keeps training and averaging while it serves."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import trio
from swarm_helpers import Swarm

from averaging.allreduce_core import AllReduceConfig
from averaging.errors import StateDownloadFailed
from averaging.state import StateConfig, install_state_server, load_state_from_peers


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
        install_state_server(provider.node, trainer.get_state, lock=lock, config=StateConfig(chunk_bytes=16384))
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
        state = await load_state_from_peers(newcomer.node, [(provider.peer_id, provider.address)], timeout=30)
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
        install_state_server(provider.node, trainer.get_state, lock=lock, config=StateConfig(chunk_bytes=65536))
        nursery.start_soon(trio.to_thread.run_sync, training_thread)
        try:
            with trio.fail_after(30):
                while trainer.step < 5:
                    await trio.sleep(0.01)
                state = await load_state_from_peers(newcomer.node, [(provider.peer_id, provider.address)],
                                                    timeout=30)
        finally:
            stop.set()
        nursery.cancel_scope.cancel()

    snapshot_step, snapshot = trainer.handed_out[-1]
    assert state.metadata == {"step": snapshot_step} and snapshot_step >= 5
    for received, expected in zip(state.tensors, snapshot):
        assert torch.equal(received, expected)
