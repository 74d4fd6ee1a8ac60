"""`Replicator`: puts records on the peers that should hold them, and keeps them there.

Every way a record travels to a replica goes through here, because they share one rule for swarmd and stock
peers (batched stores and offers for the first, one stock `store` per plain value for the second): a caller's
store (a store lookup, then stores to the d*k closest that did not store during it), republishing (a replica
re-stores what nobody refreshed within `republish_interval`; plain values go as offers, which never renew a stock
TTL), welcoming a server new to the routing table (policy.WelcomeQueue says when, policy.welcome_gifts what), and
read repair after a get (policy.repair_gifts). The plans are sans-I/O (dht/policy.py); this executes them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import trio
from kademlia.node import Node

from dht import protocol as proto
from dht import records
from dht.background import BackgroundTasks
from dht.config import DHTConfig
from dht.errors import RequestTimeout
from dht.lookup_driver import LookupDriver, StorePlan, in_chunks
from dht.policy import Gifts, WelcomeQueue, welcome_gifts
from dht.records import Record
from dht.requests import Requester
from dht.routing import RoutingTable
from dht.storage import LOCAL, Storage
from peer.p2p.net import Address


class Replicator:
    """Stores records on their k closest peers (d*k over d disjoint paths), republishes, welcomes, repairs."""

    def __init__(self, peer_id: bytes, *, client_mode: bool, config: DHTConfig, clock: Callable[[], float],
                 table: RoutingTable, storage: Storage, lookups: LookupDriver, requester: Requester,
                 tasks: BackgroundTasks, dropped: Counter[str]):
        self.peer_id = peer_id
        self.client_mode = client_mode  # a client holds no replicas; a promoted node (become_server) clears it
        self._config = config
        self._clock = clock  # the DHT clock, for the expirations of stored records
        self._table = table
        self._storage = storage
        self._lookups = lookups
        self._requester = requester
        self._tasks = tasks
        self._dropped = dropped
        self._welcomes = WelcomeQueue()

    async def store_in_chunks(self, by_key: dict[bytes, Record], offer: bool = False) -> dict[bytes, bool]:
        """Store many records (lookups of a bounded number of keys, see lookup_driver.in_chunks); returns, per
        key, whether at least one replica acknowledged it."""
        acknowledged: dict[bytes, bool] = {}

        async def chunk(part: list[bytes]) -> None:
            acknowledged.update(await self._store_records({key_id: by_key[key_id] for key_id in part}, offer))

        await in_chunks(list(by_key), chunk)
        return acknowledged

    async def _store_records(self, by_key: dict[bytes, Record], offer: bool = False) -> dict[bytes, bool]:
        """Find the k closest peers of each key (d*k over d disjoint paths) and store there. Swarmd peers store
        during the lookup itself (`swarmd_store_find`); stock peers among the closest get a stock `store`
        afterwards. With `offer` (republishing), plain values go as offers to swarmd peers and not at all to stock
        peers."""
        wire = {key_id: records.encode(record) for key_id, record in by_key.items()}
        offers = {key_id for key_id, record in by_key.items() if record.stock} if offer else set()
        store = StorePlan(wire, offers)
        targets = await self._lookups.run(set(by_key), want_value=False, store=None if self.client_mode else store)
        now = self._clock()
        acknowledged = {key_id: False for key_id in by_key}
        plan: dict[tuple[bytes, Address], list[bytes]] = {}
        my_long = int.from_bytes(self.peer_id, "big")
        for key_id, target in targets.items():
            # over d disjoint paths, the d*k closest hold it: a reader's d paths each meet about k replicas, so
            # each path's vote (records.resolve) rests on many honest replicas, not on a few a liar can outnumber
            replicas = self._config.k * self._config.disjoint_paths
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
        if (len(items) > 1 or offered) and await self._requester.probe(address):
            marked = [(k, v, proto.OFFER) if k in offers else (k, v) for k, v in items]
            groups, oversized = proto.batches("swarmd_store_many", marked)
            for batch in groups:
                try:
                    reply = await self._requester.request(address, "swarmd_store_many", [self.peer_id, batch],
                                                          node_id=node_id)
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
                reply = await self._requester.request(address, "store", [self.peer_id, key_id, value],
                                                      node_id=node_id)
            except RequestTimeout:
                return
            results[key_id] = reply is True

        async with trio.open_nursery() as nursery:
            for key_id, value in items:
                nursery.start_soon(one, key_id, value)
        return results

    async def republish(self, force: bool = False) -> int:
        """Re-store held records that no other replica refreshed within `republish_interval` (so about one
        replica per interval does the work). Stale copies cannot resurrect overwritten values: receivers merge
        by expiration. Returns how many records were sent."""
        now, local_now = self._clock(), trio.current_time()
        due = {
            key_id: item.record
            for key_id, item in self._storage.items()
            if force or local_now - item.refreshed_at >= self._config.republish_interval
        }
        if not due:
            return 0
        for key_id in due:
            item = self._storage.get(key_id, now)
            if item is not None:
                item.refreshed_at = local_now
        await self.store_in_chunks(due, offer=True)
        return len(due)

    def send_gifts(self, gifts: Gifts) -> None:
        """Execute a welcome or read-repair plan: each peer gets its records in the background."""
        for (node_id, address), items in gifts.items.items():
            self._tasks.spawn(self._send_stores, node_id, address, items, gifts.offers)

    def queue_welcome(self, node: Node) -> None:
        """A server new to the routing table: it gets the records it should hold at the next welcome pass."""
        verdict = self._welcomes.add(node, trio.current_time())
        if verdict == "skipped":
            self._dropped["welcome_skipped"] += 1
        elif verdict == "schedule":
            self._tasks.spawn(self._welcome)

    async def _welcome(self) -> None:
        """A welcome pass (policy.WelcomeQueue says when and for whom, policy.welcome_gifts what each gets)."""
        await trio.sleep_until(self._welcomes.pass_at(trio.current_time()))
        batch, more = self._welcomes.take(trio.current_time())
        if more:  # the rest of a burst: the next pass, WELCOME_MIN_INTERVAL later
            self._tasks.spawn(self._welcome)
        self.send_gifts(welcome_gifts(batch, self._storage, self._table, self.peer_id, self._config.k,
                                      self._clock()))
