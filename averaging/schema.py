"""Model schema hash: peers only average with peers whose registered tensors line up element for element.

Averaging flattens every registered tensor into one vector and splits it into parts by offset, so two peers whose
tensors differ in names, order, shapes or dtypes would silently mix unrelated numbers. A short hash of the
(name, shape, dtype) list travels in every matchmaking declaration and join request; peers with a different hash
are simply not grouped together (a swarm can run several models under one prefix without mixing them).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import msgpack
import torch

SCHEMA_HASH_BYTES = 8


def describe(tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> list[list[Any]]:
    """The schema as plain data: one [name, shape, dtype] per tensor, in registration order."""
    if names is None:
        names = [str(index) for index in range(len(tensors))]
    if len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    return [[str(name), list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]
            for name, tensor in zip(names, tensors)]


def schema_hash(tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> bytes:
    """8 bytes that differ (with overwhelming probability) whenever a name, shape, dtype or the order differs.

    8 bytes is plenty: this guards against mistakes (two models under one prefix), not against forgery; a hostile
    peer can always send wrong numbers with the right schema.
    """
    packed = msgpack.packb(describe(tensors, names), use_bin_type=True)
    return hashlib.sha256(b"swarmd-averaging-schema-v1|" + packed).digest()[:SCHEMA_HASH_BYTES]
