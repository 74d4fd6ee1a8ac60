"""`SwarmView`: where a DiLoCo trainer's outer state stands among the run's trainers, and whom its rounds concern.

Why its own object: the rounds (`averaging.rounds`) ask what this trainer holds and whom to expect, the offers
ask whether others hold a newer outer step, the downloads ask who holds a given one, and the final agreement asks
who is still training. All of it is read from the same two sources, the members of the rounds that produced the
recent outer steps and the run's progress records (`averaging.progress`); one owner of both answers alike.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from averaging.outer_state import OuterState
from averaging.progress import PeerProgress, ProgressTracker, SwarmProgress
from averaging.provenance import Anchors, Provenance
from averaging.rounds import Holding, RoundService
from peer.p2p.net import Address

__all__ = ["Members", "SwarmView"]

Members = tuple[tuple[bytes, Address | None], ...]


class SwarmView:
    """What this trainer holds (`holding`, the `chain` of hashes of the recent outer steps it held, the members
    of the rounds that produced them) and what it knows of the others (the progress records, the rounds' roster).
    `address`: where this trainer is reached (None until it serves, or when it serves nothing). `last_progress`:
    the progress records as last fetched."""

    def __init__(self, outer: OuterState, tracker: ProgressTracker, rounds: RoundService, max_staleness: int):
        self.outer = outer
        self.tracker = tracker
        self.rounds = rounds
        self.max_staleness = max_staleness
        self.members_of: dict[int, Members] = {}  # outer step -> members of the round that produced it
        self.chain: dict[int, str] = {}  # outer step -> hash, of the recent outer states I held (RoundService)
        self.address: Address | None = None
        self.last_progress: SwarmProgress | None = None
        # whose claims may move me (docs/integrity.md, "Whose outer state a DiLoCo trainer takes")
        self.provenance = Provenance(bytes(tracker.peer_id), recent=tracker.ttl / 2)

    # ------------------------------------------------------------------------------------------ what I hold

    def holding(self) -> Holding:
        return Holding(self.outer.step, self.outer.hash, self.members_of.get(self.outer.step, ()))

    def chain_items(self) -> tuple[tuple[int, str], ...]:
        """The (outer step, hash) pairs my offers carry (`quorum.Offer.chain`)."""
        return tuple(sorted(self.chain.items()))

    def publish(self) -> None:
        """The outer state changed: say so in my progress record, and add it to the chain."""
        self.tracker.new_epoch(self.outer.step)
        self.tracker.info.update({"hash": self.outer.hash})
        self.chain[self.outer.step] = self.outer.hash
        for step in [s for s in self.chain if s < self.outer.step - self.max_staleness]:
            del self.chain[step]

    def forget_old_members(self) -> None:
        for step in [s for s in self.members_of if s < self.outer.step - self.max_staleness - 2]:
            del self.members_of[step]

    # ------------------------------------------------------------------------------------------ the others

    def at_step(self, step: int) -> Members:
        """Trainers of the run at outer step `step` in the progress records (and me, when I am there)."""
        me = self.tracker.peer_id
        progress = self.tracker.progress()
        members = [(bytes(p.peer_id), p.address) for p in self.other_trainers(progress.peers) if p.epoch == step]
        if self.outer.step == step:
            members.append((bytes(me), self.address))
        return tuple(members)

    def candidates(self, step: int) -> Members:
        """Who may coordinate round `step`: the members of the round that produced outer step `step`, and the
        trainers at that step in the progress records (so that trainers whose rounds split, or that started
        apart, meet again under one coordinator)."""
        merged = dict(self.at_step(step))
        merged.update((p, a) for p, a in self.members_of.get(step, ())
                      if (a is not None or p not in merged) and p not in self.distrusted)
        return tuple(merged.items())

    def expected(self, step: int) -> dict[bytes, Address | None]:
        """Whom I expect in a round I coordinate: the members of the round that produced outer step `step`, and the
        trainers at that step in the progress records; for a round of
        an outer step I know nothing of (the first of a run), every trainer of the roster (those busy elsewhere
        say so when the window opens)."""
        if step not in self.members_of:
            return {**dict(self.rounds.roster()), **dict(self.at_step(step))}
        # not minus the peers my last all-reduce saw fail: a timeout on a loaded machine is no proof of death, and
        # the window's opening probes every expected trainer anyway (a dead one refuses it at once)
        return dict(self.candidates(step))

    def note_roster(self) -> None:
        """The trainers the progress records show, into the rounds' roster."""
        now = self.tracker.dht.now()
        for peer in self.tracker.progress().peers:
            if peer.left:
                self.rounds.forget(bytes(peer.peer_id))
            elif (peer.info.get("alg") and now - peer.time <= self.tracker.ttl  # a record refreshed in time
                  and bytes(peer.peer_id) not in self.distrusted):
                self.rounds.note(bytes(peer.peer_id), peer.address)

    def other_trainers(self, peers: Sequence[PeerProgress]) -> list[PeerProgress]:
        """The other trainers of the run among these progress records, live (not said goodbye)."""
        me = self.tracker.peer_id
        return [p for p in peers if p.peer_id != me and p.info.get("alg") and not p.left
                and bytes(p.peer_id) not in self.distrusted]

    def others_finished(self) -> bool:
        """Whether the progress records show other live trainers of the run, all of them finished."""
        others = self.other_trainers(self.tracker.progress().peers)
        return bool(others) and all(p.info.get("fin") for p in others)

    def canonical(self, peers: list[PeerProgress]) -> tuple[int, str | None, list[PeerProgress]]:
        """The newest outer step among `peers` (and me), the hash most trainers at it hold (ties: the smaller), and
        the others holding that hash. Why no preference for my own hash in a tie: every trainer must pick the same
        one; two trainers that started from different weights each kept their own and never averaged. Only
        credible claims count (`credible`): no progress record alone makes a trainer move."""
        others = self.credible(self.other_trainers(peers))
        mine, my_hash = self.outer.step, self.outer.hash
        step = max([p.epoch for p in others] + [mine])
        counts = collections.Counter(p.info.get("hash") for p in others
                                     if p.epoch == step and isinstance(p.info.get("hash"), str))
        if step == mine:
            counts[my_hash] += 1
        if not counts:
            return step, None, []
        top = max(counts.values())
        tied = sorted(str(h) for h, n in counts.items() if n == top)
        best = tied[0]
        return step, best, [p for p in others if p.epoch == step and p.info.get("hash") == best]

    def moved_past(self, step: int, progress: SwarmProgress | None = None) -> int | None:
        """The newest outer step past `step` that trainers still training hold, per the progress records (the
        tracker's latest unless given); None when there is none. Round `step` was then held without me, and they
        will not come to it again (finished trainers come to no more rounds)."""
        peers = (progress if progress is not None else self.tracker.progress()).peers
        newest, _, holders = self.canonical(list(peers))
        return newest if newest > step and any(not p.info.get("fin") for p in holders) else None

    def ahead(self, progress: SwarmProgress) -> bool:
        """Whether the progress records show trainers holding a newer outer step than mine."""
        step, best, holders = self.canonical(list(progress.peers))
        return best is not None and step > self.outer.step and bool(holders)

    # ------------------------------------------------------------------------------------------ provenance

    @property
    def distrusted(self) -> dict[bytes, str]:
        return self.provenance.distrusted

    def saw_contribute(self, members: Iterable[bytes]) -> None:
        """These peers contributed to a round that finished with me: their claims vouch for outer states."""
        self.provenance.saw_contribute(members)

    def anchors(self, others: Sequence[PeerProgress] = ()) -> Anchors:
        """Whose word vouches for an outer state (`averaging.provenance`), from every progress record I know and
        `others` (the final agreement asks about the finished trainers alone: a liar that says it finished must
        not be all there is to compare with). Claimants of unreachable outer steps are distrusted here, and leave
        the rounds' roster."""
        known = {p.peer_id: p for p in [*self.tracker.progress().peers, *others]
                 if p.info.get("alg") and not p.left}
        anchors, distrusted = self.provenance.judge(known.values(), (self.outer.step, self.outer.hash),
                                                    now=self.tracker.dht.now(), banned=self.rounds.banned())
        self._forget(distrusted)
        return anchors

    def credible(self, others: list[PeerProgress]) -> list[PeerProgress]:
        """The claims among `others` that may move me (`Provenance.admitted`)."""
        return self.provenance.admitted(others, self.anchors(others))

    def vouched(self, step: int, hash_: str, tellers: Iterable[bytes]) -> bool:
        """Whether I may take outer state (step, hash) that `tellers` said (over authenticated calls) they hold
        (`Anchors.vouch`); a teller claiming a state no anchor can have reached is distrusted."""
        vouched, distrusted = self.provenance.vouched(self.anchors(), step, hash_, set(tellers))
        self._forget(distrusted)
        return vouched

    def _forget(self, distrusted: Iterable[bytes]) -> None:
        for peer in distrusted:
            self.rounds.forget(peer)  # no round of mine waits for it or asks it
