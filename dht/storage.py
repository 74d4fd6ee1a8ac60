"""Records this node holds as a replica, merged on every store, bounded in count.

Stored items keep the time the last store for them arrived (`refreshed_at`, on trio's clock since it schedules
work): republishing skips keys another replica refreshed recently, so one replica per interval does the work
instead of all k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from dht import records
from dht.records import Record


@dataclass
class StoredItem:
    record: Record
    wire: Any  # the DHT value to hand out (envelope bytes or the bare stock value)
    refreshed_at: float


class Storage:
    def __init__(self, max_records: int):
        self.max_records = max_records
        self._items: dict[bytes, StoredItem] = {}

    def store(self, key_id: bytes, incoming: Record, now: float, local_time: float) -> str:
        """Merge `incoming`; returns "accepted", "rejected" (an entry of it lost the merge: older, or owned by
        someone else) or "full" (a new key while at the record cap)."""
        item = self._items.get(key_id)
        existing = item.record.pruned(now) if item is not None else None
        if existing is not None and existing.empty():
            existing = None
        if existing is None and len(self._items) >= self.max_records:
            self.expire(now)
            if len(self._items) >= self.max_records:
                return "full"
        merged = records.merge(existing, incoming, now)
        if merged is None:
            self._items.pop(key_id, None)
            return "rejected"
        merged = records.fit(merged)
        self._items[key_id] = StoredItem(merged, records.encode(merged), local_time)
        return "accepted" if _contains(merged, incoming.pruned(now)) else "rejected"

    def get(self, key_id: bytes, now: float) -> StoredItem | None:
        item = self._items.get(key_id)
        if item is None:
            return None
        record = item.record.pruned(now)
        if record.empty():
            del self._items[key_id]
            return None
        if record != item.record:
            item.record, item.wire = record, records.encode(record)
        return item

    def expire(self, now: float) -> int:
        removed = 0
        for key_id in list(self._items):
            if self.get(key_id, now) is None:
                removed += 1
        return removed

    def items(self) -> Iterator[tuple[bytes, StoredItem]]:
        return iter(list(self._items.items()))

    def __len__(self) -> int:
        return len(self._items)


def _contains(merged: Record, incoming: Record) -> bool:
    """Did every entry of `incoming` survive the merge?"""
    if incoming.empty():
        return False
    if incoming.entry is not None and merged.entry != incoming.entry:
        return False
    return all(merged.subkeys.get(subkey) == entry for subkey, entry in incoming.subkeys.items())
