"""Records this node holds as a replica: merged on every store, bounded in count and bytes, shared fairly.

Why it looks like this: a DHT node stores whatever any host asks it to, so one host sending plain `store`
requests for new keys could fill the store (and with it the process's memory), after which honest new keys
were refused, and each refused store walked every record looking for expired ones. Now:

* Every record has a local deadline. A swarmd record lives until its latest entry expires. An entry that never
  expires (a stock kademlia value, `record.stock`, or a signed entry with an infinite expiration) is kept for
  `stock_ttl` seconds (default 24 h) after the last accepted store of its key, so a stock node's republishing
  (a plain `store` every hour in kademlia 2.2.3) keeps it alive and an abandoned one goes away. Offers (plain
  values re-sent by swarmd replicas on their own initiative) do not refresh it: the node handles them before
  they reach `store`.
* Deadlines sit in a heap with lazy deletion: `expire()` pops only what is due, so no request ever walks all
  records. A deadline that moves later is not re-pushed (the stale, earlier heap entry is re-pushed when it
  surfaces); removed items leave stale entries that are skipped when popped and dropped by an occasional
  rebuild once they outnumber the live ones (amortized O(1) per removal). Every store, get and eviction is
  O(log n) amortized in the number of records held; `work` counts heap entries touched, for tests.
* Each record is charged to the account of the sender that created it: one account per sender IP (IPv6: per
  /64, the block one host usually gets) and one per first byte of the sender's node id (256 prefixes), or the
  single local account for records this node's own client stored. Shares apply when the store is full: a new
  key then makes room by evicting the soonest-expiring record of the account furthest over its share (by
  records or bytes; default share 10% of the store per IP and per prefix), or, when nobody is over, the
  soonest-expiring record overall. A host (IP or this node) already at its share when the store is full is
  refused (cheaply: before any merge). So a flooder may fill an idle store, but the new keys of honest peers
  then take the room from it, it cannot grow back while the store is full, and a sender under its shares
  always gets its new keys in. The prefix share catches a flooder that varies its source address but not its
  id; since a prefix is shared by 1/256 of all honest peers, a sender whose prefix is at its share is not
  refused: its new key takes the room of the soonest-expiring record of that prefix (the flooder's, mostly),
  so the prefix cannot grow while the store is full. Updates to a held key are never refused for the record
  cap; growth of its bytes counts like a new record's, and stays charged to the key's creator.
* Bytes: a record is charged its key, its encoded value (twice for a swarmd envelope, held both decoded and
  encoded) and RECORD_OVERHEAD bytes for the Python objects that hold it (measured with tracemalloc: 700-960
  bytes per record, heap entries and account books included; charged: 1 KiB), so `max_bytes` bounds the memory
  the store takes. Defaults (DHTConfig): 100,000 records and 128 MiB. Small values meet the record cap
  first (100,000 tiny records are charged ~105 MB), large ones the byte cap: ~14,800 stock values or ~7,800
  swarmd records of 8 KiB (the largest a store request carries).

Stored items keep the time the last store for them arrived (`refreshed_at`, on trio's clock since it schedules
work): republishing skips keys another replica refreshed recently, so one replica per interval does the work
instead of all k. Expirations and deadlines are on the DHT clock (`now`).
"""

from __future__ import annotations

import functools
import heapq
import ipaddress
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator

from dht import records
from dht.records import Record

RECORD_OVERHEAD = 1024  # bytes of Python objects per stored record besides key and value (see module doc)
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
DEFAULT_STOCK_TTL = 24 * 3600.0
DEFAULT_MAX_TTL = 24 * 3600.0
DEFAULT_SHARE = 0.10
_COMPACT_SLACK = 64  # stale heap entries tolerated beyond the live ones before a rebuild

HeapEntry = tuple[float, int, bytes]  # (deadline no later than the item's, item generation, key id)


@dataclass(frozen=True)
class Sender:
    """Who a store came from, as the accounts it is charged to: (kind, name) pairs."""

    accounts: tuple[tuple[str, Any], ...]

    @classmethod
    def remote(cls, host: str, node_id: bytes) -> "Sender":
        """A request from `host` claiming node id `node_id`: charged per IP (IPv6 per /64) and per id prefix."""
        return cls((("ip", ip_account(host)), ("prefix", node_id[0] if node_id else -1)))


LOCAL = Sender((("local", None),))  # this node's own client


