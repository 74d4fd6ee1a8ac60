"""Outer rounds over RPC: offers to a round's coordinator, its verdicts, the window's opening, holders' status.

The rule (who is in a round, when it starts) is `averaging.quorum`; the contract is docs/outer-rounds.md. This
module is its trio driver, one per DiLoCo trainer (`RoundService`), in two roles:

- **Coordinator.** `diloco.round.join` takes an offer and answers at once: queued (with the round's deadline as
  far as it is known), a redirect to a better-ranked candidate it believes alive, or the verdict of a round that
  already started. `diloco.round.wait` is the long poll that follows a queued answer; it returns by the round's
  deadline plus a poll limit at the latest, so a frozen coordinator is noticed within one round trip of a
  deadline, never after a fixed timeout. When a round's window opens, the coordinator tells the expected trainers
  that are not ready (`diloco.round.open`); a refused connection or no answer takes that trainer out of the
  round's expected set (the message doubles as a liveness probe, so a dead trainer costs no grace window).
- **Trainer.** `enter()` offers a contribution to the candidates of a round, best first, skipping the ones that
  refuse connections or do not answer within `ack_timeout`, until one gives a final verdict. `await_step()`
  waits (long poll on `diloco.round.status`) until one of a round's members holds a given outer step, which is
  how a late trainer learns where to catch up.

Candidates that disagree: a candidate accepts an offer only when it ranks first among the candidates it
believes alive, or already coordinates the round; it probes the better candidates the trainer says it could not
reach (a live one gets the trainer redirected). A trainer that cannot reach a candidate that others can
(a partial partition) insists at the next one, which then coordinates too: two groups for one round, which the
next round's hash agreement resolves (the minority downloads the majority's state).

Every message is checked: a malformed offer is refused with `BadRequest`; a malformed answer counts as that
candidate failing. The offer's sender is the authenticated caller, never a field of the message.

This module is the service and its coordinator role; the rest has modules of its own, each readable alone:
`averaging.round_wire` the messages and their checks (its public names are still importable from here),
`averaging.roster` the trainers this one knows of, `averaging.round_client` the trainer role.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from averaging.polled import unless
from averaging.quorum import GraceEstimator, Offer, OuterRound, Queued, QuorumPolicy, coordinator_order
from averaging.roster import Roster
from averaging.round_client import RoundClient
from averaging.round_wire import (
    JOIN,
    MAX_ROSTER,
    OPEN,
    STATUS,
    WAIT,
    Behind,
    Final,
    Holding,
    as_number,
    is_int,
    offer_from_wire,
    start_from_wire,
    start_to_wire,
    verdict_to_wire,
)
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import BadRequest, CallContext, RPCError, RPCNode

logger = logging.getLogger(__name__)

PROBE_POLL = 0.05  # seconds between looks, while an offer's probes run, for the round having started here

__all__ = ["Behind", "Final", "Holding", "JOIN", "OPEN", "RoundService", "STATUS", "WAIT", "start_from_wire",
           "start_to_wire"]


# ------------------------------------------------------------------------------------------------ the service


class _Coordinated:
    """A round this trainer coordinates: the core, and an event set whenever it may have changed."""

    def __init__(self, core: OuterRound, addresses: dict[bytes, Address | None]):
        self.core = core
        self.addresses = addresses
        self.changed = trio.Event()
        self.started_at: float | None = None

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class RoundService:
    """One trainer's side of the outer rounds (see the module doc). Owned by the DiLoCo optimizer: `serve` runs
    in its nursery and installs the handlers; cancelling it removes them.

    `holding()`: what this trainer holds now; `chain()`: the hashes of the recent outer steps it held (step ->
    hash), so that trainers behind on them can take part in the rounds it coordinates. `expected(step)`: whom
    to expect in a round it coordinates (peer -> address). `on_open(step, closes_in)`: a coordinator opened
    round `step`, whose grace window closes in `closes_in` seconds; returns whether this trainer will offer to
    that round (False: it already did, elsewhere, or it is behind and will be late).

    The **roster** (`known`, an `averaging.roster.Roster`) is every trainer of the run this one knows of: the
    owner adds what the progress records say (`note`), offers and answers carry the sender's roster, and a
    trainer that refuses connections or stays silent is suspected for a while. The trainer role (`enter`,
    `intend`, `await_step`) is `client`, an `averaging.round_client.RoundClient`; this class is the coordinator.

    It learns two figures as it goes: the round trip to coordinators (`rtt`, measured by the client), which sets
    `ack_timeout`; and the grace window (`grace`, from the arrival offsets that every start it sees carries),
    which it uses for the rounds it coordinates."""

    def __init__(
        self,
        rpc: RPCNode,
        run_id: str,
        policy: QuorumPolicy,
        *,
        holding: Callable[[], Holding],
        expected: Callable[[int], dict[bytes, Address | None]],
        on_open: Callable[[int, float], bool],
        address: Callable[[], Address | None],
        banned: Callable[[], set[bytes]] = set,
        chain: Callable[[], Mapping[int, str]] = dict,
        ack_floor: float = 2.0,
        poll_limit: float = 2.0,
        keep_rounds: int = 8,
        suspect_for: float = 30.0,
        roster_ttl: float = 30.0,
    ):
        self.rpc = rpc
        self.run_id = run_id
        self.policy = policy
        self.me = bytes(rpc.peer_id)
        self._holding = holding
        self._expected = expected
        self._on_open = on_open
        self._address = address
        self._banned = banned
        self._chain = chain
        self.grace = GraceEstimator(policy)
        self.poll_limit = poll_limit
        self.keep_rounds = keep_rounds
        self.known = Roster(self.me, address=address, banned=banned, ttl=roster_ttl, suspect_for=suspect_for)
        self.rounds: dict[int, _Coordinated] = {}
        self._attempts: dict[int, int] = {}  # step -> attempt of the next round started for it
        self._dead: dict[int, set[bytes]] = {}  # per round: better candidates this coordinator found dead
        self._held = trio.Event()  # set (and renewed) whenever `holding()` may have changed
        self._nursery: trio.Nursery | None = None
        self.stats = {"coordinated": 0, "offers": 0, "redirects": 0, "opens_sent": 0, "lost_on_open": 0,
                      "candidates_skipped": 0, "behind_answers": 0}
        self.client = RoundClient(rpc, run_id, self.known, self.grace, local=self._local, stats=self.stats,
                                  ack_floor=ack_floor, poll_limit=poll_limit)

    # ------------------------------------------------------------------------------------------ lifetime

    async def serve(self, *, task_status: trio.TaskStatus[RoundService] = trio.TASK_STATUS_IGNORED) -> None:
        for name, handler in ((JOIN, self._on_join), (WAIT, self._on_wait), (OPEN, self._on_open_call),
                              (STATUS, self._on_status)):
            self.rpc.register(name, handler)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for name in (JOIN, WAIT, OPEN, STATUS):
                self.rpc.unregister(name)

    def held_changed(self) -> None:
        """The owner's holding changed (a round applied, a download): wakes status long polls."""
        self._held.set()
        self._held = trio.Event()

    @property
    def rtt(self) -> float:
        """Seconds, an exponential average of the measured round trips to coordinators (0: none measured yet)."""
        return self.client.rtt

    @property
    def ack_timeout(self) -> float:
        """How long an answer that needs no work may take (`RoundClient.ack_timeout`)."""
        return self.client.ack_timeout

    # ------------------------------------------------------------------------------------------ roster

    def note(self, peer: bytes, address: Address | None) -> None:
        """`peer` trains in this run and listens at `address` (`Roster.note`)."""
        self.known.note(peer, address)

    def forget(self, peer: bytes) -> None:
        """`peer` left the run (it said goodbye)."""
        self.known.forget(peer)

    def roster(self) -> list[tuple[bytes, Address]]:
        """The trainers of the run heard of lately and not banned, me included when I listen (`Roster.members`)."""
        return self.known.members()

    def banned(self) -> set[bytes]:
        """The peers this trainer's all-reduce banned (never members, never anchors of its outer state)."""
        return self._banned()

    def suspect(self, peer: bytes) -> None:
        """`peer` refused a connection or did not answer in time: rank it last for a while (`Roster.suspect`)."""
        self.known.suspect(peer)

    def suspected(self, peer: bytes) -> bool:
        return self.known.suspected(peer)

    # ------------------------------------------------------------------------------------------ coordinator

    def _check_run(self, args: Any) -> None:
        if not isinstance(args, dict) or args.get("run") != self.run_id:
            raise BadRequest("not a round of this trainer's run")

    async def _on_join(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._check_run(args)
        return await self.join(bytes(context.peer_id), args)

    async def join(self, peer: bytes, args: Any) -> dict[str, Any]:
        """An offer from `peer` (the authenticated caller, or this trainer itself)."""
        step, offer, skipped, insist = offer_from_wire(peer, args)
        self.stats["offers"] += 1
        if peer in self._banned():
            return {"dropped": "banned by this coordinator (its all-reduce caught it misbehaving)"}
        if peer != self.me:
            self.note(peer, offer.address)
            self.known.merge(args.get("roster"))
        coordinated = self.rounds.get(step)
        if coordinated is None:
            holding = self._holding()
            if holding.step > step:  # round `step` is over and not mine to tell about: say where the swarm is
                self.stats["behind_answers"] += 1
                return {"behind": holding.to_wire(), "roster": self.known.gossip()}
            if not insist:
                # given up as soon as another offer (my own, say) starts the round here: that one found the
                # better-ranked candidates dead itself, and this offer waiting out its probes (an acknowledgement
                # timeout) made the round wait past its window for its quorum (issue 34's frozen trainer)
                redirect = await unless(lambda: step in self.rounds, PROBE_POLL, None, self._better_candidate,
                                        step, skipped, peer == self.me)
                if redirect is not None:
                    self.stats["redirects"] += 1
                    return {"redirect": [redirect[0], list(redirect[1])]}
            # another offer (my own, say) may have started coordinating it during the probes: one round, not two
            coordinated = self.rounds.get(step) or self._coordinate(step)
        elif await self._lone_round_void(step, coordinated, peer):
            self.round_failed(step)
            coordinated = self._coordinate(step)
        coordinated = self.rounds.get(step, coordinated)  # another offer may have started it again meanwhile
        now = trio.current_time()
        self._hold(coordinated)
        verdict = coordinated.core.offer(offer, now)
        if offer.address is not None:
            coordinated.addresses[peer] = offer.address
        if isinstance(verdict, Queued) and coordinated.core.poll(now) is not None:
            verdict = coordinated.core.verdict(peer)  # this offer completed the round: no long poll needed
        coordinated.wake()
        return {**verdict_to_wire(verdict, now), "roster": self.known.gossip(), **self._suspects(step)}

    def _suspects(self, step: int) -> dict[str, Any]:
        """What a verdict of round `step` adds: the better-ranked candidates this coordinator found dead for it
        (`_better_candidate`'s probes), so that every member ranks them last in the next rounds. A member whose
        offer a round's opening took elsewhere while it waited on the frozen first candidate never suspected
        that one itself, and when it ranked first again two rounds later, that member's offer waited on it a
        second time (tests/scenarios/test_wan_training.py's frozen trainer, 1 run in 3)."""
        dead = self._dead.get(step)
        return {"suspects": sorted(dead)[:MAX_ROSTER]} if dead else {}

    async def _lone_round_void(self, step: int, coordinated: _Coordinated, offerer: bytes) -> bool:
        """True when round `step`, which I started, had one member, another than `offerer`, and that member
        (asked once, briefly) holds nothing newer: the member applied nothing, as a lone member with others live
        does (`DiLoCoOptimizer._average`), or died. Told "late" for that round, every later offerer would look
        for an outer step nobody will ever hold (a whole churn run stalled at one step that way); the round is
        started again instead. A member that applied it alone holds the next step: then "late" is right."""
        start = coordinated.core.start
        if start is None or len(start.members) != 1 or start.members[0].peer == offerer \
                or self._holding().step > step:
            return False
        member = start.members[0]
        if member.peer == self.me or member.address is None:
            return False  # my own round: `alone_in`/`round_failed` already said what it produced
        held = await self.await_step(step + 1, [(member.peer, member.address)],
                                     deadline=trio.current_time() + min(2.0, self.poll_limit))
        if held is not None or self.rounds.get(step) is not coordinated:
            return False
        logger.info("round %d: its one member %s holds no outer step %d; starting it again for %s", step,
                    PeerID(member.peer).short(), step + 1, PeerID(offerer).short())
        return True

    def round_failed(self, step: int) -> None:
        """A round this trainer started produced nothing here (lost, or skipped alone): forget it, so the next
        offer for that step starts it again (as a new attempt) instead of being told it is late for a round
        after which nobody holds the next outer step."""
        coordinated = self.rounds.get(step)
        if coordinated is not None and coordinated.core.start is not None and self._holding().step <= step:
            del self.rounds[step]
            self._void(step)

    def _void(self, step: int) -> None:
        """Round `step` produced nothing here: status polls for outer step `step + 1` answer "void" (`_on_status`)
        until the round is started again."""
        self._attempts[step] = self._attempts.get(step, 0) + 1
        self.held_changed()  # members waiting for outer step `step + 1` from me learn it will not come

    def alone_in(self, step: int) -> None:
        """A round in which I was the only member applied nothing (`DiLoCoOptimizer._average`): nobody holds the
        outer step it would have produced. Whoever started it, trainers told to catch up to that step from me (its
        only member) must hear so at once (a "void" status), not wait for it until their deadline; at the end of
        a run, when the others are finishing and come to no round, they waited past everyone's final agreement."""
        coordinated = self.rounds.get(step)
        if coordinated is not None and coordinated.core.start is not None:
            self.round_failed(step)
        elif self._holding().step <= step:
            self._void(step)

    def members_of_group(self, group_id: bytes) -> list[bytes] | None:
        """The members of a round this trainer started (for `averaging.gather`'s decision), by group id."""
        for coordinated in self.rounds.values():
            start = coordinated.core.start
            if start is not None and start.group_id == group_id:
                return start.peers
        return None

    async def _better_candidate(self, step: int, skipped: list[bytes], own: bool = False
                                ) -> tuple[bytes, Address] | None:
        """A candidate ranked before me that I believe alive (probing the ones the trainer could not reach, and
        the ones I suspect); None when I am the best. `own`: the offer is mine, so the candidates it skipped are
        ones I failed to reach moments ago, which is the probe's answer already (probing again cost a frozen
        candidate's round a second `ack_timeout` before its window could open).

        The probes run together, so an answer takes one `ack_timeout` at most, whatever the number of candidates
        to probe: the trainer waits that long beyond its own ack timeout for it (`RoundClient.enter`), and an
        answer later than that made it coordinate the round too (two coordinators, each waiting `max_wait` for
        the other's offer)."""
        listed = dict(self.roster())
        dead = self._dead.setdefault(step, set())
        order = coordinator_order(self.run_id, step, [*listed, self.me])
        better = [peer for peer in order[:order.index(self.me)] if peer not in dead]
        doubted = [peer for peer in better if peer in skipped or self.suspected(peer)]
        answered = await self._answering([peer for peer in doubted if not (own and peer in skipped)], listed)
        for peer in better:
            if peer in doubted and peer not in answered:
                dead.add(peer)
                self.suspect(peer)
                continue
            return peer, listed[peer]
        return None

    async def _answering(self, peers: list[bytes], listed: Mapping[bytes, Address]) -> set[bytes]:
        """Which of `peers` answer a status call within `ack_timeout` (asked together)."""
        answered: set[bytes] = set()

        async def probe(peer: bytes) -> None:
            if await self._alive(peer, listed[peer]):
                answered.add(peer)

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(probe, peer)
        return answered

    async def _alive(self, peer: bytes, address: Address) -> bool:
        try:
            await self.rpc.call(address, STATUS, {"run": self.run_id}, timeout=self.ack_timeout,
                                peer_id=PeerID(peer))
            return True
        except RPCError:
            return False

    def _coordinate(self, step: int) -> _Coordinated:
        banned = self._banned()
        expected = {p: a for p, a in self._expected(step).items() if p not in banned}
        core = OuterRound(step, expected, self.policy, self.grace.window(self.rtt), own_hash=self._own_hash(step),
                          coordinator=(self.me, self._address()), attempt=self._attempts.get(step, 0),
                          chain=self._chain())
        coordinated = _Coordinated(core, dict(expected))
        logger.debug("round %d: coordinating, expecting %s", step, sorted(PeerID(p).short() for p in expected))
        self.rounds[step] = coordinated
        for old in sorted(self.rounds)[:-self.keep_rounds]:
            del self.rounds[old]
            self._dead.pop(old, None)
            self._attempts.pop(old, None)
        self.stats["coordinated"] += 1
        assert self._nursery is not None, "the round service is not serving"
        self._nursery.start_soon(self._drive, coordinated)
        return coordinated

    def _hold(self, coordinated: _Coordinated) -> None:
        """Tell a round's core what I hold now: it may have been created before I held its step."""
        coordinated.core.hold(self._own_hash(coordinated.core.step), self._chain())

    def _own_hash(self, step: int) -> str | None:
        holding = self._holding()
        return holding.hash if holding.step == step else None

    async def _drive(self, coordinated: _Coordinated) -> None:
        """Until the round starts: tell the not-ready trainers when the window opens, start when a rule fires."""
        core = coordinated.core
        while True:
            self._hold(coordinated)
            if core.poll(trio.current_time()) is not None:
                break
            for peer in core.to_notify():
                self.stats["opens_sent"] += 1
                assert self._nursery is not None
                self._nursery.start_soon(self._open, coordinated, peer)
            deadline = core.deadline()
            changed = coordinated.changed
            with trio.move_on_at(deadline if deadline is not None else math.inf):
                await changed.wait()
        coordinated.started_at = trio.current_time()
        coordinated.wake()
        start = core.start
        assert start is not None
        logger.info("round %d: started with %d of %d (%s, waited %.3f s, window %.3f s)", start.step,
                    len(start.members), len(core.expected | set(core.offers)), start.reason, start.waited,
                    start.window)

    async def _open(self, coordinated: _Coordinated, peer: bytes) -> None:
        """Tell `peer` the window of a round it is expected in opened; a peer that will not come (dead, frozen,
        or busy elsewhere) is no longer waited for."""
        core = coordinated.core
        address = coordinated.addresses.get(peer)
        closes_in = core.closes_in(trio.current_time())
        if peer == self.me:
            coming = self._on_open(core.step, closes_in)
        elif address is None:
            return  # a client-mode trainer: nobody can call it; it arrives when its phase ends
        else:
            try:
                answer = await self.rpc.call(address, OPEN, {"run": self.run_id, "step": core.step,
                                                             "closes_in": closes_in},
                                             timeout=self.ack_timeout, peer_id=PeerID(peer))
                coming = not isinstance(answer, dict) or answer.get("coming") is not False
            except RPCError as error:
                self.suspect(peer)
                logger.info("round %d: %s did not take the opening (%s)", core.step, PeerID(peer).short(), error)
                coming = False
        if not coming and core.start is None and peer not in core.offers:
            logger.debug("round %d: %s will not come", core.step, PeerID(peer).short())
            self.stats["lost_on_open"] += 1
            core.lost(peer)
            coordinated.wake()

    async def _on_wait(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._check_run(args)
        step = args.get("step")
        if not is_int(step):
            raise BadRequest("malformed round wait")
        return await self.wait(bytes(context.peer_id), step)

    async def wait(self, peer: bytes, step: int) -> dict[str, Any]:
        """Answer when the round has a verdict for `peer`, or at the poll limit (then: queued again)."""
        coordinated = self.rounds.get(step)
        if coordinated is None:
            return {"dropped": f"round {step} is not coordinated here"}
        limit = trio.current_time() + self.poll_limit
        while True:
            now = trio.current_time()
            verdict = coordinated.core.verdict(peer)
            if not isinstance(verdict, Queued) or now >= limit:
                return {**verdict_to_wire(verdict, now), **self._suspects(step)}
            changed = coordinated.changed
            with trio.move_on_at(limit):
                await changed.wait()

    async def _on_open_call(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._check_run(args)
        step, closes_in = args.get("step"), args.get("closes_in", 0.0)
        try:
            closes_in = min(as_number(closes_in), self.policy.max_wait)
        except ValueError:
            raise BadRequest("malformed round opening") from None
        if not is_int(step):
            raise BadRequest("malformed round opening")
        self.client.opened(step, bytes(context.peer_id), context.address)
        return {"coming": self._on_open(step, closes_in)}

    async def _on_status(self, context: CallContext, args: Any) -> dict[str, Any]:
        """What I hold; with `min_step`, answered once I hold at least that step or after `wait` seconds."""
        self._check_run(args)
        min_step, wait = args.get("min_step"), args.get("wait", 0.0)
        if min_step is not None and (not is_int(min_step)
                                     or isinstance(wait, bool) or not isinstance(wait, (int, float))):
            raise BadRequest("malformed status request")
        if min_step is not None:
            limit = trio.current_time() + min(max(0.0, float(wait)), self.poll_limit)
            while self._holding().step < min_step and trio.current_time() < limit:
                if self._attempts.get(min_step - 1) and min_step - 1 not in self.rounds:
                    # the round that would produce it failed here and was not started again yet: say so now
                    return {**self._holding().to_wire(), "void": True}
                held = self._held
                with trio.move_on_at(limit):
                    await held.wait()
        return self._holding().to_wire()

    # ------------------------------------------------------------------------------------------ trainer

    async def enter(self, step: int, offer: Offer, *, deadline: float) -> Final | None:
        """Offer `offer` for round `step` until a candidate gives a final verdict (`RoundClient.enter`); None when
        none could be reached before `deadline`."""
        return await self.client.enter(step, offer, deadline=deadline)

    async def intend(self, step: int, offer: Offer, *, timeout: float) -> bool:
        """Tell round `step`'s coordinator to expect me (`RoundClient.intend`); True when one took it."""
        return await self.client.intend(step, offer, timeout=timeout)

    async def await_step(self, step: int, holders: Sequence[tuple[bytes, Address | None]], *,
                         deadline: float, enough: Callable[[list[Holding]], bool] | None = None) -> Holding | None:
        """The first answer of a holder that holds at least outer step `step` (`RoundClient.await_step`, which
        says what `enough` does), or None by `deadline`."""
        return await self.client.await_step(step, holders, deadline=deadline, enough=enough)

    async def _local(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """A call of my client to myself as a candidate: answered here, without the network."""
        if method == JOIN:
            return await self.join(self.me, args)
        return await self.wait(self.me, args["step"])
