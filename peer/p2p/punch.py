"""Hole punching: turn a connection that goes through someone else (a relay's circuit, any byte stream both peers
already hold) into a direct one, by a simultaneous TCP open through both NATs.

Why it works: a MASQUERADE router lets a packet in when it comes from an endpoint the inside host has sent to
from that port. If both peers connect, from the local port their side channel's NAT mapping uses, to the address
the other's mapping has (what a third peer observed), at about the same time, each router sees its own host's
SYN go out before the other's comes in, and TCP's simultaneous open makes one connection of the two attempts.
A symmetric NAT gives the punching connect a new public port, so the observed address is wrong and the attempt
fails: the caller keeps the circuit (`PunchFailed`).

The exchange, as libp2p's DCUtR, over the side channel (`u16 length | msgpack map` messages):
the initiator (the smaller peer id) sends CONNECT {observed address, nonce}, the responder answers with its own
CONNECT, and the initiator, having measured the round trip, sends SYNC {the responder's nonce} and starts dialing
half a round trip later -- when its SYNC arrives, which is when the responder starts. Both then keep trying for
`window_rtts` round trips (at least `min_window` s). The first connection on which the ordinary secure-channel
handshake (`peer.p2p.handshake`) completes with the expected peer wins; the initiator takes the handshake's
initiator role, so both ends of a simultaneous open agree. The nonce ties a SYNC to this exchange: a stale one on
a reused channel is refused.

`PunchCoordinator` is the sans-I/O core (bytes and time in, bytes and `Dial` / `PunchFailed` out); `HolePuncher`
is its trio driver and keeps the counts of direct, upgraded and relayed connections (`stats()`).

Upgrading a relay's circuit (`HolePuncher.upgrade` on the dialing side, `answer` on the accepting one): the dialer
starts the circuit with the 8 bytes `PREFIX` (so a peer that does not punch, whose first bytes are the RPC
handshake's, is told apart), then both run the exchange on the raw circuit before any RPC byte. Each end knows
the other's mapping from the relay (`Circuit.remote_observed`), not its own, so it dials that and sends it in its
CONNECT as what the relay saw. A success hands the RPC node the punched stream with its handshake done and the
circuit closes; a failure leaves the circuit clean at a message boundary and RPC runs on it as before.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import msgpack
import trio

from peer.p2p.handshake import HandshakeComplete, Role
from peer.p2p.identity import PeerID
from peer.p2p.net import TRANSPORT_ERRORS
from peer.p2p.rpc_protocol import Address, ConnectionFailed, LocalProtocolError, RemoteProtocolError

if TYPE_CHECKING:
    from peer.p2p.relay import Circuit
    from peer.p2p.rpc import RPCNode

logger = logging.getLogger(__name__)

VERSION = 1
NONCE_BYTES = 16
MAX_MESSAGE_BYTES = 1024
_LENGTH = struct.Struct(">H")
CONNECT, SYNC = "connect", "sync"
OPERATION = "punch"
RETRY_PAUSE = 0.05  # seconds before connecting again after a reset or a failed handshake
PREFIX = b"SWPUNCH1"  # a dialer's first bytes on a circuit it wants upgraded (as long as the relay's MAGIC)
UPGRADE_TIMEOUT = 2.0  # seconds for the exchange over a circuit (a dial within RPCNode.connect_timeout)
UPGRADE_WINDOW = 1.0  # seconds of dialing at least, then the circuit is kept
# seconds after a failed punch to a peer during which its next circuits are not offered one: behind a symmetric
# NAT it fails again, and each try costs the circuit up to UPGRADE_TIMEOUT before its first call
RETRY_AFTER_FAILURE = 60.0


class PunchFailed(ConnectionFailed):
    """No direct connection was made (timeout, a symmetric NAT, the side channel closed): keep the circuit."""


class PunchProtocolError(RemoteProtocolError):
    """The other side broke the punch exchange (a malformed or unexpected message)."""


@dataclass(frozen=True)
class Dial:
    """Start connecting to `address` at time `at`; keep trying until `until`."""

    address: Address
    at: float
    until: float


class _State(enum.Enum):
    EXCHANGE = "exchange"
    DIALING = "dialing"
    DONE = "done"
    FAILED = "failed"


def _address(value: Any) -> Address:
    if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and type(value[1]) is int
            and 0 < value[1] < 65536):
        return (value[0], value[1])
    raise PunchProtocolError(f"not an address: {value!r}")


class PunchCoordinator:
    """One side of one punch. Send `data_to_send()` after construction and after each `receive_data`; a `Dial`
    event says where and when to connect. Call `succeeded()` when a connection authenticated, `expire(now)` when
    the driver's clock passes `deadline` (a `PunchFailed` comes back)."""

    def __init__(self, local_peer: PeerID, remote_peer: PeerID, observed: Address, *, now: float,
                 timeout: float = 10.0, window_rtts: float = 4.0, min_window: float = 2.0,
                 nonce_source: Callable[[int], bytes] = os.urandom, remote: Address | None = None):
        """`remote`: the address to dial when known by other means (a relay observed the other end's mapping);
        None dials the address the other end sends."""
        if local_peer == remote_peer:
            raise LocalProtocolError("a peer cannot punch a hole to itself")
        self.local_peer, self.remote_peer = local_peer, remote_peer
        self.observed = observed
        self.role = Role.INITIATOR if bytes(local_peer) < bytes(remote_peer) else Role.RESPONDER
        self.window_rtts, self.min_window = window_rtts, min_window
        self.deadline = now + timeout  # for the exchange; replaced by the dial window's end once dialing
        self.nonce = nonce_source(NONCE_BYTES)
        self.remote_address: Address | None = None
        self._known_remote = remote
        self.rtt: float | None = None
        self._remote_nonce: bytes | None = None
        self._sent_connect_at: float | None = None
        self._outgoing = bytearray()
        self._buffer = bytearray()
        self._state = _State.EXCHANGE
        if self.role is Role.INITIATOR:
            self._send({"t": CONNECT, "v": VERSION, "addr": list(observed), "nonce": self.nonce}, now)

    @property
    def state(self) -> str:
        return self._state.value

    def data_to_send(self) -> bytes:
        data, self._outgoing = bytes(self._outgoing), bytearray()
        return data

    def _send(self, message: dict[str, Any], now: float) -> None:
        payload = msgpack.packb(message, use_bin_type=True)
        self._outgoing += _LENGTH.pack(len(payload)) + payload
        if message["t"] == CONNECT:
            self._sent_connect_at = now

    def receive_data(self, data: bytes | bytearray | memoryview, now: float) -> list[Dial]:
        if self._state is not _State.EXCHANGE:
            if self._state is _State.FAILED:
                raise LocalProtocolError("this punch already failed")
            return []  # messages after the exchange (none are defined) are ignored, as a relay may lag
        self._buffer += data
        events: list[Dial] = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > MAX_MESSAGE_BYTES:
                self._state = _State.FAILED
                raise PunchProtocolError(f"a punch message of {length} bytes (at most {MAX_MESSAGE_BYTES})")
            if len(self._buffer) < _LENGTH.size + length:
                break
            payload = bytes(self._buffer[_LENGTH.size:_LENGTH.size + length])
            del self._buffer[:_LENGTH.size + length]
            try:
                events += self._on_message(payload, now)
            except PunchProtocolError:
                self._state = _State.FAILED
                raise
            if self._state is not _State.EXCHANGE:
                break
        return events

    def _on_message(self, payload: bytes, now: float) -> list[Dial]:
        try:
            message = msgpack.unpackb(payload, raw=False)
        except Exception as error:
            raise PunchProtocolError(f"undecodable punch message: {error}") from None
        if not isinstance(message, dict):
            raise PunchProtocolError("a punch message is a map")
        kind = message.get("t")
        if kind == CONNECT and self._remote_nonce is None:
            if message.get("v") != VERSION:
                raise PunchProtocolError(f"punch version {message.get('v')!r}, this build speaks {VERSION}")
            nonce = message.get("nonce")
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
                raise PunchProtocolError("a CONNECT without a nonce")
            self.remote_address = _address(message.get("addr"))
            if self._known_remote is not None:
                self.remote_address = self._known_remote
            self._remote_nonce = nonce
            if self.role is Role.RESPONDER:
                self._send({"t": CONNECT, "v": VERSION, "addr": list(self.observed), "nonce": self.nonce}, now)
                return []
            assert self._sent_connect_at is not None
            self.rtt = max(now - self._sent_connect_at, 0.0)
            self._send({"t": SYNC, "nonce": nonce}, now)
            return [self._dial(now + self.rtt / 2)]
        if kind == SYNC and self.role is Role.RESPONDER and self._remote_nonce is not None:
            if message.get("nonce") != self.nonce:
                raise PunchProtocolError("a SYNC that does not echo this exchange's nonce")
            return [self._dial(now)]
        raise PunchProtocolError(f"unexpected punch message {kind!r} in state {self._state.value}"
                                 f" as {self.role.name.lower()}")

    def _dial(self, at: float) -> Dial:
        assert self.remote_address is not None
        self._state = _State.DIALING
        window = max(self.window_rtts * (self.rtt or 0.0), self.min_window)
        self.deadline = at + window
        return Dial(self.remote_address, at, self.deadline)

    def succeeded(self) -> None:
        if self._state is not _State.DIALING:
            raise LocalProtocolError(f"a punch cannot succeed in state {self._state.value}")
        self._state = _State.DONE

    def expire(self, now: float, detail: str | None = None) -> PunchFailed:
        """The deadline passed (or the driver gave up): the punch failed; the error says how far it got, and
        `detail` (the driver's last error) why."""
        if self._state is _State.DONE:
            raise LocalProtocolError("this punch already succeeded")
        stage = ("no answer on the side channel" if self._state is _State.EXCHANGE
                 else f"no direct connection to {self.remote_address} within the dial window")
        if detail:
            stage += f" (last: {detail})"
        self._state = _State.FAILED
        return PunchFailed(f"hole punch failed: {stage}", peer=self.remote_peer, address=self.remote_address,
                           method=OPERATION)


