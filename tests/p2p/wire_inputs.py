"""Tensors that tests/p2p/test_wire_codecs.py encodes both in its own process and in child processes (with 1 and 2
torch threads) to show the codecs' bytes do not depend on the process: a module of its own so the child imports
these inputs alone, not a test module."""

from __future__ import annotations

import torch


def determinism_inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(12)
    heavy = torch.randn(3 * 4096 + 77, generator=generator) * torch.randn(3 * 4096 + 77, generator=generator).exp()
    ties = torch.tensor([1.0, -1.0, 0.5, 0.0] * 3000)  # every chunk's boundary falls inside a tie
    return [heavy, heavy.double(), heavy.bfloat16(), ties, torch.zeros(5000)]
