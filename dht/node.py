"""DHTNode: the trio driver around the datagram protocol, routing table, lookups and record storage.

The decisions live in plain objects without I/O, and this module only moves datagrams, runs lookups and executes
their plans: `dht.protocol` frames datagrams, `dht.server.Server` answers requests, `dht.policy` decides who
enters the routing table (only senders that answered our ping: made-up ids never do), what each peer speaks,
which newcomer or reader gets which records, and how many requests one IP may send (checked before decoding).

One node owns one UDP endpoint (from any `peer.p2p.net.Network`, so the same code runs on real sockets and on the
in-memory simulator) and one nursery holding its receive loop and maintenance tasks; leaving
`DHTNode.open(...)` cancels them all and closes the socket.

Wire compatibility: requests and replies are those of kademlia 2.2.3 (see dht/protocol.py), so stock nodes can
join, store and read plain values. Our request msg ids carry a mark (opaque to rpcudp), so a node knows from any
request it receives whether the sender is a swarmd server, a swarmd client or a stock node. Extension RPCs
(`swarmd_find_many`, `swarmd_store_many`, `swarmd_store_find`) go only to peers known to speak them; a peer that
never sent us a request is asked once with `swarmd_hello` (a stock peer stays silent: a short wait, once).

Client mode: the node sends requests but answers only `swarmd_hello`; its msg ids say "client", so swarmd nodes
never add it to their routing tables. Stock nodes add any sender they hear from; they will try to contact the
client later and get no answer, which costs them a timeout (documented limitation).

Healing: a peer that stops answering may only be frozen (SIGSTOP, a GC pause, a suspended laptop). After
`failures_to_evict` unanswered requests it leaves the routing table, but its address is retried after a backoff
(doubling, capped) and servers that ever answered are remembered, so the healing task re-probes them and they come
back. A node with nobody to ask (empty table, or a lookup where nobody answered) logs it once and rejoins through
its initial peers and remembered servers, with capped, jittered exponential backoff. Maintenance and healing run
through the one periodic-task runner (`peer.p2p.periodic.run_periodic`) in the node's nursery; `stats()`
counts what healing did.

Timing: every expiration is absolute on the DHT clock (`clock`, default `time.time`); scheduling (timeouts,
refresh, republish) runs on trio's clock. Under `trio.testing.MockClock` pass `clock=trio.current_time` so records
expire in virtual time too.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import trio
from kademlia.node import Node
from kademlia.utils import digest

from dht import protocol as proto
from dht import records
from dht.errors import BootstrapFailed, InvalidValue, RequestTimeout
from dht.lookup import State, Target
from dht.peers import PeerBook
from dht.policy import (
    Admission,
    Contacts,
    Gifts,
    IPRequestLimit,
    WelcomeQueue,
    repair_gifts,
    welcome_gifts,
)
from dht.records import Record, Subkey
from dht.routing import RoutingTable, TableLimits, has_work
from dht.server import MAX_REPLY_BYTES, NO_REPLY, Server
from dht.storage import DEFAULT_MAX_BYTES, DEFAULT_MAX_TTL, DEFAULT_SHARE, DEFAULT_STOCK_TTL, LOCAL, Storage
from peer.p2p.identity import Identity, SwarmKey
from peer.p2p.lifetime import owned_nursery
from peer.p2p.net import Address, Network, RealNetwork, UDPEndpoint
from peer.p2p.periodic import run_periodic

logger = logging.getLogger(__name__)

# What one lookup query reports back: (query id, the peer asked, {key id: its answer or None})
_QueryAnswer = tuple[int, bytes, dict[bytes, Any]]

__all__ = ["DHTConfig", "DHTNode", "key_id_of", "MAX_REPLY_BYTES"]

LOOKUP_CHUNK = 48  # keys per multi-key lookup
PARALLEL_CHUNKS = 4
HEALING_COUNTERS = ("rebootstraps", "rebootstrap_attempts", "lookups_without_peers", "evictions",
                    "contacts_restored", "reprobes")


@dataclass
class DHTConfig:
    """Tunables; the defaults suit both loopback tests and a WAN swarm."""

    k: int = 20
    alpha: int = 3
    # Floor of the adaptive per-peer timeout. It only paces lookups (after it a further query starts; a late
    # answer still counts), so it can sit close to loopback RTTs: a dead peer then costs ~10 ms, not 5 s.
    min_timeout: float = 0.01
    max_timeout: float = 2.0  # ceiling of it, and the hard timeout after which a request counts as failed
    initial_timeout: float = 1.0  # for a peer when nothing has been measured yet
    probe_timeout: float = 0.25  # floor of the wait for a swarmd_hello answer (silence = stock peer)
    failures_to_evict: int = 3  # consecutive unanswered requests before a contact leaves the routing table
    # ... but a frozen peer is not dead: a failing address is asked again after this backoff, doubling with each
    # further failure up to the cap (see dht/peers.py); if it answers, it is back in the table
    retry_backoff: float = 1.0
    retry_backoff_max: float = 6.0
    forget_after: float = 600.0  # a remembered server failing and silent this long is no longer retried
    # A node with nobody to ask (empty table, or a lookup where nobody answered) rejoins through its initial peers
    # and every server it remembers, retrying after this backoff (doubling, capped, jittered)
    rejoin_backoff: float = 0.5
    rejoin_backoff_max: float = 5.0
    heal_interval: float = 1.0  # how often the healing task re-probes failing contacts whose backoff passed
    head_check_after: float = 60.0  # a full bucket pings its oldest contact only if silent this long
    lookup_timeout: float = 10.0  # a whole lookup never takes longer
    get_quorum: int = 3  # get(latest=False) stops after this many replicas answered with a value (over d paths:
    # each path after ceil(get_quorum / d))
    # Lookups over this many disjoint paths (S/Kademlia; see dht/lookup.py): a node is asked by one path at most,
    # and a get decides a key's own value by a vote of the paths (records.resolve). 1: plain Kademlia.
    disjoint_paths: int = 1
    # Routing-table limits against cheap Sybils (dht/routing.py TableLimits; None: off; loopback is exempt):
    # contacts of one IP (IPv6 /64) per bucket and per table, contacts of one bucket in one 1/8 slice of its range
    table_per_ip_bucket: int | None = 2
    table_per_ip: int | None = 10
    table_per_prefix: int | None = 10
    # Proof-of-work PeerIDs: > 0 makes this swarm's nodes leave contacts whose id lacks this many bits of work
    # out of routing tables and lookups (routing.has_work; make an identity with routing.identity_with_work)
    id_difficulty: int = 0
    bootstrap_attempts: int = 3
    refresh_interval: float = 600.0  # look up a random id in buckets untouched this long
    republish_interval: float = 1800.0  # replicas re-store held records nobody refreshed this long
    maintenance_interval: float = 30.0
    # Storage bounds and fairness (dht/storage.py): records and bytes held as a replica (bytes include ~1 KiB of
    # bookkeeping per record, so max_bytes bounds the memory), how long a never-expiring value (stock) is kept
    # after its last store, and the share of a full store one sender IP (or IPv6 /64) or this node's own client
    # may hold before its new keys are refused, and one first byte of sender node ids before its new keys only
    # replace its own records.
    max_records: int = 100_000
    max_bytes: int = DEFAULT_MAX_BYTES
    stock_ttl: float = DEFAULT_STOCK_TTL
    max_ttl: float = DEFAULT_MAX_TTL  # a stored record outlives its last store by at most this (issue 40)
    storage_share_per_ip: float = DEFAULT_SHARE
    storage_share_per_prefix: float = DEFAULT_SHARE
    requests_per_second: float = 500.0  # per source address (IP and port), after decoding
    request_burst: float = 1000.0
    # per source IP, checked on a request datagram's first byte before decoding (see policy.IPRequestLimit)
    ip_requests_per_second: float = 5000.0
    ip_request_burst: float = 10000.0
    # senders pinged back before they may enter the routing table, in flight at once (a quarter of it per IP;
    # see dht/policy.py)
    max_concurrent_probes: int = 256


@dataclass
class _StorePlan:
    """Records a store lookup carries, and which peers acknowledged each key during the lookup."""

    wire: dict[bytes, Any]
    offers: set[bytes] = field(default_factory=set)  # keys sent as protocol.OFFER items
    stored_on: dict[bytes, set[bytes]] = field(default_factory=dict)


@dataclass
class _Waiter:
    event: trio.Event
    result: Any = None
    answered: bool = False


def key_id_of(key: str | bytes) -> bytes:
    """The 160-bit DHT id of a key, as the stock package computes it (sha1 of bytes, or of str(key))."""
    key_id: bytes = digest(key)  # kademlia.utils is untyped
    return key_id


class DHTNode:
    """A Kademlia node; create it with `DHTNode.open(...)` (an async context manager owning its tasks)."""

    def __init__(self, identity: Identity, endpoint: UDPEndpoint, nursery: trio.Nursery, *, client_mode: bool,
                 clock: Callable[[], float], config: DHTConfig, rng: random.Random,
                 random_bytes: Callable[[int], bytes] = os.urandom, swarm_key: SwarmKey | None = None,
                 validator: Callable[[bytes, Record], bool] | None = None):
        if config.disjoint_paths < 1:
            raise ValueError("DHTConfig.disjoint_paths must be at least 1")
        if not client_mode and not has_work(identity.peer_id, config.id_difficulty):
            raise ValueError(f"this identity's PeerID lacks the swarm's {config.id_difficulty} bits of work "
                             "(make one with dht.routing.identity_with_work)")
        self.identity = identity
        self._validator = validator
        self.peer_id = identity.peer_id
        self.client_mode = client_mode
        self.config = config
        self._clock = clock
        self._endpoint = endpoint
        self._nursery = nursery
        self._rng = rng
        self._swarm_key = swarm_key  # a private swarm's: datagrams carry its MAC (dht/protocol.py)
        self._protocol = proto.DatagramProtocol(random_bytes=random_bytes,
                                                flags=proto.FLAG_CLIENT if client_mode else 0, swarm_key=swarm_key)
        self._waiters: dict[bytes, _Waiter] = {}
        self._dropped: Counter[str] = Counter()
        limits = TableLimits(config.table_per_ip_bucket, config.table_per_ip, config.table_per_prefix,
                             difficulty=config.id_difficulty)
        self._table = RoutingTable(self.peer_id, config.k, trio.current_time(), limits, refused=self._dropped)
        self._peers = PeerBook(min_timeout=config.min_timeout, max_timeout=config.max_timeout,
                               initial_timeout=config.initial_timeout, rate=config.requests_per_second,
                               burst=config.request_burst, failures_to_evict=config.failures_to_evict,
                               retry_backoff=config.retry_backoff, retry_backoff_max=config.retry_backoff_max)
        self._storage = Storage(config.max_records, config.max_bytes, stock_ttl=config.stock_ttl,
                                ip_share=config.storage_share_per_ip, prefix_share=config.storage_share_per_prefix,
                                max_ttl=config.max_ttl)
        self._served: Counter[str] = Counter()
        self._contacts = Contacts(self.peer_id, self._table, self._peers, client_mode=client_mode,
                                  head_check_after=config.head_check_after,
                                  max_verifications=config.max_concurrent_probes,
                                  verify_backoff=config.retry_backoff_max, dropped=self._dropped)
        self._server = Server(self.peer_id, client_mode=client_mode, k=config.k, table=self._table,
                              peers=self._peers, storage=self._storage, contacts=self._contacts,
                              dropped=self._dropped, served=self._served)
        self._ip_limit = IPRequestLimit(config.ip_requests_per_second, config.ip_request_burst)
        self._probes: dict[Address, trio.Event] = {}  # swarmd_hello in flight, per address
        self._welcomes = WelcomeQueue()
        self._initial_peers: list[Address] = []
        self._healing: Counter[str] = Counter()  # rebootstraps, evictions, contacts restored... (see stats())
        self._starved = False  # nobody to ask: the healing task rejoins (with backoff) until someone answers
        self._rejoin_failures = 0
        self._rejoin_at = -math.inf  # trio time before which no new rejoin attempt starts
        self._network: Network | None = None  # set by `open`: fresh sockets for dial-backs
        self._heal_wakeup = trio.Event()

    # ------------------------------------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def open(cls, host: str, port: int, initial_peers: Sequence[Address] = (), *,
                   identity: Identity | None = None, network: Network | None = None, client_mode: bool = False,
                   clock: Callable[[], float] = time.time, config: DHTConfig | None = None,
                   seed: int | None = None, swarm_key: SwarmKey | None = None,
                   validator: Callable[[bytes, Record], bool] | None = None) -> AsyncIterator["DHTNode"]:
        """Bind UDP host:port, join through `initial_peers` (none: start a new DHT), serve until the block ends.
        With `swarm_key` the node is part of that private swarm only (every datagram MACed, others dropped).

        `validator(key_id, record)` is asked about every record a lookup receives (after its signatures were
        checked, dht/records.decode): a record it refuses counts as no value (stats()["dropped"]["rejected_record"]).
        Raises BootstrapFailed when initial peers were given and none of them answered."""
        network = network or RealNetwork()
        identity = identity or Identity.generate()
        config = config or DHTConfig()
        # A seed makes simulations reproducible (msg ids included); real nodes draw msg ids from os.urandom so
        # that nobody can predict them.
        rng = random.Random(seed if seed is not None else bytes(identity.peer_id))
        random_bytes = os.urandom if seed is None else (lambda n: rng.getrandbits(8 * n).to_bytes(n, "big"))
        endpoint = await network.open_udp(host, port)
        async with endpoint, owned_nursery() as nursery:
            node = cls(identity, endpoint, nursery, client_mode=client_mode, clock=clock, config=config, rng=rng,
                       random_bytes=random_bytes, swarm_key=swarm_key, validator=validator)
            node._network = network
            nursery.start_soon(node._receive_loop)
            await node._bootstrap([(h, p) for h, p in initial_peers])
            # the one periodic-task runner: each step returns the delay to its next round; a failed round is
            # logged once per kind (with its traceback: any exception here is a bug), counted, and retried later
            for step, name, first, wake in ((node._maintain, "DHT maintenance", node._maintenance_delay(), None),
                                            (node._heal, "DHT healing", config.heal_interval,
                                             node._heal_wakeup_event)):
                nursery.start_soon(functools.partial(
                    run_periodic, step, config.maintenance_interval, name=name, first_delay=first, step_plans=True,
                    max_retry=config.maintenance_interval, wake=wake, on_failure=node._count_failure, log=logger,
                    traceback=True))
            yield node

    def _spawn(self, function: Callable[..., Any], *args: Any) -> None:
        """Start a background task in the node's nursery. A bug in one must not take the node down (a DHT node
        never lets an exception out): it is logged once per kind and counted in stats()["dropped"]."""

        async def guarded() -> None:
            try:
                await function(*args)
            except Exception as error:  # Cancelled is a BaseException and passes through
                kind = f"internal_error:{type(error).__name__}"
                if not self._dropped[kind]:
                    logger.exception("DHT background task %s failed", getattr(function, "__name__", function))
                self._dropped[kind] += 1

        self._nursery.start_soon(guarded)

    @property
    def address(self) -> Address:
        return self._endpoint.address

    def now(self) -> float:
        """The DHT clock: expiration times are absolute values of it."""
        return self._clock()

    def stats(self) -> dict[str, Any]:
        """Counters for `peer status`: table size, records held, dropped datagrams by reason, requests served,
        and how the node healed: `rebootstraps` (rejoins that found someone), `rebootstrap_attempts`,
        `lookups_without_peers`, `evictions`, `contacts_restored` (evicted contacts that answered again),
        `reprobes` (pings to failing contacts whose backoff passed)."""
        return {
            "peer_id": str(self.peer_id),
            "address": list(self.address),
            "client_mode": self.client_mode,
            "private_swarm": self._protocol.private,
            "routing_table_size": len(self._table),
            "buckets": len(self._table.buckets),
            "records_held": len(self._storage),
            "storage": self._storage.stats(),
            "peers_known": len(self._peers),
            "peers_speaking_swarmd": self._peers.count_swarmd(),
            "outstanding_requests": self._protocol.outstanding,
            "dropped": dict(self._dropped),
            "requests_served": dict(self._served),
            "remembered_servers": len(self._peers.remembered()),
            "cut_off": self._starved,
            **{name: self._healing[name] for name in HEALING_COUNTERS},
        }

    def local_record(self, key: str | bytes) -> Record | None:
        """What this node holds for `key` as a replica, without asking the network."""
        item = self._storage.get(key_id_of(key), self.now())
        return item.record if item is not None else None

    def routing_table_ids(self) -> list[bytes]:
        return [node.id for node in self._table.nodes()]

    # ---------------------------------------------------------------------------------------------- public API

    async def store(self, key: str | bytes, value: Any, expiration_time: float, subkey: Subkey | None = None,
                    signed: bool = False) -> bool:
        """Store `value` under `key` (or under `subkey` of `key`) until `expiration_time` (DHT clock).

        True only if at least one replica acknowledged (this node counts when it is one of the k closest).
        `signed=True` makes this node's identity the entry's owner: replicas then refuse values for the same
        (key, subkey) not signed by it. An infinite expiration with no subkey and no signature writes a plain
        stock value (readable by stock kademlia nodes as is). Replicas keep an entry that never expires for
        `DHTConfig.stock_ttl` (24 h) after its last store: store it again to keep it longer."""
        return (await self.store_many([(key, value, expiration_time, subkey)], signed=signed))[0]

    async def store_many(self, items: Iterable[tuple[Any, ...]], *, signed: bool = False) -> list[bool]:
        """Store several (key, value, expiration_time[, subkey]) items with one lookup traversal; returns one
        bool per item. Entries for the same key are merged into one record before sending."""
        items = list(items)
        now = self.now()
        by_key: dict[bytes, Record] = {}
        item_keys: list[tuple[bytes, bool]] = []
        for item in items:
            key, value, expiration_time = item[0], item[1], item[2]
            subkey = item[3] if len(item) > 3 else None
            records.check_key(key, "store")
            records.check_subkey(subkey, "store")
            if not isinstance(expiration_time, (int, float)) or isinstance(expiration_time, bool):
                raise InvalidValue("expiration_time must be a number (DHT clock seconds)", operation="store")
            key_id = key_id_of(key)
            if expiration_time <= now or math.isnan(expiration_time):
                item_keys.append((key_id, False))
                continue
            record = records.record_for_store(key_id, value, expiration_time, subkey,
                                              self.identity if signed else None)
            merged = records.merge(by_key.get(key_id), record, now)
            by_key[key_id] = records.fit(merged) if merged is not None else record
            item_keys.append((key_id, True))
        if not by_key:
            return [False for _ in items]
        acknowledged = await self._store_in_chunks(by_key)
        return [valid and acknowledged.get(key_id, False) for key_id, valid in item_keys]

    async def get(self, key: str | bytes, latest: bool = False, quorum: int | None = None,
                  frugal: bool = False) -> Record | None:
        """The merged record of `key` from several replicas, or None. With `latest=True` the lookup continues
        until every one of the k closest live replicas answered, so the newest stored value is found. Over
        `DHTConfig.disjoint_paths` > 1 the key's own value is the paths' vote (records.resolve); against liars,
        `latest=True` gives every path's vote many replicas. `quorum`: how many replicas (this node's own copy
        counts as one) a quick read stops after, instead of `DHTConfig.get_quorum`. `frugal=True` (quick reads
        only): keep no more queries active than replicas the quorum still lacks (dht/lookup.py,
        `Target.next_candidates`; in a small swarm where every node holds the key, 2 requests for a quorum of 3
        instead of 4), which costs latency when a replica has died. For a caller that reads one key over and
        over and merges what it reads: matchmaking's view."""
        return (await self.get_many([key], latest=latest, quorum=quorum, frugal=frugal))[key]

    async def get_many(self, keys: Iterable[str | bytes], latest: bool = False,
                       quorum: int | None = None, frugal: bool = False) -> dict[Any, Record | None]:
        """Records for many keys in one traversal (peers that speak swarmd get one request for all keys they
        are asked about). `latest`, `quorum` and `frugal` as in `get`."""
        keys = list(dict.fromkeys(keys))
        for key in keys:
            records.check_key(key, "get")
        ids = {key: key_id_of(key) for key in keys}
        # over d paths each path stops at its share of the quorum (S/Kademlia: a path ends at the value it
        # finds), so a quick get asks about as many replicas as with one path; latest=True runs every window out
        wanted = self.config.get_quorum if quorum is None else quorum
        if wanted < 1:
            raise ValueError(f"a get's quorum is at least 1 replica, not {wanted}")
        if frugal and latest:
            raise ValueError("a latest=True get runs every window out: it cannot be frugal")
        path_quorum = None if latest else max(1, math.ceil(wanted / self.config.disjoint_paths))
        targets: dict[bytes, Target] = {}
        key_ids = list(dict.fromkeys(ids.values()))

        async def chunk(part: list[bytes]) -> None:
            targets.update(await self._lookup(set(part), want_value=True, quorum=path_quorum,
                                              frugal=frugal))

        await self._in_chunks(key_ids, chunk)
        now = self.now()
        results: dict[Any, Record | None] = {}
        for key, key_id in ids.items():
            if self.config.disjoint_paths > 1:
                # the vote of the paths, each resting on its k/2 closest replicas (this node's own copy is on every
                # path, by its distance, see Target.add_local)
                results[key] = records.resolve(targets[key_id].path_records(), now,
                                               voters=max(1, self.config.k // 2))
                continue
            found = sorted(targets[key_id].values, key=lambda pair: pair[0], reverse=True)  # farthest first
            merged: Record | None = None
            for _, record in found:
                merged = records.merge(merged, record, now)
            local = self._storage.get(key_id, now)
            if local is not None:
                merged = records.merge(merged, local.record, now)
            results[key] = merged
        self._send_gifts(repair_gifts(targets, ((key_id, results[key]) for key, key_id in ids.items()),
                                      self.config.k))
        return results

    def _send_gifts(self, gifts: Gifts) -> None:
        """Execute a welcome or read-repair plan: each peer gets its records in the background."""
        for (node_id, address), items in gifts.items.items():
            self._spawn(self._send_stores, node_id, address, items, gifts.offers)

    # ------------------------------------------------------------------------------------------------ requests

    async def _request(self, address: Address, name: str, args: list[Any], node_id: bytes | None = None,
                       timeout: float | None = None) -> Any:
        """Send one request and wait for its reply (matched by msg id and address); RequestTimeout after
        `timeout` (default: the hard timeout). A reply refreshes the peer's RTT and its routing-table entry."""
        msg_id, datagram = self._protocol.request(address, name, args)
        waiter = _Waiter(trio.Event())
        self._waiters[msg_id] = waiter
        sent_at = trio.current_time()
        try:
            await self._endpoint.sendto(datagram, address)
            with trio.move_on_after(self.config.max_timeout if timeout is None else timeout):
                await waiter.event.wait()
        finally:
            self._waiters.pop(msg_id, None)
            self._protocol.forget(msg_id)
        if not waiter.answered:
            if self._peers.record_failure(address, trio.current_time(), self._rng.random()) and node_id is not None:
                if self._table.remove(node_id):
                    self._healing["evictions"] += 1
                    if not len(self._table):
                        self._note_cut_off("every contact in the routing table stopped answering")
            raise RequestTimeout(f"{name} to {address[0]}:{address[1]} got no answer", operation=name,
                                 peer=address)
        self._peers.observe_rtt(address, trio.current_time() - sent_at)
        if name == "ping" and isinstance(waiter.result, bytes) and len(waiter.result) == proto.NODE_ID_BYTES:
            node_id = waiter.result
        if self._peers.record_answer(address, trio.current_time(), node_id):
            self._healing["contacts_restored"] += 1
        if node_id is not None:
            self._admit(self._contacts.answered(node_id, address, trio.current_time()))
        return waiter.result

    async def observed_address(self, peers: Sequence[Address] | None = None, *, timeout: float = 2.0,
                               ask: int = 3) -> Address | None:
        """The address this node's datagrams are seen to come from, as `stun` reports it: asked of up to `ask`
        of `peers` (default: contacts of the routing table) at once, the answer most of them give (one peer
        cannot make a node announce a wrong address alone); None when none answers within `timeout`.

        Why: a peer listening on all interfaces, or behind a NAT, does not know which address others reach it
        at; the peers it talks to do (the daemon announces this address, peer/daemon.py)."""
        candidates = list(peers) if peers is not None else [(n.ip, n.port) for n in self._table.nodes()]
        answers: list[Address] = []

        async def one(address: Address) -> None:
            try:
                reply = await self._request(address, "stun", [], timeout=timeout)
            except RequestTimeout:
                return
            if (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[0], str)
                    and type(reply[1]) is int and 0 < reply[1] < 65536):
                answers.append((reply[0], reply[1]))

        async with trio.open_nursery() as nursery:
            for address in candidates[:ask]:
                nursery.start_soon(one, address)
        if not answers:
            return None
        return Counter(answers).most_common(1)[0][0]

    async def udp_dial_back(self, address: Address, *, timeout: float = 3.0) -> bool:
        """Whether a datagram from a socket `address` has never heard from gets an answer: `stun` from a fresh
        UDP port of this host. A NAT that drops unsolicited datagrams (a home router's MASQUERADE) lets the
        node's usual traffic through but not this, which is what a reachability check must see."""
        assert self._network is not None, "open the node with DHTNode.open"
        endpoint = await self._network.open_udp(self._endpoint.address[0], 0)
        try:
            protocol = proto.DatagramProtocol(flags=proto.FLAG_CLIENT, swarm_key=self._swarm_key)
            _msg_id, datagram = protocol.request(address, "stun", [])
            await endpoint.sendto(datagram, address)
            with trio.move_on_after(timeout):
                while True:
                    data, source = await endpoint.recvfrom()
                    if isinstance(protocol.receive(data, source), proto.Reply):
                        return True
            return False
        except OSError:
            return False
        finally:
            endpoint.close()

    async def become_server(self) -> None:
        """A client-mode node found to be publicly reachable (`peer.reachability`) takes part as a server from
        now on: its requests stop saying "client", it answers every request, and a lookup of its own id makes
        the peers it meets ping it back and add it to their tables. (The other way, never: a server already
        sits in others' tables, which is what a private peer must never do.)"""
        if not self.client_mode:
            return
        self.client_mode = False
        self._protocol.mark_requests(0)
        self._server.client_mode = False
        self._contacts.client_mode = False
        await self._settle()

    def _admit(self, admission: Admission) -> None:
        """Execute what a server's arrival in the table asks for: a bucket-head check, a welcome."""
        if admission.check_head is not None:
            self._spawn(self._check_head, admission.check_head)
        if admission.welcome is not None:
            self._queue_welcome(admission.welcome)

    async def _check_head(self, head: Node) -> None:
        """A full bucket met a newcomer: ping its least recently seen contact; after repeated failures it is
        evicted (in `_request`) and the freshest replacement takes its place."""
        try:
            for _ in range(self.config.failures_to_evict):
                try:
                    await self._request((head.ip, head.port), "ping", [self.peer_id], node_id=head.id)
                    return
                except RequestTimeout:
                    continue
        finally:
            self._contacts.head_check_done(head.id)

    async def _verify(self, address: Address) -> None:
        """Ping back a sender the table does not hold (policy.Contacts.heard_request): if it answers, the id in
        its answer enters the table (in `_request`)."""
        answered = False
        try:
            await self._request(address, "ping", [self.peer_id])
            answered = True
        except RequestTimeout:
            pass
        finally:
            self._contacts.verification_done(address, answered, trio.current_time())

    async def _start_probe(self, address: Address) -> trio.Event:
        """Send a `swarmd_hello` now and collect its answer in the background; the event fires when the
        peer's capability is known (an answer) or assumed stock (silence for a short, RTT-derived time)."""
        done = trio.Event()
        self._probes[address] = done
        msg_id, datagram = self._protocol.request(address, "swarmd_hello",
                                                  [self.peer_id, {"client": self.client_mode}])
        waiter = _Waiter(trio.Event())
        self._waiters[msg_id] = waiter
        try:
            await self._endpoint.sendto(datagram, address)
        except BaseException:
            self._waiters.pop(msg_id, None)
            self._protocol.forget(msg_id)
            self._probes.pop(address, None)
            done.set()
            raise
        self._spawn(self._finish_probe, address, msg_id, waiter, trio.current_time(), done)
        return done

    async def _finish_probe(self, address: Address, msg_id: bytes, waiter: _Waiter, sent_at: float,
                            done: trio.Event) -> None:
        try:
            wait = self._contacts.probe_wait(address, self.config.probe_timeout, self.config.max_timeout)
            with trio.move_on_after(wait):
                await waiter.event.wait()
        finally:
            self._waiters.pop(msg_id, None)
            self._protocol.forget(msg_id)
            if self._probes.get(address) is done:
                del self._probes[address]
            done.set()
        if waiter.answered:
            self._peers.observe_rtt(address, trio.current_time() - sent_at)
            self._contacts.learn_hello(address, waiter.result)
        else:
            self._contacts.probe_silent(address)

    async def _probe(self, address: Address) -> bool:
        """Does the peer speak the swarmd extensions? Learned once per address."""
        if self._contacts.needs_probe(address):
            done = self._probes.get(address)
            if done is None:
                done = await self._start_probe(address)
            await done.wait()
        return bool(self._peers.get(address).swarmd)

    # ------------------------------------------------------------------------------------------------ receiving

    async def _receive_loop(self) -> None:
        while True:
            try:
                data, address = await self._endpoint.recvfrom()
            except (trio.ClosedResourceError, OSError):
                return
            try:
                await self._handle_datagram(data, address)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            except Exception:
                # Whatever a datagram triggers, the node keeps serving; the bug shows up as a counter.
                self._dropped["handler_error"] += 1

    async def _handle_datagram(self, data: bytes, address: Address) -> None:
        if data[:1] == b"\x00" and not self._ip_limit.allow(address[0], trio.current_time()):
            self._dropped["ip_rate_limited"] += 1  # refused before decoding: see policy.IPRequestLimit
            return
        event = self._protocol.receive(data, address)
        if isinstance(event, proto.Dropped):
            self._dropped[event.reason] += 1
            return
        if isinstance(event, proto.Reply):
            waiter = self._waiters.get(event.msg_id)
            if waiter is not None:
                waiter.result, waiter.answered = event.result, True
                waiter.event.set()
            return
        if not self._peers.allow_request(address, trio.current_time()):
            self._dropped["rate_limited"] += 1
            return
        outcome = self._server.handle(event, self.now(), trio.current_time())
        if outcome.verify is not None:
            self._spawn(self._verify, outcome.verify)
        if outcome.reply is NO_REPLY:
            return
        await self._endpoint.sendto(self._protocol.reply(event, outcome.reply), address)

    # ------------------------------------------------------------------------------------------------- lookups

    async def _lookup(self, key_ids: set[bytes], *, want_value: bool, quorum: int | None = None,
                      frugal: bool = False, store: _StorePlan | None = None) -> dict[bytes, Target]:
        """Iterative lookups for all `key_ids` at once (see dht/lookup.py for the stopping rule)."""
        config = self.config
        now = trio.current_time()
        targets: dict[bytes, Target] = {}
        # A quick get (a value quorum) shares alpha among its paths (at least one query each): over d paths it
        # costs about what one path does (bench_dht: p50 1.45x). Stores and latest=True reads give every path
        # alpha: they must run every window out, and with one query per path the 10,000-node adversarial
        # simulation read stale values in 5% of gets instead of none.
        quick = want_value and quorum is not None
        path_alpha = max(1, math.ceil(config.alpha / config.disjoint_paths)) if quick else config.alpha
        for key_id in key_ids:
            target = Target(key_id, config.k, path_alpha, want_value=want_value, quorum=quorum, frugal=frugal,
                            paths=config.disjoint_paths)
            # seeded with 2k of our contacts: holders of a value answer without contacts, so a lookup whose
            # closest candidates died must still have live ones to turn to
            for node in self._table.neighbors(key_id, 2 * config.k):
                if self._usable(node.id, (node.ip, node.port)):
                    target.add(node.id, (node.ip, node.port))
            if not target.candidates:
                # Nobody usable (every contact evicted or backing off: a flood made the kernel drop our
                # answers, say): ask the servers that answered us most recently anyway rather than fail at
                # once; an answer puts them straight back in the table.
                for address, node_id in self._peers.remembered()[: 2 * config.k]:
                    if node_id != self.peer_id and address != self.address:
                        target.add(node_id, address)
            if want_value:
                local = self._storage.get(key_id, self.now())
                if local is not None:
                    target.add_local(int.from_bytes(self.peer_id, "big") ^ target.long_id, local.record)
            targets[key_id] = target
            self._table.touch(key_id, now)
        # Query tasks live in the node's nursery, not the lookup's: when the lookup is done, a query still
        # waiting runs to its hard timeout, so a dead peer's failure is counted (eviction) and a late answer
        # still refreshes that peer's RTT estimate. The answer itself then goes nowhere.
        send_channel, receive_channel = trio.open_memory_channel[_QueryAnswer](math.inf)
        soft_deadlines: dict[int, tuple[float, bytes, list[bytes]]] = {}
        query_ids = iter(range(1 << 62))
        with receive_channel, trio.move_on_after(config.lookup_timeout):
            while True:
                for node_id, address, keys in self._plan(targets):
                    query_id = next(query_ids)
                    soft = trio.current_time() + self._peers.timeout(address)
                    soft_deadlines[query_id] = (soft, node_id, keys)
                    self._spawn(self._query, query_id, node_id, address, keys, want_value, send_channel,
                                             store)
                if all(t.finished() for t in targets.values()):
                    break
                if not any(t.pending() for t in targets.values()):
                    break
                wake_at = min((d for d, _, _ in soft_deadlines.values()), default=math.inf)
                with trio.move_on_at(wake_at):
                    message = await receive_channel.receive()
                    self._absorb(targets, soft_deadlines, message)
                    continue
                now = trio.current_time()
                for query_id, (deadline, node_id, keys) in list(soft_deadlines.items()):
                    if deadline <= now:
                        del soft_deadlines[query_id]
                        for key_id in keys:
                            targets[key_id].on_slow(node_id)
        if targets and not any(t.answered(1) for t in targets.values()) and self._rejoin_sources():
            self._healing["lookups_without_peers"] += 1
            self._note_cut_off("a lookup found no peer that answers" if len(self._table) else
                               "the routing table is empty")
        return targets

    def _usable(self, node_id: bytes, address: Address) -> bool:
        """Worth asking in a lookup: not ourselves, not a client, carrying the swarm's proof of work (if any), and
        not failing within its backoff (a failing peer is asked again once its backoff passed, so one that was
        only frozen is found again)."""
        if node_id == self.peer_id or address == self.address:
            return False
        if not has_work(node_id, self.config.id_difficulty):
            return False
        info = self._peers.known(address)
        return info is None or (not info.client and not self._peers.suspended(address, trio.current_time()))

    def _plan(self, targets: dict[bytes, Target]) -> list[tuple[bytes, Address, list[bytes]]]:
        """Pick the next peers to ask; a swarmd peer asked about one key is also asked about every other key
        whose window holds it, in the same datagram."""
        planned: dict[bytes, tuple[Address, list[bytes]]] = {}
        for target in targets.values():
            for candidate in target.next_candidates():
                target.set_state(candidate, State.ACTIVE)
                planned.setdefault(candidate.node_id, (candidate.address, []))[1].append(target.key_id)
        if len(targets) > 1:
            for node_id, (address, keys) in planned.items():
                info = self._peers.known(address)
                if not (info and info.swarmd):
                    continue
                for target in targets.values():
                    if target.key_id in keys or target.finished() or len(keys) >= proto.MAX_BATCH_KEYS:
                        continue
                    extra = target.candidates.get(node_id)
                    if extra is not None and extra.state is State.NEW and target.in_window(extra):
                        target.set_state(extra, State.ACTIVE)
                        keys.append(target.key_id)
        return [(node_id, address, keys) for node_id, (address, keys) in planned.items()]

    def _absorb(self, targets: dict[bytes, Target], soft_deadlines: dict[int, tuple[float, bytes, list[bytes]]],
                message: _QueryAnswer) -> None:
        query_id, node_id, answers = message
        soft_deadlines.pop(query_id, None)
        now = self.now()
        for key_id, answer in answers.items():
            target = targets[key_id]
            if answer is None:
                target.on_failure(node_id)
                continue
            kind, payload = answer
            if kind == "value":
                record = records.decode(key_id, payload, now)
                if record is None:
                    self._dropped["invalid_record"] += 1
                elif self._validator is not None and not self._validator(key_id, record):
                    self._dropped["rejected_record"] += 1
                    record = None
                target.on_answer(node_id, [], record, True, self.peer_id)
            else:
                contacts = [c for c in payload if self._usable(c[0], (c[1], c[2]))]
                target.on_answer(node_id, contacts, None, False, self.peer_id)

    async def _query(self, query_id: int, node_id: bytes, address: Address, keys: list[bytes], want_value: bool,
                     results: trio.MemorySendChannel[_QueryAnswer], store: _StorePlan | None) -> None:
        """Ask one peer about `keys`; the lookup always gets an answer message (None per key = no answer),
        even if something here fails, so it never waits for a query that died."""
        answers: dict[bytes, Any] = {}
        try:
            await self._ask(node_id, address, keys, want_value, store, answers)
        finally:
            _deliver(results, (query_id, node_id, {key_id: answers.get(key_id) for key_id in keys}))

    async def _ask(self, node_id: bytes, address: Address, keys: list[bytes], want_value: bool,
                   store: _StorePlan | None, answers: dict[bytes, Any]) -> None:
        info = self._peers.get(address)
        if info.swarmd is None and (store is not None or len(keys) > 1):
            await self._probe(address)  # one round trip, once per peer that never sent us a request
        if store is not None and info.swarmd:
            await self._store_find(node_id, address, keys, store, answers)
            return
        if len(keys) > 1 and info.swarmd:
            try:
                reply = await self._request(address, "swarmd_find_many", [self.peer_id, keys], node_id=node_id)
            except RequestTimeout:
                reply = None
            if isinstance(reply, list) and len(reply) == len(keys):
                for key_id, raw in zip(keys, reply):
                    if raw is not None:
                        answers[key_id] = self._parse_find(raw, want_value)
                keys = [key_id for key_id in keys if key_id not in answers]
            elif reply is None:
                return
            else:
                self._dropped["bad_reply"] += 1

        async def one(key_id: bytes) -> None:
            method = "find_value" if want_value else "find_node"
            try:
                raw = await self._request(address, method, [self.peer_id, key_id], node_id=node_id)
            except RequestTimeout:
                answers[key_id] = None
                return
            answers[key_id] = self._parse_find(raw, want_value)

        if len(keys) == 1:
            await one(keys[0])  # the common case: no nursery, no extra task
        elif keys:
            async with trio.open_nursery() as nursery:
                for key_id in keys:
                    nursery.start_soon(one, key_id)

    async def _store_find(self, node_id: bytes, address: Address, keys: list[bytes], store: _StorePlan,
                          answers: dict[bytes, Any]) -> None:
        """A store lookup asking a swarmd peer: it stores the records and names its closest contacts in one
        round trip, so a peer of the final k closest needs no second request."""

        async def one(batch: list[list[Any]]) -> None:
            try:
                reply = await self._request(address, "swarmd_store_find", [self.peer_id, batch], node_id=node_id)
            except RequestTimeout:
                return
            if not (isinstance(reply, list) and len(reply) == len(batch)):
                self._dropped["bad_reply"] += 1
                return
            for (key_id, *_), answer in zip(batch, reply):
                if not (isinstance(answer, list) and len(answer) == 2):
                    self._dropped["bad_reply"] += 1
                    continue
                if answer[0] is True:
                    store.stored_on.setdefault(key_id, set()).add(node_id)
                answers[key_id] = self._parse_find(answer[1], False)

        async def find_only(key_id: bytes) -> None:  # too large to ride along: stock store after the lookup
            try:
                raw = await self._request(address, "find_node", [self.peer_id, key_id], node_id=node_id)
            except RequestTimeout:
                return
            answers[key_id] = self._parse_find(raw, False)

        items = [(k, store.wire[k], proto.OFFER) if k in store.offers else (k, store.wire[k]) for k in keys]
        groups, oversized = proto.batches("swarmd_store_find", items)
        if len(groups) == 1 and not oversized:
            await one(groups[0])
        else:
            async with trio.open_nursery() as nursery:
                for batch in groups:
                    nursery.start_soon(one, batch)
                for key_id in oversized:
                    nursery.start_soon(find_only, key_id)
        for key_id in keys:
            answers.setdefault(key_id, None)

    def _parse_find(self, raw: Any, want_value: bool) -> tuple[str, Any]:
        if want_value and isinstance(raw, dict):
            value = raw.get("value")
            if len(raw) == 1 and "value" in raw and proto.is_stock_value(value):
                return ("value", value)
            self._dropped["bad_value"] += 1
            return ("nodes", [])
        contacts = proto.parse_contacts(raw, self.config.k)
        if contacts is None:
            self._dropped["bad_reply"] += 1
            return ("nodes", [])
        return ("nodes", contacts)

    # ------------------------------------------------------------------------------------------------- storing

    async def _in_chunks(self, key_ids: list[bytes], work: Callable[[list[bytes]], Any]) -> None:
        """Many keys are looked up in chunks (a few at a time): one lookup's bookkeeping grows with the
        number of its keys times their candidates."""
        parts = [key_ids[i : i + LOOKUP_CHUNK] for i in range(0, len(key_ids), LOOKUP_CHUNK)]
        if len(parts) == 1:
            await work(parts[0])
            return
        limiter = trio.Semaphore(PARALLEL_CHUNKS)

        async def run(part: list[bytes]) -> None:
            async with limiter:
                await work(part)

        async with trio.open_nursery() as nursery:
            for part in parts:
                nursery.start_soon(run, part)

    async def _store_in_chunks(self, by_key: dict[bytes, Record], offer: bool = False) -> dict[bytes, bool]:
        acknowledged: dict[bytes, bool] = {}

        async def chunk(part: list[bytes]) -> None:
            acknowledged.update(await self._store_records({key_id: by_key[key_id] for key_id in part}, offer))

        await self._in_chunks(list(by_key), chunk)
        return acknowledged

    async def _store_records(self, by_key: dict[bytes, Record], offer: bool = False) -> dict[bytes, bool]:
        """Find the k closest peers of each key (d*k over d disjoint paths) and store there. Swarmd peers store
        during the lookup itself (`swarmd_store_find`); stock peers among the closest get a stock `store`
        afterwards. With `offer` (republishing), plain values go as offers to swarmd peers and not at all to stock
        peers."""
        wire = {key_id: records.encode(record) for key_id, record in by_key.items()}
        offers = {key_id for key_id, record in by_key.items() if record.stock} if offer else set()
        store = _StorePlan(wire, offers)
        targets = await self._lookup(set(by_key), want_value=False, store=None if self.client_mode else store)
        now = self.now()
        acknowledged = {key_id: False for key_id in by_key}
        plan: dict[tuple[bytes, Address], list[bytes]] = {}
        my_long = int.from_bytes(self.peer_id, "big")
        for key_id, target in targets.items():
            # over d disjoint paths, the d*k closest hold it: a reader's d paths each meet about k replicas, so
            # each path's vote (records.resolve) rests on many honest replicas, not on a few a liar can outnumber
            replicas = self.config.k * self.config.disjoint_paths
            closest = target.answered(replicas)
            if not self.client_mode:
                mine = my_long ^ target.long_id
                if len(closest) < replicas or mine < closest[-1].distance:
                    if key_id in offers and self._storage.get(key_id, now) is not None:
                        acknowledged[key_id] = True  # republishing our own copy must not renew its stock TTL
                    else:
                        outcome = self._storage.store(key_id, by_key[key_id], now, trio.current_time(), LOCAL)
                        if outcome == "full":
                            self._dropped["storage_full"] += 1
                        acknowledged[key_id] = outcome == "accepted"
            stored_on = store.stored_on.get(key_id, set())
            if stored_on:
                acknowledged[key_id] = True
            for candidate in closest:
                if candidate.node_id not in stored_on:
                    plan.setdefault((candidate.node_id, candidate.address), []).append(key_id)

        async def send(node_id: bytes, address: Address, key_ids: list[bytes]) -> None:
            items = [(k, wire[k]) for k in key_ids]
            for key_id, ok in (await self._send_stores(node_id, address, items, offers)).items():
                if ok:
                    acknowledged[key_id] = True

        async with trio.open_nursery() as nursery:
            for (node_id, address), key_ids in plan.items():
                nursery.start_soon(send, node_id, address, key_ids)
        return acknowledged

    async def _send_stores(self, node_id: bytes, address: Address, items: list[tuple[bytes, Any]],
                           offers: set[bytes] | frozenset[bytes] = frozenset()) -> dict[bytes, bool]:
        """Store items on one peer: batched for swarmd peers, one stock `store` per key otherwise. Keys in
        `offers` (plain values re-sent by maintenance) go as offers, and never to stock peers."""
        results: dict[bytes, bool] = {}
        offered = any(key_id in offers for key_id, _ in items)
        if (len(items) > 1 or offered) and await self._probe(address):
            marked = [(k, v, proto.OFFER) if k in offers else (k, v) for k, v in items]
            groups, oversized = proto.batches("swarmd_store_many", marked)
            for batch in groups:
                try:
                    reply = await self._request(address, "swarmd_store_many", [self.peer_id, batch], node_id=node_id)
                except RequestTimeout:
                    return results
                if isinstance(reply, list) and len(reply) == len(batch):
                    for (key_id, *_), ok in zip(batch, reply):
                        results[key_id] = ok is True
            too_large = set(oversized) - set(offers)
            items = [(key_id, value) for key_id, value in items if key_id in too_large]
        elif offered:
            items = [(key_id, value) for key_id, value in items if key_id not in offers]

        async def one(key_id: bytes, value: Any) -> None:
            try:
                reply = await self._request(address, "store", [self.peer_id, key_id, value], node_id=node_id)
            except RequestTimeout:
                return
            results[key_id] = reply is True

        async with trio.open_nursery() as nursery:
            for key_id, value in items:
                nursery.start_soon(one, key_id, value)
        return results

    # ------------------------------------------------------------------------------------------------ joining

    async def _bootstrap(self, initial_peers: list[Address]) -> None:
        """Ping the initial peers (with retries); look ourselves up; refresh every bucket. Doing both lookups
        is what makes peers that joined through the same initial peers find each other (one DHT, not two)."""
        self._initial_peers = list(dict.fromkeys(initial_peers))
        if not initial_peers:
            return
        answered: list[Address] = []
        timeout = self.config.initial_timeout
        for _ in range(self.config.bootstrap_attempts):
            answered += await self._ping_all([a for a in self._initial_peers if a not in answered], timeout)
            if answered:
                break
            timeout = min(self.config.max_timeout, timeout * 2)
        if not answered:
            raise BootstrapFailed(initial_peers, self.config.bootstrap_attempts, private=self._protocol.private)
        await self._settle()

    async def _ping_all(self, addresses: list[Address], timeout: float,
                        node_ids: dict[Address, bytes] | None = None) -> list[Address]:
        """Ping every address at once; returns those that answered (each answering server enters the table).
        With a known node id a failure counts against that contact (it may be evicted)."""
        answered: list[Address] = []

        async def ping(address: Address) -> None:
            try:
                await self._request(address, "ping", [self.peer_id], timeout=timeout,
                                    node_id=(node_ids or {}).get(address))
                answered.append(address)
            except RequestTimeout:
                pass

        async with trio.open_nursery() as nursery:
            for address in addresses:
                nursery.start_soon(ping, address)
        return answered

    async def _settle(self) -> None:
        await self._lookup({bytes(self.peer_id)}, want_value=False)
        await self.refresh(all_buckets=True)

    async def refresh(self, all_buckets: bool = False) -> None:
        """Look up a random id in every bucket (or only in those untouched for `refresh_interval`)."""
        now = trio.current_time()
        if all_buckets:
            ids = self._table.random_ids_per_bucket(self._rng)
        else:
            ids = self._table.stale_bucket_ids(now, self.config.refresh_interval, self._rng)
        if ids:
            await self._lookup(set(ids), want_value=False)

    # ---------------------------------------------------------------------------------------------- maintenance

    def _count_failure(self, error: Exception) -> None:
        """A periodic round failed: counted like a failed background task (maintenance must outlive a bug)."""
        self._dropped[f"internal_error:{type(error).__name__}"] += 1

    def _maintenance_delay(self) -> float:
        return self.config.maintenance_interval * (0.5 + self._rng.random())

    async def _maintain(self) -> float:
        """Expire records, refresh stale buckets, republish (servers)."""
        self._storage.expire(self.now())
        await self.refresh()
        if not self.client_mode:
            await self.republish()
        return self._maintenance_delay()

    def _heal_wakeup_event(self) -> trio.Event:
        return self._heal_wakeup

    def _rejoin_sources(self) -> list[Address]:
        """Where a node cut off from the DHT asks again: its initial peers, then every server it remembers
        (most recently answered first), bounded so that a rejoin round stays one burst of pings."""
        sources = list(self._initial_peers)
        for address, _ in self._peers.remembered():
            if len(sources) >= len(self._initial_peers) + 2 * self.config.k:
                break
            if address not in sources and address != self.address:
                sources.append(address)
        return sources

    def _note_cut_off(self, reason: str) -> None:
        """Nobody answers: say so once (one log line per episode, no traceback) and wake the healing task."""
        if self._starved or not self._rejoin_sources():
            return  # already rejoining, or a DHT of one (no one was ever there to ask)
        self._starved = True
        logger.warning("DHT node %s (%s mode) is cut off: %s; rejoining through %d known peer(s) with backoff",
                       self.peer_id, "client" if self.client_mode else "server", reason,
                       len(self._rejoin_sources()))
        self._heal_wakeup.set()

    async def _heal(self) -> float:
        """The healing task's round: rejoin when cut off (exponential backoff, capped, jittered), otherwise
        ask failing contacts again once their backoff passed, so peers that were frozen come back."""
        self._heal_wakeup = trio.Event()
        now = trio.current_time()
        if not len(self._table) and self._rejoin_sources():
            self._note_cut_off("the routing table is empty")
        if self._starved:
            if now < self._rejoin_at:
                return self._rejoin_at - now
            return await self._rejoin()
        await self._reprobe(now)
        return self.config.heal_interval * (0.5 + self._rng.random())

    async def _rejoin(self) -> float:
        self._healing["rebootstrap_attempts"] += 1
        sources = self._rejoin_sources()
        remembered = dict(self._peers.remembered())
        answered = await self._ping_all(sources, self.config.initial_timeout, remembered)
        if not answered:
            self._rejoin_failures += 1
            exponent = min(self._rejoin_failures - 1, 30)
            delay: float = min(self.config.rejoin_backoff_max, self.config.rejoin_backoff * 2 ** exponent)
            delay *= 0.5 + 0.5 * self._rng.random()
            self._rejoin_at = trio.current_time() + delay
            return delay
        self._healing["rebootstraps"] += 1
        logger.info("DHT node %s rejoined through %d peer(s) after %d failed attempt(s)", self.peer_id,
                    len(answered), self._rejoin_failures)
        self._starved = False
        self._rejoin_failures = 0
        self._rejoin_at = -math.inf
        await self._settle()
        return self.config.heal_interval * (0.5 + self._rng.random())

    async def _reprobe(self, now: float) -> None:
        """Ping remembered servers that left the table after failing and whose backoff passed (at most k per
        round); an answer puts them back. Ones failing and silent for `forget_after` are let go."""
        due: dict[Address, bytes] = {}
        for address, node_id in self._peers.failing_remembered():
            if node_id in self._table:
                continue
            info = self._peers.known(address)
            if info is not None and info.answered_at is not None and now - info.answered_at > self.config.forget_after:
                if address not in self._initial_peers:
                    self._peers.forget(address)
                continue
            if not self._peers.suspended(address, now) and len(due) < self.config.k:
                due[address] = node_id
        if due:
            self._healing["reprobes"] += len(due)
            await self._ping_all(list(due), self.config.max_timeout, due)

    async def republish(self, force: bool = False) -> int:
        """Re-store held records that no other replica refreshed within `republish_interval` (so about one
        replica per interval does the work). Stale copies cannot resurrect overwritten values: receivers merge
        by expiration. Returns how many records were sent."""
        now, local_now = self.now(), trio.current_time()
        due = {
            key_id: item.record
            for key_id, item in self._storage.items()
            if force or local_now - item.refreshed_at >= self.config.republish_interval
        }
        if not due:
            return 0
        for key_id in due:
            item = self._storage.get(key_id, now)
            if item is not None:
                item.refreshed_at = local_now
        await self._store_in_chunks(due, offer=True)
        return len(due)

    def _queue_welcome(self, node: Node) -> None:
        verdict = self._welcomes.add(node, trio.current_time())
        if verdict == "skipped":
            self._dropped["welcome_skipped"] += 1
        elif verdict == "schedule":
            self._spawn(self._welcome)

    async def _welcome(self) -> None:
        """A welcome pass (policy.WelcomeQueue says when and for whom, policy.welcome_gifts what each gets)."""
        await trio.sleep_until(self._welcomes.pass_at(trio.current_time()))
        batch, more = self._welcomes.take(trio.current_time())
        if more:  # the rest of a burst: the next pass, WELCOME_MIN_INTERVAL later
            self._spawn(self._welcome)
        self._send_gifts(welcome_gifts(batch, self._storage, self._table, self.peer_id, self.config.k, self.now()))


def _deliver(channel: trio.MemorySendChannel[_QueryAnswer], message: _QueryAnswer) -> None:
    try:
        channel.send_nowait(message)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the lookup finished before this answer came
