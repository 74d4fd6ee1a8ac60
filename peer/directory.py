"""Who is in the swarm: every serving peer keeps a signed, expiring entry in a few well-known DHT keys.

Why: `peer status` and launchers need the list of live peers without crawling the DHT. Each peer writes a subkey
(its PeerID) under one of `SHARDS` keys, signed so nobody else can overwrite it, and re-declares it before it
expires; a peer that dies simply disappears after `ttl`. Sharding keeps each record far under the DHT's 8 KiB
value limit: an entry's value is the address and a small summary (about 70 bytes; the subkey and signature come
on top), so several dozen peers fit in each shard.

The summary is what others read without calling the peer: `peer status` shows it, and `peer.discover` finds the
swarm's expert families in it (the daemon's grid pattern, expert count and hidden size).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import trio

from dht.client import DHTClient
from dht.records import signed_by_subkey
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.periodic import run_periodic

logger = logging.getLogger(__name__)

SHARDS = 8
KEY_PREFIX = "swarmd.peers."


def shard_key(peer_id: bytes) -> str:
    return f"{KEY_PREFIX}{peer_id[0] % SHARDS}"


@dataclass(frozen=True)
class PeerEntry:
    peer_id: str
    address: Address
    summary: dict[str, Any]
    expiration_time: float


class PeerDirectory:
    """Keeps this peer's entry alive in the DHT (the daemon runs it in its nursery)."""

    def __init__(self, dht: DHTClient, *, ttl: float = 30.0, interval: float | None = None):
        self.dht = dht
        self.ttl = ttl
        self.interval = interval if interval is not None else ttl / 3
        self.failures = 0

    async def declare(self, address: Address, peer_id: PeerID, summary: dict[str, Any]) -> bool:
        value = [address[0], address[1], summary]
        return await self.dht.store(shard_key(peer_id), value, self.dht.now() + self.ttl, subkey=peer_id.hex(),
                                    signed=True)

    async def run(self, address: Address | Callable[[], Address], peer_id: PeerID,
                  summary: Callable[[], dict[str, Any]], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Declare now, then every `interval` seconds until cancelled; `started` once the first declaration was
        tried. A failed round is retried sooner (the entry expires `ttl` after the last success), never later.
        `address` may be a function, read every round (a private peer's relayed address changes with its relays)."""

        async def declare_round() -> None:
            where = address() if callable(address) else address
            if not await self.declare(where, peer_id, summary()):
                self.failures += 1  # nobody acknowledged: no exception, but the entry was not refreshed

        def failed(error: Exception) -> None:
            self.failures += 1

        await run_periodic(declare_round, self.interval, name="declaring this peer in the directory",
                           retry=self.interval / 4, max_retry=self.interval, on_failure=failed, log=logger,
                           task_status=task_status)


SHARD_KEYS = [f"{KEY_PREFIX}{shard}" for shard in range(SHARDS)]


async def list_peers(dht: DHTClient) -> list[PeerEntry]:
    """Every live peer in the directory, ordered by PeerID. Malformed entries (anyone can write) are skipped."""
    records = await dht.get_many(SHARD_KEYS)
    return entries_from_records(records.values(), dht.now())


def entries_from_records(records: Iterable[Any], now: float) -> list[PeerEntry]:
    """The live, well-formed entries of the directory's shard records (from a DHT read, or replicas peers hold:
    the dashboard gets them in `peer.status` replies), ordered by PeerID. An entry not signed by the peer its
    subkey names is skipped (storing nodes refuse those already; this holds for records from anywhere)."""
    peers: dict[str, PeerEntry] = {}
    for record in records:
        if record is None:
            continue
        for subkey, entry in record.subkeys.items():
            value = entry.value
            if (not isinstance(subkey, str) or len(subkey) != 40 or not isinstance(value, list) or len(value) != 3
                    or not isinstance(value[0], str) or not isinstance(value[1], int)
                    or not isinstance(value[2], dict) or entry.expiration_time < now
                    or not signed_by_subkey(subkey, entry)):
                continue
            peers[subkey] = PeerEntry(subkey, (value[0], value[1]), value[2], entry.expiration_time)
    return [peers[key] for key in sorted(peers)]
