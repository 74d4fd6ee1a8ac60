"""The messages of the outer rounds (`averaging.rounds`): what a trainer holds, the verdicts, the offers, as they
travel over RPC (msgpack maps and lists), and their checks.

Why a module of its own: both roles of the round service speak them (a coordinator reads offers and writes
verdicts, a trainer writes offers and reads verdicts, `averaging.round_client`), and so does the roster's gossip
(`averaging.roster`); every field that comes from the network is checked here, once: a malformed offer raises
`BadRequest`, a malformed answer ValueError (that candidate counts as failing). The names that
`averaging.rounds` exported before this module existed are still importable from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from averaging.quorum import Admission, Dropped, Late, Offer, Queued, Resync, Start, Verdict
from peer.p2p.net import Address
from peer.p2p.rpc import BadRequest

JOIN = "diloco.round.join"
WAIT = "diloco.round.wait"
OPEN = "diloco.round.open"
STATUS = "diloco.round.status"

MAX_MEMBERS = 4096
MAX_CHAIN = 64  # (outer step, hash) pairs an offer may vouch for
MAX_ROSTER = 256


@dataclass(frozen=True)
class Holding:
    """What a trainer holds: its outer step, the hash of that outer state, and the members (with addresses) of
    the round that produced it (the candidates of the next round). `tellers`: the peers that said so over
    authenticated calls (none: read from progress records); never on the wire."""

    step: int
    hash: str
    members: tuple[tuple[bytes, Address | None], ...]
    tellers: tuple[bytes, ...] = field(default=(), compare=False)

    def to_wire(self) -> dict[str, Any]:
        return {"step": self.step, "hash": self.hash,
                "members": [[p, list(a) if a is not None else None] for p, a in self.members]}

    @classmethod
    def from_wire(cls, obj: Any) -> "Holding":
        if not isinstance(obj, dict):
            raise ValueError("status is not a map")
        step, hash_, members = as_count(obj.get("step")), obj.get("hash"), obj.get("members")
        if not isinstance(hash_, str) or len(hash_) > 128:
            raise ValueError("bad hash")
        if not isinstance(members, list) or len(members) > MAX_MEMBERS:
            raise ValueError("bad member list")
        return cls(step, hash_, tuple((as_peer(m[0]), as_address(m[1])) for m in members
                                      if isinstance(m, (list, tuple)) and len(m) == 2))


@dataclass(frozen=True)
class Behind:
    """The candidate asked holds a newer outer step than the round offered for: that round is over (elsewhere).
    Catch up to `holding` (the candidate `source` holds it, and so do `holding.members`), then offer again."""

    holding: Holding
    source: tuple[bytes, Address | None]


Final = Start | Late | Resync | Dropped | Behind  # a verdict a trainer acts on (anything but Queued)


# ------------------------------------------------------------------------------------------------ wire forms


def is_int(value: Any) -> bool:
    """An int that is not a bool (msgpack keeps them apart; Python's isinstance does not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_count(value: Any) -> int:
    """A non-negative integer field; ValueError otherwise."""
    if not is_int(value) or value < 0:
        raise ValueError("bad count")
    return int(value)


def as_peer(value: Any) -> bytes:
    """A peer id field (20 bytes); ValueError otherwise."""
    if not isinstance(value, (bytes, bytearray)) or len(value) != 20:
        raise ValueError("bad peer id")
    return bytes(value)


def as_address(value: Any) -> Address | None:
    """An address field ([host, port]) or None (a trainer nobody can call); ValueError otherwise."""
    if value is None:
        return None
    if (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str) and len(value[0]) <= 255
            and is_int(value[1]) and 0 < value[1] < 65536):
        return (value[0], int(value[1]))
    raise ValueError("bad address")


