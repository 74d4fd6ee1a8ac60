"""`KeptStore`: the forward graphs an expert server keeps for the backwards its callers will send.

Why: a trainer's backward used to make the server recompute the forward (a third of a small expert's training
compute, and the largest single item of the server's profile). A caller that will come back asks the forward to
keep its graph (`"keep": true`); the reply carries a token per expert, and the backward sends the tokens back.

Why bounded, and how: a caller may never come back (it died, its step failed elsewhere, its deadline passed), so
every kept graph expires `ttl` seconds after its forward, and all of them together hold at most `max_bytes` of
activations: a new one evicts the oldest beyond that (a caller whose graph was evicted gets a recomputed backward,
the same gradients a little later, so a bound never fails a call). Tokens are per caller (the handshake's PeerID):
another peer cannot use or free someone else's graph.

Sans-I/O: the store never reads a clock; its caller passes `now` (trio's clock in the server, so MockClock tests
drive expiry).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

from moe.experts import KeptForward


@dataclass(frozen=True)
class KeptStats:
    held: int
    nbytes: int
    kept: int
    used: int
    expired: int
    evicted: int


class KeptStore:
    def __init__(self, *, max_bytes: int = 256 << 20, ttl: float = 30.0):
        if max_bytes < 0 or ttl <= 0:
            raise ValueError(f"need max_bytes >= 0 and ttl > 0, got {max_bytes}, {ttl}")
        self.max_bytes = max_bytes
        self.ttl = ttl
        # (caller, token) -> (expires at, uid, graph), oldest first: expiry and eviction pop from the front
        self._entries: collections.OrderedDict[tuple[str, int], tuple[float, str, KeptForward]] = \
            collections.OrderedDict()
        self._tokens = itertools.count(1)
        self.nbytes = 0
        self._counts = {"kept": 0, "used": 0, "expired": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, caller: str, uid: str, graph: KeptForward, now: float) -> int:
        """Keep `graph` for `caller`'s backward of expert `uid`; returns its token (0: not kept, over the budget
        on its own)."""
        self.expire(now)
        if graph.nbytes > self.max_bytes:
            graph.release()
            return 0
        while self._entries and self.nbytes + graph.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)), "evicted")
        token = next(self._tokens)
        self._entries[(caller, token)] = (now + self.ttl, uid, graph)
        self.nbytes += graph.nbytes
        self._counts["kept"] += 1
        return token

    def take(self, caller: str, uid: str, token: int, now: float) -> KeptForward | None:
        """`caller`'s graph under `token`, if it is still held and belongs to expert `uid` (removed from the store:
        a graph serves one backward)."""
        self.expire(now)
        entry = self._entries.get((caller, token))
        if entry is None or entry[1] != uid:
            return None
        del self._entries[(caller, token)]
        self.nbytes -= entry[2].nbytes
        self._counts["used"] += 1
        return entry[2]

    def expire(self, now: float) -> None:
        """Free the graphs whose backward did not come in time."""
        while self._entries:
            key, (expires, _, _) = next(iter(self._entries.items()))
            if expires > now:
                break
            self._drop(key, "expired")

    def clear(self) -> None:
        while self._entries:
            self._drop(next(iter(self._entries)), "expired")

    def _drop(self, key: tuple[str, int], why: str) -> None:
        _, _, graph = self._entries.pop(key)
        self.nbytes -= graph.nbytes
        graph.release()
        self._counts[why] += 1

    def stats(self) -> KeptStats:
        return KeptStats(held=len(self._entries), nbytes=self.nbytes, **self._counts)


__all__ = ["KeptStats", "KeptStore"]
