"""The DHT datagram protocol without I/O: rpcudp framing, byte for byte as the `kademlia` package speaks it.

    request: 0x00 | msg_id (20 bytes) | msgpack([name, args])
    reply:   0x01 | msg_id (20 bytes) | msgpack(result)

`umsgpack` (used by rpcudp) and the C `msgpack` package with `use_bin_type=True` produce the same bytes: str as
str, bytes as bin, tuples and lists as arrays, floats as float64. Stock RPCs are `ping`, `store`, `find_node`,
`find_value` and `stun`; swarmd adds `swarmd_*` extension RPCs that stock nodes simply never answer.

`DatagramProtocol` takes datagrams in and gives events out; it keeps the table of outstanding requests so that a
reply is accepted only from the address the request went to (the stock package matches by msg id alone, so any
host that sees a msg id can forge the answer). No sockets, clocks or trio here: the driver in `dht/node.py` does
the waiting and the timeouts, and tests feed this object arbitrary bytes.

Private swarms (`--swarm-key`): every datagram, request and reply, ends with a 16-byte tag, HMAC-SHA256 truncated,
under a key derived from the swarm key with its own label (`dht-mac`, never the handshake's key), over all the
bytes before it. `receive` checks the tag before anything else is decoded and drops a datagram with a bad or
missing one (`Dropped("bad_mac")`, counted in the node's stats), so a non-holder's datagram is never parsed,
never answered and never reaches the routing table or the store: all it learns is that the port answers nothing.
Stock `kademlia` nodes cannot take part (they send no tag), which is what a private swarm means. The tag covers
the msg id, so a reply cannot be moved to another request; what it does not stop is an eavesdropper replaying a
holder's datagram verbatim (a duplicate request: the same answers or the same store again). An open swarm (no
key) sends and accepts exactly rpcudp's bytes, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from peer.p2p.identity import SwarmKey
from peer.p2p.net import Address

REQUEST = 0x00
REPLY = 0x01
MSG_ID_BYTES = 20
NODE_ID_BYTES = 20
MAX_REQUEST_PAYLOAD = 8192  # rpcudp refuses to send [name, args] packed larger than this
MAX_DATAGRAM = 65507

STOCK_VALUE_TYPES = (int, float, bool, str, bytes)
MAC_BYTES = 16  # 128 bits: a forger's chance per datagram is 2**-128, at the cost of 16 bytes
MAC_LABEL = b"dht-mac"


def pack(obj: Any) -> bytes:
    """msgpack exactly as umsgpack writes it."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def unpack(data: bytes) -> Any:
    """msgpack as umsgpack reads it (str -> str, bin -> bytes, arrays -> lists, any hashable map key)."""
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)


# Our request msg ids start with a 3-byte mark and a flags byte, then 16 random bytes. rpcudp treats msg ids as
# opaque (it draws sha1 of random bytes and echoes the id back), so stock nodes are unaffected, while a swarmd node
# learns from any request it receives whether the sender runs swarmd and whether it is a client, with no extra
# round trip. A stock id carries the mark by chance with probability 2**-24; such a peer is taken for swarmd until
# an extension request to it goes unanswered (then it is treated as stock).
SWARMD_MARK = b"swd"
FLAG_CLIENT = 0x01


def new_msg_id(random_bytes: Callable[[int], bytes] = os.urandom, flags: int | None = None) -> bytes:
    """rpcudp draws sha1(32 random bytes); any 20 unpredictable bytes are equivalent on the wire."""
    if flags is None:
        return hashlib.sha1(random_bytes(32)).digest()
    return SWARMD_MARK + bytes([flags]) + random_bytes(16)


def swarmd_flags(msg_id: bytes) -> int | None:
    """The flags of a request sent by a swarmd node, None for a stock sender."""
    if msg_id[:3] == SWARMD_MARK and msg_id[3] <= FLAG_CLIENT:
        return msg_id[3]
    return None


def batches(method: str, items: list[tuple[Any, ...]]) -> tuple[list[list[list[Any]]], list[bytes]]:
    """Split (key, value) or (key, value, OFFER) items into `method` requests ([node_id, [item, ...]]) that fit
    the rpcudp size cap and MAX_BATCH_KEYS. Returns (groups, keys of items too large for any such request): those
    go as stock `store` requests, whose smaller framing always fits a record of at most MAX_RECORD_BYTES."""
    overhead = len(pack([method, [b"\x00" * NODE_ID_BYTES, []]])) + 2  # + array header growth
    room = MAX_REQUEST_PAYLOAD - overhead
    groups: list[list[list[Any]]] = [[]]
    oversized: list[bytes] = []
    size = 0
    for item in items:
        item_size = len(pack(list(item)))
        if item_size > room:
            oversized.append(item[0])
            continue
        if groups[-1] and (size + item_size > room or len(groups[-1]) >= MAX_BATCH_KEYS):
            groups.append([])
            size = 0
        groups[-1].append(list(item))
        size += item_size
    return (groups if groups[0] else []), oversized


