"""The two peers of the sans-I/O handshake tests (tests/p2p/test_handshake.py, tests/p2p/test_private_handshake.py)
and the seeded nonce sources that make their bytes repeatable."""

from __future__ import annotations

import random
from typing import Callable

from peer.p2p.identity import Identity

ALICE = Identity.from_seed(b"alice")
BOB = Identity.from_seed(b"bob")


def nonces(seed: int) -> Callable[[int], bytes]:
    """A handshake's `nonce_source`: n bytes at a time from a generator seeded with `seed`."""
    rng = random.Random(seed)
    return lambda n: bytes(rng.getrandbits(8) for _ in range(n))