def as_number(value: Any, *, low: float = 0.0) -> float:
    """A finite number field of at least `low`; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise ValueError("bad number")
    return float(value)


def start_to_wire(start: Start) -> dict[str, Any]:
    return {"step": start.step, "hash": start.hash, "reason": start.reason, "waited": start.waited,
            "window": start.window, "group_id": start.group_id, "resync": list(start.resync),
            "coordinator": [start.coordinator, list(start.coordinator_address)
                            if start.coordinator_address is not None else None], "attempt": start.attempt,
            "members": [[m.peer, list(m.address) if m.address is not None else None, m.bandwidth, m.samples,
                         m.staleness, m.weight, m.offset] for m in start.members]}


def start_from_wire(obj: Any) -> Start:
    """A start as a coordinator sent it; ValueError for anything malformed (the coordinator is then skipped)."""
    if not isinstance(obj, dict):
        raise ValueError("start is not a map")
    step, hash_, members, resync = as_count(obj.get("step")), obj.get("hash"), obj.get("members"), obj.get("resync")
    if not isinstance(hash_, str) or len(hash_) > 128:
        raise ValueError("bad hash")
    if not isinstance(members, list) or not members or len(members) > MAX_MEMBERS:
        raise ValueError("bad member list")
    if not isinstance(resync, list) or len(resync) > MAX_MEMBERS:
        raise ValueError("bad resync list")
    admissions = []
    for item in members:
        if not isinstance(item, list) or len(item) != 7:
            raise ValueError("bad member")
        admissions.append(Admission(as_peer(item[0]), as_address(item[1]), as_number(item[2]), as_count(item[3]),
                                    as_count(item[4]), as_number(item[5]), as_number(item[6])))
    peers = [a.peer for a in admissions]
    if peers != sorted(set(peers)):
        raise ValueError("members not sorted or repeated")
    group_id = obj.get("group_id")
    if not isinstance(group_id, (bytes, bytearray)) or not 1 <= len(group_id) <= 64:
        raise ValueError("bad group id")
    reason = obj.get("reason")
    coordinator = obj.get("coordinator")
    if not isinstance(coordinator, list) or len(coordinator) != 2:
        raise ValueError("bad coordinator")
    return Start(step, hash_, tuple(admissions), tuple(as_peer(p) for p in resync),
                 reason if isinstance(reason, str) else "", as_number(obj.get("waited")), as_number(obj.get("window")),
                 bytes(group_id), as_peer(coordinator[0]), as_address(coordinator[1]), as_count(obj.get("attempt", 0)))


def verdict_to_wire(verdict: Verdict, now: float) -> dict[str, Any]:
    if isinstance(verdict, Queued):
        return {"queued": None if verdict.deadline is None else max(0.0, verdict.deadline - now)}
    if isinstance(verdict, Start):
        return {"start": start_to_wire(verdict)}
    if isinstance(verdict, Late):
        return {"late": start_to_wire(verdict.start)}
    if isinstance(verdict, Resync):
        return {"resync": start_to_wire(verdict.start)}
    return {"dropped": verdict.reason}


def verdict_from_wire(obj: Any, now: float, peer: bytes, address: Address | None
                      ) -> Verdict | Behind | tuple[bytes, Address]:
    """A verdict of candidate `peer`, or a redirect (peer, address). ValueError when malformed."""
    if not isinstance(obj, dict) or len(obj) != 1:
        raise ValueError("answer is not a one-key map")
    (kind, value), = obj.items()
    if kind == "behind":
        return Behind(replace(Holding.from_wire(value), tellers=(peer,)), (peer, address))
    if kind == "queued":
        return Queued(None if value is None else now + min(as_number(value), 3600.0))
    if kind == "start":
        return start_from_wire(value)
    if kind == "late":
        return Late(start_from_wire(value))
    if kind == "resync":
        return Resync(start_from_wire(value))
    if kind == "dropped":
        return Dropped(str(value)[:300])
    if kind == "redirect" and isinstance(value, list) and len(value) == 2:
        address = as_address(value[1])
        if address is None:
            raise ValueError("redirect without an address")
        return as_peer(value[0]), address
    raise ValueError(f"unknown answer {kind!r}")


def offer_from_wire(peer: bytes, args: Any) -> tuple[int, Offer, list[bytes], bool]:
    """(step, offer, skipped candidates, insist) of a join call; BadRequest when malformed."""
    try:
        if not isinstance(args, dict):
            raise ValueError("not a map")
        step, base, samples = as_count(args.get("step")), as_count(args.get("base")), as_count(args.get("samples"))
        hash_ = args.get("hash")
        if not isinstance(hash_, str) or len(hash_) > 128:
            raise ValueError("bad hash")
        skipped = args.get("skipped", [])
        if not isinstance(skipped, list) or len(skipped) > MAX_MEMBERS:
            raise ValueError("bad skipped list")
        chain = args.get("chain", [])
        if not isinstance(chain, list) or len(chain) > MAX_CHAIN or not all(
                isinstance(item, list) and len(item) == 2 and isinstance(item[1], str) and len(item[1]) <= 128
                for item in chain):
            raise ValueError("bad chain")
        offer = Offer(peer, base, samples, hash_, as_address(args.get("address")),
                      as_number(args.get("bandwidth", 1.0)), bool(args.get("intent", False)),
                      tuple((as_count(b), h) for b, h in chain))
        return step, offer, [as_peer(p) for p in skipped], bool(args.get("insist", False))
    except ValueError as error:
        raise BadRequest(f"malformed round offer: {error}") from None
