"""The harness for DiLoCo trainers on the in-memory network: each trainer a thread around one shared bridge (its trio
thread runs every simulated peer, peer/testing/sim_peers.py), as tests/averaging/test_diloco.py,
test_diloco_junk.py and test_sparse_byzantine.py run them; and the check of an outer step against a reference
Nesterov step that tests/peer/test_train_diloco.py also applies to trainer processes' traces.

- `SimSwarm`: a `SwarmHandle` over one simulated peer; `start_swarm`: simulated peers started on a bridge.
- `make_trainer`, `make_together`, `start_trainers`: DiLoCo optimizers of `tiny_model()` (built together, each
  constructor waiting for `start_with` of them); `close_all` closes them.
- `train_steps`: a trainer's inner steps on seeded random batches; `run_threads`: callables in threads, the
  first error raised in the caller's thread.
- `reference_check`: every outer step of a `DiLoCoHooks(trace_dir=...)` trace equals Nesterov SGD on the
  sample-weighted mean of the members' pseudo-gradients, and all members hold the same result.
"""

from __future__ import annotations

import glob
import threading
from typing import Any

import torch
import trio
from torch import nn

from averaging.diloco import DiLoCoOptimizer
from averaging.quorum import QuorumPolicy
from peer.p2p.bridge import Bridge
from peer.p2p.net import MemoryNetwork
from peer.testing.sim_peers import SimPeer, start_peers


class SimSwarm:
    """A `SwarmHandle` over one simulated peer of a shared bridge (what DiLoCoOptimizer needs)."""

    def __init__(self, bridge: Bridge, peer: SimPeer):
        self.bridge, self.peer = bridge, peer

    @property
    def rpc(self) -> Any:
        return self.peer.rpc

    @property
    def dht(self) -> Any:
        return self.peer.dht

    def run(self, async_fn: Any, *args: Any) -> Any:
        return self.bridge.run(async_fn, *args)


def start_swarm(bridge: Bridge, memory: MemoryNetwork, count: int, first: int = 0,
                bootstrap: list | None = None) -> list[SimPeer]:
    async def start(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            peers = await start_peers(nursery, count, memory=memory, seed=3, first=first, bootstrap=bootstrap)
            task_status.started(peers)

    return bridge.start_and_wait(start)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def make_trainer(swarm: SimSwarm, model: nn.Module | None = None,
                 **options: Any) -> tuple[nn.Module, DiLoCoOptimizer]:
    model = tiny_model() if model is None else model
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    # a window of at least 2 s: on a loaded machine a trainer descheduled for a moment must not cut its phase
    # (most tests check that every member's phases end together)
    defaults = dict(inner_steps=5, batch_size_per_step=4, averaging_timeout=20.0, progress_ttl=10.0,
                    min_refresh=0.05, max_refresh=0.5, quorum=QuorumPolicy(grace_min=2.0))
    defaults.update(options)
    return model, DiLoCoOptimizer(inner, swarm, "sim", **defaults)


def make_together(swarms: list[SimSwarm], **options: Any) -> list[tuple[nn.Module, DiLoCoOptimizer]]:
    """Trainers built at the same time (each constructor waits for `start_with` of them), in swarm order."""
    made: dict[int, tuple[nn.Module, DiLoCoOptimizer]] = {}
    models = [tiny_model() for _ in swarms]  # here: tiny_model seeds torch's global generator, threads would race

    def build(index: int) -> None:
        made[index] = make_trainer(swarms[index], models[index], **options)

    run_threads([lambda i=i: build(i) for i in range(len(swarms))])
    return [made[i] for i in range(len(swarms))]


def start_trainers(bridge: Bridge, count: int, latency: float = 0.002, building: int | None = None,
                   **options: Any) -> tuple[MemoryNetwork, list[SimPeer], list[tuple[nn.Module, DiLoCoOptimizer]]]:
    """`count` simulated peers on a fresh in-memory network, and trainers built together on the first `building`
    of them (all by default; the rest are left for a newcomer)."""
    memory = MemoryNetwork(latency=latency)
    peers = start_swarm(bridge, memory, count)
    made = make_together([SimSwarm(bridge, peer) for peer in peers[:building]], **options)
    return memory, peers, made


def close_all(made: list[tuple[nn.Module, DiLoCoOptimizer]]) -> None:
    for _, opt in made:
        opt.close()


def train_steps(model: nn.Module, opt: DiLoCoOptimizer, steps: int, seed: int, rows: int = 4,
                before_step: Any = None) -> None:
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        x = torch.randn(rows, 6, generator=generator)
        y = torch.randn(rows, 2, generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step(batch_size=rows)


def run_threads(targets: list) -> None:
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as error:  # reported in the test's thread
                errors.append(error)
        return run

    threads = [threading.Thread(target=guarded(fn), daemon=True) for fn in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not any(thread.is_alive() for thread in threads), "a trainer hung"
    if errors:
        raise errors[0]


def reference_check(trace_dir: str, steps: int, count: int) -> None:
    """Every outer step equals Nesterov SGD (lr 0.7, momentum 0.9) on the sample-weighted mean of the group's
    own (uncompressed) pseudo-gradients, and all members hold the same result."""
    momentum = None
    for step in range(1, steps + 1):
        records = [torch.load(f, weights_only=True) for f in sorted(glob.glob(f"{trace_dir}/*.{step}.pt"))]
        assert len(records) == count, f"outer step {step}: {len(records)} trainers"
        assert len({r["hash"] for r in records}) == 1, f"outer step {step}: hashes differ"
        weights = torch.stack([r["weight"] for r in records])
        for index in range(len(records[0]["own"])):
            mean = sum(w * r["own"][index] for w, r in zip(weights, records)) / weights.sum()
            assert torch.allclose(records[0]["averaged"][index], mean, atol=1e-6)
        grads = records[0]["averaged"]
        if momentum is None:
            momentum = [torch.zeros_like(g) for g in grads]
        for index, grad in enumerate(grads):
            momentum[index] = 0.9 * momentum[index] + grad
            expected = records[0]["before"][index] - 0.7 * (grad + 0.9 * momentum[index])
            assert torch.allclose(records[0]["after"][index], expected, atol=1e-6)
