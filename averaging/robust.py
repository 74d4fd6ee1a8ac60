"""Byzantine-robust aggregation of one all-reduce part: the math only (torch; no trio, no sockets, no clock).

Why a module of its own: the reducer of a part (`allreduce_core.PartReducer`) decides what goes into the mean,
and a member decides whether the part its reducer returned is believable; both decisions are pure functions of
the vectors involved, tested here without a network (tests/averaging/test_robust.py).

Aggregations (`Aggregation.kind`):
- `mean`: the weighted mean (what the all-reduce always did). Only non-finite parts are rejected.
- `centered_clip`: CenteredClip (Karimireddy, He, Jaggi 2021; used per part of the butterfly all-reduce by
  BTARD-SGD, Gorbunov et al. 2022). Start at the medoid (the part with the least total distance to the others: a
  robust start that costs one Gram matrix, where a coordinate-wise median costs a sort of the whole part), then
  `iterations` times move the center by the weighted mean of the differences to every part, each clipped to
  norm tau:
      v <- v + sum_i w_i * (x_i - v) * min(1, tau / |x_i - v|) / sum_i w_i
  tau is relative (`tau` times the median distance of the parts to the starting center), because the averager
  does not know whether it averages parameters, gradients or pseudo-gradients, nor their scale. A part at
  distance <= tau counts fully, as in the mean; a far outlier moves the center by at most tau * w_i / sum w per
  iteration, so the result stays within `iterations * tau` of the medoid whatever the outliers hold.
- `trimmed_mean`: per coordinate, drop the `trim` fraction of the lowest and of the highest values, average
  the rest (unweighted: trimming by weight would let a heavy member decide what is trimmed).

Claimed weights (`bounded_weights`): with a robust kind, a member's sample weight counts at most
`max_weight_ratio` times the low median of the group's positive weights. Why: the weight is the member's own
claim, and CenteredClip moves its center by each clipped difference times its weight share, so a sign-flipping
member claiming 1e6 samples owned every step (issue 36: honest accuracy 0.11). Capped, a minority claiming any
weight holds at most `max_weight_ratio` honest shares each; an honest member with a larger batch than the rest
loses the excess of its share too (the cost: the mean is less sample-weighted where batches differ > 2x).
Measured (tests/averaging/test_integrity_aggregation.py, 8 members, 2 sign-flipping with 1e6 claimed): the
result is 0.20 of the honest mean's norm away from it at 2x, 0.46 at 4x, 0.10 for the same flippers claiming 1;
uncapped, 1.45 (pointing away).

Validation (`validate`), before any of them: a part that is not finite is rejected; with a robust aggregation,
so is a part whose norm exceeds `max_norm_ratio` times the median norm of the group's parts (at least 3 parts:
with 2 there is no majority to say which one is off). Rejected members are reported, and the averager counts
them against the member (`Strikes`).

Lying reducers (`plausible`): whatever the robust aggregation produces lies within reach of the validated parts
(each at most `max_norm_ratio` times the median norm from zero), so a member whose own part was typical finds
the returned part within `lie_ratio` times its own part's norm of its own part. A returned part beyond that, or
not finite, is something no honest reducer could have produced: the member keeps its local values for that part
and counts a strike against the reducer. A member that contributed nothing (weight 0, or an all-zero part) uses
the median norm the reducer reported instead.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

KINDS = ("mean", "centered_clip", "trimmed_mean")


@dataclass(frozen=True)
class Aggregation:
    """How a reducer combines the parts it received, and how much a member believes of what comes back.

    kind: one of KINDS. tau, iterations: CenteredClip's clipping radius (relative to the median distance to the
    starting center) and number of iterations. trim: fraction cut off each side by `trimmed_mean`.
    max_norm_ratio: a part with a norm above this times the group's median norm is rejected (robust kinds).
    lie_ratio: a reduced part further than this times the member's own part's norm from that part is a lie
    (robust kinds; `mean` checks nothing, since an unvalidated mean can legitimately be anywhere).
    max_weight_ratio: a claimed sample weight counts at most this times the group's low median weight (robust
    kinds; see `bounded_weights`)."""

    kind: str = "mean"
    tau: float = 1.0
    iterations: int = 5
    trim: float = 0.25
    max_norm_ratio: float = 5.0
    lie_ratio: float = 12.0
    max_weight_ratio: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown aggregation {self.kind!r} (one of {', '.join(KINDS)})")
        if not (self.tau > 0 and self.iterations >= 1 and 0 <= self.trim < 0.5
                and self.max_norm_ratio > 1 and self.lie_ratio > 1 and self.max_weight_ratio >= 1):
            raise ValueError("aggregation: tau > 0, iterations >= 1, 0 <= trim < 0.5, ratios > 1")

    @property
    def robust(self) -> bool:
        return self.kind != "mean"


def aggregation_of(value: str | Aggregation | None) -> Aggregation:
    """The constructors' `aggregation=` keyword: a kind name or a full Aggregation (None: the mean)."""
    if value is None:
        return Aggregation()
    if isinstance(value, Aggregation):
        return value
    return Aggregation(kind=value)


