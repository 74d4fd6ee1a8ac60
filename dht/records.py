"""swarmd records: expiring, mergeable, optionally signed values that ride inside plain DHT `bytes` values.

A stock kademlia node stores one opaque value per key and the last writer wins. swarmd needs more: every value
expires at an absolute time of the DHT clock, a key can hold a dictionary of subkeys that many peers write
independently (experts declaring under one grid prefix, peers joining an averaging group), and an entry can
belong to an owner whose Ed25519 signature nobody else can produce.

So a swarmd value is `MAGIC + msgpack([key_entry | nil, {subkey: entry}])` with
`entry = [value, expiration_time, owner_public_key | nil, signature | nil]`. Stock nodes just keep those bytes;
swarmd nodes merge what they receive into what they hold, and readers merge the replicas they hear from.

Merge rule for one (key, subkey), existing entry E versus incoming entry I (`choose`):
  1. an expired entry never wins (and expired entries vanish from every record);
  2. an entry with an owner only yields to an entry signed by the same owner;
  3. an owned entry replaces an unowned one (ownership is claimed by signing, first come);
  4. otherwise the later expiration wins; on a tie the incoming entry wins (so a stock-style overwrite works).
The signature covers (key id, subkey, value, expiration), so an entry cannot be replayed under another key or
subkey, or kept alive longer than its owner asked.

A subkey that names a PeerID (20 raw bytes, or their 40-character lowercase hex) belongs to that peer: its entry
is valid only when signed by the key whose PeerID it is (`subkey_peer_id`, checked in `entry_authentic`). Without
this rule "first come" let anyone sign an entry under someone else's PeerID (a forged directory entry, a forged
ban record) before that peer did, or after its entry expired. Storing nodes refuse such entries on arrival
(`decode`), and readers drop them from what replicas answer.

One owner cannot crowd others out of a key: `fit` keeps at most MAX_SUBKEYS_PER_OWNER subkeys of each owner (all
unsigned entries count as one owner), and when the record still exceeds a datagram it drops entries of whichever
owner holds the most (max-min fairness), not the soonest-expiring ones (an attacker picks far expirations).

Plain values written by stock nodes (int, float, bool, str, bytes) read as a `Record` whose key entry has that
value and `expiration_time == math.inf` (stock values never expire on the wire; holders keep them for a local
TTL after their last store, see dht/storage.py), with `record.stock == True`. Conversely a
swarmd store with an infinite expiration, no subkey and no signature is written as a plain stock value, so stock
nodes read it unchanged. Between a plain value and a swarmd record for the same key the swarmd record wins
(whatever the expirations): a stock write, or a peer answering a lookup with a bare value, cannot displace
records with expirations and owners. Between two plain values the incoming one wins (stock last-writer-wins).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Union

from dht.errors import InvalidKey, InvalidValue, ValueTooLarge
from dht.protocol import is_stock_value, pack, unpack
from peer.p2p.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify_signature

MAGIC = b"\xc1swarmd\x01"  # 0xc1 is never a msgpack type byte: no msgpack-ish plain value starts like this
# The largest value a store request can carry: 8192 (rpcudp request cap) minus the framing of
# ["store", [node_id(20), key(20), value]] with a bin16 header on the value.
MAX_RECORD_BYTES = 8192 - 55
Subkey = Union[str, bytes, int]
_SIGNATURE_DOMAIN = "swarmd-dht-record-v1"
# The most subkeys of one record one owner keeps (see the module doc): far more than any honest writer needs (one
# subkey per peer for directories, bans and progress; one per served coordinate in an expert grid prefix).
MAX_SUBKEYS_PER_OWNER = 32
_PEER_ID_BYTES = 20


@dataclass(frozen=True)
class Entry:
    """One value with its absolute expiration time; `owner` (raw Ed25519 public key) and `signature` together
    or not at all."""

    value: Any
    expiration_time: float
    owner: bytes | None = None
    signature: bytes | None = None

    def expired(self, now: float) -> bool:
        return self.expiration_time <= now


@dataclass
class Record:
    """What `DHTNode.get` returns: the key's own entry (if any) and its subkey entries, all unexpired."""

    entry: Entry | None = None
    subkeys: dict[Subkey, Entry] = field(default_factory=dict)
    stock: bool = False  # a bare stock value (no envelope): yields to any swarmd record of the key

    @property
    def value(self) -> Any:
        """The key's own value; None when the key holds only subkeys."""
        return self.entry.value if self.entry is not None else None

    @property
    def expiration_time(self) -> float:
        """The key entry's expiration, or the latest subkey expiration for a key holding only subkeys."""
        if self.entry is not None:
            return self.entry.expiration_time
        return max((e.expiration_time for e in self.subkeys.values()), default=-math.inf)

    @property
    def owner(self) -> bytes | None:
        return self.entry.owner if self.entry is not None else None

    def empty(self) -> bool:
        return self.entry is None and not self.subkeys

    def is_plain(self) -> bool:
        """Stored as a bare stock value: an unsigned, never-expiring stock-typed value and nothing else."""
        entry = self.entry
        return (
            entry is not None
            and not self.subkeys
            and entry.owner is None
            and entry.expiration_time == math.inf
            and is_stock_value(entry.value)
            and not (isinstance(entry.value, bytes) and entry.value.startswith(MAGIC))
        )

    def pruned(self, now: float) -> "Record":
        entry = self.entry if self.entry is not None and not self.entry.expired(now) else None
        return Record(entry, {k: e for k, e in self.subkeys.items() if not e.expired(now)}, self.stock)

    def __repr__(self) -> str:
        stock = ", stock=True" if self.stock else ""
        return f"Record(value={self.value!r}, expiration_time={self.expiration_time}, subkeys={self.subkeys!r}{stock})"


