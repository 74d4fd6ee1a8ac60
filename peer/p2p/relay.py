"""Circuit relays: the sans-I/O protocol core, relayed addresses, and the dialer's side of opening a circuit.

Why relays: a peer behind a home router or a campus firewall can open connections but accept none. A public peer
that it keeps a reservation with (an authenticated RPC exchange, `peer.p2p.relay_service`) splices the byte
stream of anyone who asks for a circuit to it with a stream the private peer opens to the relay on request. The
RPC handshake then runs end to end through the splice, so the relay forwards sealed records it can neither read
nor forge: a flipped byte fails the record's AEAD tag at the far end (`peer.p2p.seal`), a relay that answers
for someone else fails the handshake's `expected_peer` check.

The wire: a circuit stream opens on the relay's ordinary RPC port with `MAGIC` (8 bytes no RPC handshake begins
with: read as a frame length it is over a gigabyte), then one length-prefixed msgpack request, answered by one
length-prefixed msgpack response; after an `ok` response the stream is a raw splice. Requests:
- `{"op": "connect", "target": PeerID, "source": PeerID}` -- a dialer asks for a circuit to a reserved peer
  (`source` is only a claim, written by the requester before any authentication: it is used to refuse a
  circuit to oneself and as a hint to the target, never as the key of a limit -- those are keyed on the IP
  group the relay observes (`peer.p2p.budget`); the end-to-end handshake authenticates the dialer);
- `{"op": "accept", "token": bytes}` -- the reserved peer takes the circuit the relay offered it over its
  reservation (the token is a capability only that peer was told).
The `ok` response carries the other end's address as the relay observes it (`observed`), which is what a
direct-connection upgrade (hole punching) needs; `dial_through_relays` hands it with the stream to its caller.

Each side reads exactly the bytes of its message (`next_read_size`), never past them, so after the response the
caller holds the bare transport stream and the RPC layer's zero-copy receive path stays as it is.

Relayed addresses fit in an ordinary `Address`, so every place that publishes or dials addresses (peer
directory, expert declarations, averaging and state announcements, `RPCNode.call`) carries them unchanged:
host `relay:TARGET;RELAY@HOST:PORT;RELAY@HOST:PORT` (PeerIDs in hex, up to `MAX_RELAYS` relays tried in order),
port the first relay's port.
"""

from __future__ import annotations

import errno
import math
import struct
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, TypeVar, Union

import msgpack
import trio

from peer.p2p import budget
from peer.p2p.identity import PeerID
from peer.p2p.net import Address, Network
from peer.p2p.rpc_protocol import (
    LocalProtocolError,
    RemoteError,
    RemoteProtocolError,
    RPCError,
    remote_error,
)

MAGIC = b"SWRELAY1"
PREFIX = "relay:"
MAX_RELAYS = 3
MAX_MESSAGE_BYTES = 1024
TOKEN_BYTES = 16
LIMIT_RETRY_PAUSE = 0.25  # seconds before a dial that every relay refused for its limit tries them again
_LENGTH = struct.Struct("!I")
T = TypeVar("T")

# ------------------------------------------------------------------------------------------------------- errors


class RelayError(RemoteError, code="relay.failed"):
    """A relay refused or could not make a circuit; the subclass says why. Also sent as the error of the
    relay's RPC methods (`relay.reserve`, `relay.poll`)."""


class NoReservation(RelayError, code="relay.no_reservation"):
    """The relay holds no reservation for the target peer (or no offered circuit for the accept token)."""


class CircuitToSelf(RelayError, code="relay.self"):
    """A circuit from a peer to itself, or to the relay itself (dial the relay directly)."""


class RelayLimitReached(RelayError, code="relay.limit"):
    """The relay runs `--relay-limit` circuits (or holds as many reservations) already."""


class MalformedRequest(RelayError, code="relay.malformed"):
    """A circuit request that is not one: bad magic, bad length, bad msgpack, unknown op, bad fields."""


class RelayProtocolError(RemoteProtocolError):
    """The relay's response is not a response (a relay that speaks garbage, or not a relay at all)."""


def _error_for(code: Any, message: Any) -> RelayError:
    """A relay's refusal as its typed error; a code that is no relay error's is still a `RelayError`."""
    text = str(message)[:200]
    error = remote_error(code, text) if isinstance(code, str) else None
    return error if isinstance(error, RelayError) else RelayError(text)