def norm(vector: torch.Tensor) -> float:
    """The L2 norm; recomputed in float64 when the native one is not finite (a float32 sum of squares of 1e30
    values overflows to inf), so inf or nan means a value that is not finite. The native pass is the cheap one:
    it runs on every part of every round."""
    value = float(torch.linalg.vector_norm(vector))
    if math.isfinite(value) or vector.dtype == torch.float64:
        return value
    return float(torch.linalg.vector_norm(vector.to(torch.float64)))


def part_norm(pieces: Iterable[torch.Tensor]) -> float:
    """The L2 norm of a part given as pieces (its chunks' segments); inf when any value is not finite."""
    total = 0.0
    for piece in pieces:
        value = norm(piece)
        if not math.isfinite(value):
            return math.inf
        total += value ** 2
    return math.sqrt(total)


def validate_norms(norms: Sequence[float], aggregation: Aggregation) -> tuple[list[int], float]:
    """Indices of the parts to reject given their `part_norm`s, and the median norm of the finite ones (0.0 when
    none is finite)."""
    finite = [n for n in norms if math.isfinite(n)]
    median = statistics.median(finite) if finite else 0.0
    rejected = [i for i, n in enumerate(norms) if not math.isfinite(n)]
    if aggregation.robust and len(finite) >= 3:
        limit = aggregation.max_norm_ratio * median
        rejected += [i for i, n in enumerate(norms) if math.isfinite(n) and n > limit]
    return sorted(rejected), median


def validate(parts: Sequence[torch.Tensor], aggregation: Aggregation) -> tuple[list[int], float]:
    """`validate_norms` of whole flat parts."""
    return validate_norms([part_norm([p]) for p in parts], aggregation)


GRAM_BLOCK = 65_536  # columns per block of the Gram product: a block's differences stay in cache (2.9x faster on
# 8 x 2.1M than differencing the whole matrix first), and each block's sum is kept in float64


def centered_clip(parts: torch.Tensor, weights: torch.Tensor, *, tau: float, iterations: int) -> torch.Tensor:
    """CenteredClip of the rows of `parts` (n x d) with `weights` (n); see the module docstring.

    The center is always an affine combination of the rows (it starts at one and moves by weighted differences),
    so every iteration runs on the n x n Gram matrix of the rows' differences to the first row instead of on the
    n x d matrix: one blocked matrix product before, one product after, whatever the iterations. Differences, not
    raw rows: the members' vectors may be nearly equal (averaged parameters), and distances from raw dot products
    would cancel out in float32."""
    n = parts.shape[0]
    if n == 1:
        return parts[0].clone()
    base = parts[0]
    gram = torch.zeros(n, n, dtype=torch.float64)
    inner = gram[1:, 1:]
    for begin in range(0, parts.shape[1], GRAM_BLOCK):
        block = parts[1:, begin:begin + GRAM_BLOCK] - base[begin:begin + GRAM_BLOCK]
        inner += (block @ block.T).to(torch.float64)
    square = gram.diagonal().clone()
    pairwise = torch.sqrt(torch.clamp(square[:, None] + square[None, :] - 2 * gram, min=0))
    start = int(pairwise.sum(dim=1).argmin())
    coefficients = torch.zeros(n, dtype=torch.float64)
    coefficients[start] = 1.0
    share = weights.to(torch.float64) / float(weights.sum())

    def distances(c: torch.Tensor) -> torch.Tensor:
        gc = gram @ c
        return torch.sqrt(torch.clamp(square - 2 * gc + c @ gc, min=0))

    radius = tau * statistics.median(distances(coefficients).tolist())
    if radius <= 0:
        return parts[start].clone()  # most parts coincide with the starting one: that is the robust answer
    for _ in range(iterations):
        scale = share * torch.clamp(radius / torch.clamp(distances(coefficients), min=1e-300), max=1.0)
        coefficients = coefficients * (1.0 - float(scale.sum())) + scale
    # the center as the combination of the rows it is: the coefficients sum to 1 and none is negative (each
    # iteration mixes in at most the whole of `share`), so nothing cancels
    return coefficients.to(parts.dtype) @ parts