# ----------------------------------------------------------------------------------------------- keys, signing


def check_key(key: Any, operation: str) -> None:
    if not isinstance(key, (str, bytes)):
        raise InvalidKey(f"DHT keys are str or bytes, not {type(key).__name__}", operation=operation)


def check_subkey(subkey: Any, operation: str) -> None:
    if subkey is not None and (not isinstance(subkey, (str, bytes, int)) or isinstance(subkey, bool)):
        raise InvalidKey(f"subkeys are str, bytes or int, not {type(subkey).__name__}", operation=operation)


def signing_payload(key_id: bytes, subkey: Subkey | None, value: Any, expiration_time: float) -> bytes:
    return pack([_SIGNATURE_DOMAIN, key_id, subkey, value, float(expiration_time)])


def make_entry(
    key_id: bytes, subkey: Subkey | None, value: Any, expiration_time: float, identity: Identity | None = None
) -> Entry:
    """A new entry, signed by `identity` when given (which makes `identity` its owner)."""
    try:
        pack(value)
    except Exception as error:
        raise InvalidValue(f"value cannot be encoded with msgpack: {error}", operation="store") from error
    expiration_time = float(expiration_time)
    if identity is None:
        return Entry(value, expiration_time)
    signature = identity.sign(signing_payload(key_id, subkey, value, expiration_time))
    return Entry(value, expiration_time, identity.public_key, signature)


def subkey_peer_id(subkey: Subkey | None) -> bytes | None:
    """The PeerID a subkey names (20 raw bytes, or their 40-character lowercase hex), else None."""
    if isinstance(subkey, bytes) and len(subkey) == _PEER_ID_BYTES:
        return subkey
    if isinstance(subkey, str) and len(subkey) == 2 * _PEER_ID_BYTES and subkey == subkey.lower():
        try:
            return bytes.fromhex(subkey)
        except ValueError:
            return None
    return None