@functools.lru_cache(maxsize=4096)  # parsing an address costs more than the rest of a refused store
def ip_account(host: str) -> str:
    """The account of a sender address: the IP, an IPv6 sender's /64, or a name of the in-memory network."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # a host name of the in-memory network
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Account:
    """What one sender (an IP, an id prefix, or this node) has stored here, with its records' deadlines."""

    __slots__ = ("name", "records", "bytes", "heap", "record_quota", "byte_quota")

    def __init__(self, name: tuple[str, Any], record_quota: float, byte_quota: float):
        self.name = name
        self.records = 0
        self.bytes = 0
        self.heap: list[HeapEntry] = []
        self.record_quota = record_quota
        self.byte_quota = byte_quota

    def over(self) -> bool:
        return self.records > self.record_quota or self.bytes > self.byte_quota

    def excess(self) -> float:
        return max(self.records / self.record_quota, self.bytes / self.byte_quota)


class StoredItem:
    __slots__ = ("record", "wire", "refreshed_at", "size", "deadline", "generation", "accounts")

    def __init__(self, record: Record, wire: Any, refreshed_at: float, size: int, deadline: float,
                 generation: int, accounts: tuple[_Account, ...]):
        self.record = record
        self.wire = wire  # the DHT value to hand out (envelope bytes or the bare stock value)
        self.refreshed_at = refreshed_at
        self.size = size  # bytes charged
        self.deadline = deadline  # DHT clock; the item is dropped then
        self.generation = generation  # heap entries of another generation are stale
        self.accounts = accounts


