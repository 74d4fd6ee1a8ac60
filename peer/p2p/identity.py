"""Peer identities: Ed25519 key pairs whose public key hashes to the peer's id.

The PeerID is SHA-1 of the raw 32-byte public key, which also makes it the peer's Kademlia node id: a peer can
only choose its place in the DHT by grinding keys, and any signature it makes can be attributed to that place.
PeerIDs are shown as lowercase hex everywhere (logs, CLI, status).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PEER_ID_BYTES = 20
_KEY_FILE_MAGIC = b"swarmd-ed25519-v1\n"


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


def _check_private(path: Path) -> None:
    """Refuse a key file that group or others may read (as ssh does): whoever can read it can act as this peer.
    Files this module writes are 0600, so this fires only for a file copied or made by hand, or loosened later;
    fixing it is one command, losing the identity to another user is not undoable."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as error:
        raise IdentityError(f"cannot read identity file {path}: {error.strerror}") from error
    if mode & 0o077:
        raise IdentityError(f"identity file {path} is accessible by group or others (mode {mode:04o}); "
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
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(_KEY_FILE_MAGIC + self.private_bytes().hex().encode() + b"\n")
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Identity":
        path = Path(path)
        try:
            content = path.read_bytes()
        except OSError as error:
            raise IdentityError(f"cannot read identity file {path}: {error.strerror}") from error
        if not content.startswith(_KEY_FILE_MAGIC):
            raise IdentityError(f"{path} is not a swarmd identity file (missing header)")
        try:
            raw = bytes.fromhex(content[len(_KEY_FILE_MAGIC):].decode("ascii").strip())
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