def encode_request(msg_id: bytes, name: str, args: list[Any] | tuple[Any, ...]) -> bytes:
    payload = pack([name, list(args)])
    if len(payload) > MAX_REQUEST_PAYLOAD:
        raise RequestTooLarge(len(payload))
    return bytes([REQUEST]) + msg_id + payload


def encode_reply(msg_id: bytes, result: Any) -> bytes:
    return bytes([REPLY]) + msg_id + pack(result)


class RequestTooLarge(ValueError):
    def __init__(self, size: int):
        super().__init__(f"request of {size} bytes exceeds the rpcudp limit of {MAX_REQUEST_PAYLOAD} bytes")
        self.size = size


# ------------------------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Request:
    """A well-formed request: `args` already checked against the RPC's expected shape."""

    msg_id: bytes
    name: str
    args: list[Any]
    address: Address


@dataclass(frozen=True)
class Reply:
    """The answer to one of our outstanding requests, from the address we sent it to."""

    msg_id: bytes
    name: str
    result: Any
    address: Address


@dataclass(frozen=True)
class Dropped:
    """A datagram we ignore; `reason` is the counter it goes to in `DHTNode.stats()`."""

    reason: str
    address: Address


Event = Request | Reply | Dropped


# ------------------------------------------------------------------------------------------- argument checking


def _is_id(value: Any) -> bool:
    return isinstance(value, bytes) and len(value) == NODE_ID_BYTES


def _is_key(value: Any) -> bool:
    return isinstance(value, bytes) and len(value) == NODE_ID_BYTES


def is_stock_value(value: Any) -> bool:
    """Values a stock node can store and hand back; anything else (lists, maps, nil) is refused, so a hostile
    peer cannot plant an unhashable value that breaks readers."""
    return isinstance(value, STOCK_VALUE_TYPES)


def _valid_key_list(keys: Any, limit: int) -> bool:
    return isinstance(keys, list) and 0 < len(keys) <= limit and all(_is_key(k) for k in keys)


MAX_BATCH_KEYS = 64
# A store item marked OFFER carries a plain stock value a node re-sends on its own initiative (republish,
# welcome, read repair): the receiver keeps whatever it holds for the key and only fills a gap. Plain values have
# no expiration to compare, so this is what stops a stale copy from overwriting a newer write network-wide.
OFFER = "offer"


KNOWN_METHODS = frozenset(
    {"ping", "store", "find_node", "find_value", "stun",
     "swarmd_hello", "swarmd_find_many", "swarmd_store_many", "swarmd_store_find"}
)


def check_request_args(name: str, args: list[Any]) -> bool:
    """True when `args` has the shape kademlia 2.2.3 sends for RPC `name` (first argument: sender's node id)."""
    if name == "stun":
        return args == []
    if not args or not _is_id(args[0]):
        return False
    if name == "ping":
        return len(args) == 1
    if name in ("find_node", "find_value"):
        return len(args) == 2 and _is_key(args[1])
    if name == "store":
        return len(args) == 3 and _is_key(args[1]) and is_stock_value(args[2])
    if name == "swarmd_hello":  # [nodeid, {"client": bool}]
        return len(args) == 2 and isinstance(args[1], dict)
    if name == "swarmd_find_many":  # [nodeid, [key, ...]]
        return len(args) == 2 and _valid_key_list(args[1], MAX_BATCH_KEYS)
    if name in ("swarmd_store_many", "swarmd_store_find"):  # [nodeid, [[key, value(, "offer")], ...]]
        items = args[1] if len(args) == 2 else None
        return (
            isinstance(items, list)
            and 0 < len(items) <= MAX_BATCH_KEYS
            and all(
                isinstance(item, list)
                and (len(item) == 2 or (len(item) == 3 and item[2] == OFFER))
                and _is_key(item[0])
                and is_stock_value(item[1])
                for item in items
            )
        )
    return False


