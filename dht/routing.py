"""The routing table: k-buckets from the kademlia package, maintained by us without asyncio.

`kademlia.routing.RoutingTable.add_contact` pings a full bucket's head with `asyncio.ensure_future`, which leaks
tasks under trio; here `add` only reports which contact should be probed and the trio driver does the probing.
A full bucket keeps newcomers in its replacement cache (`KBucket.replacement_nodes`), and a contact leaves the
table only after repeated failures (the driver calls `remove` then); the freshest replacement takes its place.
"""

from __future__ import annotations

import heapq
import random

from kademlia.node import Node
from kademlia.routing import KBucket

ID_SPACE = 2**160


class RoutingTable:
    def __init__(self, node_id: bytes, k: int = 20, now: float = 0.0):
        self.node = Node(node_id)
        self.k = k
        self.buckets: list[KBucket] = [self._new_bucket(0, ID_SPACE, now)]
        self._flat: list[tuple[int, Node]] | None = None  # (long_id, node) of every contact; None = stale

    def _new_bucket(self, low: int, high: int, now: float) -> KBucket:
        bucket = KBucket(low, high, self.k)
        bucket.swarmd_touched = now  # our own clock (KBucket's own uses time.monotonic, wrong under MockClock)
        return bucket

    def bucket_index(self, long_id: int) -> int:
        for index, bucket in enumerate(self.buckets):
            if bucket.range[0] <= long_id <= bucket.range[1]:
                return index
        return len(self.buckets) - 1

    def __contains__(self, node_id: bytes) -> bool:
        node = Node(node_id)
        return node_id in self.buckets[self.bucket_index(node.long_id)].nodes

    def get(self, node_id: bytes) -> Node | None:
        node = Node(node_id)
        return self.buckets[self.bucket_index(node.long_id)].nodes.get(node_id)

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self.buckets)

    def nodes(self) -> list[Node]:
        return [node for bucket in self.buckets for node in bucket.nodes.values()]

    def add(self, node: Node, now: float) -> Node | None:
        """Insert or refresh `node` (moved to its bucket's tail, the most recently seen end). Returns the head of
        a full bucket that could not split, so the caller can check whether that old contact is still alive;
        the newcomer waits in the replacement cache meanwhile."""
        if node.id == self.node.id:
            return None
        while True:
            index = self.bucket_index(node.long_id)
            bucket = self.buckets[index]
            if node.id not in bucket.nodes:
                self._flat = None
            if bucket.add_node(node):
                bucket.swarmd_touched = now
                return None
            if bucket.has_in_range(self.node) or bucket.depth() % 5 != 0:
                low, high = bucket.range
                middle = (low + high) // 2
                first, second = self._new_bucket(low, middle, now), self._new_bucket(middle + 1, high, now)
                for contact in list(bucket.nodes.values()):
                    (first if contact.long_id <= middle else second).add_node(contact)
                for contact in list(bucket.replacement_nodes.values()):
                    target = first if contact.long_id <= middle else second
                    if len(target) < self.k:
                        target.add_node(contact)
                    else:
                        target.replacement_nodes[contact.id] = contact
                self.buckets[index : index + 1] = [first, second]
                continue
            return bucket.head()

    def remove(self, node_id: bytes) -> bool:
        """Forget a contact that failed repeatedly; its bucket promotes the freshest replacement."""
        node = Node(node_id)
        bucket = self.buckets[self.bucket_index(node.long_id)]
        present = node_id in bucket.nodes or node_id in bucket.replacement_nodes
        if node_id in bucket.nodes:
            self._flat = None
        bucket.remove_node(node)
        return present

    def touch(self, target_id: bytes, now: float) -> None:
        """A lookup for `target_id` ran: its bucket needs no refresh for a while."""
        self.buckets[self.bucket_index(Node(target_id).long_id)].swarmd_touched = now

    def neighbors(self, target_id: bytes, k: int | None = None, exclude: bytes | None = None) -> list[Node]:
        """The k contacts closest to `target_id` (exact: every bucket is considered)."""
        if self._flat is None:
            self._flat = [(node.long_id, node) for node in self.nodes()]
        target = int.from_bytes(target_id, "big")
        distances = [(long_id ^ target, node) for long_id, node in self._flat]  # ids are unique: no ties
        closest = heapq.nsmallest((k or self.k) + 2, distances)
        return [node for distance, node in closest if distance and node.id != exclude][: k or self.k]

    def stale_bucket_ids(self, now: float, interval: float, rng: random.Random) -> list[bytes]:
        """A random id in each bucket not looked up for `interval` seconds (Kademlia's bucket refresh)."""
        return [_random_id(b, rng) for b in self.buckets if now - b.swarmd_touched >= interval]

    def random_ids_per_bucket(self, rng: random.Random) -> list[bytes]:
        return [_random_id(b, rng) for b in self.buckets]


def _random_id(bucket: KBucket, rng: random.Random) -> bytes:
    low, high = bucket.range
    return rng.randrange(low, min(high, ID_SPACE - 1) + 1).to_bytes(20, "big")
