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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from averaging.quorum import (
    Admission,
    Dropped,
    GraceEstimator,
    Late,
    Offer,
    OuterRound,
    Queued,
    QuorumPolicy,
    Resync,
    Start,
    Verdict,
    coordinator_order,
)
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import BadRequest, CallContext, RPCError, RPCNode

logger = logging.getLogger(__name__)

JOIN = "diloco.round.join"
WAIT = "diloco.round.wait"
OPEN = "diloco.round.open"
STATUS = "diloco.round.status"

__all__ = ["Behind", "Final", "Holding", "JOIN", "OPEN", "RoundService", "STATUS", "WAIT", "start_from_wire",
           "start_to_wire"]

_MAX_MEMBERS = 4096
_MAX_CHAIN = 64  # (outer step, hash) pairs an offer may vouch for
_MAX_ROSTER = 256


@dataclass(frozen=True)
class Holding:
    """What a trainer holds: its outer step, the hash of that outer state, and the members (with addresses) of
    the round that produced it (the candidates of the next round)."""

    step: int
    hash: str
    members: tuple[tuple[bytes, Address | None], ...]

    def to_wire(self) -> dict[str, Any]:
        return {"step": self.step, "hash": self.hash,
                "members": [[p, list(a) if a is not None else None] for p, a in self.members]}

    @classmethod
    def from_wire(cls, obj: Any) -> "Holding":
        if not isinstance(obj, dict):
            raise ValueError("status is not a map")
        step, hash_, members = _count(obj.get("step")), obj.get("hash"), obj.get("members")
        if not isinstance(hash_, str) or len(hash_) > 128:
            raise ValueError("bad hash")
        if not isinstance(members, list) or len(members) > _MAX_MEMBERS:
            raise ValueError("bad member list")
        return cls(step, hash_, tuple((_peer(m[0]), _address(m[1])) for m in members
                                      if isinstance(m, (list, tuple)) and len(m) == 2))


@dataclass(frozen=True)
class Behind:
    """The candidate asked holds a newer outer step than the round offered for: that round is over (elsewhere).
    Catch up to `holding` (the candidate `source` holds it, and so do `holding.members`), then offer again."""

    holding: Holding
    source: tuple[bytes, Address | None]


Final = Start | Late | Resync | Dropped | Behind  # a verdict a trainer acts on (anything but Queued)


# ------------------------------------------------------------------------------------------------ wire forms


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any) -> int:
    """A non-negative integer field; ValueError otherwise."""
    if not _is_int(value) or value < 0:
        raise ValueError("bad count")
    return int(value)


def _peer(value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != 20:
        raise ValueError("bad peer id")
    return bytes(value)


def _address(value: Any) -> Address | None:
    if value is None:
        return None
    if (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str) and len(value[0]) <= 255
            and _is_int(value[1]) and 0 < value[1] < 65536):
        return (value[0], int(value[1]))
    raise ValueError("bad address")