@dataclass
class Punched:
    """A direct, authenticated connection: the stream, the handshake's outcome (keys, peer) and where it goes."""

    stream: trio.abc.Stream
    handshake: HandshakeComplete
    address: Address


def local_port_of(stream: trio.abc.Stream) -> int | None:
    """The local port of a stream over a socket or the in-memory network (None for anything else)."""
    local = getattr(stream, "local_address", None)
    if local is not None:
        return int(local[1])
    sock = getattr(stream, "socket", None)
    if sock is not None:
        return int(sock.getsockname()[1])
    return None


class HolePuncher:
    """Drives punches for one RPC node (its network, identity and handshake) and counts the outcomes.

    `stats()`: `direct` connections made without help, `upgraded` circuits replaced by a punched connection,
    `relayed` circuits kept because the punch failed (or was not tried: one to the same peer failed within
    `retry_after` seconds, `skipped`), and the punch attempts themselves."""

    def __init__(self, rpc: "RPCNode", *, timeout: float = 10.0, min_window: float = 2.0,
                 retry_after: float = RETRY_AFTER_FAILURE):
        self.rpc = rpc
        self.timeout = timeout
        self.min_window = min_window
        self.retry_after = retry_after
        self.failed: dict[PeerID, float] = {}  # peer -> when the last punch to it failed
        self.counters = {"direct": 0, "upgraded": 0, "relayed": 0, "punch_attempts": 0, "punch_failures": 0}
        self.skipped = 0  # of the relayed: circuits not offered a punch (a recent one to their peer failed)

    def stats(self) -> dict[str, int]:
        """The counters; `direct` from the node's: connections opened or accepted without a circuit."""
        rpc_stats = self.rpc.stats
        direct = rpc_stats["connections_opened"] - rpc_stats["circuits_dialed"] + rpc_stats["connections_accepted"]
        return {**self.counters, "direct": max(direct, 0)}

    async def upgrade(self, circuit: "Circuit",
                      expected_peer: PeerID) -> tuple[trio.abc.Stream, HandshakeComplete] | None:
        """The dialing side (`RPCNode.upgrade_circuit`): ask for a punch on a fresh circuit; the direct stream
        and its handshake, or None (the circuit stays, usable for RPC)."""
        if circuit.remote_observed is None:  # the relay did not say where the other end is
            self.counters["relayed"] += 1
            return None
        failed_at = self.failed.get(expected_peer)
        if failed_at is not None and trio.current_time() - failed_at < self.retry_after:
            self.skipped += 1
            self.counters["relayed"] += 1
            return None
        try:
            await circuit.stream.send_all(PREFIX)
        except TRANSPORT_ERRORS:
            self.counters["relayed"] += 1
            return None
        return await self._upgrade(circuit, expected_peer)

    async def answer(self, circuit: "Circuit",
                     expected_peer: PeerID) -> tuple[trio.abc.Stream, HandshakeComplete] | None:
        """The accepting side, once the circuit's first bytes were `PREFIX`: as `upgrade`."""
        if circuit.remote_observed is None:
            self.counters["relayed"] += 1
            return None
        return await self._upgrade(circuit, expected_peer)

    async def _upgrade(self, circuit: "Circuit",
                       expected_peer: PeerID) -> tuple[trio.abc.Stream, HandshakeComplete] | None:
        assert circuit.remote_observed is not None
        try:
            punched = await self.punch(circuit.stream, circuit.remote_observed, expected_peer,
                                       remote=circuit.remote_observed)
        except (PunchFailed, PunchProtocolError) as error:
            logger.debug("circuit to %s through relay %s stays: %s", expected_peer.short(), circuit.relay.short(),
                         error)
            now = trio.current_time()
            for peer, when in list(self.failed.items()):  # bounded: only the failures still remembered
                if now - when >= self.retry_after:
                    del self.failed[peer]
            self.failed[expected_peer] = now
            return None
        self.failed.pop(expected_peer, None)
        return punched.stream, punched.handshake

    async def punch(self, side_channel: trio.abc.Stream, observed: Address, expected_peer: PeerID, *,
                    local_port: int | None = None, remote: Address | None = None) -> Punched:
        """Exchange addresses with `expected_peer` over `side_channel` (a stream both hold; the caller keeps
        owning it) and connect directly; `observed` is this side's address as a third peer sees the side
        channel's mapping, `local_port` the port to punch from (default: the side channel's own). Raises
        `PunchFailed` when no direct connection authenticated in time (the caller keeps its circuit),
        `PunchProtocolError` when the other side broke the exchange. On real sockets the side channel must have
        been opened with `Network.connect_tcp_from` (both sockets need SO_REUSEPORT to share the port).
        `remote`: the other end's address when known otherwise (see `PunchCoordinator`)."""
        self.counters["punch_attempts"] += 1
        try:
            result = await self._punch(side_channel, observed, expected_peer, local_port, remote)
        except (PunchFailed, PunchProtocolError):
            self.counters["punch_failures"] += 1
            self.counters["relayed"] += 1
            raise
        self.counters["upgraded"] += 1
        return result

    async def _punch(self, side_channel: trio.abc.Stream, observed: Address, expected_peer: PeerID,
                     local_port: int | None, remote: Address | None) -> Punched:
        port = local_port if local_port is not None else local_port_of(side_channel)
        core = PunchCoordinator(self.rpc.peer_id, expected_peer, observed, now=trio.current_time(),
                                timeout=self.timeout, min_window=self.min_window, remote=remote)
        dial: Dial | None = None
        with trio.move_on_at(core.deadline):
            try:
                await side_channel.send_all(core.data_to_send())
                while dial is None:
                    data = await side_channel.receive_some(MAX_MESSAGE_BYTES)
                    if not data:
                        break
                    events = core.receive_data(data, trio.current_time())
                    reply = core.data_to_send()
                    if reply:
                        await side_channel.send_all(reply)
                    dial = events[0] if events else None
            except TRANSPORT_ERRORS:
                pass
        if dial is None:
            raise core.expire(trio.current_time())
        punched, last_error = await self._dial(dial, port, core.role, expected_peer)
        if punched is None:
            raise core.expire(trio.current_time(), last_error)
        core.succeeded()
        return punched

    async def _dial(self, dial: Dial, port: int | None, role: Role,
                    expected_peer: PeerID) -> tuple[Punched | None, str | None]:
        """Connect again and again within the window (a reset or a refusal is retried after a pause: the other
        side may not have sent its SYN yet); the first connection whose handshake proves `expected_peer` wins.
        Returns it, or None and the last error seen. A port another socket holds without SO_REUSEPORT ends the
        attempt at once: retrying cannot help."""
        network = self.rpc.network
        last_error: str | None = None
        await trio.sleep_until(dial.at)
        with trio.move_on_at(dial.until):
            while True:
                try:
                    if port is None:
                        stream = await network.connect_tcp(dial.address)
                    else:
                        stream = await network.connect_tcp_from(dial.address, port)
                except OSError as error:
                    last_error = f"connect: {error.strerror or error}"
                    if error.errno in (errno.EADDRINUSE, errno.EOPNOTSUPP):
                        return None, f"cannot connect from port {port}: {error.strerror or error}"
                    await trio.sleep(RETRY_PAUSE)
                    continue
                try:
                    handshake = await self.rpc._handshake(stream, role, expected_peer=expected_peer)
                except ConnectionFailed as error:
                    last_error = f"handshake: {error}"
                    await trio.aclose_forcefully(stream)
                    await trio.sleep(RETRY_PAUSE)
                    continue
                return Punched(stream, handshake, dial.address), None
        return None, last_error
