"""Typed DHT errors: each names the operation and, where one is involved, the peer, so a log line or a CLI
message says what failed against whom without a traceback."""

from __future__ import annotations

from typing import Sequence

from peer.p2p.net import Address


class DHTError(Exception):
    """Base class of every error the DHT raises to its caller."""

    def __init__(self, message: str, *, operation: str, peer: Address | None = None):
        super().__init__(message)
        self.operation = operation
        self.peer = peer


class BootstrapFailed(DHTError):
    """None of the initial peers answered: joining would silently start a separate DHT, so refuse instead."""

    def __init__(self, addresses: Sequence[Address], attempts: int, private: bool = False):
        tried = ", ".join(f"{host}:{port}" for host, port in addresses)
        # a private swarm's peers stay silent to anyone without their key: say so, it is the likely cause
        hint = "; only peers holding this --swarm-key answer: check that the key file is the swarm's" if private else ""
        super().__init__(
            f"DHT bootstrap failed: none of the initial peers answered after {attempts} attempt(s) each "
            f"(tried {tried}){hint}",
            operation="bootstrap",
        )
        self.addresses = list(addresses)
        self.attempts = attempts


class ValueTooLarge(DHTError):
    """The record would not fit in one datagram of the stock protocol (requests are capped at 8192 bytes)."""

    def __init__(self, size: int, limit: int, *, operation: str = "store"):
        super().__init__(f"record of {size} bytes exceeds the DHT limit of {limit} bytes", operation=operation)
        self.size = size
        self.limit = limit


class InvalidKey(DHTError):
    """Keys are str or bytes; subkeys are str, bytes or int (they travel as msgpack map keys)."""


class InvalidValue(DHTError):
    """The value cannot be encoded with msgpack (or, for a plain stock value, is not a stock value type)."""


class RequestTimeout(DHTError):
    """A peer did not answer a request within its deadline."""


class MalformedDatagram(DHTError):
    """A datagram that is not valid rpcudp framing or carries arguments of the wrong shape."""

    def __init__(self, reason: str, *, peer: Address | None = None):
        super().__init__(f"malformed datagram ({reason})", operation="receive", peer=peer)
        self.reason = reason
