"""A trainer's side of the outer rounds: its offers to a round's candidates, its intents, its waits for an outer
step. `averaging.rounds.RoundService` owns it (and is the coordinator side); docs/outer-rounds.md is the contract.

Why a module of its own: the trainer role only calls out (the coordinator role only answers), and what it needs
of the service is narrow: the roster to rank candidates (`averaging.roster`), the grace estimator it feeds with
the starts it sees, and the service's own coordinator for the offers it makes to itself (no network). It keeps
the one figure it measures, the round trip to coordinators (`rtt`, from the answers to offers, which need no
work), which sets `ack_timeout` for every call of the service.

- `enter` offers a contribution to the candidates of a round, best first, skipping the ones that refuse
  connections or do not answer within `ack_timeout`, until one gives a final verdict (following redirects, and
  the long polls of `diloco.round.wait` while it is queued).
  An offer still waiting for a candidate's first answer goes to the coordinator that meanwhile told this trainer
  the round's window opened (`opened`): a frozen candidate holds it for a whole `ack_timeout`, which is longer
  than a window, while the round opens at the next candidate.
- `intend` tells a round's coordinator to expect this trainer, without waiting for the round.
- `await_step` waits (long polls on `diloco.round.status`) until one of a round's members holds an outer step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

import trio

from averaging.polled import unless
from averaging.quorum import GraceEstimator, Offer, Queued, Start, coordinator_order
from averaging.roster import Roster
from averaging.round_wire import (
    JOIN,
    MAX_ROSTER,
    STATUS,
    WAIT,
    Final,
    Holding,
    as_address,
    as_peer,
    verdict_from_wire,
)
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import CallTimeout, RPCError, RPCNode

logger = logging.getLogger("averaging.rounds")  # the round service's log, as before this part had a module
OPENING_POLL = 0.05  # seconds between looks, during an offer's first call, for another coordinator's opening
_OPENED = object()  # `_join`'s call given up for an opening elsewhere


@dataclass(eq=False)
class RoundClient:
    """The trainer role of one trainer's round service (see the module doc). `known`: the roster it ranks
    candidates from and notes the trainers it hears of in; `grace`: the service's grace estimator, fed with
    the arrival offsets of every start it sees; `local(method, args)`: the service's own answer to a call
    addressed to this trainer; `stats`: the service's counters (it counts `candidates_skipped`)."""

    rpc: RPCNode
    run_id: str
    known: Roster
    grace: GraceEstimator
    _: KW_ONLY
    local: Callable[[str, dict[str, Any]], Awaitable[Any]]
    stats: dict[str, int]
    ack_floor: float
    poll_limit: float
    me: bytes = field(init=False)
    # seconds, an exponential average of measured round trips (0: none measured yet)
    rtt: float = field(init=False, default=0.0)
    # step -> the coordinator (peer, address) that told me its window opened
    _openers: dict[int, tuple[bytes, Address]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.me = bytes(self.rpc.peer_id)

    def opened(self, step: int, peer: bytes, address: Address | None) -> None:
        """`peer` (the authenticated caller of `diloco.round.open`, listening at `address`) coordinates round
        `step` and opened its window: an offer of mine for that round that waits on another candidate's first
        answer goes there instead (`_join`)."""
        if address is None or peer == self.me:
            return
        self._openers[step] = (peer, address)
        for old in [s for s in self._openers if s < step - 2]:
            del self._openers[old]

    @property
    def ack_timeout(self) -> float:
        """How long an answer that needs no work may take: a few measured round trips, at least `ack_floor`."""
        return max(self.ack_floor, 6.0 * self.rtt)

    def _measured(self, seconds: float) -> None:
        """A round trip to a coordinator, whose answer needed no work: smoothed into `rtt`."""
        if math.isfinite(seconds) and seconds >= 0:
            self.rtt = seconds if self.rtt == 0.0 else 0.8 * self.rtt + 0.2 * seconds

    def _observe(self, verdict: Any) -> None:
        """A final verdict: the start it carries teaches the grace window (its arrival offsets) and the roster (its
        members' addresses)."""
        start = verdict if isinstance(verdict, Start) else getattr(verdict, "start", None)
        if isinstance(start, Start):
            self.grace.observe(start.offsets)
            for member in start.members:
                if member.address is not None:
                    self.known.note(member.peer, member.address)

    async def enter(self, step: int, offer: Offer, *, deadline: float) -> Final | None:
        """Offer `offer` for round `step` to the roster, best-ranked first, until one gives a final verdict;
        None when none could be reached before `deadline`."""
        listed = dict(self.known.members())
        ranked = coordinator_order(self.run_id, step, listed)
        queue = [p for p in ranked if not self.known.suspected(p)] + [p for p in ranked if self.known.suspected(p)]
        skipped: list[bytes] = []
        failed: set[bytes] = set()
        insist = False
        while queue and trio.current_time() < deadline:
            peer = queue.pop(0)
            address = listed.get(peer)
            args = {"run": self.run_id, "step": step, "base": offer.base, "samples": offer.samples,
                    "hash": offer.hash, "address": list(offer.address) if offer.address is not None else None,
                    "bandwidth": offer.bandwidth, "intent": offer.intent, "skipped": skipped, "insist": insist,
                    "roster": self.known.gossip(), "chain": [list(item) for item in offer.chain]}
            # a candidate that finds better-ranked ones doubtful (ones I skipped or suspect) probes them before it
            # answers, for up to its own ack timeout (`RoundService._better_candidate`): wait for that too
            before = ranked[:ranked.index(peer)] if peer in ranked else []
            doubted = any(p in failed or self.known.suspected(p) for p in before)
            try:
                verdict = await self._ask(peer, address, args, step, deadline,
                                          first_timeout=self.ack_timeout * (2 if doubted else 1))
            except (RPCError, ValueError) as error:
                logger.debug("round %d: candidate %s failed: %s", step, PeerID(peer).short(), error)
                self.stats["candidates_skipped"] += 1
                skipped.append(peer)
                failed.add(peer)
                if peer != self.me:
                    self.known.suspect(peer)
                continue
            if isinstance(verdict, tuple):  # a redirect
                target, target_address = verdict
                if target in failed:
                    insist = True  # they can reach it, I cannot: the next candidate takes me in anyway
                    continue
                listed[target] = target_address
                self.known.note(target, target_address)
                if target in queue:
                    queue.remove(target)
                queue.insert(0, target)
                continue
            self._observe(verdict)
            return verdict
        return None

    async def intend(self, step: int, offer: Offer, *, timeout: float) -> bool:
        """Tell round `step`'s coordinator to expect me (an intent: no contribution yet), so that it tells me when
        the window opens and my phase ends in time for it: what a trainer that just downloaded outer step `step`
        does, or its first round would start without it and it would be late. Follows redirects; never waits for
        the round. True when a coordinator took it (False: nobody could be reached, or the round already started).
        """
        deadline = trio.current_time() + timeout
        listed = dict(self.known.members())
        queue = [p for p in coordinator_order(self.run_id, step, listed) if not self.known.suspected(p)]
        skipped: list[bytes] = []
        args = {"run": self.run_id, "step": step, "base": offer.base, "samples": offer.samples, "hash": offer.hash,
                "address": list(offer.address) if offer.address is not None else None,
                "bandwidth": offer.bandwidth, "intent": True, "skipped": skipped, "insist": False,
                "roster": self.known.gossip(), "chain": [list(item) for item in offer.chain]}
        for _ in range(4):  # the best candidate, or up to 3 redirects from it
            if not queue or trio.current_time() >= deadline:
                return False
            peer = queue.pop(0)
            try:
                reply = await self._call(peer, listed.get(peer), JOIN, args, self.ack_timeout, deadline)
            except (RPCError, ValueError) as error:
                logger.debug("round %d: intent to %s failed: %s", step, PeerID(peer).short(), error)
                skipped.append(peer)
                continue
            if isinstance(reply, dict) and isinstance(reply.get("redirect"), list):
                try:
                    target, address = as_peer(reply["redirect"][0]), as_address(reply["redirect"][1])
                except (ValueError, TypeError, IndexError):
                    return False
                if address is None:
                    return False
                listed[target] = address
                queue.insert(0, target)
                continue
            return isinstance(reply, dict) and "queued" in reply
        return False

    async def _ask(self, peer: bytes, address: Address | None, args: dict[str, Any], step: int,
                   deadline: float, first_timeout: float) -> Final | tuple[bytes, Address]:
        """Offer to one candidate (its first answer within `first_timeout`) and follow its answers until final
        (or a redirect)."""
        asked = trio.current_time()
        reply = await self._join(peer, address, args, step, deadline, first_timeout)
        if isinstance(reply, tuple):
            return reply  # another coordinator opened the round meanwhile: a redirect to it
        if peer != self.me and first_timeout <= self.ack_timeout:  # (a probing answer is no round trip)
            self._measured(trio.current_time() - asked)
        if peer != self.me:
            self.known.note(peer, address)
        while True:
            if isinstance(reply, dict):
                self.known.merge(reply.pop("roster", None))
                self._take_suspects(reply.pop("suspects", None), peer, step)
            verdict = verdict_from_wire(reply, trio.current_time(), peer, address)
            if not isinstance(verdict, Queued):
                return verdict
            # the long poll answers by the round's deadline (or the poll limit); a frozen coordinator does not
            limit = self.poll_limit
            if verdict.deadline is not None:
                limit = min(limit, max(0.0, verdict.deadline - trio.current_time()) + 0.05)
            reply = await self._call(peer, address, WAIT, {"run": self.run_id, "step": step},
                                     limit + self.ack_timeout, deadline)

    def _take_suspects(self, suspects: Any, coordinator: bytes, step: int) -> None:
        """The candidates round `step`'s coordinator found dead (`RoundService._suspects`), suspected here too.
        Only ones ranked before that coordinator count (the only ones it probes): a coordinator cannot push
        the trainers ranked after it down the order, and suspicion only reorders candidates for
        `suspect_for`, it excludes nobody."""
        if not isinstance(suspects, list):
            return
        for item in suspects[:MAX_ROSTER]:
            try:
                peer = as_peer(item)
            except (ValueError, TypeError):
                continue
            if peer not in (self.known.me, coordinator) \
                    and coordinator_order(self.run_id, step, [peer, coordinator])[0] == peer:
                self.known.suspect(peer)

    async def _join(self, peer: bytes, address: Address | None, args: dict[str, Any], step: int,
                    deadline: float, timeout: float) -> Any:
        """The offer's first call to `peer`: its answer, or (peer, address) of another coordinator that told me
        meanwhile that round `step`'s window opened (the call is then given up)."""
        def opened_elsewhere() -> bool:
            opener = self._openers.get(step)
            return opener is not None and opener[0] != peer

        reply = await unless(opened_elsewhere, OPENING_POLL, _OPENED, self._call, peer, address, JOIN, args,
                             timeout, deadline)
        if reply is _OPENED:
            opener = self._openers[step]
            logger.info("round %d: %s opened it while %s had not answered; my offer goes there",
                        step, PeerID(opener[0]).short(), PeerID(peer).short())
            return opener
        return reply

    async def _call(self, peer: bytes, address: Address | None, method: str, args: dict[str, Any],
                    timeout: float, deadline: float) -> Any:
        timeout = max(0.0, min(timeout, deadline - trio.current_time()))
        if peer == self.me:  # local: no network, and no RPC deadline, so bounded here
            # (`wait` returns by its poll limit, queued again while the round has not started: `_ask` polled its
            # own round past `deadline` for as long as the round did not start, which can be forever)
            with trio.move_on_at(deadline):
                return await self.local(method, args)
            raise CallTimeout(f"no verdict of my own round by the deadline ({method})", method=method)
        if address is None:
            raise ValueError("a candidate without an address")
        return await self.rpc.call(address, method, args, timeout=timeout, peer_id=PeerID(peer))

    async def await_step(self, step: int, holders: Sequence[tuple[bytes, Address | None]], *,
                         deadline: float, enough: Callable[[list[Holding]], bool] | None = None) -> Holding | None:
        """The first answer of a holder that holds at least outer step `step` (asked in parallel, long polls),
        or None by `deadline`. With `enough`, answers are gathered until `enough(answers so far)` holds (the last
        answer is returned) or every holder answered (the first is returned)."""
        found: list[Holding] = []
        chosen: list[Holding] = []
        reachable = [(bytes(p), a) for p, a in holders if a is not None and bytes(p) != self.me]
        if not reachable:
            return None
        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                async def ask(peer: bytes, address: Address) -> None:
                    while trio.current_time() < deadline:
                        wait = max(0.0, min(self.poll_limit, deadline - trio.current_time()))
                        try:
                            reply = await self.rpc.call(
                                address, STATUS, {"run": self.run_id, "min_step": step, "wait": wait},
                                timeout=wait + self.ack_timeout, peer_id=PeerID(peer))
                            holding = replace(Holding.from_wire(reply), tellers=(peer,))
                        except (RPCError, ValueError):
                            return  # this holder is gone or lies; the others may answer
                        if holding.step < step and isinstance(reply, dict) and reply.get("void"):
                            return  # the round that would produce it failed at this holder: not coming from it
                        if holding.step >= step:
                            found.append(holding)
                            if enough is None or enough(found):
                                chosen.append(replace(holding, tellers=tuple(
                                    t for a in found if (a.step, a.hash) == (holding.step, holding.hash)
                                    for t in a.tellers)))
                                nursery.cancel_scope.cancel()
                            return

                for peer, address in reachable:
                    nursery.start_soon(ask, peer, address)
        return chosen[0] if chosen else found[0] if found else None
