"""The group an all-reduce round runs in: what matchmaking hands to the all-reduce.

Matchmaking decides WHO averages together; the all-reduce only needs a fixed, agreed description of that group.
Every member must build the same `GroupInfo` (same id, same members in the same order, same bandwidths), because
each member derives from it, without further messages, which part of the flat vector every member reduces.
Members are therefore kept sorted by peer id: the order is canonical however matchmaking collected them.

Weights are NOT part of the group: a member's averaging weight is its own business for that round and travels
with its data (`run_allreduce(weight=...)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from peer.p2p.identity import PeerID
from peer.p2p.net import Address


@dataclass(frozen=True)
class Member:
    """One member of a group.

    `address` is where the member's RPC node listens; None means client mode (it accepts no connections, so it
    sends and receives through calls it makes itself and reduces no part). `bandwidth` is a relative figure
    (bytes/s or any unit shared by the group): a reducing member's share of the vector is proportional to it.
    A member with an address may still ask for client mode (e.g. behind a slow uplink).
    """

    peer_id: PeerID
    address: Address | None
    bandwidth: float = 1.0
    client_mode: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_id", PeerID(bytes(self.peer_id)))
        if self.address is not None:
            host, port = self.address
            object.__setattr__(self, "address", (str(host), int(port)))
        else:
            object.__setattr__(self, "client_mode", True)
        if not math.isfinite(self.bandwidth) or self.bandwidth < 0:
            raise ValueError(f"bandwidth must be a finite number >= 0, got {self.bandwidth!r}")

    @property
    def reduces(self) -> bool:
        """True when this member reduces a part (it is reachable and has bandwidth to offer)."""
        return not self.client_mode and self.bandwidth > 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "peer_id": bytes(self.peer_id),
            "address": list(self.address) if self.address is not None else None,
            "bandwidth": float(self.bandwidth),
            "client_mode": self.client_mode,
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> "Member":
        address = obj.get("address")
        return cls(
            peer_id=PeerID(obj["peer_id"]),
            address=(address[0], address[1]) if address is not None else None,
            bandwidth=float(obj.get("bandwidth", 1.0)),
            client_mode=bool(obj.get("client_mode", False)),
        )


@dataclass(frozen=True)
class GroupInfo:
    """An agreed group: `group_id` names the round (every message of the round carries it), `members` are sorted
    by peer id and unique. Build it with `GroupInfo.create` to get the canonical order from any order."""

    group_id: bytes
    members: tuple[Member, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        members = tuple(self.members)
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "group_id", bytes(self.group_id))
        ids = [m.peer_id for m in members]
        if ids != sorted(ids):
            raise ValueError("GroupInfo.members must be sorted by peer id (use GroupInfo.create)")
        if len(set(ids)) != len(ids):
            raise ValueError("GroupInfo.members has the same peer twice")
        if not members:
            raise ValueError("a group has at least one member")

    @classmethod
    def create(cls, group_id: bytes, members: Iterable[Member]) -> "GroupInfo":
        return cls(group_id, tuple(sorted(members, key=lambda m: m.peer_id)))

    @property
    def peer_ids(self) -> list[PeerID]:
        return [m.peer_id for m in self.members]

    @property
    def size(self) -> int:
        return len(self.members)

    def index_of(self, peer_id: PeerID) -> int:
        for index, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return index
        raise KeyError(f"{PeerID(peer_id).short()} is not a member of this group")

    def member(self, peer_id: PeerID) -> Member:
        return self.members[self.index_of(peer_id)]

    def __contains__(self, peer_id: object) -> bool:
        return any(m.peer_id == peer_id for m in self.members)

    @property
    def reducers(self) -> list[Member]:
        """The members that reduce a part, in group order (the order of the parts)."""
        return [m for m in self.members if m.reduces]

    def to_wire(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "members": [m.to_wire() for m in self.members]}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> "GroupInfo":
        return cls.create(bytes(obj["group_id"]), [Member.from_wire(m) for m in obj["members"]])
