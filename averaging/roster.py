"""The trainers of a run that one trainer knows of: the candidates of every outer round (`averaging.rounds`).

Why a module of its own: both roles of the round service use it (a trainer offers to the roster's best-ranked
candidates, `averaging.round_client`; a coordinator looks for better-ranked ones it believes alive) and both feed
it (offers and answers carry the sender's roster), so it belongs to neither. Every round ranks the whole roster
(`averaging.quorum.coordinator_order`), so trainers that know the same trainers agree on the coordinator whatever
outer step they believe the others are at.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from averaging.round_wire import MAX_ROSTER, as_address, as_peer
from peer.p2p.net import Address


class Roster:
    """Every trainer of the run this one knows of, with its address and when it was last heard of (trio time).

    The owner adds what the progress records say (`note`), offers and answers carry the sender's roster
    (`gossip` out, `merge` in), and a trainer that refuses connections or stays silent is suspected for
    `suspect_for` seconds (`suspect`). A trainer not heard of within `ttl` seconds drops out; `banned()` ones
    are never listed, and `address()` is where this trainer listens (None: it is never a candidate)."""

    def __init__(self, me: bytes, *, address: Callable[[], Address | None], banned: Callable[[], set[bytes]],
                 ttl: float, suspect_for: float) -> None:
        self.me = me
        self._address = address
        self._banned = banned
        self.ttl = ttl
        self.suspect_for = suspect_for
        self._heard: dict[bytes, tuple[Address, float]] = {}  # peer -> (address, trio time last heard of)
        self._suspects: dict[bytes, float] = {}  # peer -> trio time until which it is asked last

    def note(self, peer: bytes, address: Address | None) -> None:
        """`peer` trains in this run and listens at `address` (a trainer nobody can call is never a candidate)."""
        peer = bytes(peer)
        if address is not None and peer != self.me:
            self._heard[peer] = (address, trio.current_time())

    def forget(self, peer: bytes) -> None:
        """`peer` left the run (it said goodbye)."""
        self._heard.pop(bytes(peer), None)

    def members(self) -> list[tuple[bytes, Address]]:
        """The trainers of the run heard of within `ttl` and not banned (me included when I listen)."""
        now = trio.current_time()
        for peer in [p for p, (_, seen) in self._heard.items() if now - seen > self.ttl]:
            del self._heard[peer]
        banned = self._banned()
        members = [(p, a) for p, (a, _) in self._heard.items() if p not in banned]
        mine = self._address()
        if mine is not None:
            members.append((self.me, mine))
        return members

    def merge(self, gossip: Any) -> None:
        """Another trainer's roster (`gossip`, as it came over the network: entries that do not parse are
        skipped)."""
        if not isinstance(gossip, list):
            return
        for item in gossip[:MAX_ROSTER]:
            try:
                peer, address = as_peer(item[0]), as_address(item[1])
            except (ValueError, TypeError, IndexError):
                continue
            if peer not in self._heard:  # hearsay adds a trainer, never refreshes one (it must be heard itself)
                self.note(peer, address)

    def gossip(self) -> list[list[Any]]:
        """This roster as offers and answers carry it."""
        return [[p, list(a)] for p, a in self.members()[:MAX_ROSTER]]

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
