"""The RPC handshake as a sans-I/O state machine: who is on the other end, proven, before any call.

Why an object of its own (as wsproto's handshake or h11's Connection): the handshake decides who a connection
belongs to, so every malformed field, every frame out of order and every split of the bytes must be testable
without sockets, tasks or clocks. The trio driver (`peer.p2p.rpc.RPCNode._handshake`) only writes
`data_to_send()`, feeds what it reads to `receive_data`, and bounds the whole exchange with its timeout. It is
also the seam for the next protocol step (a key exchange and sealed frames): that changes what this object
sends, checks and hands on in `HandshakeComplete`, not the driver.

Wire (version 1; byte-compatible with every peer of this version): both sides send at once a HELLO control frame
(`framing.control_frame(HELLO, msgpack {"v": 1, "pk": ed25519 public key, "nonce": 32 random bytes, "listen":
[host, port] | None})`), and on the other's HELLO a PROOF frame: the signature of
`DOMAIN + their nonce + our nonce`. A side is done when the other's PROOF verifies under the key its HELLO
announced, so the PeerID it derives is proven, never claimed. HELLO keys beyond these are ignored, which leaves
room for new fields; an ERROR control frame is the other side's refusal. The handshake reads exactly its own two
frames and hands whatever followed them on (`HandshakeComplete.leftover`) to the connection protocol.

Failures are `HandshakeFailed` subclasses (all `RemoteProtocolError`s: the remote's doing); feeding a finished or
failed handshake is a `LocalProtocolError` (ours).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Union

import msgpack

from peer.p2p import framing
from peer.p2p.identity import Identity, PeerID, verify_signature
from peer.p2p.rpc_protocol import Address, LocalProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 1
DOMAIN = b"swarmd-rpc-handshake-v1|"
NONCE_BYTES = 32
_MAX_FRAME_BYTES = max(framing.CHUNK_BYTES, framing.MAX_CONTROL_BYTES) + framing.TOTAL.size + framing.HEADER.size


class Role(enum.Enum):
    """Who dialed. Version 1 is symmetric; the role picks the connection's stream ids (and, in a key exchange,
    who speaks first)."""

    INITIATOR = "initiator"
    RESPONDER = "responder"


# ------------------------------------------------------------------------------------------------------ failures


class HandshakeFailed(RemoteProtocolError):
    """The remote did not complete a valid handshake. `peer_id` is set once its HELLO named a key."""

    def __init__(self, message: str, peer_id: PeerID | None = None):
        super().__init__(message)
        self.peer_id = peer_id


class NotAPeer(HandshakeFailed):
    """The bytes are not a swarmd handshake: a bad frame, a frame out of order, or an unreadable HELLO."""


class VersionMismatch(HandshakeFailed):
    """The remote speaks another protocol version (`version`: what its HELLO said)."""

    def __init__(self, message: str, version: object):
        super().__init__(message)
        self.version = version


class BadProof(HandshakeFailed):
    """The remote's PROOF does not verify under the key its HELLO announced: it does not hold that key."""


class UnexpectedPeer(HandshakeFailed):
    """The remote proved a key, but not the one of the peer we meant to reach (checked before we sign anything)."""


class HandshakeRefused(HandshakeFailed):
    """The remote sent an ERROR frame instead of finishing the handshake."""


# ------------------------------------------------------------------------------------------------------- events


class Hello(NamedTuple):
    public_key: bytes
    nonce: bytes
    listen: Address | None


@dataclass(frozen=True)
class HandshakeComplete:
    """The other side is `peer_id` (it proved it holds `public_key`). `remote_listen` is the address it announced
    (None: a client-mode peer); `leftover` are the bytes that followed its PROOF, the connection's first input."""

    peer_id: PeerID
    public_key: bytes
    remote_listen: Address | None
    role: Role
    version: int
    leftover: bytes


Event = Union[HandshakeComplete]


def parse_hello(payload: bytes) -> Hello:
    """Check a HELLO payload field by field; raises `VersionMismatch` or `NotAPeer` naming the first bad one."""
    try:
        hello = msgpack.unpackb(payload, raw=False, max_str_len=1024, max_bin_len=1024,
                                max_array_len=16, max_map_len=16)
    except Exception as error:  # msgpack raises several unrelated types for garbage
        raise NotAPeer(f"unreadable hello: {error.__class__.__name__}") from None
    if not isinstance(hello, dict):
        raise NotAPeer("unreadable hello")
    version = hello.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True and 1.0 equal 1 in Python
        raise VersionMismatch(f"protocol version {version!r}, expected {PROTOCOL_VERSION}", version)
    public_key, nonce, listen = hello.get("pk"), hello.get("nonce"), hello.get("listen")
    if not isinstance(public_key, bytes) or len(public_key) != 32:
        raise NotAPeer("hello without a valid public key")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise NotAPeer("hello without a valid nonce")
    address: Address | None = None
    if listen is not None:
        if (not isinstance(listen, list) or len(listen) != 2 or not isinstance(listen[0], str)
                or type(listen[1]) is not int or not 0 < listen[1] < 65536):  # a bool is no port
            raise NotAPeer("hello with a malformed listen address")
        address = (listen[0], listen[1])
    return Hello(public_key, nonce, address)


class _State(enum.Enum):
    WAIT_HELLO = "waiting for the remote's hello"
    WAIT_PROOF = "waiting for the remote's proof"
    DONE = "complete"
    FAILED = "failed"


