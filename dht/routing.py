"""The routing table: k-buckets from the kademlia package, maintained by us without asyncio.

`kademlia.routing.RoutingTable.add_contact` pings a full bucket's head with `asyncio.ensure_future`, which leaks
tasks under trio; here `add` only reports which contact should be probed and the trio driver does the probing.
A full bucket keeps newcomers in its replacement cache (`KBucket.replacement_nodes`), and a contact leaves the
table only after repeated failures (the driver calls `remove` then); the freshest replacement takes its place.

Limits against cheap Sybils (`TableLimits`; S/Kademlia and the eclipse defences of Kad and Ethereum's discv4):
anyone can make many node ids, but addresses and id positions cost more. So one IP (an IPv6 /64) holds at most
`per_ip_bucket` contacts of a bucket and `per_ip` of the whole table, and one bucket holds at most `per_prefix`
contacts whose ids fall in the same 1/2^prefix_bits slice of the bucket's range (honest ids spread evenly; a
Sybil swarm aimed at one region does not). Loopback addresses are exempt (a swarm on one machine), as are the
in-memory network's host names. With `difficulty > 0` a contact must also carry proof of work (`has_work`): its
id, the hash of its public key, must hash to `difficulty` leading zero bits, which costs its maker about
2^difficulty key generations (`identity_with_work`). A refused contact is counted in `refused` and never enters
the table or its replacement cache.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import ipaddress
import random
from collections import Counter
from dataclasses import dataclass

from kademlia.node import Node
from kademlia.routing import KBucket

from dht.storage import ip_account
from peer.p2p.identity import Identity
from peer.p2p.net import Address

ID_SPACE = 2**160
_WORK_DOMAIN = b"swarmd-dht-id-work-v1"


def work_bits(node_id: bytes) -> int:
    """Leading zero bits of sha256(domain + node id): the proof of work an id carries."""
    digest = int.from_bytes(hashlib.sha256(_WORK_DOMAIN + bytes(node_id)).digest(), "big")
    return 256 - digest.bit_length()


def has_work(node_id: bytes, difficulty: int) -> bool:
    return difficulty <= 0 or work_bits(node_id) >= difficulty


def identity_with_work(difficulty: int, max_tries: int = 1 << 24) -> Identity:
    """A fresh identity whose PeerID carries `difficulty` bits of work (about 2^difficulty key generations)."""
    for _ in range(max_tries):
        identity = Identity.generate()
        if has_work(identity.peer_id, difficulty):
            return identity
    raise ValueError(f"no identity with {difficulty} bits of work in {max_tries} tries")


@functools.lru_cache(maxsize=65536)
def _ip_limited(host: str) -> str | None:
    """The account an address counts against, or None when it is exempt (loopback, in-memory host names)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        return None
    return ip_account(host)


@dataclass(frozen=True)
class TableLimits:
    """See the module docstring; None switches a limit off."""

    per_ip_bucket: int | None = 2
    per_ip: int | None = 10
    per_prefix: int | None = 10
    prefix_bits: int = 3
    difficulty: int = 0


NO_LIMITS = TableLimits(None, None, None)


