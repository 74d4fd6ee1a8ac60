"""Expert modules that answer wrongly on purpose, for the tests of what a client makes of a bad reply
(test_calls.py, test_batched_calls.py)."""

from __future__ import annotations

import torch
from torch import nn


class AnswersInf(nn.Module):
    """A linear layer whose every output is infinite."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * float("inf")
