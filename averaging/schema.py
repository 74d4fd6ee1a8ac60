"""Model schema hash: peers only average with peers whose registered tensors line up element for element.

Averaging flattens every registered tensor into one vector and splits it into parts by offset, so two peers whose
tensors differ in names, order, shapes or dtypes would silently mix unrelated numbers. A short hash of the
(name, shape, dtype) list travels in every matchmaking declaration and join request; peers with a different hash
are simply not grouped together (a swarm can run several models under one prefix without mixing them).
"""

from __future__ import annotations

import hashlib
import logging
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


def difference(ours: Sequence[Sequence[Any]], theirs: Sequence[Sequence[Any]]) -> str | None:
    """The first difference between two schemas (`describe` lists: [name, shape, dtype]) as words, e.g.
    "0.weight: shape [48, 8] there, [32, 8] here"; None when they are the same. Why the first only: the
    user fixes one model definition, and one line is what a log can say once without drowning the rest."""
    for index, (mine, other) in enumerate(zip(ours, theirs)):
        (name, shape, dtype), (other_name, other_shape, other_dtype) = mine, other
        if name != other_name:
            return f"tensor {index} is {other_name!r} there, {name!r} here"
        if list(shape) != list(other_shape):
            return f"{name}: shape {list(other_shape)} there, {list(shape)} here"
        if dtype != other_dtype:
            return f"{name}: dtype {other_dtype} there, {dtype} here"
    if len(ours) != len(theirs):
        extra = theirs[len(ours)] if len(theirs) > len(ours) else ours[len(theirs)]
        side = "there only" if len(theirs) > len(ours) else "here only"
        return f"{len(theirs)} tensors there, {len(ours)} here (first unmatched: {extra[0]!r}, {side})"
    return None


class MismatchLog:
    """Peers found holding another model than ours, each logged ONCE.

    Why process-wide (`MISMATCHES`): a mismatched peer is met again in every round and every state download,
    by objects that live one round; the user needs one line naming the peer and the difference, and
    `peer train` needs to know at the end that it never averaged because of it. Why once per peer and not per
    wording: matchmaking names the tensors ("grad.0: shape ...") and a state download numbers them ("tensor 0:
    shape ..."), so the same mismatch reads differently from each; the later wording is kept for the summary."""

    def __init__(self) -> None:
        self.seen: dict[bytes, str] = {}  # peer -> the difference last reported
        self._met: dict[bytes, int] = {}  # peer -> the sequence number of its last meeting
        self._meetings = 0

    def report(self, peer: bytes, difference: str, log: logging.Logger, what: str) -> bool:
        """Log `what` (a sentence naming the operation) once per peer; True when logged now."""
        self._meetings += 1
        self._met[bytes(peer)] = self._meetings
        known = bytes(peer) in self.seen
        self.seen[bytes(peer)] = difference
        if known:
            log.debug("%s: a different model (%s)", what, difference)
            return False
        log.warning("%s: a different model (%s); not averaging with it", what, difference)
        return True

    def mark(self) -> int:
        """A point in time for `summary(since=...)`: a run asks only about the peers it met itself, not those
        an earlier run in the same process met (two runs of `run_training` in one test process, say)."""
        return self._meetings

    def summary(self, since: int = 0) -> str | None:
        """One line for an exit message, or None when no mismatch was seen (after the `since` mark)."""
        seen = {peer: difference for peer, difference in self.seen.items() if self._met.get(peer, 0) > since}
        if not seen:
            return None
        peer, difference = next(iter(seen.items()))
        more = f" (and {len(seen) - 1} more peers)" if len(seen) > 1 else ""
        return f"peer {peer.hex()[:12]} trains a different model: {difference}{more}"


MISMATCHES = MismatchLog()
