"""What a node learns about each peer address: round-trip times, failures, extension support, request rate.

Timeouts follow TCP's retransmission timer (RFC 6298): SRTT and RTTVAR per peer, timeout = SRTT + 4 * RTTVAR,
clamped. A peer never measured starts from what the node measured across all peers (times a safety factor), so
on a fast network a dead newcomer costs tens of milliseconds, not the stock package's fixed 5 seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Address = tuple[str, int]


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
    swarmd: bool | None = None  # speaks the swarmd_* extension RPCs; None = not probed yet
    client: bool = False  # a client-mode node: never enters a routing table
    node_id: bytes | None = None
    last_seen: float = -1e18  # trio time of the last request or reply from it
    tokens: float = 0.0
    refilled_at: float | None = None


class PeerBook:
    def __init__(self, *, min_timeout: float, max_timeout: float, initial_timeout: float, unknown_factor: float = 3.0,
                 rate: float, burst: float, max_peers: int = 100_000):
        self.min_timeout = min_timeout
        self.max_timeout = max_timeout
        self.initial_timeout = initial_timeout
        self.unknown_factor = unknown_factor
        self.rate = rate
        self.burst = burst
        self.max_peers = max_peers
        self.overall = RTTEstimator()
        self._peers: dict[Address, PeerInfo] = {}

    def get(self, address: Address) -> PeerInfo:
        info = self._peers.get(address)
        if info is None:
            if len(self._peers) >= self.max_peers:
                # forget the oldest entries: a flood of spoofed source addresses must not grow memory forever
                for stale in list(self._peers)[: self.max_peers // 10]:
                    del self._peers[stale]
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

    def __len__(self) -> int:
        return len(self._peers)

    def count_swarmd(self) -> int:
        return sum(1 for info in self._peers.values() if info.swarmd)
