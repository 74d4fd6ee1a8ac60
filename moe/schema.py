"""Tensor schemas of an expert's inputs and outputs, and validation of tensors that arrive from the network.

An expert server computes on tensors sent by strangers. Everything about them is checked before they reach a
batch shared with other callers: one bad request must fail alone (a typed error to that caller) and never poison
the batch, the expert's weights (NaN gradients) or the server. The checks are pure functions raising
`SchemaError`; the server turns that into the wire error `moe.errors.BadExpertInput` for the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from peer.p2p import wire


class SchemaError(ValueError):
    """Tensors do not match the schema they were checked against (the message says how)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of an expert's dtype (the one table is `peer.p2p.wire.DTYPES`)."""
    name = wire.dtype_name(dtype)
    if name is None:
        raise SchemaError(f"unsupported dtype {dtype}")
    return name


def dtype_from_name(name: object) -> torch.dtype:
    dtype = wire.dtype_from_name(name)
    if dtype is None:
        raise SchemaError(f"unsupported dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a batch: its shape WITHOUT the leading batch dimension, and its dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise SchemaError(f"negative dimension in {self.shape}")
        dtype_name(self.dtype)

    def to_wire(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_wire(cls, obj: Any) -> "TensorSpec":
        """Parse a spec received from a peer (`moe.info`); raises SchemaError on anything malformed."""
        if not isinstance(obj, dict) or not isinstance(obj.get("shape"), (list, tuple)):
            raise SchemaError(f"malformed tensor spec {obj!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in obj["shape"]):
            raise SchemaError(f"malformed shape {obj['shape']!r}")
        return cls(tuple(obj["shape"]), dtype_from_name(obj.get("dtype")))

    def empty(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros((batch_size, *self.shape), dtype=self.dtype, device=device)


def specs_to_wire(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    return [spec.to_wire() for spec in specs]


def specs_from_wire(obj: Any) -> list[TensorSpec]:
    if not isinstance(obj, (list, tuple)):
        raise SchemaError(f"expected a list of tensor specs, got {type(obj).__name__}")
    return [TensorSpec.from_wire(item) for item in obj]


def validate_batch(
    specs: Sequence[TensorSpec],
    tensors: Any,
    *,
    max_batch_size: int,
    batch_size: int | None = None,
    what: str = "inputs",
    finite: bool = True,
) -> int:
    """Check `tensors` against `specs` and return the batch size (the common leading dimension).

    Checks, in order of cost: it is a list of the right length; each item is a tensor of the declared dtype
    and of shape (batch, *spec.shape); all share one batch size in 1..max_batch_size (equal to `batch_size`
    when given, e.g. grad_outputs must match their inputs); floating values are all finite (unless `finite` is
    False: a packed call checks finiteness itself, to fail only the experts whose rows hold such values).
    """
    if not isinstance(tensors, (list, tuple)):
        raise SchemaError(f"{what}: expected a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != len(specs):
        raise SchemaError(f"{what}: expected {len(specs)} tensors, got {len(tensors)}")
    found: int | None = batch_size
    for index, (spec, tensor) in enumerate(zip(specs, tensors)):
        if not isinstance(tensor, torch.Tensor):
            raise SchemaError(f"{what}[{index}]: expected a tensor, got {type(tensor).__name__}")
        if tensor.dtype != spec.dtype:
            raise SchemaError(f"{what}[{index}]: dtype {tensor.dtype} != expected {spec.dtype}")
        if tensor.dim() != len(spec.shape) + 1 or tuple(tensor.shape[1:]) != spec.shape:
            raise SchemaError(
                f"{what}[{index}]: shape {tuple(tensor.shape)} != expected (batch, {', '.join(map(str, spec.shape))})"
            )
        rows = tensor.shape[0]
        if found is None:
            found = rows
        elif rows != found:
            raise SchemaError(f"{what}[{index}]: batch size {rows} != {found}")
    if found is None or found < 1:
        raise SchemaError(f"{what}: empty batch")
    if found > max_batch_size:
        raise SchemaError(f"{what}: batch size {found} exceeds the expert's maximum {max_batch_size}")
    for index, tensor in enumerate(tensors):
        if finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SchemaError(f"{what}[{index}]: contains NaN or infinite values")
    return found
