"""`LookupDriver`: runs the iterative lookups whose state and stopping rule live in dht/lookup.py (`Target`).

The sans-I/O `Target` decides whom to ask next for a key and when the key is done; this driver does the asking:
it seeds each target from the routing table, sends the queries (one datagram per peer for every key whose window
holds that peer, when the peer speaks swarmd), feeds answers, failures and soft timeouts back into the targets,
checks every record a lookup receives (signatures in records.decode, then the node's validator), and tells the
node's membership when nobody answered at all (the node may be cut off, dht/membership.py).

A store lookup carries a `StorePlan`: swarmd peers store its records while answering (`swarmd_store_find`), so
the final k closest need no second round trip. `in_chunks` splits many keys into lookups of a bounded size.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from dht import protocol as proto
from dht import records
from dht.background import BackgroundTasks
from dht.config import DHTConfig
from dht.errors import RequestTimeout
from dht.lookup import State, Target
from dht.peers import PeerBook
from dht.records import Record
from dht.requests import Requester
from dht.routing import RoutingTable, has_work
from dht.storage import Storage
from peer.p2p.net import Address

__all__ = ["LOOKUP_CHUNK", "PARALLEL_CHUNKS", "LookupDriver", "StorePlan", "in_chunks"]

LOOKUP_CHUNK = 48  # keys per multi-key lookup
PARALLEL_CHUNKS = 4

# What one lookup query reports back: (query id, the peer asked, {key id: its answer or None})
_QueryAnswer = tuple[int, bytes, dict[bytes, Any]]


@dataclass
class StorePlan:
    """Records a store lookup carries, and which peers acknowledged each key during the lookup."""

    wire: dict[bytes, Any]
    offers: set[bytes] = field(default_factory=set)  # keys sent as protocol.OFFER items
    stored_on: dict[bytes, set[bytes]] = field(default_factory=dict)


async def in_chunks(key_ids: list[bytes], work: Callable[[list[bytes]], Any]) -> None:
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


class LookupDriver:
    """Iterative lookups for many keys at once, over the node's requester, table, peer book and storage.

    `on_unanswered()` is called after a lookup in which no peer answered about any key."""

    def __init__(self, peer_id: bytes, address: Address, *, config: DHTConfig, clock: Callable[[], float],
                 table: RoutingTable, peers: PeerBook, storage: Storage, requester: Requester,
                 tasks: BackgroundTasks, dropped: Counter[str],
                 validator: Callable[[bytes, Record], bool] | None, on_unanswered: Callable[[], None]):
        self.peer_id = peer_id
        self.address = address
        self._config = config
        self._clock = clock  # the DHT clock, for the expirations of the records found
        self._table = table
        self._peers = peers
        self._storage = storage
        self._requester = requester
        self._tasks = tasks
        self._dropped = dropped
        self._validator = validator
        self._on_unanswered = on_unanswered

    async def run(self, key_ids: set[bytes], *, want_value: bool, quorum: int | None = None,
                  frugal: bool = False, store: StorePlan | None = None) -> dict[bytes, Target]:
        """Iterative lookups for all `key_ids` at once (see dht/lookup.py for the stopping rule)."""
        config = self._config
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
                local = self._storage.get(key_id, self._clock())
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
                    self._tasks.spawn(self._query, query_id, node_id, address, keys, want_value, send_channel,
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
        if targets and not any(t.answered(1) for t in targets.values()):
            self._on_unanswered()
        return targets

    def _usable(self, node_id: bytes, address: Address) -> bool:
        """Worth asking in a lookup: not ourselves, not a client, carrying the swarm's proof of work (if any), and
        not failing within its backoff (a failing peer is asked again once its backoff passed, so one that was
        only frozen is found again)."""
        if node_id == self.peer_id or address == self.address:
            return False
        if not has_work(node_id, self._config.id_difficulty):
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
        now = self._clock()
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
                     results: trio.MemorySendChannel[_QueryAnswer], store: StorePlan | None) -> None:
        """Ask one peer about `keys`; the lookup always gets an answer message (None per key = no answer),
        even if something here fails, so it never waits for a query that died."""
        answers: dict[bytes, Any] = {}
        try:
            await self._ask(node_id, address, keys, want_value, store, answers)
        finally:
            _deliver(results, (query_id, node_id, {key_id: answers.get(key_id) for key_id in keys}))

    async def _ask(self, node_id: bytes, address: Address, keys: list[bytes], want_value: bool,
                   store: StorePlan | None, answers: dict[bytes, Any]) -> None:
        info = self._peers.get(address)
        if info.swarmd is None and (store is not None or len(keys) > 1):
            await self._requester.probe(address)  # one round trip, once per peer that never sent us a request
        if store is not None and info.swarmd:
            await self._store_find(node_id, address, keys, store, answers)
            return
        if len(keys) > 1 and info.swarmd:
            try:
                reply = await self._requester.request(address, "swarmd_find_many", [self.peer_id, keys],
                                                      node_id=node_id)
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
                raw = await self._requester.request(address, method, [self.peer_id, key_id], node_id=node_id)
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

    async def _store_find(self, node_id: bytes, address: Address, keys: list[bytes], store: StorePlan,
                          answers: dict[bytes, Any]) -> None:
        """A store lookup asking a swarmd peer: it stores the records and names its closest contacts in one
        round trip, so a peer of the final k closest needs no second request."""

        async def one(batch: list[list[Any]]) -> None:
            try:
                reply = await self._requester.request(address, "swarmd_store_find", [self.peer_id, batch],
                                                      node_id=node_id)
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
                raw = await self._requester.request(address, "find_node", [self.peer_id, key_id], node_id=node_id)
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
        contacts = proto.parse_contacts(raw, self._config.k)
        if contacts is None:
            self._dropped["bad_reply"] += 1
            return ("nodes", [])
        return ("nodes", contacts)


def _deliver(channel: trio.MemorySendChannel[_QueryAnswer], message: _QueryAnswer) -> None:
    try:
        channel.send_nowait(message)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the lookup finished before this answer came
