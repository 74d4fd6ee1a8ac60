"""Validation of tensors arriving from callers: every kind of bad input is caught before batching."""

import pytest
import torch

from moe.schema import SchemaError, TensorSpec, specs_from_wire, specs_to_wire, validate_batch

SPECS = [TensorSpec((4,), torch.float32), TensorSpec((2, 3), torch.float32)]


def good(batch=5):
    return [torch.randn(batch, 4), torch.randn(batch, 2, 3)]


def test_valid_batch_returns_batch_size():
    assert validate_batch(SPECS, good(5), max_batch_size=8) == 5
    assert validate_batch(SPECS, good(3), max_batch_size=8, batch_size=3) == 3


@pytest.mark.parametrize(
    "tensors, message",
    [
        ("not a list", "expected a list"),
        ([torch.randn(5, 4)], "expected 2 tensors"),
        ([torch.randn(5, 4), "x"], "expected a tensor"),
        ([torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, 3)], "dtype"),
        ([torch.randn(5, 5), torch.randn(5, 2, 3)], "shape"),
        ([torch.randn(4), torch.randn(5, 2, 3)], "shape"),
        ([torch.randn(5, 4), torch.randn(6, 2, 3)], "batch size 6 != 5"),
        ([torch.randn(0, 4), torch.randn(0, 2, 3)], "empty batch"),
        ([torch.randn(9, 4), torch.randn(9, 2, 3)], "exceeds"),
        ([torch.tensor([[1.0, float("nan"), 0, 0]]), torch.randn(1, 2, 3)], "NaN"),
        ([torch.randn(1, 4), torch.full((1, 2, 3), float("inf"))], "NaN or infinite"),
    ],
)
def test_bad_batches_are_rejected(tensors, message):
    with pytest.raises(SchemaError, match=message):
        validate_batch(SPECS, tensors, max_batch_size=8)


def test_grad_outputs_must_match_input_batch():
    with pytest.raises(SchemaError, match="batch size"):
        validate_batch(SPECS, good(4), max_batch_size=8, batch_size=3, what="grad_outputs")


def test_wire_round_trip_and_malformed_specs():
    assert specs_from_wire(specs_to_wire(SPECS)) == SPECS
    for bad in [None, [{"shape": "4", "dtype": "float32"}], [{"shape": [4], "dtype": "complex_thing"}],
                [{"shape": [True], "dtype": "float32"}], [{"dtype": "float32"}]]:
        with pytest.raises(SchemaError):
            specs_from_wire(bad)
