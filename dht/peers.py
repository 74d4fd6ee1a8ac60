"""What a node learns about each peer address: round-trip times, failures, extension support, request rate.

Timeouts follow TCP's retransmission timer (RFC 6298): SRTT and RTTVAR per peer, timeout = SRTT + 4 * RTTVAR,
clamped. A peer never measured starts from what the node measured across all peers (times a safety factor), so
on a fast network a dead newcomer costs tens of milliseconds, not the stock package's fixed 5 seconds.

Failures are not a verdict: a peer that stopped answering may be frozen (SIGSTOP, a long GC pause, a laptop lid)
rather than dead. After `failures_to_evict` unanswered requests an address is suspended, not banned: it becomes
usable again after a backoff that doubles with every further failure (capped), and the book keeps remembering
the servers that ever answered us (`remembered`), so the node can ask them again once they run again.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from peer.p2p.net import Address


@dataclass
class RTTEstimator:
    srtt: float | None = None
    rttvar: float = 0.0

    def observe(self, sample: float) -> None:
        sample = max(sample, 0.0)
        if self.srtt is None:
            self.srtt, self.rttvar = sample, sample / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - sample)
            self.srtt = 0.875 * self.srtt + 0.125 * sample

    def timeout(self) -> float | None:
        return None if self.srtt is None else self.srtt + 4 * self.rttvar


@dataclass
class PeerInfo:
    rtt: RTTEstimator = field(default_factory=RTTEstimator)
    failures: int = 0  # consecutive requests that got no answer at all
    retry_at: float = -math.inf  # trio time before which a suspended address is left out of lookups
    answered_at: float | None = None  # trio time of its last answer to one of our requests
    swarmd: bool | None = None  # speaks the swarmd_* extension RPCs; None = not probed yet
    client: bool = False  # a client-mode node: never enters a routing table
    node_id: bytes | None = None
    last_seen: float = -1e18  # trio time of the last request or reply from it
    tokens: float = 0.0
    refilled_at: float | None = None


@dataclass(eq=False, kw_only=True)
class PeerBook:
    """What this node knows of the addresses it talks to: round trips, failures, request tokens, answering servers.
    A dataclass: its settings are its fields (DHTNode passes its DHTConfig's), the bookkeeping below them."""

    min_timeout: float
    max_timeout: float
    initial_timeout: float
    unknown_factor: float = 3.0
    rate: float
    burst: float
    max_peers: int = 100_000
    failures_to_evict: int = 3
    retry_backoff: float = 1.0
    retry_backoff_max: float = 6.0
    max_remembered: int = 1024
    overall: RTTEstimator = field(init=False, default_factory=RTTEstimator)
    _peers: dict[Address, PeerInfo] = field(init=False, repr=False, default_factory=dict)
    # servers that answered one of our requests, most recent last: (address -> node id). Kept apart from
    # `_peers`, which a flood of spoofed source addresses may trim, and bounded itself.
    _remembered: OrderedDict[Address, bytes] = field(init=False, repr=False, default_factory=OrderedDict)
    # addresses whose failures reached `failures_to_evict` (insertion-ordered, so iteration is deterministic):
    # the healing task looks at these every round, and scanning every remembered server for them was a
    # fifth of a 500-node churn simulation's time
    _failing: dict[Address, None] = field(init=False, repr=False, default_factory=dict)

    def get(self, address: Address) -> PeerInfo:
        info = self._peers.get(address)
        if info is None:
            if len(self._peers) >= self.max_peers:
                # forget the oldest entries: a flood of spoofed source addresses must not grow memory forever
                for stale in list(self._peers)[: self.max_peers // 10]:
                    del self._peers[stale]
                    self._failing.pop(stale, None)
            info = self._peers[address] = PeerInfo()
        return info

    def known(self, address: Address) -> PeerInfo | None:
        return self._peers.get(address)

    def observe_rtt(self, address: Address, sample: float) -> None:
        self.get(address).rtt.observe(sample)
        self.overall.observe(sample)

    def _clamp(self, value: float) -> float:
        return min(self.max_timeout, max(self.min_timeout, value))

    def timeout(self, address: Address) -> float:
        """How long to wait before treating a request to `address` as lost (for lookup pacing)."""
        info = self._peers.get(address)
        own = info.rtt.timeout() if info is not None else None
        if own is not None:
            return self._clamp(own)
        overall = self.overall.timeout()
        if overall is None:
            return self._clamp(self.initial_timeout)
        return self._clamp(self.unknown_factor * overall)

    def allow_request(self, address: Address, now: float) -> bool:
        """Token bucket per source address: `rate` requests per second, bursts up to `burst`."""
        info = self.get(address)
        if info.refilled_at is None:
            info.tokens = self.burst
        else:
            info.tokens = min(self.burst, info.tokens + (now - info.refilled_at) * self.rate)
        info.refilled_at = now
        if info.tokens < 1.0:
            return False
        info.tokens -= 1.0
        return True

    # ------------------------------------------------------------------------------------- failures and healing

    def record_failure(self, address: Address, now: float, jitter: float) -> bool:
        """A request to `address` got no answer. Returns True once the address counts as failing (then it is
        suspended until a backoff passed: `retry_backoff`, doubling per further failure, capped at
        `retry_backoff_max`; `jitter` in [0, 1) from the node's seeded rng spreads retries over [d/2, d])."""
        info = self.get(address)
        info.failures += 1
        if info.failures < self.failures_to_evict:
            return False
        self._failing[address] = None
        exponent = min(info.failures - self.failures_to_evict, 30)
        delay = min(self.retry_backoff_max, self.retry_backoff * 2 ** exponent)
        info.retry_at = now + delay * (0.5 + 0.5 * jitter)
        return True

    def record_answer(self, address: Address, now: float, node_id: bytes | None) -> bool:
        """`address` answered a request: its failures are forgiven and, when it is a server, it is remembered.
        Returns True when it was failing until now (a contact that came back)."""
        info = self.get(address)
        came_back = self.failing(address)
        self.heard_from(address, now)
        info.answered_at = now
        if node_id is not None and not info.client:
            self._remembered[address] = node_id
            self._remembered.move_to_end(address)
            while len(self._remembered) > self.max_remembered:
                self._remembered.popitem(last=False)
        return came_back

    def heard_from(self, address: Address, now: float) -> None:
        """Any request or reply from `address` shows it runs: nothing it failed before counts any more."""
        info = self.get(address)
        info.failures = 0
        self._failing.pop(address, None)
        info.retry_at = -math.inf
        info.last_seen = now

    def failing(self, address: Address) -> bool:
        info = self._peers.get(address)
        return info is not None and info.failures >= self.failures_to_evict

    def suspended(self, address: Address, now: float) -> bool:
        """Failing, and its backoff has not passed yet: lookups leave it out for now."""
        info = self._peers.get(address)
        return info is not None and info.failures >= self.failures_to_evict and now < info.retry_at

    def remembered(self) -> list[tuple[Address, bytes]]:
        """Servers that answered us, most recently answered first (candidates to rejoin through)."""
        return [(address, node_id) for address, node_id in reversed(self._remembered.items())]

    def failing_remembered(self) -> list[tuple[Address, bytes]]:
        """The remembered servers that are failing now, most recently answered first (as `remembered`)."""
        failing = [(address, self._remembered[address]) for address in self._failing if address in self._remembered]
        failing.sort(key=lambda entry: self._answered_at(entry[0]), reverse=True)
        return failing

    def _answered_at(self, address: Address) -> float:
        info = self._peers.get(address)
        return -math.inf if info is None or info.answered_at is None else info.answered_at

    def forget(self, address: Address) -> None:
        self._remembered.pop(address, None)

    def __len__(self) -> int:
        return len(self._peers)

    def count_swarmd(self) -> int:
        return sum(1 for info in self._peers.values() if info.swarmd)
