"""The DHT server's request handling without I/O: a decoded request in, the reply and its side effects out.

`Server.handle(request, now, local_now)` takes a `protocol.Request` (already decoded and checked by
`protocol.DatagramProtocol`), the DHT clock (`now`, for record expirations) and the scheduling clock
(`local_now`, for contact bookkeeping), and returns an `Outcome`: the reply to send (or NO_REPLY), the sender
to ping back before it may enter the routing table (see dht/policy.py), and the keys stored. The routing table,
peer book and storage it updates are plain objects; no trio, sockets or clocks here, so tests feed it requests
directly (tests/dht/test_server_core.py) and the trio driver in dht/node.py only moves datagrams and runs the
pings.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dht import protocol as proto
from dht import records
from dht.peers import PeerBook
from dht.policy import Contacts
from dht.routing import RoutingTable
from dht.storage import Sender, Storage

Address = tuple[str, int]
MAX_REPLY_BYTES = 60000


class _NoReply:
    def __repr__(self) -> str:
        return "NO_REPLY"


NO_REPLY: Any = _NoReply()


@dataclass
class Outcome:
    """What serving one request produced."""

    reply: Any = NO_REPLY
    verify: Address | None = None  # ping this sender back: it enters the routing table once it answers
    stored: list[bytes] = field(default_factory=list)  # key ids accepted into storage


class Server:
    """Answers the stock RPCs and the swarmd extensions from the node's table and storage."""

    def __init__(self, peer_id: bytes, *, client_mode: bool, k: int, table: RoutingTable, peers: PeerBook,
                 storage: Storage, contacts: Contacts, dropped: Counter[str] | None = None,
                 served: Counter[str] | None = None):
        self.peer_id = peer_id
        self.client_mode = client_mode
        self.k = k
        self.table = table
        self.peers = peers
        self.storage = storage
        self.contacts = contacts
        self.dropped = dropped if dropped is not None else Counter()
        self.served = served if served is not None else Counter()

    def handle(self, request: proto.Request, now: float, local_now: float) -> Outcome:
        """Serve one request. A client-mode node answers only `stun` and `swarmd_hello` (its msg ids say it is
        a client, so nobody should ask it anything else)."""
        name, args, address = request.name, request.args, request.address
        self.contacts.note_flags(address, request.msg_id)
        outcome = Outcome()
        if name == "stun":
            self.served[name] += 1
            outcome.reply = [address[0], address[1]]
            return outcome
        sender = args[0]
        if name == "swarmd_hello":
            self.served[name] += 1
            self.contacts.learn_hello(address, args[1])
            if not self.client_mode:
                self._note_sender(sender, address, local_now, outcome)
            outcome.reply = {"id": bytes(self.peer_id), "client": self.client_mode, "version": 1}
            return outcome
        if self.client_mode:
            self.dropped["client_mode"] += 1
            return outcome
        self.served[name] += 1
        self._note_sender(sender, address, local_now, outcome)
        if name == "ping":
            outcome.reply = bytes(self.peer_id)
        elif name == "find_node":
            outcome.reply = self.contacts_for(args[1], sender)
        elif name == "find_value":
            outcome.reply = self.find_value(args[1], sender, now)
        elif name == "store":
            outcome.reply = self.store_local(args[1], args[2], now, local_now, Sender.remote(address[0], sender),
                                             outcome=outcome)
        elif name == "swarmd_store_many":
            origin = Sender.remote(address[0], sender)
            outcome.reply = [self.store_local(item[0], item[1], now, local_now, origin, offer=len(item) == 3,
                                              outcome=outcome) for item in args[1]]
        elif name == "swarmd_store_find":  # store, and answer like find_node: one round trip does both
            origin = Sender.remote(address[0], sender)
            outcome.reply = [[self.store_local(item[0], item[1], now, local_now, origin, offer=len(item) == 3,
                                               outcome=outcome),
                              self.contacts_for(item[0], sender)] for item in args[1]]
        elif name == "swarmd_find_many":
            outcome.reply = self.find_many(args[1], sender, now)
        return outcome

    def _note_sender(self, node_id: bytes, address: Address, local_now: float, outcome: Outcome) -> None:
        if self.contacts.heard_request(node_id, address, local_now):
            outcome.verify = address

    def contacts_for(self, key_id: bytes, exclude: bytes) -> list[list[Any]]:
        """The k contacts closest to `key_id` as a find_node answer (never the asker itself)."""
        return [[n.id, n.ip, n.port] for n in self.table.neighbors(key_id, self.k, exclude=exclude)]

    def find_value(self, key_id: bytes, sender: bytes, now: float) -> Any:
        item = self.storage.get(key_id, now)
        if item is None:
            return self.contacts_for(key_id, sender)
        return {"value": item.wire}

    def store_local(self, key_id: bytes, value: Any, now: float, local_now: float, origin: Sender,
                    offer: bool = False, outcome: Outcome | None = None) -> bool:
        """Store a value a peer sent; `origin` (its IP and node id) is what the record is charged to."""
        record = records.decode(key_id, value, now)
        if record is None:
            self.dropped["invalid_record"] += 1
            return False
        if offer and record.stock and self.storage.get(key_id, now) is not None:
            return True  # an offered plain value only fills a gap (see protocol.OFFER) and renews no TTL
        result = self.storage.store(key_id, record, now, local_now, origin)
        if result == "full":
            self.dropped["storage_full"] += 1
        if result == "accepted" and outcome is not None:
            outcome.stored.append(key_id)
        return result == "accepted"

    def find_many(self, key_ids: list[bytes], sender: bytes, now: float) -> list[Any]:
        """One answer per key ({"value": v} or contacts); answers that would push the reply past one datagram
        are sent as nil, and the asker falls back to find_value for those keys."""
        answers: list[Any] = []
        size = 0
        for key_id in key_ids:
            answer = self.find_value(key_id, sender, now)
            answer_size = len(proto.pack(answer))
            if size + answer_size > MAX_REPLY_BYTES:
                answers.append(None)
                continue
            size += answer_size
            answers.append(answer)
        return answers
