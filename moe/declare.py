"""The DHT record layout of experts, shared by servers (who write it) and clients (who read it).

For an expert `ffn.3.17` served at host:port by peer P, a server stores
  - key `ffn.3.17`                -> `[host, port, P_hex]`             (find one expert by uid)
  - key `ffn.`,   subkey `3`      -> `["ffn.3.17", host, port, P_hex]`  (the grid has experts below `ffn.3.`)
  - key `ffn.3.`, subkey `17`     -> `["ffn.3.17", host, port, P_hex]`  (the expert itself, for the last level)
  - key `ffn.3.17/replicas`, subkey P (20 bytes) -> `[host, port, P_hex]`    (every server of the uid)
all with the same absolute expiration in the DHT's clock. Beam search walks the grid with one `get_many` per
level over prefix keys; many servers write under one prefix without conflict because each coordinate is its
own subkey. Everything read back is validated: DHT values come from arbitrary peers.

Nobody can hijack a declaration (issue 36): every entry is signed by the declaring server, and an owned entry
only yields to its own owner, so the first server of a uid keeps the uid key and its grid coordinates for as long
as it refreshes them; a fresh identity re-declaring the grid is refused by every storing node. A replica
(`peer join --replicate`) adds itself under its own PeerID in the replicas key, beside the owner, and takes the
uid key over only once the owner's entry expired. Readers drop a signed entry whose PeerID is not its signer's,
and a trainer calls a location only through a handshake that proves that PeerID (`RPCNode.call(peer_id=...)`).
The DHT keeps at most `dht.records.MAX_SUBKEYS_PER_OWNER` coordinates of one prefix per owner.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from dht.client import DHTClient
from dht.records import owner_peer_id
from moe.grid import GridPattern, InvalidUID, choose_free_uids, is_valid_uid, prefix_entries
from peer.p2p.identity import PeerID
from peer.p2p.net import Address

logger = logging.getLogger(__name__)
StoreItem = tuple[str, Any, float, Any]  # (key, value, expiration_time, subkey or None)
PeerIDLike = PeerID | str  # a PeerID, or its hex as read from a record


@dataclass(frozen=True, slots=True)
class ExpertLocation:
    """Where an expert is served: the RPC address and the PeerID (hex) it declared in the DHT."""

    host: str
    port: int
    peer_id_hex: str

    @property
    def address(self) -> Address:
        return (self.host, self.port)


def parse_location(value: Any) -> ExpertLocation | None:
    """Read `[uid, host, port, peer_id_hex]` (prefix entries) or `[host, port, peer_id_hex]` (uid entries), or
    the `(uid, ExpertLocation)` pairs `get_prefixes` returns; None for anything malformed, since DHT
    values come from arbitrary peers."""
    if isinstance(value, ExpertLocation):
        return value
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], ExpertLocation):
        return value[1]
    if not isinstance(value, (list, tuple)):
        return None
    if len(value) == 4:
        value = value[1:]
    if len(value) != 3:
        return None
    host, port, peer_id_hex = value
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    if not isinstance(peer_id_hex, str):
        return None
    return ExpertLocation(host, port, peer_id_hex)


def _location_value(address: Address, peer_id: PeerIDLike) -> list[Any]:
    peer_hex = peer_id if isinstance(peer_id, str) else bytes(peer_id).hex()
    return [str(address[0]), int(address[1]), peer_hex]


def replicas_key(uid: str) -> str:
    """The key where every server of `uid` declares itself under its own PeerID (never a valid uid itself)."""
    return f"{uid}/replicas"


def replica_items(uids: Iterable[str], address: Address, peer_id: PeerIDLike, expiration: float) -> list[StoreItem]:
    """The store items adding this server beside the others under each uid's replicas key (store them signed)."""
    location = _location_value(address, peer_id)
    return [(replicas_key(uid), location, expiration, bytes.fromhex(location[2])) for uid in uids]


def declaration_items(uids: Iterable[str], address: Address, peer_id: PeerIDLike, expiration: float) -> list[StoreItem]:
    """The store items declaring `uids` at `address`: one per uid, plus one per distinct (prefix, coordinate).
    Stored signed (as `declare_experts` does) they belong to this server: nobody else can overwrite them."""
    location = _location_value(address, peer_id)
    items: list[StoreItem] = []
    seen_prefixes: set[tuple[str, int]] = set()
    for uid in uids:
        if not is_valid_uid(uid):
            raise InvalidUID(f"cannot declare {uid!r}: not a grid uid")
        items.append((uid, location, expiration, None))
        for prefix, coord in prefix_entries(uid):
            if (prefix, coord) not in seen_prefixes:
                seen_prefixes.add((prefix, coord))
                items.append((prefix, [uid, *location], expiration, coord))
    return items


