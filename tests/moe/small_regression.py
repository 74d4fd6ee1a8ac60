"""The small regression a RemoteMixtureOfExperts learns in tests/moe/test_mixture.py and test_lying_experts.py:
a fixed random teacher's outputs, fitted through the mixture and a linear head with Adam."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def teacher_data(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """256 inputs and the outputs of a random teacher (torch seeded with 1 first)."""
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(hidden, 32), nn.Tanh(), nn.Linear(32, hidden))
    xs = torch.randn(256, hidden)
    with torch.no_grad():
        ys = teacher(xs)
    return xs, ys


def regression_losses(moe: nn.Module, xs: torch.Tensor, ys: torch.Tensor, steps: int) -> Iterator[float]:
    """`steps` Adam steps (lr 0.01) on `moe` and a fresh linear head, batches of 32 in turn; yields each loss."""
    hidden = xs.shape[1]
    head = nn.Linear(hidden, hidden)
    opt = torch.optim.Adam([*moe.parameters(), *head.parameters()], lr=0.01)
    for step in range(steps):
        batch = slice((step * 32) % 256, (step * 32) % 256 + 32)
        loss = ((head(moe(xs[batch])) - ys[batch]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield loss.item()
