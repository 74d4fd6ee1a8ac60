"""The DHT node's decisions without I/O: who enters the routing table, what peers speak, which newcomer gets
which records, which readers repair which replicas, and how many requests one IP may send.

Everything here is a plain object or function: no trio, no sockets, no clock (times are passed in as numbers).
Each returns a plan (a contact to ping, records to send to whom, a verdict) that the trio driver in dht/node.py
executes; tests drive them directly (tests/dht/test_server_core.py).

Who enters the routing table (S/Kademlia's rule, section 4.1 of Baumgart and Mies): only a contact that
answered a request of ours. A request from a sender the table does not hold at that address makes the node ping
it back (`Contacts.heard_request` says so); the sender enters when the ping's answer names its id
(`Contacts.answered`). A flood of datagrams claiming made-up node ids from a few addresses therefore never
reaches the table: nobody at those addresses answers with those ids, so lookups, `find_node` replies and
welcome passes only ever see servers that answered. Verification pings are bounded (one in flight per address,
`max_verifications` in all and a quarter of that per IP, a failed address left alone for a while), so a flood
costs at most a few dozen small pings per second. A stock kademlia node answers `ping` like any node, so it
still joins; a swarmd client announces itself in its msg ids and is never pinged or added.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from kademlia.node import Node

from dht import protocol as proto
from dht import records
from dht.lookup import Target
from dht.peers import PeerBook
from dht.records import Record
from dht.routing import RoutingTable
from dht.storage import Storage, ip_account

Address = tuple[str, int]

WELCOME_BATCH_DELAY = 0.05
# A welcome pass costs one neighbour search per held record, plus a check per record and newcomer: passes are at
# least this far apart and take at most WELCOME_PER_PASS newcomers (the rest wait for the next pass; past
# WELCOME_QUEUE_LIMIT waiting, newcomers are skipped), so a burst of joins costs about what ordinary churn costs.
# Skipped newcomers still get records through republish and read repair.
WELCOME_MIN_INTERVAL = 1.0
WELCOME_PER_PASS = 64
WELCOME_QUEUE_LIMIT = 1024
READ_REPAIRS = 2  # per key and read: close replicas found without the value get it


# -------------------------------------------------------------------------------------------- routing-table entry


@dataclass(frozen=True)
class Admission:
    """What an answering server's arrival in the table asks of the driver."""

    check_head: Node | None = None  # a full bucket's oldest contact, silent for a while: ping it
    welcome: Node | None = None  # a server new to the table: hand it the records it should hold


NOTHING = Admission()