def owner_peer_id(owner: bytes) -> bytes:
    """The PeerID of an entry's owner (its Ed25519 public key), as peer.p2p.identity.PeerID derives it."""
    return hashlib.sha1(owner).digest()


def signed_by_subkey(subkey: Subkey | None, entry: Entry) -> bool:
    """Does the entry's signer own `subkey`? True for subkeys that name no PeerID."""
    named = subkey_peer_id(subkey)
    if named is None:
        return True
    return entry.owner is not None and owner_peer_id(entry.owner) == named


class VerifiedSignatures:
    """The signatures this process has already checked and found good, as digests of (owner, signature, payload),
    the oldest forgotten past `size`.

    Why: a reader polls the same keys again and again (matchmaking reads its group key a few times a second, the
    progress and directory keys every few seconds), and every read carried the same signed entries, each checked
    with Ed25519 again: a third of the CPU of a 64-peer averaging simulation. A good signature stays good, and the
    digest covers all three inputs, so a replayed signature over another value or by another owner is checked
    afresh. Only good signatures are kept: junk cannot push out what honest peers signed any faster than it is
    checked."""

    def __init__(self, size: int = 16384):
        self.size = size
        self._good: dict[bytes, None] = {}

    def verify(self, owner: bytes, signature: bytes, payload: bytes) -> bool:
        if len(owner) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return False  # fixed sizes: the concatenation below is unambiguous
        digest = hashlib.blake2b(bytes(owner) + bytes(signature) + bytes(payload), digest_size=32).digest()
        if digest in self._good:
            return True
        if not verify_signature(owner, signature, payload):
            return False
        self._good[digest] = None
        if len(self._good) > self.size:
            del self._good[next(iter(self._good))]
        return True


VERIFIED = VerifiedSignatures()


def entry_authentic(key_id: bytes, subkey: Subkey | None, entry: Entry) -> bool:
    if not signed_by_subkey(subkey, entry):
        return False  # a PeerID's subkey signed by someone else, or not signed at all
    if entry.owner is None:
        return entry.signature is None
    if entry.signature is None:
        return False
    return VERIFIED.verify(
        entry.owner, entry.signature, signing_payload(key_id, subkey, entry.value, entry.expiration_time)
    )


# ----------------------------------------------------------------------------------------------------- merging


def choose(existing: Entry | None, incoming: Entry | None, now: float) -> Entry | None:
    """The entry that (key, subkey) holds after `incoming` arrives at a holder of `existing` (see module doc)."""
    if incoming is None or incoming.expired(now):
        return existing if existing is not None and not existing.expired(now) else None
    if existing is None or existing.expired(now):
        return incoming
    if existing.owner is not None and incoming.owner != existing.owner:
        return existing
    if existing.owner is None and incoming.owner is not None:
        return incoming
    return incoming if incoming.expiration_time >= existing.expiration_time else existing


def merge(existing: Record | None, incoming: Record | None, now: float) -> Record | None:
    """Merge `incoming` into `existing` entry by entry; None when nothing unexpired is left."""
    existing = existing.pruned(now) if existing is not None else None
    incoming = incoming.pruned(now) if incoming is not None else None
    existing = None if existing is None or existing.empty() else existing
    incoming = None if incoming is None or incoming.empty() else incoming
    if existing is None or incoming is None:
        only = (existing or incoming or Record()).pruned(now)
        return None if only.empty() else only
    if existing.stock != incoming.stock:
        kept = (incoming if existing.stock else existing).pruned(now)  # the swarmd record wins
        return None if kept.empty() else kept
    if existing.stock:
        kept = incoming.pruned(now)  # plain over plain: the last writer wins, as on stock nodes
        return None if kept.empty() else kept
    entry = choose(existing.entry, incoming.entry, now)
    subkeys: dict[Subkey, Entry] = {}
    for subkey in existing.subkeys.keys() | incoming.subkeys.keys():
        chosen = choose(existing.subkeys.get(subkey), incoming.subkeys.get(subkey), now)
        if chosen is not None:
            subkeys[subkey] = chosen
    merged = Record(entry, subkeys)
    return None if merged.empty() else merged