async def declare_experts(
    dht: DHTClient, uids: Sequence[str], address: Address, peer_id: PeerIDLike, expiration: float
) -> dict[str, bool]:
    """Store the records of `uids` (expiring at `expiration`, absolute in `dht.now()` time), signed by the DHT
    node's identity (which must be `peer_id`), in one batch; returns, per uid, whether a replica acknowledged this
    server's own entry under the uid's replicas key. The uid key and the grid coordinates are refused while
    another server owns them (this server is then a replica, see the module doc)."""
    owned = declaration_items(uids, address, peer_id, expiration)
    replicas = replica_items(uids, address, peer_id, expiration)
    acknowledged = list(await dht.store_many([*owned, *replicas], signed=True))[len(owned):]
    return {uid: bool(ok) for uid, ok in zip(uids, acknowledged)}


def _signer_matches(entry: Any, location: ExpertLocation) -> bool:
    """A signed entry names its signer's PeerID: anything else is a forged location (an unsigned entry, which
    any signed declaration replaces, is read as it is)."""
    owner = getattr(entry, "owner", None)
    return owner is None or owner_peer_id(owner).hex() == location.peer_id_hex


def _valid_location(value: Any, *, with_uid: bool) -> tuple[str | None, ExpertLocation] | None:
    if not isinstance(value, (list, tuple)) or len(value) != (4 if with_uid else 3):
        return None
    uid = value[0] if with_uid else None
    if with_uid and not is_valid_uid(uid):
        return None
    location = parse_location(list(value))
    if location is None or len(location.peer_id_hex) != 40:
        return None
    try:
        bytes.fromhex(location.peer_id_hex)
    except ValueError:
        return None
    return uid, location


async def get_experts(dht: DHTClient, uids: Sequence[str]) -> dict[str, ExpertLocation | None]:
    """Where each uid is served now (None: not declared, expired, or a malformed record)."""
    if not uids:
        return {}
    records = await dht.get_many(list(uids))
    now = dht.now()
    found: dict[str, ExpertLocation | None] = {}
    for uid in uids:
        record = records.get(uid)
        entry = getattr(record, "entry", None)
        parsed = None
        if entry is not None and entry.expiration_time > now:
            parsed = _valid_location(entry.value, with_uid=False)
        found[uid] = parsed[1] if parsed and _signer_matches(entry, parsed[1]) else None
    return found


async def get_replicas(dht: DHTClient, uids: Sequence[str]) -> dict[str, list[ExpertLocation]]:
    """Every server that declared each uid under its own PeerID (owner and replicas), ordered by PeerID."""
    if not uids:
        return {}
    records = await dht.get_many([replicas_key(uid) for uid in uids])
    now = dht.now()
    found: dict[str, list[ExpertLocation]] = {}
    for uid in uids:
        record = records.get(replicas_key(uid))
        servers: list[ExpertLocation] = []
        for subkey, entry in sorted((getattr(record, "subkeys", None) or {}).items(), key=lambda item: repr(item[0])):
            if not isinstance(subkey, bytes) or entry.expiration_time <= now:
                continue
            parsed = _valid_location(entry.value, with_uid=False)
            if parsed is not None and parsed[1].peer_id_hex == subkey.hex() and _signer_matches(entry, parsed[1]):
                servers.append(parsed[1])
        found[uid] = servers
    return found


