"""Peer identities: Ed25519 key pairs whose public key hashes to the peer's id.

The PeerID is SHA-1 of the raw 32-byte public key, which also makes it the peer's Kademlia node id: a peer can
only choose its place in the DHT by grinding keys, and any signature it makes can be attributed to that place.
PeerIDs are shown as lowercase hex everywhere (logs, CLI, status).

A private swarm's shared secret lives here too (`SwarmKey`): like an identity it is a key file that must stay the
owner's, and everything that proves membership (the RPC handshake, the DHT's datagram MACs) derives its own key
from it under its own label, so no two uses ever share key material. `load_peer_list` reads an `--allow-peers`
file.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PEER_ID_BYTES = 20
_KEY_FILE_MAGIC = b"swarmd-ed25519-v1\n"
SWARM_KEY_BYTES = 32
_SWARM_KEY_MAGIC = b"swarmd-swarm-key-v1\n"
_SWARM_KEY_INFO = b"swarmd swarm key|"


class IdentityError(Exception):
    """A key file that cannot be used as this peer's identity (corrupt, foreign format, unreadable)."""


class PeerID(bytes):
    """20-byte peer id; a bytes subclass so it can be used directly as a DHT node id or dict key."""

    def __new__(cls, value: bytes) -> "PeerID":
        if len(value) != PEER_ID_BYTES:
            raise ValueError(f"a PeerID is {PEER_ID_BYTES} bytes, got {len(value)}")
        return super().__new__(cls, value)

    @classmethod
    def from_public_key(cls, public_key: bytes) -> "PeerID":
        if len(public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
        return cls(hashlib.sha1(public_key).digest())

    @classmethod
    def from_hex(cls, text: str) -> "PeerID":
        try:
            return cls(bytes.fromhex(text))
        except ValueError as error:
            raise ValueError(f"not a PeerID: {text!r}") from error

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"PeerID({self.hex()[:12]}…)"

    def short(self) -> str:
        """The first 12 hex digits: enough to tell peers apart in logs and tables."""
        return self.hex()[:12]


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when `signature` is `public_key`'s Ed25519 signature of `data`; false for any malformed input."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(data))
    except (InvalidSignature, ValueError):
        return False
    return True


def _write_secret(path: Path, magic: bytes, secret: bytes) -> None:
    """`magic` and the hex of `secret` in a file readable by the owner only (0600), replacing any old file
    atomically (a crash mid-write leaves the old key, never half of a new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(magic + secret.hex().encode() + b"\n")
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)


def _read_secret(path: Path, magic: bytes, what: str, error: type[IdentityError], hint: str = "") -> bytes:
    """What follows `magic` in a key file `_write_secret` wrote (the caller decodes it); `error`, naming the file
    as `what`, when the file cannot be read or is not that kind of file (`hint` says where to get one)."""
    try:
        content = path.read_bytes()
    except OSError as reason:
        raise error(f"cannot read {what} {path}: {reason.strerror}") from reason
    if not content.startswith(magic):
        raise error(f"{path} is not a swarmd {what} (missing header{hint})")
    return content[len(magic):]


def _check_private(path: Path, what: str = "identity file") -> None:
    """Refuse a key file that group or others may read (as ssh does): whoever can read it can act as this peer.
    Files this module writes are 0600, so this fires only for a file copied or made by hand, or loosened later;
    fixing it is one command, losing the identity to another user is not undoable."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as error:
        raise IdentityError(f"cannot read {what} {path}: {error.strerror}") from error
    if mode & 0o077:
        raise IdentityError(f"{what} {path} is accessible by group or others (mode {mode:04o}); "
                            f"run `chmod 600 {path}`")


class Identity:
    """A peer's private key, its raw public key and the PeerID derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: PeerID = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        """Deterministic identity from a 32-byte seed: simulations use it so runs are reproducible."""
        return cls(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(bytes(data))

    def private_bytes(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key file readable by the owner only (0600), replacing any old file atomically."""
        _write_secret(Path(path), _KEY_FILE_MAGIC, self.private_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Identity":
        path = Path(path)
        encoded = _read_secret(path, _KEY_FILE_MAGIC, "identity file", IdentityError)
        try:
            raw = bytes.fromhex(encoded.decode("ascii").strip())
            if len(raw) != 32:
                raise ValueError("wrong key length")
            identity = cls(Ed25519PrivateKey.from_private_bytes(raw))
        except (ValueError, UnicodeDecodeError) as error:
            raise IdentityError(f"{path} is corrupt: {error}") from error
        _check_private(path)
        return identity

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> "Identity":
        """The peer's persistent identity: loaded when the file exists, generated and saved on first run."""
        if Path(path).exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return identity

    def __repr__(self) -> str:
        return f"Identity({self.peer_id.short()})"


# --------------------------------------------------------------------------------------------- private swarms


class SwarmKeyError(IdentityError):
    """A swarm key file that cannot be used (missing, corrupt, readable by others, or one that keygen would
    overwrite)."""


class SwarmKey:
    """The shared secret of a private swarm: 32 random bytes, never sent anywhere.

    Why derived keys (`derive`): the handshake's key proof and the DHT's datagram MAC are different protocols;
    HKDF with a distinct label per use means a tag from one can never be replayed as the other, and learning one
    derived key (a bug, a side channel) reveals neither the secret nor the other keys."""

    def __init__(self, secret: bytes):
        if not isinstance(secret, bytes) or len(secret) != SWARM_KEY_BYTES:
            raise ValueError(f"a swarm key is {SWARM_KEY_BYTES} bytes")
        self._secret = secret

    @classmethod
    def generate(cls) -> "SwarmKey":
        return cls(os.urandom(SWARM_KEY_BYTES))

    def derive(self, label: bytes, length: int = 32) -> bytes:
        """The key for one use of the swarm key (`label` names it, e.g. b"rpc-proof", b"dht-mac")."""
        return HKDF(algorithm=hashes.SHA256(), length=length, salt=None,
                    info=_SWARM_KEY_INFO + label).derive(self._secret)

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the key readable by the owner only (0600). An existing file is kept unless `overwrite`: losing
        a swarm's key by a repeated command cuts this peer off from its swarm, which no one can undo."""
        path = Path(path)
        if path.exists() and not overwrite:
            raise SwarmKeyError(f"{path} exists; pass --force to replace it (peers holding the old key will no "
                                f"longer reach this one)")
        _write_secret(path, _SWARM_KEY_MAGIC, self._secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "SwarmKey":
        path = Path(path)
        encoded = _read_secret(path, _SWARM_KEY_MAGIC, "swarm key file", SwarmKeyError,
                            hint="; `peer keygen --swarm-key FILE` writes one")
        try:
            key = cls(bytes.fromhex(encoded.decode("ascii").strip()))
        except (ValueError, UnicodeDecodeError):
            raise SwarmKeyError(f"{path} is corrupt: not {SWARM_KEY_BYTES} hex-encoded bytes") from None
        try:
            _check_private(path, "swarm key file")
        except IdentityError as error:
            raise SwarmKeyError(str(error)) from None
        return key

    def __repr__(self) -> str:
        return "SwarmKey(…)"  # never the secret, not even in a traceback


def load_membership(swarm_key: str | os.PathLike[str] | None, allow_peers: str | os.PathLike[str] | None
                    ) -> tuple[SwarmKey | None, frozenset[PeerID] | None]:
    """`--swarm-key FILE` and `--allow-peers FILE` as the RPC and DHT nodes take them (None: open swarm, any
    peer); the one place every command (join, status, train, dashboard, `peer.client.Swarm`) reads them."""
    return (SwarmKey.load(swarm_key) if swarm_key is not None else None,
            load_peer_list(allow_peers) if allow_peers is not None else None)


def load_peer_list(path: str | os.PathLike[str]) -> frozenset[PeerID]:
    """An `--allow-peers` file: one PeerID in hex per line; blank lines and `#` comments are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise IdentityError(f"cannot read peer list {path}: {reason}") from None
    peers: set[PeerID] = set()
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            peers.add(PeerID.from_hex(text))
        except ValueError:
            raise IdentityError(f"{path}:{number}: {text[:60]!r} is not a PeerID (40 hex digits)") from None
    return frozenset(peers)
