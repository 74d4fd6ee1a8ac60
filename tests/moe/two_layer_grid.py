"""Two expert servers holding the two layers of a small grid, and the mixture model that routes over them, for the
batched and packed expert call tests and the steps-in-flight tests (tests/moe/test_batched_calls.py,
test_packed_calls.py, test_pipeline.py), on the `harness` fixture of tests/moe/conftest.py.

- `server_experts(server, lr)`: server 0 holds experts 0-3 of each layer ("la", "lb"), server 1 experts 4-7, each
  ffn expert seeded by its uid (`uid_seed`), so a local copy can be rebuilt; `two_servers` starts both.
- `TwoLayers`: x -> x + layer_a(x) -> ... + layer_b(...); `mixture_layer` one `RemoteMixtureOfExperts` of it,
  `static_model` the two over known expert locations (no DHT lookups).
"""

from __future__ import annotations

import torch
from torch import nn

from moe.beam_search import StaticGridOracle
from moe.experts import OptimizerConfig, make_expert
from moe.mixture import RemoteMixtureOfExperts
from tests.moe.process_training import TIMEOUT

HIDDEN = 8
GRID = 8  # experts per layer, half on each server
LAYERS = ("la", "lb")


def uid_seed(uid: str) -> int:
    prefix, index = uid.split(".")
    return 100 * LAYERS.index(prefix) + int(index)


def server_experts(server: int, lr: float) -> list:
    """Server 0 holds experts 0-3 of each layer, server 1 experts 4-7, each seeded by its uid."""
    uids = [f"{layer}.{i}" for layer in LAYERS for i in range(4 * server, 4 * server + 4)]
    return [make_expert(uid, "ffn", HIDDEN, seed=uid_seed(uid), optimizer=OptimizerConfig("sgd", lr=lr))
            for uid in uids]


class TwoLayers(nn.Module):
    """x -> x + layer_a(x) -> ... + layer_b(...): two mixture layers, one grid prefix each."""

    def __init__(self, layers: list[RemoteMixtureOfExperts]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def mixture_layer(swarm, prefix: str, grid: int, k_best: int, oracle=None) -> RemoteMixtureOfExperts:
    return RemoteMixtureOfExperts(HIDDEN, (grid,), prefix, k_best=k_best, k_min=1, forward_timeout=TIMEOUT,
                                  timeout_after_k_min=TIMEOUT, backward_timeout=TIMEOUT, swarm=swarm, oracle=oracle)


def static_model(swarm, locations, k_best: int) -> TwoLayers:
    return TwoLayers([mixture_layer(swarm, prefix, GRID, k_best, StaticGridOracle(
        {uid: loc for uid, loc in locations.items() if uid.startswith(prefix + ".")})) for prefix in LAYERS])


def two_servers(harness, lr: float = 0.0):
    servers = [harness.server(server_experts(index, lr)) for index in range(2)]
    locations = {uid: loc for server in servers for uid, loc in server.locations().items()}
    return servers, locations