class Contacts:
    """Routing-table entry (verified contacts only, see the module docstring) and what each address speaks."""

    def __init__(self, peer_id: bytes, table: RoutingTable, peers: PeerBook, *, client_mode: bool,
                 head_check_after: float, max_verifications: int, verify_backoff: float,
                 dropped: Counter[str] | None = None, max_failed: int = 4096):
        self.peer_id = peer_id
        self.table = table
        self.peers = peers
        self.client_mode = client_mode
        self.head_check_after = head_check_after
        self.max_verifications = max_verifications
        self.max_verifications_per_ip = max(1, max_verifications // 4)
        self.verify_backoff = verify_backoff
        self.dropped = dropped if dropped is not None else Counter()
        self._verifying: set[Address] = set()
        self._verifying_per_ip: Counter[str] = Counter()
        self._failed: OrderedDict[Address, float] = OrderedDict()  # address -> time before which it is not pinged
        self._max_failed = max_failed
        self._checking: set[bytes] = set()  # bucket heads being pinged

    # requests ---------------------------------------------------------------------------------------------

    def note_flags(self, address: Address, msg_id: bytes) -> None:
        """A request's msg id says what sent it: stock software, a swarmd server or a swarmd client."""
        info = self.peers.get(address)
        flags = proto.swarmd_flags(msg_id)
        if flags is None:
            info.swarmd = False  # stock software sent this (our requests always carry the mark)
        else:
            info.swarmd = True
            info.client = bool(flags & proto.FLAG_CLIENT)

    def heard_request(self, node_id: bytes, address: Address, now: float) -> bool:
        """A request from `address` claiming `node_id`. A contact the table holds there is refreshed; anyone
        else is to be pinged back (True: the driver sends a ping and reports `verification_done`)."""
        info = self.peers.get(address)
        self.peers.heard_from(address, now)
        if node_id == self.peer_id or info.client:
            return False
        if self.table.refresh(node_id, address, now):
            return False
        return self._start_verification(address, now)

    def _start_verification(self, address: Address, now: float) -> bool:
        if address in self._verifying:
            return False
        retry_at = self._failed.get(address)
        if retry_at is not None:
            if now < retry_at:
                return False
            del self._failed[address]
        if (len(self._verifying) >= self.max_verifications
                or self._verifying_per_ip[address[0]] >= self.max_verifications_per_ip):
            self.dropped["verification_skipped"] += 1
            return False
        self._verifying.add(address)
        self._verifying_per_ip[address[0]] += 1
        return True

    def verification_done(self, address: Address, answered: bool, now: float) -> None:
        """The ping planned by `heard_request` ended; an address that did not answer is not pinged again for
        `verify_backoff` seconds, however many requests it sends meanwhile."""
        if address not in self._verifying:
            return
        self._verifying.discard(address)
        self._verifying_per_ip[address[0]] -= 1
        if self._verifying_per_ip[address[0]] <= 0:
            del self._verifying_per_ip[address[0]]
        if not answered:
            self._failed[address] = now + self.verify_backoff
            self._failed.move_to_end(address)
            while len(self._failed) > self._max_failed:
                self._failed.popitem(last=False)

    @property
    def verifying(self) -> int:
        return len(self._verifying)

    # answers ----------------------------------------------------------------------------------------------

    def answered(self, node_id: bytes, address: Address, now: float) -> Admission:
        """A server at `address` answered a request of ours as `node_id`: it belongs in the routing table.
        Another id the table held at that address (a restart with a new identity) leaves it."""
        info = self.peers.get(address)
        if info.client or node_id == self.peer_id:
            return NOTHING
        if info.node_id is not None and info.node_id != node_id:
            previous = self.table.get(info.node_id)
            if previous is not None and (previous.ip, previous.port) == address:
                self.table.remove(info.node_id)
        info.node_id = node_id
        if self.table.refresh(node_id, address, now):
            return NOTHING
        existing = self.table.get(node_id)
        node = Node(node_id, address[0], address[1])
        head = self.table.add(node, now)
        check = None
        if head is not None and head.id not in self._checking:
            head_info = self.peers.known((head.ip, head.port))
            if head_info is None or now - head_info.last_seen > self.head_check_after:
                self._checking.add(head.id)
                check = head
        welcome = node if existing is None and node_id in self.table and not self.client_mode else None
        return Admission(check, welcome) if check is not None or welcome is not None else NOTHING

    def head_check_done(self, head_id: bytes) -> None:
        self._checking.discard(head_id)

    # capabilities -----------------------------------------------------------------------------------------

    def needs_probe(self, address: Address) -> bool:
        """Not known yet whether `address` speaks the swarmd extensions: ask it once (`swarmd_hello`)."""
        return self.peers.get(address).swarmd is None

    def probe_wait(self, address: Address, probe_timeout: float, max_timeout: float) -> float:
        """How long silence after a `swarmd_hello` takes to mean "stock peer": a few RTTs, within bounds."""
        return min(max_timeout, max(probe_timeout, 4 * self.peers.timeout(address)))

    def probe_silent(self, address: Address) -> None:
        info = self.peers.get(address)
        if info.swarmd is None:
            info.swarmd = False  # silence is the stock answer (rpcudp ignores unknown methods); never re-asked

    def learn_hello(self, address: Address, hello: Any) -> None:
        """A `swarmd_hello` (request arguments or answer): the peer speaks swarmd, and says if it is a client
        (then it leaves the routing table)."""
        info = self.peers.get(address)
        if isinstance(hello, dict):
            info.swarmd = True
            info.client = hello.get("client") is True
            if isinstance(hello.get("id"), bytes) and len(hello["id"]) == proto.NODE_ID_BYTES:
                info.node_id = hello["id"]
                if info.client:
                    self.table.remove(hello["id"])
        else:
            info.swarmd = False


# --------------------------------------------------------------------------------------------------- gifts


@dataclass
class Gifts:
    """Records to send, per peer ((node id, address) -> [(key id, wire value)]); keys in `offers` are plain
    values that go as protocol.OFFER items (they only fill a gap at the receiver)."""

    items: dict[tuple[bytes, Address], list[tuple[bytes, Any]]] = field(default_factory=dict)
    offers: set[bytes] = field(default_factory=set)

    def add(self, node_id: bytes, address: Address, key_id: bytes, wire: Any) -> None:
        self.items.setdefault((node_id, address), []).append((key_id, wire))

    def __bool__(self) -> bool:
        return bool(self.items)


class WelcomeQueue:
    """Newcomers waiting for a welcome pass, and when the next pass may run (WELCOME_* above)."""

    def __init__(self, *, batch_delay: float = WELCOME_BATCH_DELAY, min_interval: float = WELCOME_MIN_INTERVAL,
                 per_pass: int = WELCOME_PER_PASS, limit: int = WELCOME_QUEUE_LIMIT):
        self.batch_delay = batch_delay
        self.min_interval = min_interval
        self.per_pass = per_pass
        self.limit = limit
        self._queue: dict[bytes, tuple[Node, float]] = {}  # newcomer id -> (contact, when first seen)
        self._scheduled = False
        self._last_pass = -math.inf

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, node: Node, now: float) -> str:
        """"skipped" (the queue is full), "queued", or "schedule" (queued, and the driver must start a pass)."""
        if len(self._queue) >= self.limit and node.id not in self._queue:
            return "skipped"
        self._queue.setdefault(node.id, (node, now))
        if self._scheduled:
            return "queued"
        self._scheduled = True
        return "schedule"

    def pass_at(self, now: float) -> float:
        """When a pass scheduled at `now` runs: after a short batching delay, and min_interval after the last."""
        return max(now + self.batch_delay, self._last_pass + self.min_interval)

    def take(self, now: float) -> tuple[list[tuple[Node, float]], bool]:
        """The pass runs now: up to per_pass newcomers (first come first), and whether another pass is needed."""
        self._last_pass = now
        batch = [self._queue.pop(node_id) for node_id in list(self._queue)[: self.per_pass]]
        self._scheduled = bool(self._queue)
        return batch, self._scheduled