async def get_prefixes(
    dht: DHTClient, prefixes: Sequence[str]
) -> dict[str, dict[int, tuple[str, ExpertLocation]]]:
    """For each prefix (`ffn.` or `ffn.3.`): next coordinate -> (one full uid below it, its location)."""
    if not prefixes:
        return {}
    records = await dht.get_many(list(prefixes))
    now = dht.now()
    result: dict[str, dict[int, tuple[str, ExpertLocation]]] = {}
    for prefix in prefixes:
        children: dict[int, tuple[str, ExpertLocation]] = {}
        record = records.get(prefix)
        for subkey, entry in (getattr(record, "subkeys", None) or {}).items():
            if not isinstance(subkey, int) or isinstance(subkey, bool) or subkey < 0:
                continue
            if entry.expiration_time <= now:
                continue
            parsed = _valid_location(entry.value, with_uid=True)
            if parsed is None or not _signer_matches(entry, parsed[1]):
                continue
            uid, location = parsed
            if uid is not None and uid.startswith(prefix):  # with_uid=True: the uid was checked, never None
                children[subkey] = (uid, location)
        result[prefix] = children
    return result


async def get_prefix_entries(dht: DHTClient, prefix: str) -> dict[int, tuple[str, ExpertLocation]]:
    return (await get_prefixes(dht, [prefix]))[prefix]


def _peer_hex(peer_id: PeerIDLike | None) -> str | None:
    if peer_id is None:
        return None
    return peer_id if isinstance(peer_id, str) else bytes(peer_id).hex()


# Grids up to this many uids are looked up whole (one batched lookup) to find free uids and a restarted server's
# own declarations; in a larger grid only the uids that random probes meet are recognised.
OWN_SCAN_LIMIT = 1024


async def find_own_uids(dht: DHTClient, pattern: str | GridPattern, peer_id: PeerIDLike, *,
                        limit: int = OWN_SCAN_LIMIT) -> list[str]:
    """The uids of `pattern` whose live declaration carries `peer_id`, in grid order.

    Why: a server killed and restarted with the same identity finds its previous incarnation's declarations still
    live (they expire only after their TTL). They are its own, so it takes them back instead of treating its own
    uids as taken (which fails outright when the pattern is exactly what it served)."""
    grid = pattern if isinstance(pattern, GridPattern) else GridPattern.parse(pattern)
    own = _peer_hex(peer_id)
    if own is None or grid.size > limit:
        return []
    uids = list(grid.uids())
    locations = await get_experts(dht, uids)
    return [uid for uid in uids if (location := locations.get(uid)) is not None and location.peer_id_hex == own]


async def find_free_uids(
    dht: DHTClient,
    pattern: str | GridPattern,
    count: int,
    *,
    taken: Iterable[str] = (),
    rng: random.Random | None = None,
    rounds: int = 8,
    peer_id: PeerIDLike | None = None,
    fewer_ok: bool = False,
) -> list[str]:
    """`count` uids of `pattern` that no live expert in the DHT uses (nor any in `taken`), in random order. A
    grid of up to `OWN_SCAN_LIMIT` uids is looked up whole (exact); a larger one is probed in random batches.
    A uid declared by `peer_id` itself (this server's previous run) counts as free: it is ours. With `fewer_ok`,
    a grid with fewer free uids gives those (maybe none) instead of raising InvalidUID.

    Two servers starting at the same moment can still pick the same uid (the DHT is not a lock); the later
    declaration then simply wins the uid key, and both keep serving under their own address."""
    grid = pattern if isinstance(pattern, GridPattern) else GridPattern.parse(pattern)
    rng = rng or random.Random()
    own = _peer_hex(peer_id)
    known_taken = set(taken)
    if grid.size <= OWN_SCAN_LIMIT:  # small grid: one batched lookup of every uid is exact, even when nearly full
        uids = [uid for uid in grid.uids() if uid not in known_taken]
        locations = await get_experts(dht, uids)
        free = [uid for uid in uids if (location := locations.get(uid)) is None or location.peer_id_hex == own]
        if len(free) < count and not fewer_ok:
            raise InvalidUID(f"grid {grid.name} has {len(free)} free uids, {count} requested "
                             f"({grid.size - len(free)} taken)")
        return rng.sample(free, min(count, len(free)))
    chosen: list[str] = []
    for _ in range(rounds):
        need = count - len(chosen)
        if need <= 0:
            break
        candidates = choose_free_uids(grid, need, known_taken | set(chosen), rng)
        locations = await get_experts(dht, candidates)
        for uid in candidates:
            location = locations.get(uid)
            if location is None or location.peer_id_hex == own:
                chosen.append(uid)
            else:
                known_taken.add(uid)
    if len(chosen) < count and not fewer_ok:
        raise InvalidUID(f"found only {len(chosen)} of {count} free uids in {grid.name} after {rounds} rounds")
    return chosen
