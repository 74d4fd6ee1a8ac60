"""State of iterative Kademlia lookups, without I/O: which peer to ask next for a key, and when we are done.

One `Target` per key. Candidates are ordered by XOR distance; the "window" is the k closest candidates that have
not failed or gone quiet. The driver keeps up to alpha queries active per target (a frugal quick value lookup:
no more than the replicas its quorum still lacks) and starts a new one the moment an answer arrives or a query
passes its (per-peer, adaptive) soft timeout: no lockstep rounds, so one slow or dead peer never holds back a
lookup while live peers can answer. A late answer is still used if it arrives before the request's hard timeout.
The lookup is done when every peer in the window has answered.

Disjoint paths (S/Kademlia, Baumgart and Mies 2007, section 4.4): with `paths=d > 1` the lookup of one key runs
d lookups side by side that never share a peer. The starting candidates are dealt out round-robin (closest
first), and a contact learned from an answer joins the path of the peer that named it -- unless another path
already holds that id or that address, in which case it is ignored. Each path has its own window of k, its own
alpha queries in flight and its own stopping rule; the key is done when every path is. Why: a liar that answers
with made-up or colluding contacts can capture the path that asked it, but not the others, so as long as one
(for signed records) or most (for unsigned values, see records.resolve) of the d paths stay honest, the reader
gets the true value. With d=1 everything is as in plain Kademlia.
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


_IN_FLIGHT = (State.ACTIVE, State.SLOW)


@dataclass
class Candidate:
    node_id: bytes
    address: Address
    distance: int
    state: State = State.NEW
    path: int = 0  # which of the target's disjoint paths owns it


@dataclass
class Target:
    key_id: bytes
    k: int
    alpha: int
    want_value: bool = False
    quorum: int | None = None  # value lookups: a path stops after this many replicas answered with a value
    frugal: bool = False  # quick value lookups: no more queries active than replicas the quorum still lacks
    paths: int = 1  # disjoint paths (see the module docstring)
    candidates: dict[bytes, Candidate] = field(default_factory=dict)
    values: list[tuple[int, Record]] = field(default_factory=list)  # (distance of the replica, record)
    without_value: list[Candidate] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.paths < 1:
            raise ValueError("a lookup needs at least one path")
        self.long_id = int.from_bytes(self.key_id, "big")
        self._orders: list[list[tuple[int, bytes]]] = [[] for _ in range(self.paths)]
        self._addresses: set[Address] = set()  # every address some path holds (disjoint by address too)
        self._dealt = 0  # starting candidates dealt out so far (round-robin over the paths)
        self.path_values: list[list[tuple[int, Record]]] = [[] for _ in range(self.paths)]
        self._version = 0  # bumped on every change; windows are cached per version
        self._windows: list[tuple[int, list[Candidate]]] = [(-1, []) for _ in range(self.paths)]
        self._active = [0] * self.paths  # ACTIVE candidates per path
        self._in_flight = [0] * self.paths  # ACTIVE or SLOW candidates per path

    @property
    def order(self) -> list[tuple[int, bytes]]:
        """(distance, id) of every candidate, closest first (all paths)."""
        if self.paths == 1:
            return self._orders[0]
        return sorted(entry for order in self._orders for entry in order)

    def set_state(self, candidate: Candidate, state: State) -> None:
        path, old = candidate.path, candidate.state
        self._active[path] += (state is State.ACTIVE) - (old is State.ACTIVE)
        self._in_flight[path] += (state in _IN_FLIGHT) - (old in _IN_FLIGHT)
        candidate.state = state
        self._version += 1

    def add(self, node_id: bytes, address: Address, path: int | None = None) -> bool:
        """A starting candidate (`path=None`: dealt to the next path in turn) or one learned on `path`. Ignored
        (False) when some path already holds this id or address."""
        if node_id in self.candidates or (self.paths > 1 and address in self._addresses):
            return False
        if path is None:
            path = self._dealt % self.paths
            self._dealt += 1
        distance = int.from_bytes(node_id, "big") ^ self.long_id
        self.candidates[node_id] = Candidate(node_id, address, distance, path=path)
        self._addresses.add(address)
        bisect.insort(self._orders[path], (distance, node_id))
        self._version += 1
        return True

    def window(self, path: int | None = None) -> list[Candidate]:
        """The k closest candidates of `path` that neither failed nor went quiet; without a path, of all paths
        together (each path's window, merged)."""
        if path is None:
            if self.paths == 1:
                return self.window(0)
            return sorted((c for p in range(self.paths) for c in self.window(p)), key=lambda c: c.distance)
        cached = self._windows[path]
        if cached[0] == self._version:
            return cached[1]
        window = []
        for _, node_id in self._orders[path]:
            candidate = self.candidates[node_id]
            if candidate.state in (State.FAILED, State.SLOW):
                continue
            window.append(candidate)
            if len(window) >= self.k:
                break
        self._windows[path] = (self._version, window)
        return window

    def in_window(self, candidate: Candidate) -> bool:
        return candidate in self.window(candidate.path)

    def active(self, path: int = 0) -> int:
        return self._active[path]

    def pending(self) -> bool:
        return any(self._in_flight)

    def _path_pending(self, path: int) -> bool:
        return self._in_flight[path] > 0

    def next_candidates(self) -> list[Candidate]:
        """Candidates to ask now (up to alpha active at once per path), closest first within each path. A frugal
        quick value lookup keeps no more queries active than replicas its quorum still lacks: a replica that
        answers after the quorum is met was asked for nothing (in a small swarm, where every peer holds every key
        and this node's own copy counts, alpha queries for a quorum of 3 were half wasted). The price is latency
        after a crash: a query to a dead replica holds its slot until it goes quiet, where alpha queries would
        have let the live ones answer meanwhile (bench_dht's get p95 after a kill: 2 ms -> 23 ms), so only a
        caller that merges many reads anyway asks for it. A query that answers without the value, or goes quiet,
        frees its slot as before."""
        chosen: list[Candidate] = []
        for path in range(self.paths):
            free = self.alpha - self.active(path)
            if self.frugal and self.want_value and self.quorum is not None:
                free = min(free, self.quorum - len(self.path_values[path]) - self.active(path))
            if free <= 0 or self.path_finished(path):
                continue
            chosen += [c for c in self.window(path) if c.state is State.NEW][:free]
        return chosen

    def path_finished(self, path: int) -> bool:
        if self.want_value and self.quorum is not None and len(self.path_values[path]) >= self.quorum:
            return True
        window = self.window(path)
        if any(c.state in (State.NEW, State.ACTIVE) for c in window):
            return False
        return bool(window) or not self._path_pending(path)

    def finished(self) -> bool:
        return all(self.path_finished(path) for path in range(self.paths))

    def answered(self, limit: int | None = None) -> list[Candidate]:
        """The closest peers that answered (on any path), closest first."""
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
                self.path_values[candidate.path].append((candidate.distance, record))
        elif self.want_value:
            self.without_value.append(candidate)
        for contact_id, host, port in contacts:
            if contact_id != self_id:
                self.add(contact_id, (host, port), candidate.path)

    def path_records(self) -> list[list[Record]]:
        """Each path's records, closest replica first: the order `records.resolve` lets its voters vote in."""
        return [[record for _, record in sorted(values, key=lambda pair: pair[0])] for values in self.path_values]

    def add_local(self, distance: int, record: Record) -> None:
        """This node's own copy: it counts once, on every path (the reader trusts itself)."""
        self.values.append((distance, record))
        for values in self.path_values:
            values.append((distance, record))

    def on_failure(self, node_id: bytes) -> None:
        candidate = self.candidates.get(node_id)
        if candidate is not None and candidate.state is not State.ANSWERED:
            self.set_state(candidate, State.FAILED)

    def on_slow(self, node_id: bytes) -> None:
        candidate = self.candidates.get(node_id)
        if candidate is not None and candidate.state is State.ACTIVE:
            self.set_state(candidate, State.SLOW)
