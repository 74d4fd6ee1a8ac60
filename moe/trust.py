"""Trusting experts: statistics of the magnitudes they produce, and the rule that bans a lying expert for the run.

Why norms: an expert server is a volunteer's process, and nothing proves that what it returns is its module's
output. The finiteness and shape checks of `moe.calls` stop NaN and malformed replies, but an expert can return
finite garbage (its outputs scaled x100, or random values) forever, and mixing that in wrecks every trainer that
routes to it. What a caller can check without recomputing is the size of a reply: against the same expert's
earlier replies (its running statistics), and against the other experts that answered the same samples. Honest
experts of one layer see the same inputs and produce outputs of a similar size; a liar stands out by a factor.

Why only "too large": a reply far larger than its peers' dominates the mixture and wrecks the trainer; one far
smaller only weakens that expert's share of a sample, like an expert that failed and was masked, and honest
experts do produce it (an expert whose units mostly died, or one the gate rarely trains, answered 0.07x its
peers' size in loopback swarm runs and was banned for it). So small replies are counted as outliers in the
statistics' sense (they do not update an expert's record) but never earn a strike.

Why a ban needs several steps: one odd step is not proof (a sample far from the others, a loss spike). An expert
is banned once `strikes` of its last `window` checked steps were outliers; a ban lasts for the run (it is the
caller's local decision, never a vote a liar could win) and is listed by `ExpertTrust.bans` (and published for
`peer status` in the format of `moe.bans`).

Sans-I/O: plain objects, no trio, no clock; tensors in, verdicts out. `moe.mixture.MixtureClient` feeds the
client side (`ExpertTrust`), `moe.server.ExpertServer` the server side (`NormStats` per expert for its inputs and
gradients).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

_TINY = 1e-12  # norms are compared in log space: a zero norm is log(_TINY), not -inf


def row_norms(tensor: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each row (sample) of a batch, as float64 on the CPU."""
    if tensor.ndim == 0 or tensor.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64)
    norms: torch.Tensor = torch.linalg.vector_norm(tensor.detach().reshape(tensor.shape[0], -1).double(), dim=1)
    return norms.cpu()


def typical_norm(tensor: torch.Tensor) -> float:
    """One number for the size of a batch: the root mean square of its row norms (insensitive to the batch
    size, unlike the largest row; dominated by large rows, unlike the median)."""
    norms = row_norms(tensor)
    return float(norms.square().mean().sqrt()) if norms.numel() else 0.0


@dataclass
class NormStats:
    """Running statistics of one magnitude in log space: an exponential moving mean and variance of log(norm).

    `ratio(norm)` says how many times larger (> 1) or smaller (< 1) than usual a norm is; before `warmup`
    observations it is 1 (nothing is known yet). Log space because norms are positive and vary by factors."""

    decay: float = 0.9
    warmup: int = 8
    count: int = 0
    mean: float = 0.0
    variance: float = 0.0

    def observe(self, norm: float) -> None:
        value = math.log(max(norm, _TINY))
        if self.count == 0:
            self.mean = value
        else:
            delta = value - self.mean
            self.mean += (1 - self.decay) * delta
            self.variance = self.decay * (self.variance + (1 - self.decay) * delta * delta)
        self.count += 1

    @property
    def ready(self) -> bool:
        return self.count >= self.warmup

    def ratio(self, norm: float) -> float:
        if not self.ready:
            return 1.0
        return math.exp(math.log(max(norm, _TINY)) - self.mean)

    def typical(self) -> float | None:
        """The usual norm (the geometric mean of the recent ones), None before any observation."""
        return math.exp(self.mean) if self.count else None


@dataclass
class Verdict:
    """What the check of one expert's reply in one step found."""

    uid: str
    outlier: bool
    ratio: float  # how many times the usual size its reply was (by the check that decided)
    basis: str  # "peers": compared with the other experts of the same samples; "history": with its own record
    banned_now: bool = False  # this verdict made the expert reach its strikes: banned from now on


@dataclass
class _Record:
    stats: NormStats
    recent: collections.deque[bool]
    checked: int = 0
    outliers: int = 0


