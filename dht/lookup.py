"""State of iterative Kademlia lookups, without I/O: which peer to ask next for a key, and when we are done.

One `Target` per key. Candidates are ordered by XOR distance; the "window" is the k closest candidates that have
not failed or gone quiet. The driver keeps up to alpha queries active per target and starts a new one the moment
an answer arrives or a query passes its (per-peer, adaptive) soft timeout: no lockstep rounds, so one slow or
dead peer never holds back a lookup while live peers can answer. A late answer is still used if it arrives
before the request's hard timeout. The lookup is done when every peer in the window has answered.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from enum import Enum

from dht.records import Record
from peer.p2p.net import Address


class State(Enum):
    NEW = 0
    ACTIVE = 1  # asked, within its soft timeout
    SLOW = 2  # asked, past its soft timeout: no longer counted, a late answer is still welcome
    ANSWERED = 3
    FAILED = 4


@dataclass
class Candidate:
    node_id: bytes
    address: Address
    distance: int
    state: State = State.NEW


@dataclass
class Target:
    key_id: bytes
    k: int
    alpha: int
    want_value: bool = False
    quorum: int | None = None  # value lookups: stop after this many replicas answered with a value
    candidates: dict[bytes, Candidate] = field(default_factory=dict)
    order: list[tuple[int, bytes]] = field(default_factory=list)
    values: list[tuple[int, Record]] = field(default_factory=list)  # (distance of the replica, record)
    without_value: list[Candidate] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.long_id = int.from_bytes(self.key_id, "big")
        self._version = 0  # bumped on every change; the window is cached per version
        self._window: tuple[int, list[Candidate]] = (-1, [])

    def set_state(self, candidate: Candidate, state: State) -> None:
        candidate.state = state
        self._version += 1

    def add(self, node_id: bytes, address: Address) -> None:
        if node_id in self.candidates:
            return
        distance = int.from_bytes(node_id, "big") ^ self.long_id
        self.candidates[node_id] = Candidate(node_id, address, distance)
        bisect.insort(self.order, (distance, node_id))
        self._version += 1

    def window(self) -> list[Candidate]:
        if self._window[0] == self._version:
            return self._window[1]
        window = []
        for _, node_id in self.order:
            candidate = self.candidates[node_id]
            if candidate.state in (State.FAILED, State.SLOW):
                continue
            window.append(candidate)
            if len(window) >= self.k:
                break
        self._window = (self._version, window)
        return window

    def active(self) -> int:
        return sum(1 for c in self.candidates.values() if c.state is State.ACTIVE)

    def pending(self) -> bool:
        return any(c.state in (State.ACTIVE, State.SLOW) for c in self.candidates.values())

    def next_candidates(self) -> list[Candidate]:
        """Candidates to ask now (up to alpha active at once), closest first."""
        free = self.alpha - self.active()
        if free <= 0 or self.finished():
            return []
        return [c for c in self.window() if c.state is State.NEW][:free]

    def finished(self) -> bool:
        if self.want_value and self.quorum is not None and len(self.values) >= self.quorum:
            return True
        window = self.window()
        if any(c.state in (State.NEW, State.ACTIVE) for c in window):
            return False
        return bool(window) or not self.pending()

    def answered(self, limit: int | None = None) -> list[Candidate]:
        """The closest peers that answered, closest first."""
        result = []
        for _, node_id in self.order:
            candidate = self.candidates[node_id]
            if candidate.state is State.ANSWERED:
                result.append(candidate)
                if limit is not None and len(result) >= limit:
                    break
        return result

    def on_answer(self, node_id: bytes, contacts: list[tuple[bytes, str, int]], record: Record | None,
                  found_value: bool, self_id: bytes) -> None:
        candidate = self.candidates.get(node_id)
        if candidate is None:
            return
        self.set_state(candidate, State.ANSWERED)
        if found_value:
            if record is not None:
                self.values.append((candidate.distance, record))
        elif self.want_value:
            self.without_value.append(candidate)
        for contact_id, host, port in contacts:
            if contact_id != self_id:
                self.add(contact_id, (host, port))

    def on_failure(self, node_id: bytes) -> None:
        candidate = self.candidates.get(node_id)
        if candidate is not None and candidate.state is not State.ANSWERED:
            self.set_state(candidate, State.FAILED)

    def on_slow(self, node_id: bytes) -> None:
        candidate = self.candidates.get(node_id)
        if candidate is not None and candidate.state is State.ACTIVE:
            self.set_state(candidate, State.SLOW)

