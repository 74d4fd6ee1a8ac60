"""MoE that hides latency: a two-layer remote MoE trainer's samples/s, synchronous and with several steps in flight
(`moe.pipeline.StepsInFlight`), on loopback and with a round-trip delay.

Two expert servers in separate processes (peer/testing/expert_server_process.py), each with 4 ffn experts of each
layer (grid (8,), prefixes `la` and `lb`); the trainer is this process (`peer.client.Swarm`, two
`RemoteMixtureOfExperts` with k_best 2 over a fixed expert table, a local linear head, Adam). The delay is a
user-space RPC stage in the trainer: every expert call waits `--rtt` seconds before it goes out (a round trip's
worth, both directions together), so all calls, pipelined or not, pay it.

Figures (last line, one JSON object):
- `samples_per_s_{loopback,rtt}_{sequential,pipelined}`: the four runs (sequential: depth 1, the synchronous
  trainer; pipelined: `--depth` steps in flight);
- `latency_hiding`: pipelined samples/s with the delay / the same trainer on loopback (target >= 0.6);
- `latency_hiding_sequential`: the same ratio for the sequential trainer, beside it;
- `pipelined_speedup_at_rtt`: pipelined / sequential samples/s with the delay;
- `max_staleness`: the most updates any applied gradient was behind (at most depth - 1).

Usage: python benchmarks/bench_moe_pipeline.py [--rtt 0.05] [--depth 8] [--steps 16] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import trio  # noqa: E402
from torch import nn  # noqa: E402

from moe.beam_search import StaticGridOracle  # noqa: E402
from moe.declare import ExpertLocation  # noqa: E402
from moe.mixture import RemoteMixtureOfExperts  # noqa: E402
from moe.pipeline import StepsInFlight  # noqa: E402
from peer.client import Swarm  # noqa: E402
from peer.testing.peer_processes import ExpertServerProcess  # noqa: E402

LAYERS = ("la", "lb")


class DelayedRPC:
    """The trainer's RPC node behind a delay: each call waits `rtt` seconds first (a latency stage in user space,
    for benchmarks); everything else is the node's own."""

    def __init__(self, rpc: Any, rtt: float):
        self._rpc, self._rtt = rpc, rtt

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        if self._rtt > 0:
            await trio.sleep(self._rtt)
        return await self._rpc.call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rpc, name)


class Trainer(nn.Module):
    def __init__(self, layers: list[RemoteMixtureOfExperts], hidden: int):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def run(swarm: Swarm, locations: dict[str, ExpertLocation], hidden: int, batch: int, steps: int, rtt: float,
        depth: int) -> tuple[float, int]:
    """samples/s of `steps` training steps (after `depth` warm-up steps), and the largest staleness seen."""
    torch.manual_seed(0)
    layers = []
    for prefix in LAYERS:
        table = {uid: loc for uid, loc in locations.items() if uid.startswith(prefix + ".")}
        layer = RemoteMixtureOfExperts(hidden, (8,), prefix, k_best=2, k_min=1, swarm=swarm,
                                       oracle=StaticGridOracle(table), timeout_after_k_min=5.0,
                                       forward_timeout=30.0, backward_timeout=30.0)
        layer.client.rpc = DelayedRPC(swarm.rpc, rtt)  # type: ignore[assignment]
        layers.append(layer)
    model = Trainer(layers, hidden)
    teacher = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    trainer = StepsInFlight(model, optimizer, loss_fn, depth=depth)

    def submit(count: int) -> None:
        for _ in range(count):
            x = torch.randn(batch, hidden)
            with torch.no_grad():
                y = teacher(x)
            trainer.submit(x, y)
        failed = [r for r in trainer.drain() if r.error is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} steps failed, first: {failed[0].error}")

    submit(depth)
    started = time.perf_counter()
    submit(steps)
    return steps * batch / (time.perf_counter() - started), trainer.max_staleness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt", type=float, default=0.05, help="seconds of delay per expert call")
    parser.add_argument("--depth", type=int, default=8, help="steps in flight of the pipelined trainer")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    uids = [[f"{prefix}.{i}" for prefix in LAYERS for i in range(4 * s, 4 * s + 4)] for s in range(2)]
    servers = [ExpertServerProcess(group, "--hidden", str(args.hidden), "--torch-threads", "1",
                                   "--seed", str(10 * s), *(["--new-dht"] if s == 0 else []))
               for s, group in enumerate(uids)]
    figures: dict[str, float] = {}
    staleness = 0
    try:
        for server in servers:
            server.wait_ready(180.0)
        locations = {uid: ExpertLocation(server.address[0], server.address[1], server.peer_id)
                     for server, group in zip(servers, uids) for uid in group}
        with Swarm([servers[0].address]) as swarm:
            for name, rtt in (("loopback", 0.0), ("rtt", args.rtt)):
                for mode, depth in (("sequential", 1), ("pipelined", args.depth)):
                    rate, stale = run(swarm, locations, args.hidden, args.batch, args.steps, rtt, depth)
                    staleness = max(staleness, stale)
                    figures[f"samples_per_s_{name}_{mode}"] = round(rate, 1)
                    print(f"{name:8s} (delay {1000 * rtt:.0f} ms per call) {mode:10s} ({depth} step"
                          f"{'s' if depth > 1 else ''} in flight): {rate:.0f} samples/s, staleness <= {stale}")
    finally:
        for server in servers:
            server.kill()
    figures["latency_hiding"] = round(figures["samples_per_s_rtt_pipelined"]
                                      / figures["samples_per_s_loopback_pipelined"], 3)
    figures["latency_hiding_sequential"] = round(figures["samples_per_s_rtt_sequential"]
                                                 / figures["samples_per_s_loopback_sequential"], 3)
    figures["pipelined_speedup_at_rtt"] = round(figures["samples_per_s_rtt_pipelined"]
                                                / figures["samples_per_s_rtt_sequential"], 3)
    load = os.getloadavg()
    print(f"machine: {len(os.sched_getaffinity(0))} cores, load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min); "
          f"rtt {1000 * args.rtt:.0f} ms, batch {args.batch}, hidden {args.hidden}, "
          f"depth {args.depth}")
    print(json.dumps({**figures, "max_staleness": staleness, "rtt_ms": 1000 * args.rtt, "depth": args.depth}))


if __name__ == "__main__":
    main()