def parse_contacts(result: Any, limit: int) -> list[tuple[bytes, str, int]] | None:
    """A find_node answer: [[id20, ip, port], ...]. Malformed entries are skipped, the list is cut to `limit`
    (a peer answering with thousands of contacts gets the first k considered, never more); None if the answer
    is not a list at all."""
    if not isinstance(result, list):
        return None
    contacts: list[tuple[bytes, str, int]] = []
    for entry in result:
        if len(contacts) >= limit:
            break
        if (
            isinstance(entry, list)
            and len(entry) == 3
            and _is_id(entry[0])
            and isinstance(entry[1], str)
            and 0 < len(entry[1]) <= 255
            and isinstance(entry[2], int)
            and not isinstance(entry[2], bool)
            and 0 < entry[2] < 65536
        ):
            contacts.append((entry[0], entry[1], entry[2]))
    return contacts


# ------------------------------------------------------------------------------------------------- the protocol


@dataclass
class _Outstanding:
    name: str
    address: Address


class DatagramProtocol:
    """Frames requests and replies and matches replies to requests by (msg id, address)."""

    def __init__(self, random_bytes: Callable[[int], bytes] = os.urandom, flags: int | None = None,
                 swarm_key: SwarmKey | None = None):
        """`flags`: mark our msg ids as a swarmd node's (see SWARMD_MARK); None sends plain rpcudp ids.
        `swarm_key`: a private swarm's; every datagram carries a MAC and others are dropped (see the module)."""
        self._mac_key = swarm_key.derive(MAC_LABEL) if swarm_key is not None else None
        self._random_bytes = random_bytes
        self._flags = flags
        self._outstanding: dict[bytes, _Outstanding] = {}

    def request(self, address: Address, name: str, args: list[Any] | tuple[Any, ...]) -> tuple[bytes, bytes]:
        """Returns (msg_id, datagram) and remembers the request until `forget(msg_id)` or its reply."""
        msg_id = new_msg_id(self._random_bytes, self._flags)
        datagram = self._tagged(encode_request(msg_id, name, args))
        self._outstanding[msg_id] = _Outstanding(name, address)
        return msg_id, datagram

    def mark_requests(self, flags: int | None) -> None:
        """Mark later requests with `flags` (a client-mode node promoted to a server, `DHTNode.become_server`)."""
        self._flags = flags

    def forget(self, msg_id: bytes) -> None:
        """The driver gave up waiting (timeout or cancellation): a later reply counts as unsolicited."""
        self._outstanding.pop(msg_id, None)

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    def reply(self, request: Request, result: Any) -> bytes:
        return self._tagged(encode_reply(request.msg_id, result))

    @property
    def private(self) -> bool:
        return self._mac_key is not None

    def _tagged(self, datagram: bytes) -> bytes:
        if self._mac_key is None:
            return datagram
        return datagram + hmac.digest(self._mac_key, datagram, "sha256")[:MAC_BYTES]

    def receive(self, data: bytes, address: Address) -> Event:
        if self._mac_key is not None:  # before any decoding: a datagram without the swarm's tag is not looked at
            body = bytes(data[:-MAC_BYTES])
            if len(data) < MAC_BYTES or not hmac.compare_digest(
                    hmac.digest(self._mac_key, body, "sha256")[:MAC_BYTES], bytes(data[-MAC_BYTES:])):
                return Dropped("bad_mac", address)
            data = body
        if len(data) < 1 + MSG_ID_BYTES + 1:
            return Dropped("too_short", address)
        kind = data[0]
        if kind not in (REQUEST, REPLY):
            return Dropped("unknown_type", address)
        msg_id = bytes(data[1 : 1 + MSG_ID_BYTES])
        try:
            body = unpack(data[1 + MSG_ID_BYTES :])
        except Exception:  # msgpack raises many types (ExtraData, ValueError, TypeError, RecursionError...)
            return Dropped("bad_msgpack", address)
        if kind == REPLY:
            outstanding = self._outstanding.get(msg_id)
            if outstanding is None:
                return Dropped("unsolicited_reply", address)
            if outstanding.address != address:
                return Dropped("forged_reply", address)
            del self._outstanding[msg_id]
            return Reply(msg_id, outstanding.name, body, address)
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], str)):
            return Dropped("malformed_request", address)
        name, args = body
        if not isinstance(args, list):
            return Dropped("malformed_request", address)
        if name not in KNOWN_METHODS:
            return Dropped("unknown_method", address)
        if not check_request_args(name, args):
            return Dropped("bad_arguments", address)
        return Request(msg_id, name, args, address)