# ---------------------------------------------------------------------------------------------- addresses


@dataclass(frozen=True)
class RelayedAddress:
    """`target` reached through any of `relays` (PeerID, relay's RPC address), tried in order."""

    target: PeerID
    relays: tuple[tuple[PeerID, Address], ...]

    def to_address(self) -> Address:
        if not 0 < len(self.relays) <= MAX_RELAYS:
            raise LocalProtocolError(f"a relayed address names 1 to {MAX_RELAYS} relays, not {len(self.relays)}")
        parts = [self.target.hex()] + [f"{relay.hex()}@{host}:{port}" for relay, (host, port) in self.relays]
        return (PREFIX + ";".join(parts), int(self.relays[0][1][1]))


def is_relayed(address: Address) -> bool:
    return isinstance(address[0], str) and address[0].startswith(PREFIX)


def show_address(address: Address) -> str:
    """`address` as people read it: HOST:PORT, or a relayed address as itself (its relays' ports are in it; the
    tuple's port only repeats the first one's)."""
    return str(address[0]) if is_relayed(address) else f"{address[0]}:{address[1]}"


def parse_relayed(address: Address) -> RelayedAddress:
    """The relayed address in `address`; `MalformedRequest` when it starts like one but is not."""
    host = address[0]
    if not is_relayed(address):
        raise MalformedRequest(f"{host[:60]!r} is no relayed address")
    parts = host[len(PREFIX):].split(";")
    try:
        target = PeerID(bytes.fromhex(parts[0]))
        relays = []
        for part in parts[1:]:
            relay_hex, _, where = part.partition("@")
            relay_host, _, port = where.rpartition(":")
            if not relay_host or not 0 < int(port) < 65536:
                raise ValueError(part)
            relays.append((PeerID(bytes.fromhex(relay_hex)), (relay_host, int(port))))
    except ValueError:
        raise MalformedRequest(f"malformed relayed address {host[:80]!r}") from None
    if not 0 < len(relays) <= MAX_RELAYS:
        raise MalformedRequest(f"a relayed address names 1 to {MAX_RELAYS} relays, not {len(relays)}")
    return RelayedAddress(target, tuple(relays))


# ------------------------------------------------------------------------------------------------- messages


def _encode(message: dict[str, Any], *, magic: bool) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_MESSAGE_BYTES:
        raise LocalProtocolError(f"relay message of {len(body)} bytes, the limit is {MAX_MESSAGE_BYTES}")
    return (MAGIC if magic else b"") + _LENGTH.pack(len(body)) + body


def connect_request(target: PeerID, source: PeerID) -> bytes:
    return _encode({"op": "connect", "target": bytes(target), "source": bytes(source)}, magic=True)


def accept_request(token: bytes) -> bytes:
    return _encode({"op": "accept", "token": bytes(token)}, magic=True)


def ok_response(observed: Address | None) -> bytes:
    return _encode({"ok": True, "observed": list(observed) if observed else None}, magic=False)


def error_response(error: RelayError) -> bytes:
    return _encode({"ok": False, "code": error.code, "message": error.message}, magic=False)


@dataclass(frozen=True)
class ConnectRequest:
    target: PeerID
    source: PeerID


@dataclass(frozen=True)
class AcceptRequest:
    token: bytes


@dataclass(frozen=True)
class CircuitOpened:
    """The relay spliced the circuit; `observed` is the other end's address as the relay sees it."""

    observed: Address | None


Request = Union[ConnectRequest, AcceptRequest]


