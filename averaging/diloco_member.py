"""`RoundMember`: what a DiLoCo trainer does as a member of an outer round that started.

Why its own object: once a coordinator's start names this trainer, the rest is the same whatever path the offer
took: check the start against the rules, combine the members' pseudo-gradients (the butterfly all-reduce of
`averaging.averager`, or the all-gather of `averaging.gather` for sparse codecs), apply the outer step when the
result fits the state this trainer holds (or, a member from behind on the round's chain, download the round's
result after it), and count and record the round. The offers that lead here are `averaging.diloco_contribute`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import trio

from averaging.averager import Averager
from averaging.diloco_ledger import DiLoCoLedger
from averaging.diloco_sync import StateSync
from averaging.diloco_view import SwarmView
from averaging.gather import GatherService, combine, prefer_gather
from averaging.group import GroupInfo, Member
from averaging.outer_state import OuterState
from averaging.progress import ProgressTracker
from averaging.quorum import QuorumPolicy, Start, check_start
from averaging.rounds import RoundService
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.rpc import RPCNode

if TYPE_CHECKING:
    from averaging.diloco_contribute import Contribution

logger = logging.getLogger("averaging.diloco")  # the optimizer's own log, as before these parts had modules

__all__ = ["RoundMember"]


class RoundMember:
    """One trainer's part in the rounds it is a member of. `exchange`: "butterfly", "gather" or "auto" (see
    `DiLoCoOptimizer`); `trace_dir`: save every outer step there (`DiLoCoHooks.trace_dir`); `own_trace`: the
    pseudo-gradient of the contribution last prepared, as it was before the exchange (for that trace)."""

    def __init__(self, *, rpc: RPCNode, outer: OuterState, view: SwarmView, sync: StateSync, tracker: ProgressTracker,
                 rounds: RoundService, averager: Averager, gather: GatherService, ledger: DiLoCoLedger,
                 policy: QuorumPolicy, compression: wire.Compression, exchange: str, averaging_timeout: float,
                 load_state_timeout: float, trace_dir: str | None = None):
        self.rpc = rpc
        self.outer = outer
        self.view = view
        self.sync = sync
        self.tracker = tracker
        self.rounds = rounds
        self.averager = averager
        self.gather = gather
        self.ledger = ledger
        self.policy = policy
        self.compression = compression
        self.exchange = exchange
        self.averaging_timeout = averaging_timeout
        self.load_state_timeout = load_state_timeout
        self.trace_dir = trace_dir
        self.own_trace: list[torch.Tensor] = []

    async def average(self, start: Start, contribution: Contribution) -> str:
        """I am a member of `start`: average, apply, remember the round."""
        me = start.member(bytes(self.tracker.peer_id))
        assert me is not None
        counts = self.ledger.counts
        problem = check_start(start, self.policy)
        if problem is not None:  # a coordinator that breaks the rules: not followed, and not asked first again
            logger.warning("diloco: round %d's start from %s breaks the rules (%s); not taken", start.step,
                           PeerID(start.coordinator).short() if start.coordinator else "?", problem)
            if start.coordinator:
                self.rounds.suspect(start.coordinator)
            self.ledger.record(self.outer, {"outcome": "lost", "round": start.step, "reason": f"bad start: {problem}",
                                            "base": contribution.base})
            return "lost"
        began = trio.current_time()
        outcome, reason = "solo", ""
        others = [p for p, _ in self.rounds.roster() if p != bytes(self.tracker.peer_id)]
        if len(start.members) == 1 and others:
            # alone in a round while other trainers of the run are live (a partition, or they were reachable a
            # moment ago): apply nothing, so this trainer's progress is not lost in a state the others will not
            # hold; the next round's pseudo-gradient covers this one too
            logger.info("diloco: round %d had no other member while %d trainers are live; nothing applied",
                        start.step, len(others))
            self.ledger.record(self.outer, {"outcome": "skipped", "round": start.step, "members": 1,
                                            "reason": start.reason, "waited": round(start.waited, 4),
                                            "window": round(start.window, 4), "base": contribution.base})
            self.rounds.alone_in(start.step)
            return "skipped"
        if len(start.members) > 1 and self._gathers(start, contribution.indices):
            outcome, reason = await self._gather(start, contribution)
        elif len(start.members) > 1:
            group = GroupInfo.create(start.group_id, [
                Member(PeerID(m.peer), m.address, m.bandwidth) for m in start.members])
            result = await self.averager.average_in(group, weight=me.weight, timeout=self.averaging_timeout,
                                                    tensors=[self.outer.pseudo[i] for i in contribution.indices])
            self.ledger.count_traffic(result)
            outcome = "averaged" if result.finished else "lost"
            reason = result.reason
        behind = first = False
        if outcome == "lost":
            counts["lost_rounds"] += 1
            logger.info("diloco: round %d did not finish (%s); nothing applied", start.step, reason)
        else:
            behind = (outcome == "averaged" and self.outer.step == contribution.base < start.step
                      and self.view.chain.get(contribution.base) == self.outer.hash)
            if behind:
                # a member from an older state of the round's chain: my pseudo-gradient is in the others' outer
                # step; I download it after this round (below) instead of applying it
                self.outer.counted()
            elif self.outer.step != start.step or self.outer.hash != start.hash:
                # moved meanwhile (a download by another path): this round's update does not fit my state
                outcome = "lost"
                counts["lost_rounds"] += 1
            else:
                self._apply_outer(start, contribution, me.weight)
                self.view.members_of[self.outer.step] = tuple((m.peer, m.address) for m in start.members)
                self.view.forget_old_members()
            if outcome != "lost":
                if me.staleness:
                    counts["stale_contributions"] += 1
                if outcome == "solo":
                    counts["solo_steps"] += 1
                else:
                    sizes = counts["group_sizes"]
                    sizes[len(start.members)] = sizes.get(len(start.members), 0) + 1
                self.tracker.note_group([m.peer for m in start.members])
                if outcome == "averaged":
                    self.view.saw_contribute(m.peer for m in start.members)
                first = self.ledger.note_first(start.step)
                if not behind:
                    self.rounds.held_changed()
                    self.view.publish()
        if outcome == "lost" and start.coordinator == bytes(self.tracker.peer_id):
            self.rounds.round_failed(start.step)
        counts["rounds"] += 1
        self.ledger.record(self.outer, {
            "outcome": outcome, "round": start.step, "members": len(start.members), "reason": start.reason,
            "waited": round(start.waited, 4), "window": round(start.window, 4), "base": contribution.base,
            "staleness": me.staleness, "samples": me.samples, "weight": me.weight,
            "seconds": round(trio.current_time() - began, 4),
            "since_offer": round(trio.current_time() - contribution.started, 4),
            "contributors": [{"peer": PeerID(m.peer).short(), "samples": m.samples, "staleness": m.staleness,
                              "weight": round(m.weight, 4)} for m in start.members],
            **({"behind": self.outer.step} if behind else {}),
            **({"first_contribution": self.ledger.first_contribution} if first else {}),  # also known if killed
        })
        if behind:
            members = tuple((m.peer, m.address) for m in start.members)
            self.view.members_of[start.step + 1] = members
            if not await self.sync.catch_up(start.step + 1, members, trio.current_time() + self.load_state_timeout):
                logger.info("diloco: could not download outer step %d after contributing to it from outer step %d; "
                            "the next contribution goes from here", start.step + 1, self.outer.step)
        return outcome

    def _gathers(self, start: Start, indices: list[int]) -> bool:
        """All-gather (`averaging.gather`) instead of the butterfly: with `exchange="gather"`, or with "auto" when
        it sends fewer bytes for this group and codec; never when a member cannot be called. Every member decides
        the same from the same start."""
        if self.exchange == "butterfly" or any(m.address is None for m in start.members):
            return False
        if self.exchange == "gather":
            return True
        pseudo = self.outer.pseudo
        compressed = sum(wire.data_nbytes(pseudo[i], self.compression) for i in indices)
        sparse = self.compression in (wire.Compression.TOPK2, wire.Compression.TOPK8)
        returned = compressed if not sparse else sum(
            wire.data_nbytes(pseudo[i], wire.Compression.INT8) for i in indices)
        return prefer_gather(len(start.members), compressed, returned)

    async def _gather(self, start: Start, contribution: Contribution) -> tuple[str, str]:
        """This round by all-gather: push, agree on the set with the coordinator, combine it (robust rules on the
        decoded values); judged like the butterfly's rounds (rejected contributions are strikes)."""
        tensors = [self.outer.pseudo[i] for i in contribution.indices]
        result = await self.gather.run(start.group_id, [(m.peer, m.address) for m in start.members], tensors,
                                       self.compression, (start.coordinator, start.coordinator_address),
                                       deadline=trio.current_time() + self.averaging_timeout)
        self.ledger.add_traffic(result.bytes_sent, result.bytes_received)
        if result.contributions is None or result.chosen is None:
            return "lost", result.reason
        weights = {m.peer: m.weight for m in start.members}
        rejected = combine(result.contributions, weights, self.averager.aggregation, tensors)
        newly = self.averager.strikes.record_round(set(rejected), result.chosen)
        if newly:
            logger.warning("diloco: banning %s (contributions rejected in %d rounds)",
                           ", ".join(PeerID(p).short() for p in sorted(newly)), self.averager.strikes.ban_after)
        if len(result.contributions) - len(rejected) < 1:
            return "lost", "every contribution was rejected"
        return "averaged", ""

    def _apply_outer(self, start: Start, contribution: Contribution, weight: float) -> None:
        """The outer optimizer steps on the averaged pseudo-gradient of the contribution's fragment (in the trio
        thread, as soon as the round ends, so trainers that catch up can download the new outer step at once)."""
        before = [p.clone() for p in self.outer.outer_params] if self.trace_dir else None
        self.outer.apply(contribution.indices)
        self.ledger.counts["outer_steps"] += 1
        if before is not None:
            self._save_trace(before, start, weight)

    def _save_trace(self, before: list[torch.Tensor], start: Start, weight: float) -> None:
        directory = self.trace_dir or "."
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.rpc.peer_id.hex()}.{self.outer.step}.pt")
        torch.save({"outer_step": torch.tensor(self.outer.step), "before": before,
                    "after": [p.clone() for p in self.outer.outer_params],
                    "averaged": [p.clone() for p in self.outer.pseudo],
                    "own": [p.clone() for p in self.own_trace], "weight": torch.tensor(float(weight)),
                    "group": [torch.tensor(list(m.peer)) for m in start.members], "hash": self.outer.hash}, path)