class Handshake:
    """One side of one handshake. Send `data_to_send()` (the HELLO is ready at once), feed received bytes to
    `receive_data`, send again after each feed (the PROOF); it returns `[HandshakeComplete]` once the remote has
    proven its key. Send `data_to_send()` once more after completion (our PROOF may be queued with it).

    `listen` is the address announced to the remote (None: client mode); `expected_peer`, if given, fails the
    handshake before we sign anything when the remote is someone else; `nonce_source(n)` gives n random bytes
    (tests pass a seeded one)."""

    def __init__(
        self,
        identity: Identity,
        role: Role,
        *,
        listen: Address | None = None,
        expected_peer: PeerID | None = None,
        version: int = PROTOCOL_VERSION,
        nonce_source: Callable[[int], bytes] = os.urandom,
    ):
        if version != PROTOCOL_VERSION:
            raise LocalProtocolError(f"this build speaks protocol version {PROTOCOL_VERSION}, not {version}")
        self.identity = identity
        self.role = role
        self.expected_peer = expected_peer
        self.version = version
        self._nonce = nonce_source(NONCE_BYTES)
        if not isinstance(self._nonce, bytes) or len(self._nonce) != NONCE_BYTES:
            raise LocalProtocolError(f"the nonce source gave {self._nonce!r}, not {NONCE_BYTES} bytes")
        hello = msgpack.packb(
            {"v": version, "pk": identity.public_key, "nonce": self._nonce,
             "listen": [listen[0], listen[1]] if listen else None},
            use_bin_type=True,
        )
        self._outgoing = bytearray(framing.control_frame(framing.HELLO, hello))
        self._buffer = bytearray()
        self._state = _State.WAIT_HELLO
        self._hello: Hello | None = None
        self._peer_id: PeerID | None = None

    @property
    def state(self) -> str:
        return self._state.value

    @property
    def complete(self) -> bool:
        return self._state is _State.DONE

    def data_to_send(self) -> bytes:
        """Bytes to write to the remote now (empty when there is nothing)."""
        out = bytes(self._outgoing)
        self._outgoing.clear()
        return out

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Bytes from the remote, split anywhere. Raises a `HandshakeFailed` subclass on anything invalid."""
        if self._state in (_State.DONE, _State.FAILED):
            raise LocalProtocolError(f"handshake input after it {self._state.value}: the connection owns the bytes")
        self._buffer += data
        try:
            while True:
                frame = self._next_frame()
                if frame is None:
                    return []
                kind, payload = frame
                if self._state is _State.WAIT_HELLO:
                    self._on_hello(kind, payload)
                else:
                    return [self._on_proof(kind, payload)]
        except HandshakeFailed:
            self._state = _State.FAILED
            self._buffer.clear()
            raise

    def connection_closed(self) -> HandshakeFailed:
        """The remote closed the stream before finishing: the failure to raise (and the handshake is over)."""
        self._state = _State.FAILED
        return HandshakeFailed(f"connection closed during handshake ({self._state_before_close()})", self._peer_id)

    def _state_before_close(self) -> str:
        return "after its hello" if self._hello is not None else "before its hello"

    def _next_frame(self) -> tuple[int, bytes] | None:
        """One whole control frame from the buffer, checked as `framing.FrameParser` checks it; None: need more."""
        buffer = self._buffer
        if len(buffer) < framing.HEADER.size:
            return None
        length, kind, _stream_id = framing.HEADER.unpack_from(buffer)
        body = length - (framing.HEADER.size - 4)
        if body < 0 or length > _MAX_FRAME_BYTES:
            raise NotAPeer(f"not a swarmd peer: frame of {length} bytes is outside the allowed "
                           f"5..{_MAX_FRAME_BYTES}", self._peer_id)
        if kind not in (framing.HELLO, framing.PROOF, framing.ERROR):
            raise NotAPeer(f"not a swarmd peer: unexpected frame kind {kind:#x} during the handshake", self._peer_id)
        if body > framing.MAX_CONTROL_BYTES:
            raise NotAPeer("not a swarmd peer: control frame too large", self._peer_id)
        end = framing.HEADER.size + body
        if len(buffer) < end:
            return None
        payload = bytes(buffer[framing.HEADER.size:end])
        del buffer[:end]
        if kind == framing.ERROR:
            raise HandshakeRefused(f"peer refused: {payload[:200].decode('utf-8', 'replace')}", self._peer_id)
        return kind, payload

    def _on_hello(self, kind: int, payload: bytes) -> None:
        if kind != framing.HELLO:
            raise NotAPeer("not a swarmd peer: proof before hello")
        hello = parse_hello(payload)
        peer_id = PeerID.from_public_key(hello.public_key)
        if self.expected_peer is not None and peer_id != self.expected_peer:
            raise UnexpectedPeer(f"the peer is {peer_id.short()}, not {self.expected_peer.short()}", peer_id)
        self._hello, self._peer_id = hello, peer_id
        proof = self.identity.sign(DOMAIN + hello.nonce + self._nonce)
        self._outgoing += framing.control_frame(framing.PROOF, proof)
        self._state = _State.WAIT_PROOF

    def _on_proof(self, kind: int, payload: bytes) -> HandshakeComplete:
        hello, peer_id = self._hello, self._peer_id
        assert hello is not None and peer_id is not None
        if kind != framing.PROOF:
            raise NotAPeer("not a swarmd peer: a second hello", peer_id)
        if not verify_signature(hello.public_key, payload, DOMAIN + self._nonce + hello.nonce):
            raise BadProof("the peer could not prove it holds its key", peer_id)
        self._state = _State.DONE
        leftover = bytes(self._buffer)
        self._buffer.clear()
        return HandshakeComplete(peer_id, hello.public_key, hello.listen, self.role, self.version, leftover)