# ---------------------------------------------------------------------------------------------- wire encoding


def _entry_to_wire(entry: Entry) -> list[Any]:
    return [entry.value, entry.expiration_time, entry.owner, entry.signature]


def encode(record: Record) -> Any:
    """The DHT value for `record`: a bare stock value when `record.is_plain()`, else MAGIC + msgpack envelope."""
    if record.is_plain() and record.entry is not None:  # is_plain() implies an entry
        return record.entry.value
    body = [
        _entry_to_wire(record.entry) if record.entry is not None else None,
        {subkey: _entry_to_wire(entry) for subkey, entry in record.subkeys.items()},
    ]
    return MAGIC + pack(body)


def encoded_size(value: Any) -> int:
    """Bytes the stored value takes inside a store request."""
    return len(pack(value))


def fit(record: Record, limit: int = MAX_RECORD_BYTES, per_owner: int = MAX_SUBKEYS_PER_OWNER) -> Record:
    """The record a holder keeps: at most `per_owner` subkeys of each owner (its freshest), then, until it fits in
    one store request, the largest entry of the owner holding the most bytes is dropped. Why not just
    the soonest-expiring overall: a writer chooses its own expirations, so one identity writing many far-future
    subkeys would push everyone else's entries out; this way it can only take an equal share of the room."""
    by_owner: dict[bytes | None, list[tuple[Subkey, Entry]]] = {}
    for subkey, entry in record.subkeys.items():
        by_owner.setdefault(entry.owner, []).append((subkey, entry))
    trimmed = False
    for entries in by_owner.values():
        entries.sort(key=lambda item: (item[1].expiration_time, _subkey_order(item[0])), reverse=True)
        if len(entries) > per_owner:
            del entries[per_owner:]
            trimmed = True
    if not trimmed and encoded_size(encode(record)) <= limit:
        return record

    def build() -> Record:
        return Record(record.entry, {subkey: entry for entries in by_owner.values() for subkey, entry in entries})

    candidate = build()
    sizes = {subkey: encoded_size([subkey, _entry_to_wire(entry)]) for subkey, entry in record.subkeys.items()}
    while encoded_size(encode(candidate)) > limit and any(by_owner.values()):
        # the owner holding the most bytes (then the most subkeys; then the one whose last entry expires soonest)
        # gives up its largest entry: 8 KiB junk values from a few identities go before the small entries that
        # honest peers refresh, whatever expiration the junk claims (issue 40)
        owner = max((o for o in by_owner if by_owner[o]),
                    key=lambda o: (sum(sizes[s] for s, _ in by_owner[o]), len(by_owner[o]),
                                   -by_owner[o][-1][1].expiration_time, o or b""))
        entries = by_owner[owner]
        largest = max(range(len(entries)), key=lambda i: (sizes[entries[i][0]], -i))
        del entries[largest]
        candidate = build()
    return candidate


def _subkey_order(subkey: Subkey) -> tuple[int, Any]:
    """A total order on subkeys of mixed types, so every holder drops the same entries on a tie."""
    if isinstance(subkey, int):
        return (0, subkey)
    return (1, subkey.encode() if isinstance(subkey, str) else subkey)


def _entry_from_wire(key_id: bytes, subkey: Subkey | None, raw: Any) -> Entry | None:
    if not (isinstance(raw, list) and len(raw) == 4):
        return None
    value, expiration_time, owner, signature = raw
    if isinstance(expiration_time, bool) or not isinstance(expiration_time, (int, float)):
        return None
    if math.isnan(expiration_time):
        return None
    if owner is not None and not (isinstance(owner, bytes) and len(owner) == PUBLIC_KEY_BYTES):
        return None
    if signature is not None and not (isinstance(signature, bytes) and len(signature) == SIGNATURE_BYTES):
        return None
    entry = Entry(value, float(expiration_time), owner, signature)
    return entry if entry_authentic(key_id, subkey, entry) else None


