"""How the flat vector of all averaged tensors is split among the members of a group.

The vector is the concatenation of every registered tensor, flattened, in registration order. It is never
materialised: a part is described as segments (tensor, start, stop) of the original tensors, so sending a part
sends views of the tensors themselves and writing the averaged values back is one copy per segment.

Each REDUCING member gets one contiguous part, its length proportional to its bandwidth (largest-remainder
rounding, so the sizes add up exactly and every member computes the same split from the same inputs).

A bandwidth is the member's own claim, so the split never takes it at face value (`share_weights`): a claim
counts at most `MAX_SHARE_RATIO` times the low median of the group's positive claims. Why: a lying reducer that
declared 1e9 was handed the whole vector (issue 36: all 61 of its lies accepted). Capped, one member reduces at
most twice a typical member's part, whatever it declares; every member applies the same cap to the same claims,
so the split stays identical everywhere. The cost: a genuinely faster member is used at most at twice the
median rate.
Client-mode members and members with zero bandwidth get no part: they only send their data and receive results.

A part travels in chunks of at most `chunk_bytes`: each chunk is one message holding one or more segments (many
small tensors share a message; a large tensor is cut into several). A chunk never mixes data of two parts.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
MAX_SHARE_RATIO = 2.0  # a member's bandwidth counts at most this times the group's low median claim


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of tensor number `tensor`, counted in that tensor's flattened order."""

    tensor: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


Chunk = tuple[Segment, ...]


@dataclass(frozen=True)
class Part:
    """The part reduced by member `owner` (its index in the group): flat elements [start, stop)."""

    index: int
    owner: int
    start: int
    stop: int
    segments: tuple[Segment, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


def split_sizes(total: int, weights: Sequence[float]) -> list[int]:
    """Integer sizes proportional to `weights` that add up to `total` (largest remainder, ties to the lower
    index). A zero weight gets zero elements; all-zero weights are an error (nobody could reduce)."""
    if total < 0:
        raise ValueError("total must be >= 0")
    if any((not math.isfinite(w)) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    weight_sum = math.fsum(weights)
    if weight_sum <= 0:
        raise ValueError("at least one weight must be positive")
    ideal = [total * w / weight_sum for w in weights]
    sizes = [int(math.floor(x)) for x in ideal]
    shortfall = total - sum(sizes)
    order = sorted(range(len(weights)), key=lambda i: (-(ideal[i] - sizes[i]), i))
    for i in order:
        if shortfall <= 0:
            break
        if weights[i] > 0:
            sizes[i] += 1
            shortfall -= 1
    return sizes


def share_weights(bandwidths: Sequence[float], max_ratio: float = MAX_SHARE_RATIO) -> list[float]:
    """The weights the split actually uses: each claimed bandwidth capped at `max_ratio` times the low median of
    the positive claims (with two reducers, the smaller claim sets the cap). Zero stays zero (no part)."""
    if max_ratio < 1:
        raise ValueError("max_ratio must be >= 1")
    positive = sorted(float(b) for b in bandwidths if b > 0)
    if len(positive) < 2:
        return [float(b) for b in bandwidths]
    cap = max_ratio * positive[(len(positive) - 1) // 2]
    return [min(float(b), cap) for b in bandwidths]


class Partition:
    """The split of a list of tensors among the members of a group, computed identically by every member.

    `numels` and `element_sizes` describe the tensors (one entry per tensor); `bandwidths` has one entry per
    group member, 0 for members that reduce nothing; they are claims, capped by `share_weights` before the split
    (`max_share_ratio`). `fingerprint` digests everything that shapes the split, so
    a message built from a different split (another model, another group view) is recognised and refused.
    """

    def __init__(
        self,
        numels: Sequence[int],
        element_sizes: Sequence[int],
        bandwidths: Sequence[float],
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_share_ratio: float = MAX_SHARE_RATIO,
    ):
        if len(numels) != len(element_sizes):
            raise ValueError("numels and element_sizes must have one entry per tensor")
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.numels = [int(n) for n in numels]
        self.element_sizes = [int(s) for s in element_sizes]
        self.bandwidths = [float(b) for b in bandwidths]
        self.chunk_bytes = int(chunk_bytes)
        self.total = sum(self.numels)
        self._tensor_starts = [0]
        for n in self.numels:
            self._tensor_starts.append(self._tensor_starts[-1] + n)

        sizes = split_sizes(self.total, share_weights(self.bandwidths, max_share_ratio))
        self.parts: list[Part] = []
        self._part_of_member: dict[int, Part] = {}
        offset = 0
        for member, (size, bandwidth) in enumerate(zip(sizes, self.bandwidths)):
            if bandwidth <= 0:
                continue
            segments = self._segments(offset, offset + size)
            part = Part(len(self.parts), member, offset, offset + size, segments, self._chunks(segments))
            self.parts.append(part)
            self._part_of_member[member] = part
            offset += size
        self.fingerprint = self._digest()

    @classmethod
    def for_tensors(
        cls, tensors: Sequence[torch.Tensor], bandwidths: Sequence[float], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> "Partition":
        return cls([t.numel() for t in tensors], [t.element_size() for t in tensors], bandwidths,
                   chunk_bytes=chunk_bytes)

    def part_of(self, member: int) -> Part | None:
        """The part reduced by group member number `member`, or None if it reduces nothing."""
        return self._part_of_member.get(member)

    def chunk_bytes_of(self, chunk: Chunk) -> int:
        return sum(s.numel * self.element_sizes[s.tensor] for s in chunk)

    def part_bytes(self, part: Part) -> int:
        return sum(self.chunk_bytes_of(c) for c in part.chunks)

    # ------------------------------------------------------------------------------------------------ layout

    def _segments(self, start: int, stop: int) -> tuple[Segment, ...]:
        segments = []
        for tensor, numel in enumerate(self.numels):
            t_start, t_stop = self._tensor_starts[tensor], self._tensor_starts[tensor] + numel
            lo, hi = max(start, t_start), min(stop, t_stop)
            if lo < hi:
                segments.append(Segment(tensor, lo - t_start, hi - t_start))
        return tuple(segments)

    def _chunks(self, segments: tuple[Segment, ...]) -> tuple[Chunk, ...]:
        chunks: list[Chunk] = []
        current: list[Segment] = []
        used = 0
        for segment in segments:
            size = self.element_sizes[segment.tensor]
            position = segment.start
            while position < segment.stop:
                room = (self.chunk_bytes - used) // size
                if room <= 0:
                    if current:
                        chunks.append(tuple(current))
                        current, used = [], 0
                        continue
                    room = 1  # an element larger than a chunk: send it alone rather than never
                take = min(room, segment.stop - position)
                current.append(Segment(segment.tensor, position, position + take))
                used += take * size
                position += take
        if current:
            chunks.append(tuple(current))
        return tuple(chunks)

    def _digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=8)
        h.update(struct.pack("<qq", self.chunk_bytes, len(self.numels)))
        for numel, size in zip(self.numels, self.element_sizes):
            h.update(struct.pack("<qq", numel, size))
        for part in self.parts:
            h.update(struct.pack("<qqq", part.owner, part.start, part.stop))
        return h.digest()


def segment_view(tensors: Sequence[torch.Tensor], segment: Segment) -> torch.Tensor:
    """A 1-D view (no copy) of `segment` in the registered tensors; writes to it change the tensor."""
    return tensors[segment.tensor].view(-1)[segment.start:segment.stop]


def chunk_views(tensors: Sequence[torch.Tensor], chunk: Chunk) -> list[torch.Tensor]:
    return [segment_view(tensors, s) for s in chunk]