def _number(value: Any, *, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise ValueError("bad number")
    return float(value)


def start_to_wire(start: Start) -> dict[str, Any]:
    return {"step": start.step, "hash": start.hash, "reason": start.reason, "waited": start.waited,
            "window": start.window, "group_id": start.group_id, "resync": list(start.resync),
            "coordinator": [start.coordinator, list(start.coordinator_address)
                            if start.coordinator_address is not None else None], "attempt": start.attempt,
            "members": [[m.peer, list(m.address) if m.address is not None else None, m.bandwidth, m.samples,
                         m.staleness, m.weight, m.offset] for m in start.members]}


def start_from_wire(obj: Any) -> Start:
    """A start as a coordinator sent it; ValueError for anything malformed (the coordinator is then skipped)."""
    if not isinstance(obj, dict):
        raise ValueError("start is not a map")
    step, hash_, members, resync = _count(obj.get("step")), obj.get("hash"), obj.get("members"), obj.get("resync")
    if not isinstance(hash_, str) or len(hash_) > 128:
        raise ValueError("bad hash")
    if not isinstance(members, list) or not members or len(members) > _MAX_MEMBERS:
        raise ValueError("bad member list")
    if not isinstance(resync, list) or len(resync) > _MAX_MEMBERS:
        raise ValueError("bad resync list")
    admissions = []
    for item in members:
        if not isinstance(item, list) or len(item) != 7:
            raise ValueError("bad member")
        admissions.append(Admission(_peer(item[0]), _address(item[1]), _number(item[2]), _count(item[3]),
                                    _count(item[4]), _number(item[5]), _number(item[6])))
    peers = [a.peer for a in admissions]
    if peers != sorted(set(peers)):
        raise ValueError("members not sorted or repeated")
    group_id = obj.get("group_id")
    if not isinstance(group_id, (bytes, bytearray)) or not 1 <= len(group_id) <= 64:
        raise ValueError("bad group id")
    reason = obj.get("reason")
    coordinator = obj.get("coordinator")
    if not isinstance(coordinator, list) or len(coordinator) != 2:
        raise ValueError("bad coordinator")
    return Start(step, hash_, tuple(admissions), tuple(_peer(p) for p in resync),
                 reason if isinstance(reason, str) else "", _number(obj.get("waited")), _number(obj.get("window")),
                 bytes(group_id), _peer(coordinator[0]), _address(coordinator[1]), _count(obj.get("attempt", 0)))


def _verdict_to_wire(verdict: Verdict, now: float) -> dict[str, Any]:
    if isinstance(verdict, Queued):
        return {"queued": None if verdict.deadline is None else max(0.0, verdict.deadline - now)}
    if isinstance(verdict, Start):
        return {"start": start_to_wire(verdict)}
    if isinstance(verdict, Late):
        return {"late": start_to_wire(verdict.start)}
    if isinstance(verdict, Resync):
        return {"resync": start_to_wire(verdict.start)}
    return {"dropped": verdict.reason}


def _verdict_from_wire(obj: Any, now: float, peer: bytes, address: Address | None
                       ) -> Verdict | Behind | tuple[bytes, Address]:
    """A verdict of candidate `peer`, or a redirect (peer, address). ValueError when malformed."""
    if not isinstance(obj, dict) or len(obj) != 1:
        raise ValueError("answer is not a one-key map")
    (kind, value), = obj.items()
    if kind == "behind":
        return Behind(Holding.from_wire(value), (peer, address))
    if kind == "queued":
        return Queued(None if value is None else now + min(_number(value), 3600.0))
    if kind == "start":
        return start_from_wire(value)
    if kind == "late":
        return Late(start_from_wire(value))
    if kind == "resync":
        return Resync(start_from_wire(value))
    if kind == "dropped":
        return Dropped(str(value)[:300])
    if kind == "redirect" and isinstance(value, list) and len(value) == 2:
        address = _address(value[1])
        if address is None:
            raise ValueError("redirect without an address")
        return _peer(value[0]), address
    raise ValueError(f"unknown answer {kind!r}")


def _offer_from_wire(peer: bytes, args: Any) -> tuple[int, Offer, list[bytes], bool]:
    """(step, offer, skipped candidates, insist) of a join call; BadRequest when malformed."""
    try:
        if not isinstance(args, dict):
            raise ValueError("not a map")
        step, base, samples = _count(args.get("step")), _count(args.get("base")), _count(args.get("samples"))
        hash_ = args.get("hash")
        if not isinstance(hash_, str) or len(hash_) > 128:
            raise ValueError("bad hash")
        skipped = args.get("skipped", [])
        if not isinstance(skipped, list) or len(skipped) > _MAX_MEMBERS:
            raise ValueError("bad skipped list")
        chain = args.get("chain", [])
        if not isinstance(chain, list) or len(chain) > _MAX_CHAIN or not all(
                isinstance(item, list) and len(item) == 2 and isinstance(item[1], str) and len(item[1]) <= 128
                for item in chain):
            raise ValueError("bad chain")
        offer = Offer(peer, base, samples, hash_, _address(args.get("address")),
                      _number(args.get("bandwidth", 1.0)), bool(args.get("intent", False)),
                      tuple((_count(b), h) for b, h in chain))
        return step, offer, [_peer(p) for p in skipped], bool(args.get("insist", False))
    except ValueError as error:
        raise BadRequest(f"malformed round offer: {error}") from None


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

    The **roster** is every trainer of the run this one knows of (with its address and when it was last heard
    of): the owner adds what the progress records say (`note`), offers and answers carry the sender's roster,
    and a trainer that refuses connections or stays silent is suspected for a while. Every round ranks the
    whole roster (`coordinator_order`), so trainers that know the same trainers agree on the coordinator
    whatever outer step they believe the others are at.

    It learns two figures as it goes: the round trip to coordinators (`rtt`, from the answers to offers, which
    need no work), which sets `ack_timeout`; and the grace window (`grace`, from the arrival offsets that every
    start it sees carries), which it uses for the rounds it coordinates."""

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
        self.rtt = 0.0  # seconds, an exponential average of measured round trips (0: none measured yet)
        self.ack_floor = ack_floor
        self.poll_limit = poll_limit
        self.keep_rounds = keep_rounds
        self.suspect_for = suspect_for
        self.roster_ttl = roster_ttl
        self._roster: dict[bytes, tuple[Address, float]] = {}  # peer -> (address, trio time last heard of)
        self._suspects: dict[bytes, float] = {}  # peer -> trio time until which it is asked last
        self.rounds: dict[int, _Coordinated] = {}
        self._attempts: dict[int, int] = {}  # step -> attempt of the next round started for it
        self._dead: dict[int, set[bytes]] = {}  # per round: better candidates this coordinator found dead
        self._held = trio.Event()  # set (and renewed) whenever `holding()` may have changed
        self._nursery: trio.Nursery | None = None
        self.stats = {"coordinated": 0, "offers": 0, "redirects": 0, "opens_sent": 0, "lost_on_open": 0,
                      "candidates_skipped": 0, "behind_answers": 0}

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
    def ack_timeout(self) -> float:
        """How long an answer that needs no work may take: a few measured round trips, at least `ack_floor`."""
        return max(self.ack_floor, 6.0 * self.rtt)

    def _measured(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.rtt = seconds if self.rtt == 0.0 else 0.8 * self.rtt + 0.2 * seconds

    def _observe(self, verdict: Any) -> None:
        start = verdict if isinstance(verdict, Start) else getattr(verdict, "start", None)
        if isinstance(start, Start):
            self.grace.observe(start.offsets)
            for member in start.members:
                if member.address is not None:
                    self.note(member.peer, member.address)

    # ------------------------------------------------------------------------------------------ roster

    def note(self, peer: bytes, address: Address | None) -> None:
        """`peer` trains in this run and listens at `address` (a trainer nobody can call is never a candidate)."""
        peer = bytes(peer)
        if address is not None and peer != self.me:
            self._roster[peer] = (address, trio.current_time())

    def forget(self, peer: bytes) -> None:
        """`peer` left the run (it said goodbye)."""
        self._roster.pop(bytes(peer), None)

    def roster(self) -> list[tuple[bytes, Address]]:
        """The trainers of the run heard of within `roster_ttl` and not banned (me included when I listen)."""
        now = trio.current_time()
        for peer in [p for p, (_, seen) in self._roster.items() if now - seen > self.roster_ttl]:
            del self._roster[peer]
        banned = self._banned()
        members = [(p, a) for p, (a, _) in self._roster.items() if p not in banned]
        mine = self._address()
        if mine is not None:
            members.append((self.me, mine))
        return members

    def _merge_roster(self, gossip: Any) -> None:
        if not isinstance(gossip, list):
            return
        for item in gossip[:_MAX_ROSTER]:
            try:
                peer, address = _peer(item[0]), _address(item[1])
            except (ValueError, TypeError, IndexError):
                continue
            if peer not in self._roster:  # hearsay adds a trainer, never refreshes one (it must be heard itself)
                self.note(peer, address)

    def _gossip(self) -> list[list[Any]]:
        return [[p, list(a)] for p, a in self.roster()[:_MAX_ROSTER]]

    def suspect(self, peer: bytes) -> None:
        """`peer` refused a connection or did not answer in time: rank it last for `suspect_for` seconds (a
        frozen trainer whose progress record still looks live must not cost every round an ack timeout)."""
        self._suspects[bytes(peer)] = trio.current_time() + self.suspect_for

    def suspected(self, peer: bytes) -> bool:
        until = self._suspects.get(peer)
        if until is not None and until <= trio.current_time():
            del self._suspects[peer]
            return False
        return until is not None

    # ------------------------------------------------------------------------------------------ coordinator

    def _check_run(self, args: Any) -> None:
        if not isinstance(args, dict) or args.get("run") != self.run_id:
            raise BadRequest("not a round of this trainer's run")

    async def _on_join(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._check_run(args)
        return await self.join(bytes(context.peer_id), args)

    async def join(self, peer: bytes, args: Any) -> dict[str, Any]:
        """An offer from `peer` (the authenticated caller, or this trainer itself)."""
        step, offer, skipped, insist = _offer_from_wire(peer, args)
        self.stats["offers"] += 1
        if peer in self._banned():
            return {"dropped": "banned by this coordinator (its all-reduce caught it misbehaving)"}
        if peer != self.me:
            self.note(peer, offer.address)
            self._merge_roster(args.get("roster"))
        coordinated = self.rounds.get(step)
        if coordinated is None:
            holding = self._holding()
            if holding.step > step:  # round `step` is over and not mine to tell about: say where the swarm is
                self.stats["behind_answers"] += 1
                return {"behind": holding.to_wire(), "roster": self._gossip()}
            if not insist:
                redirect = await self._better_candidate(step, skipped)
                if redirect is not None:
                    self.stats["redirects"] += 1
                    return {"redirect": [redirect[0], list(redirect[1])]}
            coordinated = self._coordinate(step)
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
        return {**_verdict_to_wire(verdict, now), "roster": self._gossip()}

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

    async def _better_candidate(self, step: int, skipped: list[bytes]) -> tuple[bytes, Address] | None:
        """A candidate ranked before me that I believe alive (probing the ones the trainer could not reach, and
        the ones I suspect); None when I am the best."""
        listed = dict(self.roster())
        dead = self._dead.setdefault(step, set())
        for peer in coordinator_order(self.run_id, step, [*listed, self.me]):
            if peer == self.me:
                return None
            if peer in dead:
                continue
            address = listed[peer]
            if (peer in skipped or self.suspected(peer)) and not await self._alive(peer, address):
                dead.add(peer)
                self.suspect(peer)
                continue
            return peer, address
        return None

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
        if not _is_int(step):
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
                return _verdict_to_wire(verdict, now)
            changed = coordinated.changed
            with trio.move_on_at(limit):
                await changed.wait()

    async def _on_open_call(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._check_run(args)
        step, closes_in = args.get("step"), args.get("closes_in", 0.0)
        try:
            closes_in = min(_number(closes_in), self.policy.max_wait)
        except ValueError:
            raise BadRequest("malformed round opening") from None
        if not _is_int(step):
            raise BadRequest("malformed round opening")
        return {"coming": self._on_open(step, closes_in)}

    async def _on_status(self, context: CallContext, args: Any) -> dict[str, Any]:
        """What I hold; with `min_step`, answered once I hold at least that step or after `wait` seconds."""
        self._check_run(args)
        min_step, wait = args.get("min_step"), args.get("wait", 0.0)
        if min_step is not None and (not _is_int(min_step)
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
        """Offer `offer` for round `step` to the roster, best-ranked first, until one gives a final verdict;
        None when none could be reached before `deadline`."""
        listed = dict(self.roster())
        ranked = coordinator_order(self.run_id, step, listed)
        queue = [p for p in ranked if not self.suspected(p)] + [p for p in ranked if self.suspected(p)]
        skipped: list[bytes] = []
        failed: set[bytes] = set()
        insist = False
        while queue and trio.current_time() < deadline:
            peer = queue.pop(0)
            address = listed.get(peer)
            args = {"run": self.run_id, "step": step, "base": offer.base, "samples": offer.samples,
                    "hash": offer.hash, "address": list(offer.address) if offer.address is not None else None,
                    "bandwidth": offer.bandwidth, "intent": offer.intent, "skipped": skipped, "insist": insist,
                    "roster": self._gossip(), "chain": [list(item) for item in offer.chain]}
            try:
                verdict = await self._ask(peer, address, args, step, deadline)
            except (RPCError, ValueError) as error:
                logger.debug("round %d: candidate %s failed: %s", step, PeerID(peer).short(), error)
                self.stats["candidates_skipped"] += 1
                skipped.append(peer)
                failed.add(peer)
                if peer != self.me:
                    self.suspect(peer)
                continue
            if isinstance(verdict, tuple):  # a redirect
                target, target_address = verdict
                if target in failed:
                    insist = True  # they can reach it, I cannot: the next candidate takes me in anyway
                    continue
                listed[target] = target_address
                self.note(target, target_address)
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
        listed = dict(self.roster())
        queue = [p for p in coordinator_order(self.run_id, step, listed) if not self.suspected(p)]
        skipped: list[bytes] = []
        args = {"run": self.run_id, "step": step, "base": offer.base, "samples": offer.samples, "hash": offer.hash,
                "address": list(offer.address) if offer.address is not None else None,
                "bandwidth": offer.bandwidth, "intent": True, "skipped": skipped, "insist": False,
                "roster": self._gossip(), "chain": [list(item) for item in offer.chain]}
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
                    target, address = _peer(reply["redirect"][0]), _address(reply["redirect"][1])
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
                   deadline: float) -> Final | tuple[bytes, Address]:
        """Offer to one candidate and follow its answers until final (or a redirect)."""
        asked = trio.current_time()
        reply = await self._call(peer, address, JOIN, args, self.ack_timeout, deadline)
        if peer != self.me:
            self._measured(trio.current_time() - asked)
        if peer != self.me:
            self.note(peer, address)
        while True:
            if isinstance(reply, dict):
                self._merge_roster(reply.pop("roster", None))
            verdict = _verdict_from_wire(reply, trio.current_time(), peer, address)
            if not isinstance(verdict, Queued):
                return verdict
            # the long poll answers by the round's deadline (or the poll limit); a frozen coordinator does not
            limit = self.poll_limit
            if verdict.deadline is not None:
                limit = min(limit, max(0.0, verdict.deadline - trio.current_time()) + 0.05)
            reply = await self._call(peer, address, WAIT, {"run": self.run_id, "step": step},
                                     limit + self.ack_timeout, deadline)

    async def _call(self, peer: bytes, address: Address | None, method: str, args: dict[str, Any],
                    timeout: float, deadline: float) -> Any:
        timeout = max(0.0, min(timeout, deadline - trio.current_time()))
        if peer == self.me:  # local: no network (`wait` returns by its poll limit)
            if method == JOIN:
                return await self.join(peer, args)
            return await self.wait(peer, args["step"])
        if address is None:
            raise ValueError("a candidate without an address")
        return await self.rpc.call(address, method, args, timeout=timeout, peer_id=PeerID(peer))

    async def await_step(self, step: int, holders: Sequence[tuple[bytes, Address | None]], *,
                         deadline: float) -> Holding | None:
        """The first answer of a holder that holds at least outer step `step` (asked in parallel, long polls),
        or None by `deadline`."""
        found: list[Holding] = []
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
                            holding = Holding.from_wire(reply)
                        except (RPCError, ValueError):
                            return  # this holder is gone or lies; the others may answer
                        if holding.step < step and isinstance(reply, dict) and reply.get("void"):
                            return  # the round that would produce it failed at this holder: not coming from it
                        if holding.step >= step:
                            found.append(holding)
                            nursery.cancel_scope.cancel()
                            return

                for peer, address in reachable:
                    nursery.start_soon(ask, peer, address)
        return found[0] if found else None
