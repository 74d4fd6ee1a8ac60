"""The robust aggregation math (averaging.robust) on plain tensors: validation, CenteredClip, trimmed mean, the
lying-reducer check and the strike book."""

import math

import pytest
import torch

from averaging.robust import (
    Aggregation,
    Strikes,
    aggregate,
    aggregation_of,
    centered_clip,
    plausible,
    trimmed_mean,
    validate,
)


def _honest(n: int, d: int = 200, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=generator)
    return [base + 0.3 * torch.randn(d, generator=generator) for _ in range(n)]


def test_validation_rejects_non_finite_always_and_outlier_norms_only_when_robust():
    parts = _honest(6) + [torch.full((200,), 1e30), torch.full((200,), math.nan)]
    rejected, median = validate(parts, Aggregation("mean"))
    assert rejected == [7]
    rejected, median = validate(parts, Aggregation("centered_clip"))
    assert rejected == [6, 7]
    assert median == pytest.approx(float(torch.linalg.vector_norm(parts[0])), rel=0.3)
    # two parts: no majority to tell which one is off
    assert validate([parts[0], parts[6]], Aggregation("centered_clip"))[0] == []


def test_centered_clip_equals_the_mean_without_outliers_and_ignores_far_ones():
    honest = _honest(6)
    stack = torch.stack(honest)
    mean = stack.mean(0)
    weights = torch.ones(6)
    wide = centered_clip(stack, weights, tau=100.0, iterations=3)
    torch.testing.assert_close(wide, mean)
    spread = float(torch.linalg.vector_norm(stack - mean, dim=1).max())
    attacked = torch.stack(honest + [-100 * honest[0], 50 * torch.randn(200)])
    result = centered_clip(attacked, torch.ones(8), tau=1.0, iterations=5)
    # the bias an outlier can cause is about tau * f / (n - f) median distances: here within the honest spread
    assert float(torch.linalg.vector_norm(result - mean)) < spread
    assert float(torch.linalg.vector_norm(attacked.mean(0) - mean)) > 10 * spread


def test_centered_clip_of_identical_parts_is_that_part():
    part = torch.arange(10.0)
    assert torch.equal(centered_clip(torch.stack([part] * 4), torch.ones(4), tau=1.0, iterations=2), part)


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    parts = torch.tensor([[1.0, -1e9], [2.0, 0.0], [3.0, 1.0], [1e9, 2.0]])
    torch.testing.assert_close(trimmed_mean(parts, trim=0.25), torch.tensor([2.5, 0.5]))
    torch.testing.assert_close(trimmed_mean(parts[:1], trim=0.25), parts[0])


def test_aggregate_weighted_mean_and_dtypes():
    parts = torch.stack([torch.ones(3, dtype=torch.float64), 3 * torch.ones(3, dtype=torch.float64)])
    out = aggregate(parts, [1.0, 3.0], Aggregation("mean"))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, 2.5 * torch.ones(3, dtype=torch.float64))


def test_plausible_catches_what_no_honest_reducer_produces():
    honest = _honest(6)
    robust = Aggregation("centered_clip")
    mean = torch.stack(honest).mean(0)
    assert all(plausible([mean], [own], 0.0, robust) for own in honest)
    assert not plausible([-100 * mean], [honest[0]], 0.0, robust)
    assert not plausible([torch.full_like(mean, math.inf)], [honest[0]], 0.0, robust)
    # pieces: the same answer whatever the split
    assert not plausible([-100 * mean[:50], -100 * mean[50:]], [honest[0][:50], honest[0][50:]], 0.0, robust)
    # with the mean, only non-finite parts are implausible (an unvalidated mean may be anywhere)
    assert plausible([-100 * mean], [honest[0]], 0.0, Aggregation("mean"))
    assert not plausible([torch.full_like(mean, math.nan)], [honest[0]], 0.0, Aggregation("mean"))
    # a member that sent nothing compares with the reported median norm
    median = float(torch.linalg.vector_norm(honest[0]))
    assert plausible([mean], None, median, robust) and not plausible([100 * mean], None, median, robust)


def test_strikes_ban_after_several_rounds_and_once():
    strikes = Strikes(ban_after=2)
    assert strikes.record_round([b"a", b"a", b"b"]) == set()
    assert strikes.record_round([b"a"]) == {b"a"}
    assert strikes.record_round([b"a"]) == set() and strikes.banned == {b"a"}
    # strikes count within a window of rounds shared (2 x ban_after): rare rejections of an honest peer fade
    strikes = Strikes(ban_after=3)
    members = [b"honest", b"liar"]
    for round_ in range(40):
        honest_rejected = round_ % 5 == 0  # an honest part rejected now and then: never 3 in 6 shared rounds
        newly = strikes.record_round([b"honest"] if honest_rejected else [], members)
        assert b"honest" not in newly
    assert strikes.banned == set()
    for round_ in range(6):  # a liar lying every other round collects 3 strikes within the window
        strikes.record_round([b"liar"] if round_ % 2 == 0 else [], members)
    assert strikes.banned == {b"liar"}


def test_aggregation_keyword():
    assert aggregation_of(None).kind == "mean" and aggregation_of("trimmed_mean").robust
    with pytest.raises(ValueError):
        aggregation_of("median")
    with pytest.raises(ValueError):
        Aggregation("centered_clip", tau=0)
