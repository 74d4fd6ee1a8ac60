"""What the training tasks share (digits in `peer.train`, the byte-level LM in `peer.lm`, the user's model in
`peer.user_model`): seeded batches, the grid of experts a task's model holds and where its settings come from,
the local mixture that stands in for the swarm's, and the run's seed for initial weights.

Why a module of its own: the tasks imported these from `peer.train`, the runner, which imports the tasks back
(to pick one by `--task`): an import cycle through the whole application layer. The runner sits above the
tasks now, and this module below them; it imports no task and no command.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from typing import Any, Sequence

import torch
from torch import nn

from dht.client import SwarmHandle
from moe.grid import make_uid
from peer.discover import discover_experts
from peer.options import parse_grid_size


class BatchStream:
    """Shuffled mini-batches of rows, epoch after epoch, from a seeded generator (a batch is at most every row)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
        self.x, self.y, self.batch_size = x, y, min(batch_size, len(x))
        self.generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._position + self.batch_size > len(self._order):
            self._order = torch.randperm(len(self.x), generator=self.generator)
            self._position = 0
        index = self._order[self._position:self._position + self.batch_size]
        self._position += self.batch_size
        return self.x[index], self.y[index]


def grid_uids(prefix: str, grid: Sequence[int]) -> list[str]:
    return [make_uid(prefix, coords) for coords in _coords(grid)]


def _coords(grid: Sequence[int]) -> list[tuple[int, ...]]:
    coords: list[tuple[int, ...]] = [()]
    for size in grid:
        coords = [c + (i,) for c in coords for i in range(size)]
    return coords


class LocalMixtureOfExperts(nn.Module):
    """The same computation as `moe.mixture.RemoteMixtureOfExperts` with the experts in this process: a gate
    over the grid (one linear score per coordinate, an expert's score is the sum over its coordinates), each
    sample's `k_best` best experts, their outputs mixed with a softmax over the chosen scores."""

    def __init__(self, in_features: int, grid_size: Sequence[int], experts: Sequence[nn.Module], k_best: int):
        super().__init__()
        self.grid_size = tuple(grid_size)
        self.k_best = min(k_best, len(experts))
        self.gate = nn.Linear(in_features, sum(self.grid_size))
        self.experts = nn.ModuleList(experts)
        coords = torch.tensor(_coords(self.grid_size), dtype=torch.long)  # [E, ndim]
        offsets = torch.tensor([0, *self.grid_size[:-1]]).cumsum(0)
        self.register_buffer("score_index", coords + offsets, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [B, sum(grid)]
        scores = logits[:, self.score_index].sum(-1)  # [B, E]
        top, chosen = scores.topk(self.k_best, dim=1)  # [B, k]
        weights = torch.softmax(top, dim=1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slots = (chosen == e).nonzero(as_tuple=True)
            if len(rows):
                out = out.index_add(0, rows, weights[rows, slots].unsqueeze(1) * expert(x[rows]))
        return out


def run_seed(run_id: str) -> int:
    """Every trainer of a run starts from the same weights (derived from the run id), so averaging starts from
    agreement; `--seed` only changes the order of the batches."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:4], "big")


LOCAL_EXPERT_DEFAULTS = {"hidden_dim": 64, "expert_prefix": "ffn", "grid_size": "12"}
SWARM_WAIT = 15.0  # seconds to wait for a swarm whose daemons have not declared experts yet


def expert_settings(args: argparse.Namespace) -> tuple[int, str, tuple[int, ...]]:
    """(hidden_dim, expert_prefix, grid) of the model: as given, else `LOCAL_EXPERT_DEFAULTS` (on a swarm,
    `run_training` fills the missing ones from the swarm before the model is built)."""
    values: dict[str, Any] = {name: default if getattr(args, name, None) is None else getattr(args, name)
              for name, default in LOCAL_EXPERT_DEFAULTS.items()}
    return values["hidden_dim"], values["expert_prefix"], parse_grid_size(values["grid_size"])


def discover_swarm_experts(args: argparse.Namespace, swarm: SwarmHandle) -> argparse.Namespace:
    """A copy of `args` whose --hidden-dim, --expert-prefix and --grid-size left out (None) are the swarm's,
    checked against what the daemons declare (see `peer.discover`): a mismatch fails here, in seconds, with
    one line naming both sides, instead of after the whole retry budget of failed steps."""
    def waiting(waited: float, wait: float) -> None:
        print(f"peer train: no experts declared in the swarm yet, waiting ({waited:.0f} s of {wait:g} s)",
              file=sys.stderr, flush=True)

    async def discover() -> Any:
        return await discover_experts(swarm.dht, hidden_dim=args.hidden_dim, prefix=args.expert_prefix,
                                      grid_size=args.grid_size, wait=SWARM_WAIT, on_wait=waiting)

    found = swarm.run(discover)
    resolved = argparse.Namespace(**vars(args))
    resolved.hidden_dim, resolved.expert_prefix, resolved.grid_size = found.hidden_dim, found.prefix, found.grid_size
    return resolved


class GridTask:
    """The hook the tasks whose model holds a grid of experts (`DigitsTask`, `peer.lm.LMTask`) share: their
    experts are the grid that --expert-prefix and --grid-size name (once the swarm filled them in)."""

    def expert_uids(self, args: argparse.Namespace) -> list[str]:
        _, prefix, grid = expert_settings(args)
        return grid_uids(prefix, grid)
