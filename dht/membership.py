"""`Membership`: joining the DHT and staying joined -- bootstrap, bucket refresh, and healing.

Joining: ping the initial peers (with retries), look ourselves up, refresh every bucket; doing both lookups is
what makes peers that joined through the same initial peers find each other (one DHT, not two).

Healing: a peer that stops answering may only be frozen (SIGSTOP, a GC pause, a suspended laptop). After
`failures_to_evict` unanswered requests it leaves the routing table (dht/requests.py), but servers that ever
answered are remembered (dht/peers.py), so the healing round re-probes them once their backoff passed and they
come back. A node with nobody to ask (empty table, or a lookup where nobody answered) logs it once and rejoins
through its initial peers and remembered servers, with capped, jittered exponential backoff. The healing round
runs in the node's periodic-task runner (`DHTNode.open`); its counters are the node's stats() healing counters.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from typing import Awaitable, Callable

import trio

from dht.config import DHTConfig
from dht.errors import BootstrapFailed
from dht.lookup_driver import LookupDriver
from dht.peers import PeerBook
from dht.routing import RoutingTable
from peer.p2p.net import Address

# the node's log: DHT lines keep the name they always had (`dht.node`), wherever the code now lives
logger = logging.getLogger("dht.node")

__all__ = ["HEALING_COUNTERS", "Membership"]

HEALING_COUNTERS = ("rebootstraps", "rebootstrap_attempts", "lookups_without_peers", "evictions",
                    "contacts_restored", "reprobes")

# ping_all(addresses, timeout, node_ids): the addresses that answered (dht/requests.py Requester.ping_all)
PingAll = Callable[[list[Address], float, dict[Address, bytes] | None], Awaitable[list[Address]]]


class Membership:
    """The node's place in the DHT: how it joins, refreshes its buckets, notices it is cut off and rejoins."""

    def __init__(self, peer_id: bytes, address: Address, *, client_mode: bool, private: bool, config: DHTConfig,
                 table: RoutingTable, peers: PeerBook, rng: random.Random, healing: Counter[str],
                 ping_all: PingAll, lookups: LookupDriver):
        self.peer_id = peer_id
        self.address = address
        self.client_mode = client_mode  # named in the cut-off warning; a promoted node (become_server) clears it
        self._private = private  # a private swarm's BootstrapFailed says a wrong swarm key may be why
        self._config = config
        self._table = table
        self._peers = peers
        self._rng = rng
        self._healing = healing  # rebootstraps, evictions, contacts restored... (see DHTNode.stats())
        self._ping_all = ping_all
        self._lookups = lookups
        self._initial_peers: list[Address] = []
        self.starved = False  # nobody to ask: the healing task rejoins (with backoff) until someone answers
        self._rejoin_failures = 0
        self._rejoin_at = -math.inf  # trio time before which no new rejoin attempt starts
        self._wakeup = trio.Event()

    # ------------------------------------------------------------------------------------------------ joining

    async def bootstrap(self, initial_peers: list[Address]) -> None:
        """Ping the initial peers (with retries); look ourselves up; refresh every bucket. Doing both lookups
        is what makes peers that joined through the same initial peers find each other (one DHT, not two)."""
        self._initial_peers = list(dict.fromkeys(initial_peers))
        if not initial_peers:
            return
        answered: list[Address] = []
        timeout = self._config.initial_timeout
        for _ in range(self._config.bootstrap_attempts):
            answered += await self._ping_all([a for a in self._initial_peers if a not in answered], timeout, None)
            if answered:
                break
            timeout = min(self._config.max_timeout, timeout * 2)
        if not answered:
            raise BootstrapFailed(initial_peers, self._config.bootstrap_attempts, private=self._private)
        await self.settle()

    async def settle(self) -> None:
        """Look ourselves up, then refresh every bucket: the peers we meet learn of us, and we of them."""
        await self._lookups.run({bytes(self.peer_id)}, want_value=False)
        await self.refresh(all_buckets=True)

    async def refresh(self, all_buckets: bool = False) -> None:
        """Look up a random id in every bucket (or only in those untouched for `refresh_interval`)."""
        now = trio.current_time()
        if all_buckets:
            ids = self._table.random_ids_per_bucket(self._rng)
        else:
            ids = self._table.stale_bucket_ids(now, self._config.refresh_interval, self._rng)
        if ids:
            await self._lookups.run(set(ids), want_value=False)

    # ------------------------------------------------------------------------------------------------ healing

    def wakeup_event(self) -> trio.Event:
        """Set when the node finds itself cut off: the periodic runner then starts a healing round at once."""
        return self._wakeup

    def rejoin_sources(self) -> list[Address]:
        """Where a node cut off from the DHT asks again: its initial peers, then every server it remembers
        (most recently answered first), bounded so that a rejoin round stays one burst of pings."""
        sources = list(self._initial_peers)
        for address, _ in self._peers.remembered():
            if len(sources) >= len(self._initial_peers) + 2 * self._config.k:
                break
            if address not in sources and address != self.address:
                sources.append(address)
        return sources

    def note_cut_off(self, reason: str) -> None:
        """Nobody answers: say so once (one log line per episode, no traceback) and wake the healing task."""
        if self.starved or not self.rejoin_sources():
            return  # already rejoining, or a DHT of one (no one was ever there to ask)
        self.starved = True
        logger.warning("DHT node %s (%s mode) is cut off: %s; rejoining through %d known peer(s) with backoff",
                       self.peer_id, "client" if self.client_mode else "server", reason,
                       len(self.rejoin_sources()))
        self._wakeup.set()

    def lookup_unanswered(self) -> None:
        """A lookup in which no peer answered: counted, and the node may be cut off (unless it is a DHT of one)."""
        if self.rejoin_sources():
            self._healing["lookups_without_peers"] += 1
            self.note_cut_off("a lookup found no peer that answers" if len(self._table) else
                              "the routing table is empty")

    async def heal(self) -> float:
        """The healing task's round: rejoin when cut off (exponential backoff, capped, jittered), otherwise
        ask failing contacts again once their backoff passed, so peers that were frozen come back."""
        self._wakeup = trio.Event()
        now = trio.current_time()
        if not len(self._table) and self.rejoin_sources():
            self.note_cut_off("the routing table is empty")
        if self.starved:
            if now < self._rejoin_at:
                return self._rejoin_at - now
            return await self._rejoin()
        await self._reprobe(now)
        return self._config.heal_interval * (0.5 + self._rng.random())

    async def _rejoin(self) -> float:
        self._healing["rebootstrap_attempts"] += 1
        sources = self.rejoin_sources()
        remembered = dict(self._peers.remembered())
        answered = await self._ping_all(sources, self._config.initial_timeout, remembered)
        if not answered:
            self._rejoin_failures += 1
            exponent = min(self._rejoin_failures - 1, 30)
            delay: float = min(self._config.rejoin_backoff_max, self._config.rejoin_backoff * 2 ** exponent)
            delay *= 0.5 + 0.5 * self._rng.random()
            self._rejoin_at = trio.current_time() + delay
            return delay
        self._healing["rebootstraps"] += 1
        logger.info("DHT node %s rejoined through %d peer(s) after %d failed attempt(s)", self.peer_id,
                    len(answered), self._rejoin_failures)
        self.starved = False
        self._rejoin_failures = 0
        self._rejoin_at = -math.inf
        await self.settle()
        return self._config.heal_interval * (0.5 + self._rng.random())

    async def _reprobe(self, now: float) -> None:
        """Ping remembered servers that left the table after failing and whose backoff passed (at most k per
        round); an answer puts them back. Ones failing and silent for `forget_after` are let go."""
        due: dict[Address, bytes] = {}
        for address, node_id in self._peers.failing_remembered():
            if node_id in self._table:
                continue
            info = self._peers.known(address)
            if (info is not None and info.answered_at is not None
                    and now - info.answered_at > self._config.forget_after):
                if address not in self._initial_peers:
                    self._peers.forget(address)
                continue
            if not self._peers.suspended(address, now) and len(due) < self._config.k:
                due[address] = node_id
        if due:
            self._healing["reprobes"] += len(due)
            await self._ping_all(list(due), self._config.max_timeout, due)
