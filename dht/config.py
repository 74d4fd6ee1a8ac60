"""`DHTConfig`: the DHT node's tunables, in one place so that every collaborator of the node reads the same ones.

Why a module of its own: the node (dht/node.py) and the parts it is made of (requests, lookups, replication,
membership) all read these numbers; they live here so that none of those modules has to import the node.
`dht.node` re-exports `DHTConfig`, where callers have always imported it from.
"""

from __future__ import annotations

from dataclasses import dataclass

from dht.storage import DEFAULT_MAX_BYTES, DEFAULT_MAX_TTL, DEFAULT_SHARE, DEFAULT_STOCK_TTL

__all__ = ["DHTConfig"]


@dataclass
class DHTConfig:
    """Tunables; the defaults suit both loopback tests and a WAN swarm."""

    k: int = 20
    alpha: int = 3
    # Floor of the adaptive per-peer timeout. It only paces lookups (after it a further query starts; a late
    # answer still counts), so it can sit close to loopback RTTs: a dead peer then costs ~10 ms, not 5 s.
    min_timeout: float = 0.01
    max_timeout: float = 2.0  # ceiling of it, and the hard timeout after which a request counts as failed
    initial_timeout: float = 1.0  # for a peer when nothing has been measured yet
    probe_timeout: float = 0.25  # floor of the wait for a swarmd_hello answer (silence = stock peer)
    failures_to_evict: int = 3  # consecutive unanswered requests before a contact leaves the routing table
    # ... but a frozen peer is not dead: a failing address is asked again after this backoff, doubling with each
    # further failure up to the cap (see dht/peers.py); if it answers, it is back in the table
    retry_backoff: float = 1.0
    retry_backoff_max: float = 6.0
    forget_after: float = 600.0  # a remembered server failing and silent this long is no longer retried
    # A node with nobody to ask (empty table, or a lookup where nobody answered) rejoins through its initial peers
    # and every server it remembers, retrying after this backoff (doubling, capped, jittered)
    rejoin_backoff: float = 0.5
    rejoin_backoff_max: float = 5.0
    heal_interval: float = 1.0  # how often the healing task re-probes failing contacts whose backoff passed
    head_check_after: float = 60.0  # a full bucket pings its oldest contact only if silent this long
    lookup_timeout: float = 10.0  # a whole lookup never takes longer
    get_quorum: int = 3  # get(latest=False) stops after this many replicas answered with a value (over d paths:
    # each path after ceil(get_quorum / d))
    # Lookups over this many disjoint paths (S/Kademlia; see dht/lookup.py): a node is asked by one path at most,
    # and a get decides a key's own value by a vote of the paths (records.resolve). 1: plain Kademlia.
    disjoint_paths: int = 1
    # Routing-table limits against cheap Sybils (dht/routing.py TableLimits; None: off; loopback is exempt):
    # contacts of one IP (IPv6 /64) per bucket and per table, contacts of one bucket in one 1/8 slice of its range
    table_per_ip_bucket: int | None = 2
    table_per_ip: int | None = 10
    table_per_prefix: int | None = 10
    # Proof-of-work PeerIDs: > 0 makes this swarm's nodes leave contacts whose id lacks this many bits of work
    # out of routing tables and lookups (routing.has_work; make an identity with routing.identity_with_work)
    id_difficulty: int = 0
    bootstrap_attempts: int = 3
    refresh_interval: float = 600.0  # look up a random id in buckets untouched this long
    republish_interval: float = 1800.0  # replicas re-store held records nobody refreshed this long
    maintenance_interval: float = 30.0
    # Storage bounds and fairness (dht/storage.py): records and bytes held as a replica (bytes include ~1 KiB of
    # bookkeeping per record, so max_bytes bounds the memory), how long a never-expiring value (stock) is kept
    # after its last store, and the share of a full store one sender IP (or IPv6 /64) or this node's own client
    # may hold before its new keys are refused, and one first byte of sender node ids before its new keys only
    # replace its own records.
    max_records: int = 100_000
    max_bytes: int = DEFAULT_MAX_BYTES
    stock_ttl: float = DEFAULT_STOCK_TTL
    max_ttl: float = DEFAULT_MAX_TTL  # a stored record outlives its last store by at most this (issue 40)
    storage_share_per_ip: float = DEFAULT_SHARE
    storage_share_per_prefix: float = DEFAULT_SHARE
    requests_per_second: float = 500.0  # per source address (IP and port), after decoding
    request_burst: float = 1000.0
    # per source IP, checked on a request datagram's first byte before decoding (see policy.IPRequestLimit)
    ip_requests_per_second: float = 5000.0
    ip_request_burst: float = 10000.0
    # senders pinged back before they may enter the routing table, in flight at once (a quarter of it per IP;
    # see dht/policy.py)
    max_concurrent_probes: int = 256