def welcome_gifts(batch: list[tuple[Node, float]], storage: Storage, table: RoutingTable, peer_id: bytes, k: int,
                  now: float) -> Gifts:
    """New servers appeared: the records each should get (the stock rule, section 2.5 of the paper: it is
    closer to the key than our k-th closest other contact, and we are closer than all of them). One neighbour
    search per held key for the whole batch. A record stored after a newcomer was first seen is skipped for it:
    that store's own lookup already included it."""
    gifts = Gifts()
    if not batch:
        return gifts
    seen_at = {node.id: at for node, at in batch}
    newcomers = [node for node, _ in batch]
    known_since = max(seen_at.values())
    my_long = int.from_bytes(peer_id, "big")
    for key_id, item in storage.items():
        if item.refreshed_at >= known_since:
            continue
        key_long = int.from_bytes(key_id, "big")  # key ids are digests already: never hash them again
        others = [n for n in table.neighbors(key_id, k + len(newcomers)) if n.id not in seen_at][:k]
        if others and (my_long ^ key_long) >= (others[0].long_id ^ key_long):
            continue  # a closer holder exists and will do it
        farthest = (others[-1].long_id ^ key_long) if len(others) >= k else math.inf
        receivers = [node for node in newcomers if (node.long_id ^ key_long) < farthest and node.id in table
                     and item.refreshed_at < seen_at[node.id]]
        if not receivers:
            continue
        record = item.record.pruned(now)
        if record.empty():
            continue
        wire = records.encode(record)
        if record.stock:
            gifts.offers.add(key_id)
        for node in receivers:
            gifts.add(node.id, (node.ip, node.port), key_id, wire)
    return gifts


