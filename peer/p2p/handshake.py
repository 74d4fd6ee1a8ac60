"""The RPC handshake as a sans-I/O state machine: an authenticated key exchange before any call.

Why an object of its own (as wsproto's handshake or h11's Connection): the handshake decides who a connection
belongs to and which keys seal it, so every malformed field, every frame out of order and every split of the
bytes must be testable without sockets, tasks or clocks. The trio driver (`peer.p2p.rpc.RPCNode._handshake`)
only writes `data_to_send()`, feeds what it reads to `receive_data`, and bounds the whole exchange with its
timeout.

Wire (version 2): both sides send at once a HELLO control frame (`framing.control_frame(HELLO, msgpack {"v": 2,
"pk": Ed25519 identity key, "eph": a fresh X25519 public key, "nonce": 32 random bytes, "listen": [host, port] |
None, "transport": "aes-256-gcm" | "plaintext"})`), and on the other's HELLO a PROOF frame: the identity key's
signature of `DOMAIN + signer's role + transcript`, where the transcript is SHA-256 over both HELLOs exactly as
sent (the initiator's first). A side is done when the other's PROOF verifies under the key its HELLO announced.

Why this is enough against a man in the middle and a replay: the transcript holds both ephemeral keys and both
fresh nonces, so a signature covers this very exchange and nothing else; whoever swaps an ephemeral key (to learn
the session keys) breaks the other side's signature, and whoever relays the HELLOs unchanged cannot compute the
X25519 secret, so every record it forges fails to open (`peer.p2p.seal`). The signer's role is signed too, so a
PROOF reflected back to its author fails. The session keys are HKDF-SHA256 of the X25519 secret with the
transcript as salt, one key per direction (`HandshakeComplete.keys`).

Both sides must agree on the transport: a `plaintext` peer (`--insecure-transport`, for trusted clusters only)
and an encrypting one refuse each other (`TransportMismatch`), so nobody falls back to plaintext by accident.
HELLO keys beyond these are ignored and still covered by the transcript: that is the room for new fields. An
ERROR control frame is the other side's refusal. The handshake reads exactly its own two frames and hands
whatever followed them on (`HandshakeComplete.leftover`: the first sealed records).

Private swarms (`--swarm-key`): a peer holding a swarm key seals its HELLO (`SEALED_HELLO` marker byte, a
random 12-byte nonce, then AES-256-GCM under a key derived from the swarm key, label `rpc-hello`; inside it says
`"private": true`), and a private *responder* sends nothing at all until the initiator's HELLO has opened under
its key. Its PROOF is `tag || signature`, the tag being HMAC-SHA256, under a key derived with label `rpc-proof`,
of the very message it signs (role and transcript); the tag is checked before the signature. What this gives: a
non-holder that dials a private peer gets no byte back (the connection closes: it learns that a TCP port is open,
nothing else, not even the PeerID); a private peer that dials a non-holder reads the non-holder's open HELLO and
fails (`SwarmKeyMismatch`), and the non-holder sees a sealed HELLO it cannot open and fails too, each knowing why;
two holders of different keys fail at the HELLO (it does not open), the dialer seeing the listener close before
its HELLO. A replayed sealed HELLO gets an attacker nowhere: the PROOF needs the identity key and the tag is bound
to this transcript. The swarm key is also mixed into the session keys (label `rpc-session`), so the records of a
private swarm are opened only by holders even if an identity key leaks. An open swarm (no key) sends exactly the
version-2 bytes it always did. On top, `allowed_peers` (`--allow-peers`) refuses any PeerID not listed
(`PeerNotAllowed`), at its HELLO, before we sign anything, with an ERROR frame telling the remote why.

After a failure, `data_to_send()` still holds what was queued before it (our PROOF when the remote's was bad, an
ERROR refusal): the driver sends it before closing, so the remote reaches its own verdict instead of seeing a
closed connection.

Failures are `HandshakeFailed` subclasses (all `RemoteProtocolError`s: the remote's doing); feeding a finished or
failed handshake is a `LocalProtocolError` (ours).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Union

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from peer.p2p import framing, seal
from peer.p2p.identity import SIGNATURE_BYTES, Identity, PeerID, SwarmKey, verify_signature
from peer.p2p.rpc_protocol import Address, LocalProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 2
DOMAIN = b"swarmd-rpc-handshake-v2|"
NONCE_BYTES = 32
EPHEMERAL_BYTES = 32
SEALED = seal.CIPHER
PLAINTEXT = "plaintext"
_KEYS_INFO = b"swarmd-rpc-v2 session keys"
PRIVATE = "private"  # the HELLO field (true) of a peer holding a swarm key
TAG_BYTES = 32
PROOF_LABEL = b"rpc-proof"
SESSION_LABEL = b"rpc-session"
HELLO_LABEL = b"rpc-hello"
SEALED_HELLO = 0xC1  # first byte of a sealed HELLO payload: a byte msgpack never uses, so no open HELLO starts so
_HELLO_NONCE_BYTES = 12
_HELLO_AAD = DOMAIN + b"hello"
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


class TransportMismatch(HandshakeFailed):
    """One side seals its frames and the other runs with `--insecure-transport`: both must agree."""


class SwarmKeyMismatch(HandshakeFailed):
    """The two sides are not in the same private swarm: one holds a swarm key and the other none, or they hold
    different keys (the remote's key proof did not verify)."""


class PeerNotAllowed(HandshakeFailed):
    """The remote proved nothing wrong, but its PeerID is not on this peer's allow list (`--allow-peers`)."""


# ------------------------------------------------------------------------------------------------------- events


class Hello(NamedTuple):
    public_key: bytes
    nonce: bytes
    listen: Address | None
    ephemeral: bytes = b""
    transport: str = SEALED
    private: bool = False  # it holds a swarm key


@dataclass(frozen=True)
class HandshakeComplete:
    """The other side is `peer_id` (it proved it holds `public_key`). `remote_listen` is the address it announced
    (None: a client-mode peer); `leftover` are the bytes that followed its PROOF, the connection's first input;
    `keys` seal the connection (None: both sides agreed on `--insecure-transport`)."""

    peer_id: PeerID
    public_key: bytes
    remote_listen: Address | None
    role: Role
    version: int
    leftover: bytes
    keys: seal.SessionKeys | None = None


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
    ephemeral, transport = hello.get("eph"), hello.get("transport")
    if not isinstance(public_key, bytes) or len(public_key) != 32:
        raise NotAPeer("hello without a valid public key")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise NotAPeer("hello without a valid nonce")
    if not isinstance(ephemeral, bytes) or len(ephemeral) != EPHEMERAL_BYTES:
        raise NotAPeer("hello without a valid ephemeral key")
    if transport not in (SEALED, PLAINTEXT):
        raise NotAPeer(f"hello with an unknown transport {str(transport)[:40]!r}")
    private = hello.get(PRIVATE, False)
    if type(private) is not bool:
        raise NotAPeer("hello with a malformed private flag")
    address: Address | None = None
    if listen is not None:
        if (not isinstance(listen, list) or len(listen) != 2 or not isinstance(listen[0], str)
                or type(listen[1]) is not int or not 0 < listen[1] < 65536):  # a bool is no port
            raise NotAPeer("hello with a malformed listen address")
        address = (listen[0], listen[1])
    return Hello(public_key, nonce, address, ephemeral, transport, private)


def transcript_hash(initiator_hello: bytes, responder_hello: bytes) -> bytes:
    """SHA-256 over both HELLO payloads exactly as sent, the initiator's first, each prefixed by its length."""
    return hashlib.sha256(b"".join([
        DOMAIN, len(initiator_hello).to_bytes(4, "little"), initiator_hello,
        len(responder_hello).to_bytes(4, "little"), responder_hello,
    ])).digest()


def proof_message(signer: Role, transcript: bytes) -> bytes:
    """What a PROOF signs: the signer's role (so a PROOF reflected to its author fails) and the transcript."""
    return DOMAIN + signer.value.encode() + b"|" + transcript


def swarm_tag(proof_key: bytes, signer: Role, transcript: bytes) -> bytes:
    """A private swarm's key proof: HMAC-SHA256 under `proof_key` (`SwarmKey.derive(PROOF_LABEL)`) of what the
    PROOF signs, so it is bound to the signer's role and to this exchange."""
    return hmac.new(proof_key, proof_message(signer, transcript), hashlib.sha256).digest()


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
    handshake before we sign anything when the remote is someone else; `secure` False is `--insecure-transport`
    (the remote must say the same); `swarm_key` makes this a private swarm's peer (only holders of the same key
    complete); `allowed_peers`, if given, refuses every other PeerID; `nonce_source(n)` gives n random bytes, for
    the nonce and the ephemeral key (tests pass a seeded one)."""

    def __init__(
        self,
        identity: Identity,
        role: Role,
        *,
        listen: Address | None = None,
        expected_peer: PeerID | None = None,
        version: int = PROTOCOL_VERSION,
        secure: bool = True,
        swarm_key: SwarmKey | None = None,
        allowed_peers: frozenset[PeerID] | None = None,
        nonce_source: Callable[[int], bytes] = os.urandom,
    ):
        if version != PROTOCOL_VERSION:
            raise LocalProtocolError(f"this build speaks protocol version {PROTOCOL_VERSION}, not {version}")
        self.identity = identity
        self.role = role
        self.expected_peer = expected_peer
        self.version = version
        self.transport = SEALED if secure else PLAINTEXT
        self.private = swarm_key is not None
        self._proof_key = swarm_key.derive(PROOF_LABEL) if swarm_key is not None else b""
        self._session_secret = swarm_key.derive(SESSION_LABEL) if swarm_key is not None else b""
        self._hello_cipher = AESGCM(swarm_key.derive(HELLO_LABEL)) if swarm_key is not None else None
        self.allowed_peers = allowed_peers
        self._nonce = nonce_source(NONCE_BYTES)
        if not isinstance(self._nonce, bytes) or len(self._nonce) != NONCE_BYTES:
            raise LocalProtocolError(f"the nonce source gave {self._nonce!r}, not {NONCE_BYTES} bytes")
        self._ephemeral = X25519PrivateKey.from_private_bytes(nonce_source(EPHEMERAL_BYTES))
        ephemeral_public = self._ephemeral.public_key().public_bytes(serialization.Encoding.Raw,
                                                                      serialization.PublicFormat.Raw)
        hello = {"v": version, "pk": identity.public_key, "eph": ephemeral_public, "nonce": self._nonce,
                 "listen": [listen[0], listen[1]] if listen else None, "transport": self.transport}
        if self.private:
            hello[PRIVATE] = True  # an open swarm's HELLO stays byte for byte what it always was
        self._hello_payload = msgpack.packb(hello, use_bin_type=True)
        if self._hello_cipher is not None:
            seal_nonce = nonce_source(_HELLO_NONCE_BYTES)
            self._hello_payload = (bytes([SEALED_HELLO]) + seal_nonce
                                   + self._hello_cipher.encrypt(seal_nonce, self._hello_payload, _HELLO_AAD))
        self._outgoing = bytearray()
        if not (self.private and role is Role.RESPONDER):  # a private listener speaks only to holders
            self._outgoing += framing.control_frame(framing.HELLO, self._hello_payload)
        self._buffer = bytearray()
        self._state = _State.WAIT_HELLO
        self._hello: Hello | None = None
        self._peer_id: PeerID | None = None
        self._transcript = b""
        self._keys: seal.SessionKeys | None = None

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
        if self._hello is None and self.role is Role.INITIATOR:  # a private listener closes on strangers
            if self.private:
                return SwarmKeyMismatch("the peer closed the connection before its hello: it holds a different "
                                        "swarm key or none (not part of this private swarm), or it went away")
            return HandshakeFailed("connection closed during handshake (before its hello; if the peer belongs to "
                                   "a private swarm, pass its --swarm-key)")
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
        sealed = payload[:1] == bytes([SEALED_HELLO])
        if sealed and self._hello_cipher is None:
            raise SwarmKeyMismatch("the peer belongs to a private swarm; pass its --swarm-key to reach it")
        if sealed:
            assert self._hello_cipher is not None
            try:
                opened = self._hello_cipher.decrypt(payload[1:1 + _HELLO_NONCE_BYTES],
                                                    payload[1 + _HELLO_NONCE_BYTES:], _HELLO_AAD)
            except (InvalidTag, ValueError):
                raise SwarmKeyMismatch("the peer holds a different swarm key (not part of this private swarm)") \
                    from None
            hello = parse_hello(opened)
            if not hello.private:
                raise NotAPeer("a sealed hello that does not say it is private")
        else:
            hello = parse_hello(payload)
        peer_id = PeerID.from_public_key(hello.public_key)
        if self.expected_peer is not None and peer_id != self.expected_peer:
            raise UnexpectedPeer(f"the peer is {peer_id.short()}, not {self.expected_peer.short()}", peer_id)
        if hello.transport != self.transport:
            raise TransportMismatch(
                "the peer runs with --insecure-transport (unencrypted) and this one encrypts; both sides must "
                "agree" if hello.transport == PLAINTEXT else
                "this peer runs with --insecure-transport (unencrypted) and the peer encrypts; both sides must "
                "agree", peer_id)
        if hello.private != self.private or sealed != self.private:
            raise SwarmKeyMismatch(
                "the peer is not part of this private swarm (it has no swarm key)" if self.private else
                "the peer belongs to a private swarm; pass its --swarm-key to reach it", peer_id)
        if self.allowed_peers is not None and peer_id not in self.allowed_peers:
            self._outgoing += framing.control_frame(framing.ERROR, b"your PeerID is not on this peer's allow list")
            raise PeerNotAllowed(f"the peer {peer_id.short()} is not on the allow list", peer_id)
        try:
            shared = self._ephemeral.exchange(X25519PublicKey.from_public_bytes(hello.ephemeral))
        except ValueError:  # a low-order point: the shared secret would be all zeros
            raise NotAPeer("hello with an unusable ephemeral key", peer_id) from None
        mine, theirs = self._hello_payload, payload
        self._transcript = (transcript_hash(mine, theirs) if self.role is Role.INITIATOR
                            else transcript_hash(theirs, mine))
        if self.transport == SEALED:
            both = HKDF(algorithm=hashes.SHA256(), length=2 * seal.KEY_BYTES, salt=self._transcript,
                        info=_KEYS_INFO).derive(shared + self._session_secret)
            to_responder, to_initiator = both[:seal.KEY_BYTES], both[seal.KEY_BYTES:]
            self._keys = (seal.SessionKeys(send=to_responder, receive=to_initiator) if self.role is Role.INITIATOR
                          else seal.SessionKeys(send=to_initiator, receive=to_responder))
        self._hello, self._peer_id = hello, peer_id
        if self.private and self.role is Role.RESPONDER:  # the initiator proved the key: now it may see our HELLO
            self._outgoing += framing.control_frame(framing.HELLO, self._hello_payload)
        proof = self.identity.sign(proof_message(self.role, self._transcript))
        if self.private:
            proof = swarm_tag(self._proof_key, self.role, self._transcript) + proof
        self._outgoing += framing.control_frame(framing.PROOF, proof)
        self._state = _State.WAIT_PROOF

    def _on_proof(self, kind: int, payload: bytes) -> HandshakeComplete:
        hello, peer_id = self._hello, self._peer_id
        assert hello is not None and peer_id is not None
        if kind != framing.PROOF:
            raise NotAPeer("not a swarmd peer: a second hello", peer_id)
        remote_role = Role.RESPONDER if self.role is Role.INITIATOR else Role.INITIATOR
        if self.private:  # the key proof first: a non-holder's signature is never even looked at
            expected = swarm_tag(self._proof_key, remote_role, self._transcript)
            if len(payload) != TAG_BYTES + SIGNATURE_BYTES or not hmac.compare_digest(payload[:TAG_BYTES], expected):
                raise SwarmKeyMismatch("the peer holds a different swarm key (not part of this private swarm)",
                                       peer_id)
            payload = payload[TAG_BYTES:]
        if not verify_signature(hello.public_key, payload, proof_message(remote_role, self._transcript)):
            raise BadProof("the peer could not prove it holds its key for this exchange", peer_id)
        self._state = _State.DONE
        leftover = bytes(self._buffer)
        self._buffer.clear()
        return HandshakeComplete(peer_id, hello.public_key, hello.listen, self.role, self.version, leftover,
                                 self._keys)
