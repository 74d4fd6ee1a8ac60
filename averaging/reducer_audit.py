"""Whether a member believes the part a reducer returned to it: the judging half of the integrity checks of
`averaging.allreduce_core` (docs/integrity.md).

Why a module of its own: a member has three ways to catch a reducer that lies about its mean (the plausibility of
the part against the slice the member sent itself; a cross-reduction when the member is the part's checker; the
checker's verdict when another member is), and they need nothing of a round but the part, the reducer's claims
and, for a cross-reduction, the checker's copy of the contributions. These functions only judge, each answering
the lie it found (a reason) or none; `RoundCore` owns the state (the checks, the claims) and decides what a caught
lie costs (the part keeps our local values, the reducer counts as failed and gets a strike). Pure: no trio, no
sockets, no clock.

- `checker_of`: which member cross-reduces which part this round (drawn from the group id: no message).
- `reducer_claims`: what a reducer's finish reply claims of its mean (contributors, median norm).
- `implausible`, `cross_verdict`, `checker_disagrees`: the three judgments.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from averaging import robust
from averaging.group import GroupInfo
from averaging.partition import Part, Partition, chunk_views

if TYPE_CHECKING:  # the core owns the reducers, the checks among them: no import cycle
    from averaging.allreduce_core import PartReducer

CHECK_RTOL = 1e-3  # a cross-reduced part matches when |reducer's - checker's| <= this * |checker's| (float sums)


def checker_of(group: GroupInfo, partition: Partition, part_index: int, rate: float) -> int | None:
    """The member that cross-reduces part `part_index` this round, or None (not checked this time).

    Drawn from the group id, so every member knows the schedule without a message and the reducer cannot choose
    it; the group id is fixed before anyone knows which part it will reduce. Candidates are the members that
    accept calls (the checker receives pushes), other than the part's reducer."""
    if rate <= 0:
        return None
    part = partition.parts[part_index]
    candidates = [i for i, m in enumerate(group.members) if not m.client_mode and i != part.owner]
    if not candidates or not part.chunks:
        return None
    seed = hashlib.blake2b(group.group_id + b"|cross-check|" + part_index.to_bytes(4, "little"), digest_size=16)
    draw = int.from_bytes(seed.digest()[:8], "little")
    if (draw >> 11) / float(1 << 53) >= rate:
        return None
    return candidates[int.from_bytes(seed.digest()[8:], "little") % len(candidates)]


def reducer_claims(reply: dict[str, Any]) -> tuple[list[int], float]:
    """What a reducer's finish reply claims of its mean: its contributors (junk and bools dropped) and the median
    norm of the parts it took (0.0 when missing or not a finite non-negative number), the figures judged below."""
    contributors = [c for c in reply.get("contributors") or [] if isinstance(c, int) and not isinstance(c, bool)]
    reported = reply.get("norm")
    norm = float(reported) if isinstance(reported, (int, float)) and not isinstance(reported, bool) \
        and math.isfinite(reported) and reported >= 0 else 0.0
    return contributors, norm


def implausible(part: Part, values: Sequence[Sequence[torch.Tensor]], tensors: Sequence[torch.Tensor],
                weight: float, reported_norm: float, aggregation: robust.Aggregation) -> str | None:
    """Could an honest reducer have produced this pulled `part` from what we sent (our `weight` and `tensors`),
    given the median norm it reported (`averaging.robust.plausible`)? The lie, or None."""
    if not part.chunks:
        return None
    reduced = [v for chunk in values for v in chunk]
    own = None if weight == 0 else [t for chunk in part.chunks for t in chunk_views(tensors, chunk)]
    if robust.plausible(reduced, own, reported_norm, aggregation):
        return None
    return "returned an implausible reduced part"


def cross_verdict(check: PartReducer, contributors: Sequence[int], values: Sequence[Sequence[torch.Tensor]]
                  ) -> tuple[bool | None, str]:
    """As a part's checker (`check`: our copy of the contributions), with the reducer's part pulled: recompute it
    over the contributors the reducer reported, and compare. (True, ""): it matches; (False, the lie): the
    reducer lied; (None, ""): inconclusive (we lack a contributor's data). A reducer must also count at least
    half of the senders we hold data of: it cannot pick a minority (say, its Sybils) and call the rest
    rejected."""
    expected = check.recompute(contributors)
    holding = [s for s in check.complete if check.weights.get(s, 0.0) > 0]
    if expected is None:
        if contributors or not holding:
            return None, ""
        return False, "reported no contributor for a part others sent"
    if 2 * len(set(contributors)) < len(holding):
        return False, f"counted {len(set(contributors))} of {len(holding)} senders"
    reduced = torch.cat([v.reshape(-1).to(expected.dtype) for chunk in values for v in chunk])
    if reduced.numel() != expected.numel():
        return None, ""
    if robust.norm(reduced - expected) <= CHECK_RTOL * max(robust.norm(expected), 1e-30):
        return True, ""
    return False, "its part differs from the cross-reduction"


def checker_disagrees(answer: Any, values: Sequence[Sequence[torch.Tensor]]) -> str | None:
    """The lie that the checker's verdict on a part we pulled reveals ({"verdict": True/False/None, "norm": the
    norm of the part as the checker pulled it}), or None: its cross-reduction differs, or the reducer returned it
    another part than us (the norms differ). A malformed or inconclusive answer believes the part: a lying checker
    can only withhold its check."""
    if not isinstance(answer, dict):
        return None
    verdict, reported = answer.get("verdict"), answer.get("norm")
    if verdict is False:
        return "its checker's cross-reduction differs"
    if verdict is True and isinstance(reported, float) and math.isfinite(reported):
        mine = robust.part_norm(v for chunk in values for v in chunk)
        if abs(mine - reported) > CHECK_RTOL * max(reported, 1e-30):
            return "returned another part to its checker"
    return None