@dataclass
class ExpertTrust:
    """The client's record of every expert it called: output-norm statistics, recent verdicts, bans.

    `check(replies, kind=...)` takes one step's accepted replies, `{uid: (samples, outputs)}` (the batch rows each
    expert answered and its outputs for them), and returns a verdict per expert. An expert's reply is an outlier when
    its size exceeds the usual by more than `max_ratio` (never for being smaller: see the module doc), compared
    with the median size of the experts answering the same samples where at least `min_peers` of them did
    (honest experts of one layer agree in size, so one liar cannot move the median of three), otherwise with
    its own running statistics. The
    comparison with the others decides when it is possible: an honest expert whose outputs grow over training
    stays in line with its peers. Only replies judged normal update an expert's statistics, so a liar cannot
    drag its own record toward its lies."""

    max_ratio: float = 10.0
    strikes: int = 4
    window: int = 8
    min_peers: int = 3
    warmup: int = 8
    decay: float = 0.9
    _records: dict[tuple[str, str], _Record] = field(default_factory=dict)
    _bans: dict[str, str] = field(default_factory=dict)  # uid -> why

    def __post_init__(self) -> None:
        if self.max_ratio <= 1:
            raise ValueError(f"max_ratio must be above 1, got {self.max_ratio}")
        if not 1 <= self.strikes <= self.window:
            raise ValueError(f"need 1 <= strikes ({self.strikes}) <= window ({self.window})")

    def is_banned(self, uid: str) -> bool:
        return uid in self._bans

    def bans(self) -> dict[str, str]:
        """Banned experts (uid -> why), in the order they were banned."""
        return dict(self._bans)

    def record(self, uid: str, kind: str = "outputs") -> _Record:
        record = self._records.get((kind, uid))
        if record is None:
            record = self._records[(kind, uid)] = _Record(NormStats(self.decay, self.warmup),
                                                  collections.deque(maxlen=self.window))
        return record

    def check(self, replies: Mapping[str, tuple[Sequence[int], torch.Tensor]], *, kind: str = "outputs"
              ) -> dict[str, Verdict]:
        """One step's replies of one `kind` ("outputs" of the forward, "grad_inputs" of the backward: each kind
        has its own statistics, and strikes of either count toward a ban) -> a verdict per expert."""
        # plain floats from here: the bookkeeping is per sample, and torch's per-call overhead would dominate
        norms = _norms_of({uid: outputs for uid, (_, outputs) in replies.items()})
        by_sample: dict[int, list[float]] = collections.defaultdict(list)
        for uid, (samples, _) in replies.items():
            for sample, norm in zip(samples, norms[uid]):
                by_sample[sample].append(norm)
        medians = {sample: _median(sizes) for sample, sizes in by_sample.items() if len(sizes) >= self.min_peers}
        verdicts: dict[str, Verdict] = {}
        for uid, (samples, _) in replies.items():
            if not norms[uid]:
                continue  # no rows: nothing to judge (and a size of 0 is not a lie)
            record = self.record(uid, kind)
            ratios = [norm / medians[sample] for sample, norm in zip(samples, norms[uid]) if sample in medians]
            size = math.sqrt(sum(n * n for n in norms[uid]) / len(norms[uid]))
            if ratios:
                ratio, basis = _median(ratios), "peers"
            else:
                ratio, basis = record.stats.ratio(size), "history"
            outlier = ratio > self.max_ratio  # too large: the harmful lie (module doc)
            verdict = Verdict(uid, outlier, ratio, basis)
            verdicts[uid] = verdict
            if not outlier and ratio >= 1 / self.max_ratio:  # only typical replies shape the record
                record.stats.observe(size)
            record.checked += 1
            record.outliers += outlier
            record.recent.append(outlier)
            if uid not in self._bans and sum(record.recent) >= self.strikes:
                self._bans[uid] = (f"{kind} {ratio:.3g}x the usual size (by {basis}) in {sum(record.recent)} of "
                                   f"its last {len(record.recent)} steps")
                verdict.banned_now = True
        return verdicts

    def stats(self) -> dict[str, object]:
        return {
            "experts_checked": len(self._records),
            "replies_checked": sum(r.checked for r in self._records.values()),
            "outliers": sum(r.outliers for r in self._records.values()),
            "banned": self.bans(),
        }


def _norms_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """Each tensor's row norms (at least _TINY) as floats: one norm kernel over all of them when their rows
    are alike (the usual case: one layer's experts), else one per tensor."""
    rows = [t.detach().reshape(t.shape[0], -1) for t in tensors.values() if t.ndim and t.shape[0]]
    if rows and len({(r.shape[1], r.dtype, r.device) for r in rows}) == 1:
        flat = torch.linalg.vector_norm(torch.cat(rows) if len(rows) > 1 else rows[0], dim=1, dtype=torch.float64)
        values = [max(n, _TINY) for n in flat.tolist()]
    else:
        values = [max(n, _TINY) for t in tensors.values() for n in row_norms(t).tolist()]
    result: dict[str, list[float]] = {}
    offset = 0
    for uid, tensor in tensors.items():
        count = int(tensor.shape[0]) if tensor.ndim else 0
        result[uid] = values[offset:offset + count]
        offset += count
    return result


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] * ordered[middle]) ** 0.5


__all__ = ["ExpertTrust", "NormStats", "Verdict", "row_norms", "typical_norm"]
