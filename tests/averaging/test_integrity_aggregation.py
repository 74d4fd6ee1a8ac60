"""Issue 36, "weight is bought by claiming it": sign-flipping members that claim a huge sample weight, against the
part reducer with CenteredClip (sans-I/O, no network)."""

from __future__ import annotations

import pytest
import torch

from averaging.allreduce_core import PartReducer
from averaging.partition import Partition, chunk_views
from averaging.robust import Aggregation, bounded_weights


def _reduce(aggregation: Aggregation, claimed: list[float], flip: set[int]):
    generator = torch.Generator().manual_seed(36)
    base = [torch.randn(64, generator=generator) + 1.0]
    members = len(claimed)
    tensor_sets = [[b + 0.3 * torch.randn(b.shape, generator=generator) for b in base] for _ in range(members)]
    for attacker in flip:
        tensor_sets[attacker] = [-t for t in tensor_sets[attacker]]  # sign flip: same norm, passes validation
    partition = Partition.for_tensors(tensor_sets[0], [1.0], chunk_bytes=64)
    part = partition.parts[0]
    reducer = PartReducer(part, members, [t.dtype for t in tensor_sets[0]], aggregation=aggregation)
    for sender in range(members):
        for index, chunk in enumerate(part.chunks):
            views = [v.clone() for v in chunk_views(tensor_sets[sender], chunk)]
            reducer.receive(sender, index, claimed[sender], views)
        reducer.commit(sender, claimed[sender])
    result = torch.cat([v.reshape(-1) for chunk in reducer.finalize() for v in chunk])
    honest = torch.stack([torch.cat([v.reshape(-1) for chunk in part.chunks for v in chunk_views(t, chunk)])
                          for i, t in enumerate(tensor_sets) if i not in flip]).mean(0)
    return float(torch.linalg.vector_norm(result - honest) / torch.linalg.vector_norm(honest)), reducer


@pytest.mark.parametrize("claim", [100.0, 1e6])
def test_sign_flippers_claiming_a_huge_weight_no_longer_own_centered_clip(claim):
    claimed = [1.0] * 6 + [claim, claim]  # 8 trainers, 2 malicious
    uncapped, _ = _reduce(Aggregation("centered_clip", max_weight_ratio=1e12), claimed, {6, 7})
    capped, reducer = _reduce(Aggregation("centered_clip"), claimed, {6, 7})
    assert uncapped > 1.0  # the finding: the flipped parts win, the result points away from the honest mean
    assert capped < 0.25 and capped < uncapped / 4
    assert reducer.rejected == []  # sign flips pass the norm check: the weight cap is what holds


def test_weights_are_capped_at_a_multiple_of_the_low_median_and_only_for_robust_kinds():
    robust = Aggregation("centered_clip", max_weight_ratio=4.0)
    assert bounded_weights([1.0, 2.0, 1.0, 1e6], robust) == [1.0, 2.0, 1.0, 4.0]
    assert bounded_weights([1.0, 1e6], robust) == [1.0, 4.0]  # two members: the smaller claim sets the cap
    assert bounded_weights([0.0, 3.0, 3.0], robust) == [0.0, 3.0, 3.0]  # zero weights are no claim
    assert bounded_weights([1.0, 1e6], Aggregation("mean")) == [1.0, 1e6]
    with pytest.raises(ValueError):
        Aggregation("centered_clip", max_weight_ratio=0.5)


def test_clean_groups_with_ordinary_weights_are_unchanged_by_the_cap():
    claimed = [1.0, 1.5, 0.8, 1.2, 2.0, 1.0, 0.9, 1.1]
    capped, reducer = _reduce(Aggregation("centered_clip"), claimed, set())
    uncapped, _ = _reduce(Aggregation("centered_clip", max_weight_ratio=1e12), claimed, set())
    assert capped == pytest.approx(uncapped) and reducer.rejected == []