def trimmed_mean(parts: torch.Tensor, *, trim: float) -> torch.Tensor:
    """Coordinate-wise mean of the rows of `parts` without the `trim` fraction at either end."""
    n = parts.shape[0]
    cut = min(int(math.floor(trim * n)), (n - 1) // 2)
    if cut == 0:
        return parts.mean(dim=0)
    ordered = parts.sort(dim=0).values
    return ordered[cut:n - cut].mean(dim=0)


def bounded_weights(weights: Sequence[float], aggregation: Aggregation) -> list[float]:
    """The weights a robust reducer uses: each claimed weight capped at `max_weight_ratio` times the low median
    of the positive weights (the low median: with two members, the smaller claim). `mean` keeps the claims."""
    positive = sorted(float(w) for w in weights if w > 0)
    if not aggregation.robust or len(positive) < 2:
        return [float(w) for w in weights]
    cap = aggregation.max_weight_ratio * statistics.median_low(positive)
    return [min(float(w), cap) for w in weights]


def aggregate(matrix: torch.Tensor, weights: Sequence[float], aggregation: Aggregation) -> torch.Tensor:
    """Combine the rows of `matrix` (n validated flat parts) into one flat vector of its dtype."""
    w = torch.tensor([float(x) for x in weights], dtype=matrix.dtype)
    if aggregation.kind == "centered_clip":
        return centered_clip(matrix, w, tau=aggregation.tau, iterations=aggregation.iterations)
    if aggregation.kind == "trimmed_mean":
        return trimmed_mean(matrix, trim=aggregation.trim)
    return (w / w.sum()) @ matrix


def plausible(reduced: Sequence[torch.Tensor], own: Sequence[torch.Tensor] | None, reported_median: float,
              aggregation: Aggregation) -> bool:
    """Could an honest reducer have returned the part `reduced` (as pieces), given that we sent `own` (the same
    pieces of our tensors; None: we sent nothing)?"""
    reduced_norm = part_norm(reduced)
    if not math.isfinite(reduced_norm):
        return False
    if not aggregation.robust:
        return True
    own_norm = part_norm(own) if own is not None else 0.0
    if own is not None and own_norm > 0:
        distance = part_norm(r.reshape(-1) - o.reshape(-1).to(r.dtype) for r, o in zip(reduced, own))
        return distance <= aggregation.lie_ratio * own_norm
    if not math.isfinite(reported_median) or reported_median <= 0:
        return True  # nothing to compare with
    return reduced_norm <= aggregation.lie_ratio * reported_median


@dataclass
class Strikes:
    """Per-peer record of the rounds in which this peer saw it misbehave (its part rejected, or it lied as a
    reducer), and the bans that follow: `ban_after` rounds with a strike among the last `window` rounds this peer
    shared with it (0: twice `ban_after`). A local decision: strikes are never exchanged, so a liar cannot get an
    honest peer banned by others' votes; it can only lose its own place.

    Why a window, not a count over the run: an honest part is now and then rejected (in a group of three, one
    pseudo-gradient five times the median norm happens), and over a long run a plain count would ban an honest
    peer in the end; a liar that lies every other round still collects `ban_after` strikes within the window."""

    ban_after: int = 3
    window: int = 0
    counts: dict[bytes, int] = field(default_factory=dict)  # strikes within the window, per peer
    banned: set[bytes] = field(default_factory=set)
    _history: dict[bytes, list[bool]] = field(default_factory=dict, repr=False)

    def record_round(self, offenders: Iterable[bytes], members: Iterable[bytes] = ()) -> set[bytes]:
        """One strike per offender for this round (however many parts it spoiled), a clean round for every other
        member; returns the newly banned."""
        window = self.window or 2 * self.ban_after
        offending = set(offenders)
        new = set()
        for peer in offending | set(members):
            history = self._history.setdefault(peer, [])
            history.append(peer in offending)
            del history[:-window]
            self.counts[peer] = sum(history)
            if self.counts[peer] >= self.ban_after and peer not in self.banned:
                self.banned.add(peer)
                new.add(peer)
        return new