class Storage:
    def __init__(self, max_records: int, max_bytes: int = DEFAULT_MAX_BYTES, *,
                 stock_ttl: float = DEFAULT_STOCK_TTL, ip_share: float = DEFAULT_SHARE,
                 prefix_share: float = DEFAULT_SHARE, max_ttl: float = DEFAULT_MAX_TTL):
        for name, share in (("ip_share", ip_share), ("prefix_share", prefix_share)):
            if not 0 < share <= 1:
                raise ValueError(f"{name} must be in (0, 1], not {share}")
        if max_records < 1 or max_bytes < 1 or not stock_ttl > 0 or not max_ttl > 0:
            raise ValueError("max_records, max_bytes, stock_ttl and max_ttl must be positive")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.stock_ttl = stock_ttl
        self.max_ttl = max_ttl
        self._shares = {"ip": ip_share, "local": ip_share, "prefix": prefix_share}
        self._items: dict[bytes, StoredItem] = {}
        self._heap: list[HeapEntry] = []  # every item, soonest deadline first
        self._accounts: dict[tuple[str, Any], _Account] = {}
        self._over: set[_Account] = set()  # accounts beyond their share (few: shares sum to at most 1 per kind)
        self._generations = itertools.count()
        self.bytes = 0
        self.work = 0  # heap entries pushed, popped or rebuilt: the cost of storage operations, for tests
        self.evicted = 0
        self.expired = 0
        self.refused = 0

    # ------------------------------------------------------------------------------------------------ public

    def store(self, key_id: bytes, incoming: Record, now: float, local_time: float, sender: Sender = LOCAL) -> str:
        """Merge `incoming`, charging a new key to `sender`; returns "accepted", "rejected" (an entry of it lost
        the merge: older, or owned by someone else) or "full" (the store is full and the sender's host is at
        its share, or nothing could be evicted to make room)."""
        self.expire(now)
        item = self._items.get(key_id)
        existing = item.record.pruned(now) if item is not None else None
        if existing is not None and existing.empty():
            self._remove(key_id)
            item = existing = None
        if item is None and self._needs_room(1, 0) and self._host_at_share(sender, 1, 0):
            self.refused += 1  # decided before merging: a refused flood datagram costs no storage work
            return "full"
        merged = records.merge(existing, incoming, now)
        if merged is None:
            if item is not None:
                self._remove(key_id)
            return "rejected"
        merged = records.fit(merged)
        accepted = _contains(merged, incoming.pruned(now))
        wire = records.encode(merged)
        size = _charge(key_id, merged, wire)
        if item is None:
            if not self._room_for(sender, 1, size, exclude=None):
                self.refused += 1
                return "full"
            self._insert(key_id, merged, wire, size, self._deadline(merged, now, now), local_time, sender)
        else:
            grow = size - item.size
            if grow > 0 and not self._room_for(sender, 0, grow, exclude=key_id):
                self.refused += 1
                return "full"
            old_deadline = item.deadline
            base = now if accepted else old_deadline - self.stock_ttl  # a lost merge does not extend the TTL
            self._recharge(item, size)
            item.record, item.wire, item.refreshed_at = merged, wire, local_time
            item.deadline = self._deadline(merged, now, base)
            if item.deadline < old_deadline:  # earlier than its heap entries say: a new generation
                item.generation = next(self._generations)
                self._push_all(key_id, item)
        return "accepted" if accepted else "rejected"

    def get(self, key_id: bytes, now: float) -> StoredItem | None:
        item = self._items.get(key_id)
        if item is None:
            return None
        if item.deadline <= now:
            self._remove(key_id)
            self.expired += 1
            return None
        record = item.record.pruned(now)
        if record.empty():
            self._remove(key_id)
            self.expired += 1
            return None
        if record != item.record:
            item.record, item.wire = record, records.encode(record)
            self._recharge(item, _charge(key_id, record, item.wire))
        return item

    def expire(self, now: float) -> int:
        """Drop the records whose deadline passed; touches only heap entries that are due."""
        removed = 0
        while (entry := self._pop_live(self._heap, until=now)) is not None:
            self._remove(entry[2])
            removed += 1
        self.expired += removed
        return removed

    def items(self) -> Iterator[tuple[bytes, StoredItem]]:
        return iter(list(self._items.items()))

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, int]:
        return {"records_held": len(self._items), "bytes_held": self.bytes, "records_evicted": self.evicted,
                "records_expired": self.expired, "stores_refused_full": self.refused,
                "accounts_over_share": len(self._over)}

    def account_usage(self, sender: Sender) -> list[tuple[int, int]]:
        """(records, bytes) charged to each account of `sender` (for tests and diagnostics)."""
        usage = []
        for name in sender.accounts:
            account = self._accounts.get(name)
            usage.append((account.records, account.bytes) if account is not None else (0, 0))
        return usage

    # ------------------------------------------------------------------------------------------------ internals

    def _deadline(self, record: Record, now: float, base: float) -> float:
        """The latest expiration of the record's entries; an entry that never expires counts as
        `base + stock_ttl` (base: the time of the last accepted store)."""
        latest, infinite = -math.inf, False
        entries = list(record.subkeys.values())
        if record.entry is not None:
            entries.append(record.entry)
        for entry in entries:
            if entry.expiration_time == math.inf:
                infinite = True
            else:
                latest = max(latest, entry.expiration_time)
        if infinite:
            latest = max(latest, base + self.stock_ttl)
        # clamped on this node's clock: a writer picks its entries' expirations, so junk claiming to live for
        # years would outlast every honest record when the store makes room by evicting the soonest-expiring;
        # a record nobody stores again within `max_ttl` is dropped here (issue 40)
        return min(latest, now + self.max_ttl) if not infinite else latest

    def _needs_room(self, new_records: int, new_bytes: int) -> bool:
        return len(self._items) + new_records > self.max_records or self.bytes + new_bytes > self.max_bytes

    def _account(self, name: tuple[str, Any]) -> _Account:
        account = self._accounts.get(name)
        if account is None:
            share = self._shares[name[0]]
            account = self._accounts[name] = _Account(name, max(1.0, share * self.max_records),
                                                      share * self.max_bytes)
        return account

    def _at_share(self, sender: Sender, new_records: int, new_bytes: int,
                  kinds: tuple[str, ...]) -> _Account | None:
        """The first account of `sender` (of the given kinds) that `new_records` and `new_bytes` would take past
        its share."""
        for name in sender.accounts:
            account = self._accounts.get(name)
            if account is None or name[0] not in kinds:
                continue
            if (account.records + new_records > account.record_quota
                    or account.bytes + new_bytes > account.byte_quota):
                return account
        return None

    def _host_at_share(self, sender: Sender, new_records: int, new_bytes: int) -> bool:
        return self._at_share(sender, new_records, new_bytes, ("ip", "local")) is not None

    def _room_for(self, sender: Sender, new_records: int, new_bytes: int, exclude: bytes | None) -> bool:
        """Make room for what `sender` brings, or say it cannot have it. A host (IP, or this node) at its share
        is refused: it is a sender we can identify. A prefix at its share is shared by 1/256 of all honest
        peers, so it is never refused; the room comes from inside that prefix (soonest-expiring first), which
        keeps the prefix from growing while the store is full."""
        if not self._needs_room(new_records, new_bytes):
            return True
        if self._host_at_share(sender, new_records, new_bytes):
            return False
        within = self._at_share(sender, new_records, new_bytes, ("prefix",))
        return self._make_room(new_records, new_bytes, exclude, within)

    def _make_room(self, new_records: int, new_bytes: int, exclude: bytes | None,
                   within: _Account | None = None) -> bool:
        """Evict until `new_records` and `new_bytes` fit: from `within` when given, else from the account
        furthest over its share (its soonest-expiring record), else the soonest-expiring record overall.
        Never evicts `exclude`."""
        held: list[tuple[list[HeapEntry], HeapEntry]] = []
        try:
            while self._needs_room(new_records, new_bytes):
                account = within if within is not None and within.records > 0 else None
                if account is None:
                    account = max(self._over, key=_Account.excess, default=None)
                heap = account.heap if account is not None else self._heap
                key_id = self._pop_soonest(heap, exclude, held)
                if key_id is None and account is not None:
                    key_id = self._pop_soonest(self._heap, exclude, held)
                if key_id is None:
                    return False  # nothing but `exclude` left
                self._remove(key_id)
                self.evicted += 1
            return True
        finally:
            for heap, entry in held:
                self._push(heap, entry)

    def _pop_live(self, heap: list[HeapEntry], until: float = math.inf) -> HeapEntry | None:
        """Pop the heap's soonest live entry due by `until`; stale entries (a removed or replaced record) are
        dropped on the way and postponed ones (a deadline that moved later) pushed back at their new place."""
        while heap and heap[0][0] <= until:
            entry = heapq.heappop(heap)
            self.work += 1
            deadline, generation, key_id = entry
            item = self._items.get(key_id)
            if item is None or item.generation != generation:
                continue
            if item.deadline > deadline:
                self._push(heap, (item.deadline, generation, key_id))
                continue
            return entry
        return None

    def _pop_soonest(self, heap: list[HeapEntry], exclude: bytes | None,
                     held: list[tuple[list[HeapEntry], HeapEntry]]) -> bytes | None:
        while (entry := self._pop_live(heap)) is not None:
            if entry[2] == exclude:
                held.append((heap, entry))
                continue
            return entry[2]
        return None

    def _insert(self, key_id: bytes, record: Record, wire: Any, size: int, deadline: float, local_time: float,
                sender: Sender) -> None:
        accounts = tuple(self._account(name) for name in sender.accounts)
        item = StoredItem(record, wire, local_time, 0, deadline, next(self._generations), accounts)
        self._items[key_id] = item
        for account in accounts:
            account.records += 1
        self._recharge(item, size)
        self._push_all(key_id, item)

    def _push_all(self, key_id: bytes, item: StoredItem) -> None:
        entry = (item.deadline, item.generation, key_id)
        self._push(self._heap, entry)
        for account in item.accounts:
            self._push(account.heap, entry)

    def _push(self, heap: list[HeapEntry], entry: HeapEntry) -> None:
        heapq.heappush(heap, entry)
        self.work += 1

    def _recharge(self, item: StoredItem, size: int) -> None:
        """Charge `item` `size` bytes from now on (its accounts and the total), keeping the over-share set."""
        delta = size - item.size
        item.size = size
        self.bytes += delta
        for account in item.accounts:
            account.bytes += delta
            self._classify(account)

    def _classify(self, account: _Account) -> None:
        if account.over():
            self._over.add(account)
        else:
            self._over.discard(account)

    def _remove(self, key_id: bytes) -> None:
        item = self._items.pop(key_id)
        self.bytes -= item.size
        for account in item.accounts:
            account.records -= 1
            account.bytes -= item.size
            if account.records == 0:
                self._over.discard(account)
                del self._accounts[account.name]  # its heap goes with it: only stale entries were left
                continue
            self._classify(account)
            if len(account.heap) > 2 * account.records + _COMPACT_SLACK:
                self._compact(account.heap)
        if len(self._heap) > 2 * len(self._items) + _COMPACT_SLACK:
            self._compact(self._heap)

    def _compact(self, heap: list[HeapEntry]) -> None:
        """Drop stale entries (in place: a caller may be popping this heap); amortized over the removals that
        made them stale."""
        self.work += len(heap)
        items = self._items
        live = []
        for entry in heap:
            item = items.get(entry[2])
            if item is not None and item.generation == entry[1]:
                live.append(entry)
        heap[:] = live
        heapq.heapify(heap)


def _charge(key_id: bytes, record: Record, wire: Any) -> int:
    """Bytes a held record costs: key, value and RECORD_OVERHEAD; a swarmd envelope is held twice (decoded,
    to merge, and encoded, to hand out), a plain value once (the wire value is the entry's own object)."""
    copies = 1 if record.stock else 2
    return len(key_id) + copies * records.encoded_size(wire) + RECORD_OVERHEAD


def _contains(merged: Record, incoming: Record) -> bool:
    """Did every entry of `incoming` survive the merge?"""
    if incoming.empty():
        return False
    if incoming.entry is not None and merged.entry != incoming.entry:
        return False
    return all(merged.subkeys.get(subkey) == entry for subkey, entry in incoming.subkeys.items())
