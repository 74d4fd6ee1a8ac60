"""The part reducer with validation and robust aggregation (sans-I/O, no network)."""

from __future__ import annotations

import math

import torch

from averaging.allreduce_core import PartReducer
from averaging.partition import Partition, chunk_views
from averaging.robust import Aggregation


def _setup(members: int, aggregation: Aggregation):
    generator = torch.Generator().manual_seed(1)
    base = [torch.randn(40, generator=generator), torch.randn(3, 5, generator=generator, dtype=torch.float64)]
    tensor_sets = [[b + 0.1 * torch.randn(b.shape, generator=generator, dtype=b.dtype) for b in base]
                   for _ in range(members)]
    partition = Partition.for_tensors(tensor_sets[0], [1.0] * 2, chunk_bytes=32)
    part = partition.parts[0]
    reducer = PartReducer(part, members, [t.dtype for t in tensor_sets[0]], aggregation=aggregation)
    return tensor_sets, part, reducer


def _send(reducer, part, sender, tensors):
    for index, chunk in enumerate(part.chunks):
        reducer.receive(sender, index, 1.0, [v.clone() for v in chunk_views(tensors, chunk)])
    reducer.commit(sender, 1.0)


def _reduced(count: int, aggregation: Aggregation, faulty: dict | None = None):
    """`count` senders' parts reduced with `aggregation`; a sender in `faulty` sends what its function makes of
    each of its tensors. Returns (tensor sets sent, the part, the reducer, its result)."""
    tensor_sets, part, reducer = _setup(count, aggregation)
    for sender, make in (faulty or {}).items():
        tensor_sets[sender] = [make(t) for t in tensor_sets[sender]]
    for sender in range(count):
        _send(reducer, part, sender, tensor_sets[sender])
    return tensor_sets, part, reducer, reducer.finalize()


def _flat(part, values):
    return torch.cat([v.reshape(-1).to(torch.float64) for chunk in values for v in chunk])


def _flat_of(part, tensors):
    return torch.cat([v.reshape(-1).to(torch.float64) for chunk in part.chunks for v in chunk_views(tensors, chunk)])


def test_centered_clip_reducer_rejects_outliers_and_non_finite_and_reports_them():
    tensor_sets, part, reducer, result = _reduced(6, Aggregation("centered_clip"), {
        4: lambda t: torch.full_like(t, 1e30), 5: lambda t: t.clone().fill_(math.nan)})
    assert reducer.rejected == [4, 5] and reducer.contributors == [0, 1, 2, 3]
    honest = torch.stack([_flat_of(part, tensor_sets[s]) for s in range(4)])
    spread = float(torch.linalg.vector_norm(honest - honest.mean(0), dim=1).max())
    assert float(torch.linalg.vector_norm(_flat(part, result) - honest.mean(0))) < spread
    assert reducer.median_norm > 0 and math.isfinite(reducer.median_norm)
    # the result keeps the chunk/segment layout and dtypes of a mean
    for values, chunk in zip(result, part.chunks):
        for value, view in zip(values, chunk_views(tensor_sets[0], chunk)):
            assert value.shape == (view.numel(),) and value.dtype == view.dtype


def test_mean_reducer_rejects_only_non_finite_parts():
    tensor_sets, part, reducer, result = _reduced(4, Aggregation("mean"), {
        2: lambda t: torch.full_like(t, 1e30), 3: lambda t: t.clone().fill_(math.inf)})
    assert reducer.rejected == [3] and reducer.contributors == [0, 1, 2]
    assert float(_flat(part, result).abs().min()) > 1e29  # the 1e30 member moved every element


def test_mean_reducer_trusts_a_finite_running_sum():
    # all finite: one check of the running sum stands for the part-by-part pass (so no median norm), and the
    # result is the plain mean; a sum that is not finite takes the part-by-part path (the test above)
    tensor_sets, part, reducer, result = _reduced(4, Aggregation("mean"))
    assert reducer.rejected == [] and reducer.contributors == [0, 1, 2, 3] and reducer.median_norm == 0.0
    mean = torch.stack([_flat_of(part, tensor_sets[s]) for s in range(4)]).mean(0)
    torch.testing.assert_close(_flat(part, result), mean, atol=1e-6, rtol=0)


def test_trimmed_mean_reducer_matches_the_mean_without_outliers():
    tensor_sets, part, reducer, result = _reduced(4, Aggregation("trimmed_mean", trim=0.0))
    mean = torch.stack([_flat_of(part, tensor_sets[s]) for s in range(4)]).mean(0)
    torch.testing.assert_close(_flat(part, result), mean, atol=1e-5, rtol=0)