def decode(key_id: bytes, stored: Any, now: float) -> Record | None:
    """The record a DHT value carries, with expired and forged entries removed; None when nothing valid is
    left or the value is not something a DHT can hold (lists, maps, nil: refused, never an exception)."""
    if isinstance(stored, bytes) and stored.startswith(MAGIC):
        try:
            body = unpack(stored[len(MAGIC):])
        except Exception:
            return None
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[1], dict)):
            return None
        raw_entry, raw_subkeys = body
        entry = _entry_from_wire(key_id, None, raw_entry) if raw_entry is not None else None
        if raw_entry is not None and entry is None:
            return None
        subkeys: dict[Subkey, Entry] = {}
        for subkey, raw in raw_subkeys.items():
            if not isinstance(subkey, (str, bytes, int)) or isinstance(subkey, bool):
                return None
            sub_entry = _entry_from_wire(key_id, subkey, raw)
            if sub_entry is None:
                return None
            subkeys[subkey] = sub_entry
        record = Record(entry, subkeys).pruned(now)
        return None if record.empty() else record
    if is_stock_value(stored):
        return Record(Entry(stored, math.inf), stock=True)
    return None


def record_for_store(
    key_id: bytes,
    value: Any,
    expiration_time: float,
    subkey: Subkey | None = None,
    identity: Identity | None = None,
) -> Record:
    """The one-entry record a `store` call sends; raises ValueTooLarge if it does not fit in a datagram, and
    InvalidValue for a subkey naming a PeerID other than the signer's (every replica would refuse it)."""
    named = subkey_peer_id(subkey)
    if named is not None and (identity is None or bytes(identity.peer_id) != named):
        raise InvalidValue("a subkey naming a PeerID holds only entries signed by that peer (store it with "
                           "signed=True, under this node's own PeerID)", operation="store")
    entry = make_entry(key_id, subkey, value, expiration_time, identity)
    record = Record(entry, {}) if subkey is None else Record(None, {subkey: entry})
    record.stock = record.is_plain()  # it travels as a bare value, so replicas see it as one
    size = encoded_size(encode(record))
    if size > MAX_RECORD_BYTES:
        raise ValueTooLarge(size, MAX_RECORD_BYTES)
    return record


# ------------------------------------------------------------------------------------ reading over disjoint paths


def _claim(entry: Entry) -> bytes:
    """What a replica's key entry votes for: its owner when signed (the newest entry of that owner is taken
    later), the exact value and expiration when unsigned."""
    return pack(["owner", entry.owner] if entry.owner is not None else ["plain", entry.value, entry.expiration_time])


def _pick(entries: list[Entry]) -> tuple[bytes, int, float] | None:
    """The claim most of `entries` make (ties: the one with the most recent entry), with how many made it and
    its expiration."""
    votes: dict[bytes, list[float]] = {}
    for entry in entries:
        vote = votes.setdefault(_claim(entry), [0, -math.inf])
        vote[0] += 1
        vote[1] = max(vote[1], entry.expiration_time)
    if not votes:
        return None
    claim, (count, expiration) = max(votes.items(), key=lambda item: (item[1][0], item[1][1]))
    return claim, int(count), expiration


