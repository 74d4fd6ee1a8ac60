"""DHTNode: the trio driver around the datagram protocol, routing table, lookups and record storage.

The decisions live in plain objects without I/O, and the driver only moves datagrams, runs lookups and executes
their plans: `dht.protocol` frames datagrams, `dht.server.Server` answers requests, `dht.policy` decides who
enters the routing table (only senders that answered our ping: made-up ids never do), what each peer speaks,
which newcomer or reader gets which records, and how many requests one IP may send (checked before decoding).

The driver is the node and the collaborators it owns, one job each: `dht.requests.Requester` (a request and what
its answer or silence says about the peer), `dht.receiver.Receiver` (the receive loop), `dht.lookup_driver`
(iterative lookups over `dht.lookup`'s state), `dht.replication.Replicator` (stores, republishing, welcomes, read
repair), `dht.membership.Membership` (bootstrap, refresh, healing) and `dht.background.BackgroundTasks` (the
guard every background task runs under). This module holds the public API and the wiring.

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
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import trio
from kademlia.utils import digest

from dht import protocol as proto
from dht import records
from dht.background import BackgroundTasks
from dht.config import DHTConfig
from dht.errors import InvalidValue, RequestTimeout
from dht.lookup import Target
from dht.lookup_driver import LOOKUP_CHUNK as LOOKUP_CHUNK
from dht.lookup_driver import PARALLEL_CHUNKS as PARALLEL_CHUNKS
from dht.lookup_driver import LookupDriver, in_chunks
from dht.membership import HEALING_COUNTERS, Membership
from dht.peers import PeerBook
from dht.policy import Contacts, repair_gifts
from dht.receiver import Receiver
from dht.records import Record, Subkey
from dht.replication import Replicator
from dht.requests import Requester
from dht.routing import RoutingTable, TableLimits, has_work
from dht.server import MAX_REPLY_BYTES, Server
from dht.storage import Storage
from peer.p2p.identity import Identity, SwarmKey
from peer.p2p.lifetime import owned_nursery
from peer.p2p.net import Address, Network, RealNetwork, UDPEndpoint
from peer.p2p.periodic import run_periodic

logger = logging.getLogger(__name__)

__all__ = ["DHTConfig", "DHTNode", "key_id_of", "MAX_REPLY_BYTES"]


def key_id_of(key: str | bytes) -> bytes:
    """The 160-bit DHT id of a key, as the stock package computes it (sha1 of bytes, or of str(key))."""
    key_id: bytes = digest(key)  # kademlia.utils is untyped
    return key_id


class DHTNode:
    """A Kademlia node; create it with `DHTNode.open(...)` (an async context manager owning its tasks).

    The node holds the shared state (routing table, peer book, storage, counters) and the collaborators that act
    on it (see the module docstring); they run their background work in the node's nursery."""

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
        self.peer_id = identity.peer_id
        self.client_mode = client_mode
        self.config = config
        self._clock = clock
        self._endpoint = endpoint
        self._rng = rng
        self._swarm_key = swarm_key  # a private swarm's: datagrams carry its MAC (dht/protocol.py)
        self._protocol = proto.DatagramProtocol(random_bytes=random_bytes,
                                                flags=proto.FLAG_CLIENT if client_mode else 0, swarm_key=swarm_key)
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
        self._healing: Counter[str] = Counter()  # rebootstraps, evictions, contacts restored... (see stats())
        self._network: Network | None = None  # set by `open`: fresh sockets for dial-backs
        # The collaborators call each other both ways (an eviction may cut the node off, a lookup nobody answered
        # too, an answering newcomer is welcomed with records), so those calls are bound late, through the node.
        self._tasks = BackgroundTasks(nursery, self._dropped)
        self._requester = Requester(
            self.peer_id, endpoint, self._protocol, client_mode=client_mode, config=config, table=self._table,
            peers=self._peers, contacts=self._contacts, tasks=self._tasks, rng=rng, healing=self._healing,
            on_cut_off=lambda reason: self._membership.note_cut_off(reason),
            welcome=lambda node: self._replicator.queue_welcome(node))
        self._receiver = Receiver(self.peer_id, endpoint, self._protocol, config=config, clock=clock,
                                  peers=self._peers, contacts=self._contacts, server=self._server,
                                  requester=self._requester, tasks=self._tasks, dropped=self._dropped)
        self._lookups = LookupDriver(self.peer_id, endpoint.address, config=config, clock=clock, table=self._table,
                                     peers=self._peers, storage=self._storage, requester=self._requester,
                                     tasks=self._tasks, dropped=self._dropped, validator=validator,
                                     on_unanswered=lambda: self._membership.lookup_unanswered())
        self._replicator = Replicator(self.peer_id, client_mode=client_mode, config=config, clock=clock,
                                      table=self._table, storage=self._storage, lookups=self._lookups,
                                      requester=self._requester, tasks=self._tasks, dropped=self._dropped)
        self._membership = Membership(self.peer_id, endpoint.address, client_mode=client_mode,
                                      private=self._protocol.private, config=config, table=self._table,
                                      peers=self._peers, rng=rng, healing=self._healing,
                                      ping_all=self._requester.ping_all, lookups=self._lookups)

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
            nursery.start_soon(node._receiver.run)
            await node._membership.bootstrap([(h, p) for h, p in initial_peers])
            # the one periodic-task runner: each step returns the delay to its next round; a failed round is
            # logged once per kind (with its traceback: any exception here is a bug), counted, and retried later
            for step, name, first, wake in ((node._maintain, "DHT maintenance", node._maintenance_delay(), None),
                                            (node._membership.heal, "DHT healing", config.heal_interval,
                                             node._membership.wakeup_event)):
                nursery.start_soon(functools.partial(
                    run_periodic, step, config.maintenance_interval, name=name, first_delay=first, step_plans=True,
                    max_retry=config.maintenance_interval, wake=wake, on_failure=node._count_failure, log=logger,
                    traceback=True))
            yield node


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
            "cut_off": self._membership.starved,
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
        acknowledged = await self._replicator.store_in_chunks(by_key)
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
            targets.update(await self._lookups.run(set(part), want_value=True, quorum=path_quorum,
                                                   frugal=frugal))

        await in_chunks(key_ids, chunk)
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
        repairs = repair_gifts(targets, ((key_id, results[key]) for key, key_id in ids.items()), self.config.k)
        self._replicator.send_gifts(repairs)  # read repair: replicas that lacked the result get it
        return results

    # -------------------------------------------------------------------------------------------- reachability

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
                reply = await self._requester.request(address, "stun", [], timeout=timeout)
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
        self._requester.client_mode = self._replicator.client_mode = self._membership.client_mode = False
        await self._membership.settle()

    # ---------------------------------------------------------------------------------------------- maintenance

    async def refresh(self, all_buckets: bool = False) -> None:
        """Look up a random id in every bucket (or only in those untouched for `refresh_interval`)."""
        await self._membership.refresh(all_buckets)

    async def republish(self, force: bool = False) -> int:
        """Re-store held records that no other replica refreshed within `republish_interval` (so about one
        replica per interval does the work). Stale copies cannot resurrect overwritten values: receivers merge
        by expiration. Returns how many records were sent."""
        return await self._replicator.republish(force)

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

    # ------------------------------------------------------------------- internals that tests drive directly

    async def _request(self, address: Address, name: str, args: list[Any], node_id: bytes | None = None,
                       timeout: float | None = None) -> Any:
        """One request through the node's requester (tests send hand-made requests with it)."""
        return await self._requester.request(address, name, args, node_id=node_id, timeout=timeout)

    async def _store_in_chunks(self, by_key: dict[bytes, Record], offer: bool = False) -> dict[bytes, bool]:
        """Store ready-made records (tests plant records a caller could not make with `store`)."""
        return await self._replicator.store_in_chunks(by_key, offer)