class _MessageReader:
    """Reads one length-prefixed message, asking for exactly the bytes it still needs (never more)."""

    def __init__(self, prefix: bytes, malformed: Callable[[str], Exception]):
        self._prefix = prefix
        self._malformed = malformed  # the error for bytes that are no message: ours or the remote's to answer
        self._buffer = bytearray()
        self._length: int | None = None

    def next_read_size(self) -> int:
        if self._length is None:
            return len(self._prefix) + _LENGTH.size - len(self._buffer)
        return len(self._prefix) + _LENGTH.size + self._length - len(self._buffer)

    def _feed(self, data: bytes | bytearray | memoryview) -> dict[str, Any] | None:
        """Any split of the message's bytes; never bytes past its end (`next_read_size` says how many remain)."""
        head = len(self._prefix) + _LENGTH.size
        if self._length is None:
            take = head - len(self._buffer)
            self._buffer += data[:take]
            data = data[take:]
            if len(self._buffer) < head:
                return None
            if bytes(self._buffer[:len(self._prefix)]) != self._prefix:
                raise self._malformed("not a relay message (bad magic)")
            (self._length,) = _LENGTH.unpack_from(self._buffer, len(self._prefix))
            if not 0 < self._length <= MAX_MESSAGE_BYTES:
                raise self._malformed(f"message length {self._length} (1 to {MAX_MESSAGE_BYTES})")
        if len(data) > self.next_read_size():
            raise LocalProtocolError("fed bytes past the end of the message (read next_read_size() at most)")
        self._buffer += data
        if len(self._buffer) < head + self._length:
            return None
        try:
            message = msgpack.unpackb(bytes(self._buffer[head:]), raw=False, max_bin_len=MAX_MESSAGE_BYTES,
                                      max_str_len=MAX_MESSAGE_BYTES, max_array_len=8, max_map_len=8)
        except Exception as error:  # msgpack raises several unrelated types for garbage
            raise self._malformed(f"unreadable message ({error.__class__.__name__})") from None
        if not isinstance(message, dict):
            raise self._malformed("the message is no map")
        return message


class RequestReader(_MessageReader):
    """The relay's side of a circuit stream's first message: `MAGIC` already matched by the RPC node's dispatch
    is part of what this reads. Raises `MalformedRequest` (ours to answer) on anything invalid."""

    def __init__(self) -> None:
        super().__init__(MAGIC, MalformedRequest)

    def receive_data(self, data: bytes | bytearray | memoryview) -> Request | None:
        message = self._feed(data)
        if message is None:
            return None
        op = message.get("op")
        if op == "connect":
            target, source = message.get("target"), message.get("source")
            if not (isinstance(target, bytes) and len(target) == 20 and isinstance(source, bytes)
                    and len(source) == 20):
                raise MalformedRequest("connect without a 20-byte target and source PeerID")
            return ConnectRequest(PeerID(target), PeerID(source))
        if op == "accept":
            token = message.get("token")
            if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
                raise MalformedRequest(f"accept without a {TOKEN_BYTES}-byte token")
            return AcceptRequest(token)
        raise MalformedRequest(f"unknown op {str(op)[:40]!r}")


class ResponseReader(_MessageReader):
    """The dialer's (or accepter's) side: the relay's one response. Returns `CircuitOpened`, raises the relay's
    typed refusal (a `RelayError` subclass), or `RelayProtocolError` for a response that is none."""

    def __init__(self) -> None:
        super().__init__(b"", lambda message: RelayProtocolError(f"malformed relay response: {message}"))

    def receive_data(self, data: bytes | bytearray | memoryview) -> CircuitOpened | None:
        message = self._feed(data)
        if message is None:
            return None
        if message.get("ok") is True:
            observed = message.get("observed")
            if observed is None:
                return CircuitOpened(None)
            if (isinstance(observed, list) and len(observed) == 2 and isinstance(observed[0], str)
                    and type(observed[1]) is int):
                return CircuitOpened((observed[0], observed[1]))
            raise RelayProtocolError("relay response with a malformed observed address")
        if message.get("ok") is False:
            raise _error_for(message.get("code"), message.get("message", ""))
        raise RelayProtocolError("relay response without ok")


# ---------------------------------------------------------------------------------------------- relay core