def resolve(paths: list[list[Record]], now: float, voters: int | None = None) -> Record | None:
    """What a reader believes after a lookup over disjoint paths (`paths`: the records each path's replicas
    returned, each path's closest replica first; `voters`: how many of each path's closest replicas vote on the
    key's own entry, default all of them).

    Subkey entries merge across every path as usual (`merge`). The key's own entry is decided by vote, because
    nothing stops a liar from answering with any unsigned value and any expiration, or with a value signed by a key
    of its own (an owned entry beats an unowned one in `merge`). Each path first picks the claim most of its voting
    replicas make -- an owner for signed entries, the exact (value, expiration) for unsigned ones. A claim counts as
    seen on a path when more than a third of the path's voting replicas make it (one liar among honest replicas is
    not enough; honest replicas that missed the latest write still are), and the reader takes the most recent claim
    seen on a majority of the paths that answered: an update that reached most replicas beats the stale value next
    to it, and a forged value needs most paths captured. When no claim is seen on a majority, the claim most paths
    picked wins; a tie there goes to the claim backed by the most replicas over those paths (a liar sets the
    expiration it likes, so recency cannot break it; then the most recent). A signed claim then yields the newest
    entry of that owner seen on any path (signatures make stale and forged ones harmless there); an unsigned claim
    yields exactly that entry.

    Why only the closest vote: a write reaches the key's closest nodes (every writer's lookup converges there),
    but how far out past them it spreads varies from writer to writer, and a reader's path, which ends where its
    own window of k does, often reaches farther than the last writer did. Replicas out there that only an earlier
    writer reached hold its older value, and with every replica voting they were most of each stale read's votes
    in the 10,000-node adversarial simulation (tests/dht): 12 of 3,200 gets over 16 runs read the first version.
    Replaying those same lookups with each path's closest 3, 5, 8, 10 or 12 voting read it in 1, 1, 0, 1 and 2;
    `DHTNode.get` passes k/2 (10). Subkeys still merge over every replica, and the chosen claim's newest entry is
    taken from any replica: a subkey may sit only on replicas farther out."""
    pruned = [[record.pruned(now) for record in found] for found in paths]
    merged: Record | None = None
    for found in pruned:
        for record in found:
            merged = merge(merged, record, now)
    if merged is None:
        return None
    # each path's ballot: the key entries of its closest `voters` replicas that returned one
    ballots = [[record.entry for record in found if record.entry is not None][:voters] for found in pruned]
    picks: list[tuple[bytes, int, float]] = []
    for entries in ballots:
        pick = _pick(entries)
        if pick is not None:
            picks.append(pick)
    if not picks:
        return merged
    tally: dict[bytes, list[float]] = {}  # claim -> [paths, replicas, expiration]
    for claim, replicas, expiration in picks:
        vote = tally.setdefault(claim, [0, 0, -math.inf])
        vote[0] += 1
        vote[1] += replicas
        vote[2] = max(vote[2], expiration)
    # "seen" on a path: made by more than a third of the path's ballot
    seen_on: dict[bytes, list[float]] = {}  # claim -> [paths, expiration]
    for entries in ballots:
        counts: dict[bytes, list[float]] = {}
        for reported in entries:
            count = counts.setdefault(_claim(reported), [0, -math.inf])
            count[0] += 1
            count[1] = max(count[1], reported.expiration_time)
        for claim, (count_seen, expiration) in counts.items():
            if 3 * count_seen > len(entries):
                seen = seen_on.setdefault(claim, [0, -math.inf])
                seen[0] += 1
                seen[1] = max(seen[1], expiration)
    majority = [(seen[1], claim) for claim, seen in seen_on.items() if 2 * seen[0] > len(picks)]
    if majority:
        chosen = max(majority)[1]  # the most recent claim seen on a majority of the paths
    else:
        chosen = max(tally.items(), key=lambda item: (item[1][0], item[1][1], item[1][2]))[0]
    entry: Entry | None = None
    for found in pruned:  # every replica, voter or not: the newest entry of the chosen claim
        for record in found:
            if record.entry is not None and _claim(record.entry) == chosen:
                if entry is None or record.entry.expiration_time > entry.expiration_time:
                    entry = record.entry
    stock = entry is not None and not merged.subkeys and entry.owner is None and entry.expiration_time == math.inf
    result = Record(entry, dict(merged.subkeys), stock=stock)
    return None if result.empty() else result