class RoutingTable:
    def __init__(self, node_id: bytes, k: int = 20, now: float = 0.0, limits: TableLimits = NO_LIMITS,
                 refused: Counter[str] | None = None):
        self.node = Node(node_id)
        self.k = k
        self.limits = limits
        self.refused = refused if refused is not None else Counter()
        self.buckets: list[KBucket] = [self._new_bucket(0, ID_SPACE, now)]
        self._flat: list[tuple[int, Node]] | None = None  # (long_id, node) of every contact; None = stale
        self._lows: list[int] | None = None  # each bucket's lowest id, in order (bisected); None = stale
        # (lowest id, log2 of its size, bucket) per bucket when every bucket is an aligned power-of-two range, as
        # splits make them (then `neighbors` visits buckets nearest first); [] when not; None = stale
        self._spans: list[tuple[int, int, KBucket]] | None = None
        self._per_ip: Counter[str] = Counter()  # contacts (not replacements) per limited IP account

    def _new_bucket(self, low: int, high: int, now: float) -> KBucket:
        bucket = KBucket(low, high, self.k)
        bucket.swarmd_touched = now  # our own clock (KBucket's own uses time.monotonic, wrong under MockClock)
        return bucket

    def bucket_index(self, long_id: int) -> int:
        """The bucket covering `long_id` (buckets tile the id space in order: a bisection over their lower
        bounds, on every add, get and lookup)."""
        lows = self._lows
        if lows is None:
            lows = self._lows = [bucket.range[0] for bucket in self.buckets]
        return max(0, bisect.bisect_right(lows, long_id) - 1)

    def _bucket_of(self, node_id: bytes) -> KBucket:
        # int.from_bytes is `Node.long_id` without building a Node (and its hex string) per call
        return self.buckets[self.bucket_index(int.from_bytes(node_id, "big"))]

    def __contains__(self, node_id: bytes) -> bool:
        return node_id in self._bucket_of(node_id).nodes

    def get(self, node_id: bytes) -> Node | None:
        return self._bucket_of(node_id).nodes.get(node_id)

    def refresh(self, node_id: bytes, address: Address, now: float) -> bool:
        """The contact held as `node_id` at `address` was heard from again: move it to its bucket's tail (the
        most recently seen end) and return True. False, and nothing changes, when the table holds no such
        contact there (the caller then admits or verifies it). Why not `get` then `add`: this runs for every
        request and every answer, and `add` repeats the bucket search and the limit checks a known contact has
        already passed."""
        bucket = self._bucket_of(node_id)
        known = bucket.nodes.get(node_id)
        if known is None or known.ip != address[0] or known.port != address[1]:
            return False
        bucket.nodes.move_to_end(node_id)
        bucket.swarmd_touched = now
        return True

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
        if self.get(node.id) is None and not self._admissible(node):
            return None
        while True:
            index = self.bucket_index(node.long_id)
            bucket = self.buckets[index]
            held = node.id in bucket.nodes
            if not held:
                self._flat = None
            added = bucket.add_node(node)
            if not held and added:  # a full bucket's add_node puts the newcomer in its replacement cache
                self._count(node, 1)
            if added:
                bucket.swarmd_touched = now
                return None
            if bucket.has_in_range(self.node) or _depth(bucket) % 5 != 0:
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
                self._lows = None
                self._spans = None
                continue
            return bucket.head()

    def load(self, buckets: list[tuple[int, int, list[Node]]], now: float) -> None:
        """Replace the table by `buckets` ((low, high, contacts), in id order, covering the id space the way
        splits would have). Why: a simulation of ten thousand nodes cannot afford to join every node through the
        network (minutes of lookups); it builds each table as joins would have filled it. The limits are not
        applied here: the caller chose the contacts."""
        loaded = []
        per_ip: Counter[str] = Counter()
        for low, high, contacts in buckets:
            bucket = self._new_bucket(low, high, now)
            bucket.nodes.update((node.id, node) for node in contacts[: self.k])
            loaded.append(bucket)
            per_ip.update(account for account in (_ip_limited(n.ip) for n in bucket.nodes.values() if n.ip)
                          if account is not None)
        self.buckets = loaded
        self._lows = None
        self._spans = None
        self._flat = None
        self._per_ip = per_ip

    def remove(self, node_id: bytes) -> bool:
        """Forget a contact that failed repeatedly; its bucket promotes the freshest replacement."""
        bucket = self._bucket_of(node_id)
        present = node_id in bucket.nodes or node_id in bucket.replacement_nodes
        before = dict(bucket.nodes)
        if node_id in bucket.nodes:
            self._flat = None
        bucket.remove_node(Node(node_id))
        for gone in before.keys() - bucket.nodes.keys():
            self._count(before[gone], -1)
        for promoted in bucket.nodes.keys() - before.keys():
            self._count(bucket.nodes[promoted], 1)
        return present

    # -------------------------------------------------------------------------------------------- Sybil limits

    def _count(self, node: Node, delta: int) -> None:
        account = _ip_limited(node.ip) if node.ip is not None else None
        if account is not None:
            self._per_ip[account] += delta
            if self._per_ip[account] <= 0:
                del self._per_ip[account]

    def _admissible(self, node: Node) -> bool:
        """A contact new to the table passes the limits (module docstring); a refusal is counted."""
        limits = self.limits
        if limits.difficulty > 0 and not has_work(node.id, limits.difficulty):
            self.refused["table_insufficient_work"] += 1
            return False
        bucket = self.buckets[self.bucket_index(node.long_id)]
        account = _ip_limited(node.ip) if node.ip is not None else None
        if account is not None:
            if limits.per_ip is not None and self._per_ip[account] >= limits.per_ip:
                self.refused["table_ip_limit"] += 1
                return False
            if limits.per_ip_bucket is not None:
                same = sum(1 for c in bucket.nodes.values() if c.ip is not None and _ip_limited(c.ip) == account)
                if same >= limits.per_ip_bucket:
                    self.refused["table_ip_limit"] += 1
                    return False
        if limits.per_prefix is not None:
            low, high = bucket.range
            shift = max(0, (high - low + 1).bit_length() - 1 - limits.prefix_bits)
            slice_of = (node.long_id - low) >> shift
            same = sum(1 for c in bucket.nodes.values() if (c.long_id - low) >> shift == slice_of)
            if same >= limits.per_prefix:
                self.refused["table_prefix_limit"] += 1
                return False
        return True

    def touch(self, target_id: bytes, now: float) -> None:
        """A lookup for `target_id` ran: its bucket needs no refresh for a while."""
        self._bucket_of(target_id).swarmd_touched = now

    def neighbors(self, target_id: bytes, k: int | None = None, exclude: bytes | None = None) -> list[Node]:
        """The k contacts closest to `target_id` (exact: the same as sorting every contact by distance).

        Why buckets nearest first rather than every contact: this runs for every find request served, every
        lookup and every held key a newcomer may be owed (policy.welcome_gifts), and a table of hundreds of
        contacts made it the heaviest function of a 500-node churn simulation. A bucket is an aligned range of
        2^s ids (splits halve ranges), so its ids' distances to the target fill one interval
        [((low ^ target) >> s) << s, ... + 2^s) and the intervals of different buckets do not overlap: once the
        nearest buckets hold enough contacts, no contact of a farther bucket can be closer than them."""
        want = (k or self.k) + 2  # the target itself and `exclude` may be among them
        target = int.from_bytes(target_id, "big")
        spans = self._bucket_spans()
        if not spans:  # a loaded table whose ranges are not aligned: every contact
            if self._flat is None:
                self._flat = [(node.long_id, node) for node in self.nodes()]
            candidates = [(long_id ^ target, node) for long_id, node in self._flat]  # ids are unique: no ties
        else:
            candidates = []
            for _, bucket in sorted([(((low ^ target) >> size) << size, bucket) for low, size, bucket in spans],
                                    key=_first):
                candidates += [(node.long_id ^ target, node) for node in bucket.nodes.values()]
                if len(candidates) >= want:
                    break
        closest = heapq.nsmallest(want, candidates)
        return [node for distance, node in closest if distance and node.id != exclude][: k or self.k]

    def _bucket_spans(self) -> list[tuple[int, int, KBucket]]:
        spans = self._spans
        if spans is None:
            spans = []
            for bucket in self.buckets:
                low, high = bucket.range
                size = (high - low + 1).bit_length() - 1
                if high - low + 1 != 1 << size or low & ((1 << size) - 1):
                    spans = []
                    break
                spans.append((low, size, bucket))
            self._spans = spans
        return spans

    def stale_bucket_ids(self, now: float, interval: float, rng: random.Random) -> list[bytes]:
        """A random id in each bucket not looked up for `interval` seconds (Kademlia's bucket refresh)."""
        return [_random_id(b, rng) for b in self.buckets if now - b.swarmd_touched >= interval]

    def random_ids_per_bucket(self, rng: random.Random) -> list[bytes]:
        return [_random_id(b, rng) for b in self.buckets]


def _first(pair: tuple[int, KBucket]) -> int:
    return pair[0]


def _depth(bucket: KBucket) -> int:
    """`KBucket.depth()` (the bits all its contacts' ids share) without building a bit string per contact: the
    prefix every id shares is the one the smallest and the largest share."""
    longs: list[int] = [node.long_id for node in bucket.nodes.values()]
    if not longs:
        return 0
    return ID_SPACE.bit_length() - 1 - (min(longs) ^ max(longs)).bit_length()


def _random_id(bucket: KBucket, rng: random.Random) -> bytes:
    low, high = bucket.range
    return rng.randrange(low, min(high, ID_SPACE - 1) + 1).to_bytes(20, "big")