class RateLimiter:
    """A token bucket over bytes: `delay(n, now)` takes n bytes and says how long to wait before sending them
    (0 within the rate). `rate` None: no limit. The burst is one second's worth, so a cap is a cap per second."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._level = rate or 0.0
        self._updated: float | None = None

    def set_rate(self, rate: float | None) -> None:
        """A new rate (a circuit's fair share changes as others start and stop); one never used starts full."""
        if self._updated is None:
            self._level = rate or 0.0
        self.rate = rate

    def delay(self, size: int, now: float) -> float:
        if not self.rate:
            return 0.0
        if self._updated is not None:
            self._level = min(self.rate, self._level + (now - self._updated) * self.rate)
        self._updated = now
        self._level -= size
        return 0.0 if self._level >= 0 else -self._level / self.rate


@dataclass(eq=False)
class Offer:
    """A circuit the relay offered a reserved peer: told over its reservation, waiting for its accept, then (same
    object) the spliced circuit until it ends."""

    token: bytes
    target: PeerID
    source: PeerID
    observed: Address | None  # the dialer, as the relay sees it
    deadline: float
    closed: bool = False  # withdrawn, or its circuit ended: its slot is free again
    group: str = "?"  # the dialer's IP group (`peer.p2p.budget.ip_group` of `observed`)
    bytes: int = 0  # relayed both ways, against `BudgetLimits.circuit_bytes`
    active: float = 0.0  # when it last relayed a byte (or was offered): eviction takes the least recently active
    evicted: str | None = None  # why the relay closed it for a newcomer (the limit), if it did


@dataclass
class _Reservation:
    polls: int = 0
    expires: float = math.inf
    offers: list[Offer] | None = None
    since: float = 0.0  # when it was first taken: older reservations keep their circuit slots at a tie
    group: str = "?"  # the IP group of the connection that took it


def _least_active(offers: Iterable[Offer]) -> Offer | None:
    """The circuit to evict from a share: the one idle longest, the oldest at a tie (`live` is in offer order).
    Not simply the oldest: a popular private peer's share holds calls in flight next to circuits that wait out
    their idle timeout, and closing one in flight fails a call that the idle one would not."""
    return min(offers, key=lambda offer: offer.active, default=None)


class CircuitMeter:
    """One circuit's byte accounting at the relay: its rate limiter (its fair share) and its offer (data cap)."""

    def __init__(self, offer: Offer | None, rate: float | None):
        self.offer = offer
        self.limiter = RateLimiter(rate)


class RelayCore:
    """What a relay decides, with no I/O: reservations (peer -> offered circuits), circuits against their limits,
    accept tokens, and each circuit's byte rate. Time comes in as `now` (seconds, any clock).

    A reservation lives while its peer has a poll outstanding and `grace` seconds after its last one ended, so a
    private peer that vanishes is forgotten within `grace`; an offer not accepted by its `deadline` is dropped
    and its dialer is told `CircuitFailed`-like `RelayError`.

    Limits (issue 40: 70 identities holding circuits left the private peer the relay serves unreachable), each
    keyed on what the relay itself knows, never on a field a requester writes: reservations per IP group of the
    reserving connection (`reservations_per_ip`; one per authenticated identity) and in total
    (`max_reservations`); circuits per reserved peer (`circuits_per_peer`, the target: authenticated by its
    reservation), per IP group of the dialer as observed (`circuits_per_ip`), and in total (`limit`, the daemon's
    `--relay-limit`). A dialer's `source` is unauthenticated and keys nothing.

    Circuits are admitted by eviction rather than refused first come: over a reserved peer's or a dialer group's
    share, the oldest circuit of that share goes; when the total is full, the newcomer takes a slot from the
    reserved peer that holds the most circuits if that one would still hold at least as many as the newcomer's
    target (max-min fairness over the relay's private peers), and at a tie only from a younger reservation -- so
    the relay keeps slots for the private peers it has served longest, and identities that appear to flood it
    take slots from each other. Each circuit carries at most `circuit_bytes`, at most `rate` bytes/s, and a fair
    share of `total_rate`: the total divided by the circuits that moved bytes in the last second, so a flood
    through some circuits leaves the others' latency alone.

    Why `limit` counts circuits in total, over every reserved peer: what bounds a relay is what each circuit costs
    it (two pumps, two splice buffers, a share of the total byte rate), which is the same whoever the circuit is
    for. Slots come back fast: an upgraded circuit closes at once and an idle one within
    `RPCNode.circuit_idle_timeout`, and a refused dialer tries the target's other relay (`dial_through_relays`)."""

    def __init__(self, peer_id: PeerID, *, limit: int, rate: float | None = None, total_rate: float | None = None,
                 max_reservations: int = 256, grace: float = 10.0, accept_timeout: float = 5.0,
                 budget_limits: budget.BudgetLimits = budget.DEFAULT_BUDGET):
        self.peer_id = peer_id
        self.limit = limit
        self.rate = rate
        self.total_rate = total_rate
        self.max_reservations = max_reservations
        self.grace = grace
        self.accept_timeout = accept_timeout
        self.circuit_bytes = budget_limits.circuit_bytes
        self.accountant = budget.Accountant({
            ("ip", "reservations"): budget_limits.reservations_per_ip, ("total", "reservations"): max_reservations,
            ("peer", "circuits"): budget_limits.circuits_per_peer, ("ip", "circuits"): budget_limits.circuits_per_ip,
            ("total", "circuits"): limit})
        self.reservations: dict[PeerID, _Reservation] = {}
        self.offers: dict[bytes, Offer] = {}  # offered, not accepted yet
        self.live: dict[bytes, Offer] = {}  # every circuit holding a slot (offered or spliced), oldest first
        self.evicted: list[Offer] = []  # closed for a newcomer: the driver ends them (`drain_evicted`)
        self._active: dict[CircuitMeter, float] = {}  # circuit -> when it last moved bytes
        self.stats = {"circuits_opened": 0, "circuits_refused": 0, "bytes_relayed": 0, "reservations": 0,
                      "requests_evicted": 0, "circuits_evicted": 0, "circuits_capped": 0,
                      "reservations_refused": 0}

    @property
    def circuits(self) -> int:
        """Spliced circuits running, plus offers waiting for their accept."""
        return len(self.live)

    # reservations
    def reserve(self, peer: PeerID, now: float, group: str = "?") -> None:
        self.expire(now)
        if peer == self.peer_id:
            raise CircuitToSelf("a relay cannot hold a reservation for itself")
        if peer not in self.reservations:
            try:
                self.accountant.take((("ip", group),), "reservations", peer=peer)
            except budget.LimitReached as refusal:
                self.stats["reservations_refused"] += 1
                raise RelayLimitReached(refusal.message) from None
            # it lives `grace` past now unless polled (a reservation never polled used to live forever)
            self.reservations[peer] = _Reservation(offers=[], since=now, group=group, expires=now + self.grace)
            self.stats["reservations"] += 1
        self.reservations[peer].expires = max(self.reservations[peer].expires, now + self.grace)

    def poll_started(self, peer: PeerID, now: float) -> list[Offer]:
        """A reserved peer waits for offers: the ones already queued are handed over at once."""
        self.expire(now)
        reservation = self.reservations.get(peer)
        if reservation is None:
            raise NoReservation("no reservation: call relay.reserve first")
        reservation.polls += 1
        reservation.expires = math.inf
        queued, reservation.offers = reservation.offers or [], []
        return queued

    def poll_ended(self, peer: PeerID, now: float) -> None:
        reservation = self.reservations.get(peer)
        if reservation is not None:
            reservation.polls -= 1
            if reservation.polls <= 0:
                reservation.expires = now + self.grace

    def take_offers(self, peer: PeerID) -> list[Offer]:
        reservation = self.reservations.get(peer)
        if reservation is None or not reservation.offers:
            return []
        queued, reservation.offers = reservation.offers, []
        return queued

    def is_reserved(self, peer: PeerID) -> bool:
        return peer in self.reservations

    # circuits
    def request_circuit(self, request: ConnectRequest, observed: Address | None, token: bytes,
                        now: float) -> Offer:
        """A dialer's connect: refused with a typed error, or an `Offer` to deliver to the target's poll (the
        circuits it displaced are in `evicted`: the driver closes them)."""
        self.expire(now)
        group = budget.ip_group(observed[0]) if observed is not None else "?"
        try:
            if request.target == self.peer_id:
                raise CircuitToSelf("a circuit to the relay itself: dial it directly")
            if request.target == request.source:
                raise CircuitToSelf("a circuit from a peer to itself")
            if request.target not in self.reservations:
                raise NoReservation(f"peer {request.target.short()} holds no reservation here")
            self._make_room(request.target, group)
        except RelayError:
            self.stats["circuits_refused"] += 1
            raise
        offer = Offer(token, request.target, request.source, observed, now + self.accept_timeout, group=group,
                      active=now)
        self.offers[token] = offer
        self.live[token] = offer
        self.accountant.add((("peer", offer.target), ("ip", group)), "circuits", 1)
        reservation = self.reservations[request.target]
        assert reservation.offers is not None
        reservation.offers.append(offer)
        return offer

    def _make_room(self, target: PeerID, group: str) -> None:
        """Evict circuits until one more to `target` from `group` fits (see the class docstring), or raise
        `RelayLimitReached` naming the limit, the target and the dialer's group."""
        scopes: tuple[budget.Scope, ...] = (("peer", target), ("ip", group))
        while (refusal := self.accountant.over(scopes, "circuits", 1)) is not None:
            scope, limit = refusal
            if scope == budget.TOTAL:
                victim = self._fair_victim(target)
            else:  # over one share: that share's least recently active circuit goes
                victim = _least_active(offer for offer in self.live.values()
                                       if (offer.target if scope[0] == "peer" else offer.group) == scope[1])
            if victim is None:
                message = self.accountant.refusal(scope, "circuits", limit, ("ip", group))
                raise RelayLimitReached(f"{message}, dialing peer {target.short()}"
                                        + (" (--relay-limit)" if scope == budget.TOTAL else ""))
            victim.evicted = (f"{scope[0]} limit" if scope != budget.TOTAL else "--relay-limit") + \
                f" {limit:g}: closed for a circuit to peer {target.short()}"
            self.withdraw(victim)
            self.evicted.append(victim)
            self.stats["circuits_evicted"] += 1

    def _fair_victim(self, target: PeerID) -> Offer | None:
        """The node is full: the oldest circuit of the reserved peer holding the most (the youngest reservation
        among equals), if it holds more than `target` would with one more, or as many and reserved later."""
        held = self.accountant.held["circuits"]
        mine = held.get(("peer", target), 0)
        since = self.reservations[target].since
        best: tuple[float, float] | None = None
        heaviest: Any = None
        for scope, amount in held.items():
            if scope[0] != "peer" or scope[1] == target:
                continue
            reservation = self.reservations.get(PeerID(scope[1]))  # type: ignore[arg-type]
            key = (amount, reservation.since if reservation is not None else math.inf)
            if best is None or key > best:
                best, heaviest = key, scope[1]
        if best is None or not (best[0] > mine + 1 or (best[0] == mine + 1 and best[1] > since)):
            return None
        return _least_active(offer for offer in self.live.values() if offer.target == heaviest)

    def drain_evicted(self) -> list[Offer]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def accept(self, request: AcceptRequest, now: float) -> Offer:
        self.expire(now)
        offer = self.offers.pop(request.token, None)
        if offer is None or offer.closed:
            raise NoReservation("no circuit offered for this token (expired, or never offered)")
        self.stats["circuits_opened"] += 1
        return offer

    def withdraw(self, offer: Offer) -> None:
        """The offer expired, its dialer gave up, its circuit ended, or it was evicted: free its slot (once,
        whatever the order these happen in)."""
        if offer.closed:
            return
        offer.closed = True
        self.offers.pop(offer.token, None)
        self.live.pop(offer.token, None)
        reservation = self.reservations.get(offer.target)
        if reservation is not None and reservation.offers and offer in reservation.offers:
            reservation.offers.remove(offer)
        self.accountant.give_back((("peer", offer.target), ("ip", offer.group)), "circuits", 1)

    def circuit_limiter(self, offer: Offer | None = None) -> CircuitMeter:
        return CircuitMeter(offer, self.rate)

    def relayed(self, size: int, circuit: CircuitMeter, now: float) -> float:
        """`size` bytes pass a circuit: the seconds to wait before forwarding them (its cap, and its fair share
        of the total: `total_rate` over the circuits active in the last second). Raises `RelayLimitReached`
        (the driver ends the circuit) once the circuit has carried `circuit_bytes`."""
        self.stats["bytes_relayed"] += size
        offer = circuit.offer
        if offer is not None:
            offer.bytes += size
            offer.active = now
            if offer.bytes > self.circuit_bytes:
                self.stats["circuits_capped"] += 1
                raise RelayLimitReached(
                    f"limit circuit_bytes={budget.describe_amount(self.circuit_bytes, 'bytes')} reached: the circuit "
                    f"to peer {offer.target.short()} from IP {offer.group} carried it")
        rate = self.rate
        if self.total_rate:
            self._active[circuit] = now
            for meter, last in list(self._active.items()):
                if now - last > 1.0:
                    del self._active[meter]
            share = self.total_rate / len(self._active)
            rate = min(rate, share) if rate else share
        circuit.limiter.set_rate(rate)
        return circuit.limiter.delay(size, now)

    def circuit_ended(self, circuit: CircuitMeter) -> None:
        self._active.pop(circuit, None)

    def expire(self, now: float) -> None:
        for offer in list(self.offers.values()):
            if offer.deadline <= now:
                self.withdraw(offer)
        for peer, reservation in list(self.reservations.items()):
            if reservation.polls <= 0 and reservation.expires <= now:
                for offer in reservation.offers or []:
                    self.withdraw(offer)
                del self.reservations[peer]
                self.accountant.give_back((("ip", reservation.group),), "reservations", 1)


# --------------------------------------------------------------------------------------------- trio helpers


async def read_message(stream: trio.abc.ReceiveStream, reader: RequestReader | ResponseReader) -> Any:
    """Feed `reader` exactly the bytes of one message from `stream` (the caller bounds the wait)."""
    while True:
        data = await stream.receive_some(reader.next_read_size())
        if not data:
            raise trio.BrokenResourceError("the stream ended inside a relay message")
        result = reader.receive_data(data)
        if result is not None:
            return result


@dataclass
class Circuit:
    """An open circuit: the raw stream to the far end through `relay`, and the far end's address as the relay
    observed it (what a hole-punching upgrade exchanges; None if the relay did not say)."""

    stream: trio.abc.Stream
    relay: PeerID
    relay_address: Address
    remote_observed: Address | None


async def connect_shareable(network: Network, address: Address) -> trio.abc.Stream:
    """A stream to `address` whose local port a hole punch may share (SO_REUSEPORT, `Network.connect_tcp_from`
    with port 0): a circuit's both ends open theirs so, because the punch leaves through the circuit's mapping.
    A network that cannot bind outbound sockets gives an ordinary stream."""
    try:
        return await network.connect_tcp_from(address, 0)
    except OSError as error:
        if error.errno != errno.EOPNOTSUPP:
            raise
    return await network.connect_tcp(address)


async def dial_through_relays(network: Network, relayed: RelayedAddress, *, source: PeerID, timeout: float,
                              establish: Callable[[Circuit], Awaitable[T]]) -> T:
    """Ask the relays of `relayed` in order for a circuit to its target and `establish` a connection on it (the
    RPC node runs its hole punch and handshake end to end there); the first relay through which both succeed
    wins. Each relay gets an equal share of the time left (the last one all of it): a relay that refuses is left
    at once, and one that hangs -- holds the request, or delays or drops the spliced bytes so the handshake never
    completes -- costs its share, not the whole dial. When every relay refused for its limit
    (`RelayLimitReached`: a busy moment, its circuits close when idle) the round is tried again after a pause
    (`LIMIT_RETRY_PAUSE`, doubling) while time is left. `establish` owns the circuit's stream once it returns;
    on its failure the stream is closed here. Raises the last relay's error: its typed `RelayError`,
    `establish`'s `RPCError` (a handshake through it failed), or `OSError` when no relay could be reached or
    none answered in its share."""
    deadline = trio.current_time() + timeout
    pause = LIMIT_RETRY_PAUSE
    while True:
        last: Exception = OSError("no relay to try")
        full = 0
        for index, (relay, address) in enumerate(relayed.relays):
            now = trio.current_time()
            if now >= deadline:
                break
            stream = None
            with trio.move_on_at(now + (deadline - now) / (len(relayed.relays) - index)):
                try:
                    stream = await connect_shareable(network, address)
                    await stream.send_all(connect_request(relayed.target, source))
                    opened = await read_message(stream, ResponseReader())
                    result = await establish(Circuit(stream, relay, address, opened.observed))
                    stream = None  # establish's now
                    return result
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
                    last = error if isinstance(error, OSError) else OSError(f"relay {relay.short()} closed the "
                                                                             "circuit")
                except (RelayError, RelayProtocolError, RPCError) as error:
                    last = error
                    full += isinstance(error, RelayLimitReached)
                if stream is not None:
                    await trio.aclose_forcefully(stream)
                continue
            if stream is not None:
                await trio.aclose_forcefully(stream)
            last = OSError(f"no circuit through relay {relay.short()} within its share of {timeout:.3g} s")
        if full < len(relayed.relays) or trio.current_time() + pause >= deadline:
            raise last
        await trio.sleep(pause)
        pause = min(2 * pause, 4 * LIMIT_RETRY_PAUSE)
