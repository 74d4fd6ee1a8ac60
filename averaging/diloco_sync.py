"""`StateSync`: moving a DiLoCo trainer onto the swarm's outer state by verified download.

Why its own object: a trainer downloads in four situations (joining a run, catching up after a round it was
late for or contributed to from behind, taking the state of another chain back from a partition, and the final
agreement), and each must end the same way: the outer state replaced only by what hashes to what its holders
claim, the rounds told (`RoundService.held_changed`), the progress record and chain updated (`SwarmView.publish`).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import trio

from averaging.diloco_ledger import DiLoCoLedger
from averaging.diloco_view import Members, SwarmView
from averaging.outer_state import OuterState
from averaging.progress import ProgressTracker, SwarmProgress
from averaging.quorum import Offer
from averaging.rounds import Holding, RoundService
from averaging.state import load_state
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import RPCNode

logger = logging.getLogger("averaging.diloco")

__all__ = ["StateSync"]


class StateSync:
    """Downloads of the outer state for one trainer, each bounded by `load_state_timeout` (or a deadline)."""

    def __init__(self, rpc: RPCNode, outer: OuterState, view: SwarmView, tracker: ProgressTracker,
                 rounds: RoundService, ledger: DiLoCoLedger, load_state_timeout: float):
        self.rpc = rpc
        self.outer = outer
        self.view = view
        self.tracker = tracker
        self.rounds = rounds
        self.ledger = ledger
        self.load_state_timeout = load_state_timeout
        self._refused: set[tuple[int, str]] = set()  # the states not vouched for, logged once each

    async def catch_up(self, step: int, holders: Members, deadline: float) -> bool:
        """Move to outer step `step` or newer: wait until one of `holders` holds it, then download it from the
        holders at that step (checked against the hash they report). True when I hold at least `step`."""
        while self.outer.step < step and trio.current_time() < deadline:
            holding = await self.rounds.await_step(step, holders, deadline=deadline, enough=self._told_enough)
            if holding is None:
                logger.warning("diloco: nobody of round %d holds outer step %d yet", step - 1, step)
                return False
            if not self.vouched(holding):  # no anchor told it: wait until an anchor's record shows it
                with trio.move_on_at(deadline):
                    await trio.sleep(self.tracker.min_refresh)
                    await self.tracker.fetch()
                continue
            sources: Sequence[tuple[bytes, Address | None]] = [
                (p, a) for p, a in holding.members if a is not None] or holders
            if await self.download(holding, sources, deadline):
                return True
        return self.outer.step >= step

    def _told_enough(self, answers: list[Holding]) -> bool:
        """Whether the holders that told the last answer's state vouch for it (`SwarmView.vouched`)."""
        last = answers[-1]
        tellers = [t for a in answers if (a.step, a.hash) == (last.step, last.hash) for t in a.tellers]
        return self.view.vouched(last.step, last.hash, tellers)

    def vouched(self, holding: Holding) -> bool:
        """Whether outer state `holding` may replace mine (`SwarmView.vouched`: anchors hold it, per their records
        or telling me); counted and logged once per state when not."""
        if self.view.vouched(holding.step, holding.hash, holding.tellers):
            return True
        if (holding.step, holding.hash) not in self._refused:
            self._refused.add((holding.step, holding.hash))
            self.ledger.counts["unvouched_states"] += 1
            logger.info("diloco: not taking outer step %d (%s)%s: nobody I can vouch by holds it (yet)",
                        holding.step, holding.hash[:12],
                        f" from {', '.join(PeerID(t).short() for t in holding.tellers)}" if holding.tellers else "")
        return False

    async def download(self, holding: Holding, sources: Sequence[tuple[bytes, Address | None]],
                       deadline: float) -> bool:
        """Download the outer state `holding` describes from `sources`; True when what arrived is outer step
        `holding.step` or newer and hashes to what its provider claims. The callers took `holding` from anchors
        (`resync`: the credible records) or checked it (`vouched`) first."""
        me = bytes(self.tracker.peer_id)
        candidates = list(dict.fromkeys((PeerID(p), a) for p, a in sources if a is not None and p != me))
        staging = [torch.empty_like(t) for t in self.outer.tensors]
        counts = self.ledger.counts
        try:
            # in parallel verified blocks from every holder of that hash (a source that dies or lies is dropped)
            loaded = await load_state(self.rpc, candidates, into=staging, expected_hash=holding.hash,
                                      timeout=max(0.0, min(self.load_state_timeout, deadline - trio.current_time())))
        except Exception as error:  # nobody could give it: the contribution is lost, the next one retries
            counts["state_load_failures"] += 1
            logger.warning("diloco: loading outer step %d failed: %s", holding.step, error)
            return False
        metadata = loaded.metadata if isinstance(loaded.metadata, dict) else {}
        step, claimed = metadata.get("outer_step"), metadata.get("hash")
        downloaded_hash = holding.hash  # every block was checked against it
        if not isinstance(step, int) or step < holding.step or claimed != downloaded_hash:
            counts["state_load_failures"] += 1
            logger.warning("diloco: the outer state from %s is not what it claims (step %r); ignored",
                           loaded.peer.short(), step)
            return False
        members: list[tuple[bytes, Address | None]] = []
        for item in metadata.get("members") or []:
            try:
                members.append((bytes(item[0]), (str(item[1][0]), int(item[1][1])) if item[1] else None))
            except (TypeError, ValueError, IndexError):
                continue
        self.outer.replace(staging, step, downloaded_hash)
        self.view.members_of[step] = tuple(members)
        counts["state_loads"] += 1
        counts["resyncs"] += 1
        counts["bytes_received"] += sum(t.numel() * t.element_size() for t in self.outer.tensors)
        logger.info("diloco: loaded outer step %d (%s) from %d holders in %.3f s", step, self.outer.hash[:12],
                    len(loaded.sources), loaded.seconds)
        self.rounds.held_changed()
        self.view.publish()
        return True

    async def resync(self, progress: SwarmProgress, timeout: float | None = None) -> bool:
        """Download the swarm's outer state (`SwarmView.canonical`) when it is not mine. True when it was
        replaced."""
        step, best, holders = self.view.canonical(list(progress.peers))
        if best is None or (step == self.outer.step and best == self.outer.hash) or not holders:
            return False
        deadline = trio.current_time() + (self.load_state_timeout if timeout is None else timeout)
        holding = Holding(step, best, tuple((bytes(p.peer_id), p.address) for p in holders))
        sources = sorted(holding.members, key=lambda m: 0 if m[1] is not None else 1)
        return await self.download(holding, list(sources), deadline)

    async def join(self, start_with: int, start_timeout: float) -> bool:
        """Before the first inner step: wait (at most `start_timeout`) for `start_with` trainers, then hold the
        swarm's newest outer state (the one most trainers at the newest step hold). True when it was downloaded
        (the local parameters are then to start from it); else my own progress record is published."""
        progress = await self.tracker.fetch()
        if start_with > 1:
            await self.tracker.publish()  # be counted by the others that wait too
            deadline = trio.current_time() + start_timeout
            while (len([p for p in progress.peers if p.info.get("alg") and not p.left]) < start_with
                   and trio.current_time() < deadline):
                await trio.sleep(self.tracker.min_refresh)
                progress = await self.tracker.fetch()
        self.view.last_progress = progress
        self.view.note_roster()  # the trainers seen now are the first round's candidates (a later read may miss some)
        for _ in range(3):  # a download can fail when the holders moved on meanwhile: read again, fetch again
            if await self.resync(progress):
                return True
            if not self.view.ahead(progress):
                break
            await trio.sleep(self.tracker.min_refresh)
            progress = self.view.last_progress = await self.tracker.fetch()
        await self.tracker.publish()
        return False

    async def intend(self, fragments: int, timeout: float) -> None:
        """A joiner tells the coordinator of its first round to expect it: that round's window then cuts its first
        phase short instead of starting without it. Its first round is the one after the outer step it just
        downloaded: the others finished that step's phase already (that round may be under way), while the
        joiner's phase has only begun; asked to come to it, the joiner would make the others wait out a window
        it cannot make. It goes to the next one from the state it holds, stale by one (`may_offer_behind` of
        `averaging.diloco_contribute`)."""
        step = self.outer.step + (1 if fragments == 1 else 0)
        offer = Offer(bytes(self.tracker.peer_id), self.outer.step, 0, self.outer.hash, self.view.address,
                      chain=self.view.chain_items())
        taken = await self.rounds.intend(step, offer, timeout=timeout)
        logger.debug("diloco: intent for round %d %s", step, "taken" if taken else "not taken")