def repair_gifts(targets: dict[bytes, Target], found: Iterable[tuple[bytes, Record | None]], k: int,
                 per_key: int = READ_REPAIRS) -> Gifts:
    """Read repair: of a key's k closest peers that answered, up to `per_key` that answered without the value
    get the merged record, so a replica set thinned by churn fills up again as the key is read. The merge of
    many replicas' dictionaries can outgrow one datagram: it is trimmed the way a holder trims it (records.fit)."""
    gifts = Gifts()
    for key_id, record in found:
        target = targets.get(key_id)
        if record is None or target is None or not target.without_value:
            continue
        closest = {c.node_id for c in target.answered(k)}
        record = records.fit(record)
        wire = records.encode(record)
        if record.stock:
            gifts.offers.add(key_id)
        for candidate in target.without_value[:per_key]:
            if candidate.node_id in closest:
                gifts.add(candidate.node_id, candidate.address, key_id, wire)
    return gifts


# ------------------------------------------------------------------------------------------- per-IP request limit


class IPRequestLimit:
    """A token bucket per source IP for request datagrams, checked on the first byte, before any decoding.

    Why before decoding: at tens of thousands of datagrams per second from one host, msgpack decoding and
    serving is what the process cannot keep up with; the kernel then drops datagrams at the socket, honest ones
    included. Refusing the excess of one IP costs a dict lookup and some arithmetic, so the node keeps reading
    its socket and the honest share of it gets through.

    Why a plain per-IP bucket with a high rate, not a share of the node's traffic: tests and benchmarks run
    dozens of honest nodes on 127.0.0.1, where one IP is 100% of a node's traffic, so a share rule would bind on
    them exactly as on a flooder; what separates the two is volume. The defaults (DHTConfig: 5,000 requests/s,
    bursts of 10,000) sit ~9x above the busiest honest loopback case measured (bench_dht, 64 nodes on one IP:
    at most 58 requests in any 100 ms from 127.0.0.1 to one node, the joins included) and below what one
    Python node serves on a quiet core (~50 us a request, ~20,000/s), so one IP can never take all of the node.
    A NATed site with many nodes behind one address stays far below it too. The per-address limit
    (PeerBook.allow_request, 500/s per IP and port) still applies after decoding. Bounded memory: at most `max_ips`
    entries, the least recently seen IP forgotten first. IPv6 senders are counted per /64 (the block one host
    usually gets), as storage shares are.
    """

    def __init__(self, rate: float, burst: float, max_ips: int = 65536):
        self.rate = rate
        self.burst = burst
        self.max_ips = max_ips
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # ip -> [tokens, refilled_at]

    def allow(self, ip: str, now: float) -> bool:
        if ":" in ip:
            ip = ip_account(ip)
        bucket = self._buckets.get(ip)
        if bucket is None:
            if len(self._buckets) >= self.max_ips:
                self._buckets.popitem(last=False)
            bucket = self._buckets[ip] = [self.burst, now]
        else:
            self._buckets.move_to_end(ip)
            tokens = bucket[0] + (now - bucket[1]) * self.rate
            bucket[0] = tokens if tokens < self.burst else self.burst
            bucket[1] = now
        if bucket[0] < 1.0:
            return False
        bucket[0] -= 1.0
        return True

    def __len__(self) -> int:
        return len(self._buckets)
