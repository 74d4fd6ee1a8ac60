"""Whose claims of progress may move a trainer: anchors, the states they vouch for, and claimants to distrust.

Why: a progress record is a signed claim of (step, hash) and nothing more. Taken at its word, one identity that
never trained claimed outer step 1e9 and served a poisoned state: every DiLoCo trainer and newcomer downloaded it
and stopped, since the run "was over"; a collaborative trainer "caught up" to its epoch the same way. A claim counts
here when it is vouched for by **anchors**, peers whose word is worth more than a signature:

- for a trainer that saw rounds finish, the peers it saw contribute to them (`contributors`), not banned, whose
  records are recent: a state one of them holds is vouched for. Why not a majority: honest rounds split under
  load, and a trainer whose group fell behind must take the state a contributor of its went on to (a majority
  rule left a calm 4-trainer run on two chains for good). A liar must first contribute to real rounds with the
  trainer, where the robust aggregation judges what it sends, and a ban by the all-reduce ends its anchorage;
- for a newcomer (or a trainer whose contributors are all gone), the peers that another record names as a member
  of its latest round (`Claim.named`): a state one of them holds is vouched for. A lone liar names itself at best;
  a clique of identities naming each other counts as its size (docs/integrity.md says what that costs);
- with neither (the run's first round), no anchor: every claim counts, as the first states are anyone's.

A claim two or more steps past every vouched state, while an anchor's record is recent, cannot have been reached
by any round an anchor took part in: its claimant (never a contributor) is distrusted (`Provenance.distrusted`),
for good.

Layout: `judge` is the pure part (claims, my state, what I saw and `now` in; anchors and new distrusts out);
`Provenance` keeps what a trainer saw and whom it distrusts, and is what DiLoCo's `SwarmView` and the collaborative
optimizer's tracker consult. Neither sends anything: the claims are the records every trainer already reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AbstractSet, Iterable, Sequence

from averaging.progress import PeerProgress, group_name
from peer.p2p.identity import PeerID

__all__ = ["Anchors", "Claim", "Provenance", "judge"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """A peer's signed word: it holds `step` with `hash` (None where states have none), said at DHT time `time`,
    naming `named` (`group_name`s) as the members of its latest round."""

    peer: bytes
    step: int
    hash: str | None
    time: float
    named: tuple[str, ...] = ()

    @classmethod
    def of(cls, record: PeerProgress) -> "Claim":
        hash_ = record.info.get("hash")
        return cls(bytes(record.peer_id), record.epoch, hash_ if isinstance(hash_, str) else None, record.time,
                   record.last_group)


@dataclass(frozen=True)
class Anchors:
    """`peers`: whose holdings vouch for states (empty: nobody's, so every claim counts); `held`: the (step, hash)
    pairs one of them holds, and mine."""

    peers: frozenset[bytes]
    held: frozenset[tuple[int, str | None]]

    @property
    def newest(self) -> int:
        return max(step for step, _ in self.held)

    def vouch(self, step: int, hash_: str | None, tellers: AbstractSet[bytes] = frozenset()) -> bool:
        """Whether (step, hash) may be taken: no anchors, or an anchor's record holds it, or an anchor is among
        `tellers` (peers that said so over authenticated calls)."""
        return not self.peers or (step, hash_) in self.held or bool(tellers & self.peers)

    def unreachable(self, step: int, hash_: str | None) -> str | None:
        """Why a claim of (step, hash) cannot be true, or None: two or more steps past every vouched state."""
        if self.peers and step > self.newest + 1 and (step, hash_) not in self.held:
            return f"claimed step {step}; nobody credible is past step {self.newest}"
        return None


def judge(claims: Sequence[Claim], mine: tuple[int, str | None], *, contributors: AbstractSet[bytes],
          excluded: AbstractSet[bytes], now: float, recent: float) -> tuple[Anchors, dict[bytes, str]]:
    """The anchors among `claims` (others' claims, `excluded` ones left out), and the claimants to distrust with why.
    `mine`: the state I hold (always vouched for); `recent`: how old an anchor's claim may be for its absence of a
    newer state to prove anything (a dead anchor's record lingers until it expires)."""
    claims = [c for c in claims if c.peer not in excluded]
    # a dead contributor's record lingers until it expires: as an anchor it would speak for a trainer that no
    # longer moves, and make whoever went on look unreachable
    live = [c for c in claims if c.peer in contributors and now - c.time <= recent]
    if not live:
        named = {member for c in claims for member in c.named if member != group_name(c.peer)}
        live = [c for c in claims if group_name(c.peer) in named]
    # one anchor vouches: honest rounds split under load, and a trainer whose group fell behind must still take
    # the state a contributor of its went on to (a majority rule left a calm 4-trainer run on two chains for good)
    anchors = Anchors(frozenset(c.peer for c in live), frozenset({(c.step, c.hash) for c in live} | {mine}))
    distrust: dict[bytes, str] = {}
    if any(now - c.time <= recent for c in live):
        for claim in claims:
            if claim.peer in contributors:  # a peer I saw contribute is ahead, not lying: its own state is vouched
                continue
            why = anchors.unreachable(claim.step, claim.hash)
            if why is not None:
                distrust[claim.peer] = why
    return anchors, distrust


class Provenance:
    """What one trainer saw (`contributors`: peers that contributed to a round that finished with it) and whom it
    distrusts (`distrusted`: peer -> why). `recent`: see `judge`."""

    def __init__(self, me: bytes, recent: float):
        self.me = bytes(me)
        self.recent = recent
        self.contributors: set[bytes] = set()
        self.distrusted: dict[bytes, str] = {}

    def saw_contribute(self, members: Iterable[bytes]) -> None:
        self.contributors.update(bytes(p) for p in members if bytes(p) != self.me)

    def judge(self, records: Iterable[PeerProgress], mine: tuple[int, str | None], *, now: float,
              banned: AbstractSet[bytes] = frozenset()) -> tuple[Anchors, list[bytes]]:
        """The anchors among others' `records`; the claimants distrusted by this reading (each logged once)."""
        claims = [Claim.of(r) for r in records if bytes(r.peer_id) != self.me]
        anchors, distrust = judge(claims, mine, contributors=self.contributors - set(banned),
                                  excluded=self.distrusted.keys(), now=now, recent=self.recent)
        for peer, why in distrust.items():
            self.distrust(peer, why)
        return anchors, list(distrust)

    def vouched(self, anchors: Anchors, step: int, hash_: str | None, tellers: AbstractSet[bytes]
                ) -> tuple[bool, list[bytes]]:
        """Whether (step, hash), which `tellers` said they hold, may be taken (`Anchors.vouch`); when not, the
        tellers newly distrusted for claiming a state no anchor can have reached."""
        if anchors.vouch(step, hash_, tellers):
            return True, []
        why = anchors.unreachable(step, hash_)
        if why is None:
            return False, []
        newly = [t for t in tellers if t not in self.distrusted]
        for teller in newly:
            self.distrust(teller, why)
        return False, newly

    def distrust(self, peer: bytes, why: str) -> None:
        if peer not in self.distrusted:
            self.distrusted[peer] = why
            logger.warning("ignoring the claims of %s from now on: %s", PeerID(peer).short(), why)

    def admitted(self, records: Iterable[PeerProgress], anchors: Anchors) -> list[PeerProgress]:
        """The records whose claims may move me: not distrusted, and of a vouched state when there are anchors."""
        return [r for r in records if bytes(r.peer_id) not in self.distrusted
                and (not anchors.peers or bytes(r.peer_id) == self.me or (r.epoch, Claim.of(r).hash) in anchors.held)]
