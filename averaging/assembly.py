"""Matchmaking's pure parts: declarations, the shared grouping plan, and the collector's `Assembly`.

Why a module of its own: the assembly state (who joined, whom a collector still waits for, when it seals, when
it steps down into a lower collector, what a probe's answer means) used to hold trio events and sat in the same
file as the DHT polling and the RPC handlers, so it could only be exercised through whole simulated swarms. Here
everything is plain (h11 style): declarations, join requests, probe answers and times (numbers) in, decisions
out; no trio, no sockets, no clock. `averaging.matchmaking.Matchmaker` is the driver: it and its collaborators
(`match_dht`, `match_join`, `match_ping`) read and write the DHT, make the calls, hold the joiners' long polls and
wake its tasks. The protocol itself is described in `averaging.matchmaking`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from averaging.errors import LocalViolation
from averaging.group import GroupInfo, Member
from peer.p2p.identity import PeerID
from peer.p2p.net import Address

_DECLARATION_VERSION = 1

# --------------------------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Declaration:
    """One peer's readiness to average under a key, as read back from the DHT (or from a join request)."""

    peer_id: PeerID
    address: Address | None
    bandwidth: float
    client_mode: bool
    schema: bytes
    round: int
    deadline: float
    declared_at: float

    @property
    def can_collect(self) -> bool:
        """Only a peer others can call can collect a group."""
        return self.address is not None and not self.client_mode

    def member(self) -> Member:
        return Member(self.peer_id, self.address, self.bandwidth, self.client_mode)

    def to_wire(self) -> list[Any]:
        host, port = self.address if self.address is not None else (None, None)
        return [_DECLARATION_VERSION, host, port, float(self.bandwidth), bool(self.client_mode), bytes(self.schema),
                int(self.round), float(self.deadline), float(self.declared_at)]

    @classmethod
    def from_wire(cls, peer_id: bytes, value: Any) -> Declaration | None:
        """Parse a DHT entry; None for a withdrawal or anything malformed (a hostile or newer peer's entry must
        not break everyone's matchmaking)."""
        try:
            if not isinstance(value, (list, tuple)) or len(value) != 9 or value[0] != _DECLARATION_VERSION:
                return None
            _, host, port, bandwidth, client_mode, schema, round_, deadline, declared_at = value
            address = None if host is None else (str(host), int(port))
            bandwidth = float(bandwidth)
            if not math.isfinite(bandwidth) or bandwidth < 0:
                return None
            return cls(PeerID(bytes(peer_id)), address, bandwidth, bool(client_mode) or address is None,
                       bytes(schema), int(round_), float(deadline), float(declared_at))
        except (TypeError, ValueError):
            return None


WITHDRAWN: list[Any] = []  # the value that overwrites a declaration when its peer leaves matchmaking


def _order_key(declaration: Declaration, salt: bytes | None) -> bytes:
    """A peer's place in the grouping order: sha256 of the salt, ITS OWN declared round and its peer id.

    Each peer's place depends only on its own declaration, never on who else is in view: a late declaration is
    inserted into the order without moving anyone else, so peers whose views differ by a few arrivals still agree
    on the relative order of everyone they both see (a salt taken from the view, such as the highest round in
    it, reshuffled everybody whenever one peer of a round a step ahead appeared, and split rounds into 4+3+1).
    The round changes every step, so the order, and with it the grouping, changes every round."""
    if salt is None:
        return bytes(declaration.peer_id)
    return hashlib.sha256(salt + b"|%d|" % declaration.round + bytes(declaration.peer_id)).digest()


def _balanced(items: list[Any], count: int) -> list[list[Any]]:
    """Cut `items` into `count` contiguous runs whose lengths differ by at most one (longer ones first)."""
    base, extra = divmod(len(items), count)
    runs, start = [], 0
    for index in range(count):
        stop = start + base + (1 if index < extra else 0)
        runs.append(items[start:stop])
        start = stop
    return runs


def plan_groups(declarations: Iterable[Declaration], target_group_size: int, *,
                salt: bytes | None = None, full_only: bool = False) -> list[list[Declaration]]:
    """The deterministic grouping every peer computes from the same visible set.

    Peers are ordered by peer id (or by sha256(salt + peer id) when `salt` is given) and cut into
    ceil(n / target) balanced chunks, so 8 peers with target 4 give 4 + 4 and 9 give 3 + 3 + 3 rather than
    4 + 4 + 1. Client-mode peers are spread separately from reachable peers and there are never more chunks than
    reachable peers, so every chunk has a collector. Without client-mode peers this is exactly "sort, then cut".

    `full_only` (used while more peers are expected): cut into full chunks of exactly `target` and leave the rest
    as one partial chunk that waits for the stragglers, instead of spreading everyone over smaller groups.
    """
    unique = {d.peer_id: d for d in declarations}
    ordered = sorted(unique.values(), key=lambda d: _order_key(d, salt))
    servers = [d for d in ordered if d.can_collect]
    clients = [d for d in ordered if not d.can_collect]
    if full_only and not clients and servers:
        size = max(1, target_group_size)
        return [servers[i:i + size] for i in range(0, len(servers), size)]
    count = min(len(servers), math.ceil(len(ordered) / max(1, target_group_size)))
    if count == 0:
        return []
    if not clients:
        return _balanced(servers, count)
    chunks = [s + c for s, c in zip(_balanced(servers, count), _balanced(clients, count))]
    return [sorted(chunk, key=lambda d: _order_key(d, salt)) for chunk in chunks]


def collector_of(chunk: Sequence[Declaration]) -> Declaration | None:
    """The lowest peer id among the chunk's reachable members: the only rule everyone needs to agree on."""
    candidates = [d for d in chunk if d.can_collect]
    return min(candidates, key=lambda d: d.peer_id) if candidates else None


def chunk_of(plan: list[list[Declaration]], peer_id: bytes) -> list[Declaration]:
    for chunk in plan:
        if any(d.peer_id == peer_id for d in chunk):
            return chunk
    return []


def round_salt(key: str, declarations: Iterable[Declaration] = ()) -> bytes:
    """Salt of the grouping order: the key. The round enters through each declaration's own round
    (`_order_key`), so the order changes every round, and a key holding several groups regroups its peers
    differently each time (see group_keys.py for why that matters), while the order never depends on the view."""
    return key.encode()


# --------------------------------------------------------------------------------------------- collector


@dataclass
class Decision:
    """The collector's answer to a join, sent back as the reply of the long-poll call."""

    kind: str  # "group" | "redirect" | "reject"
    group: GroupInfo | None = None
    round: int = 0  # with "group": the group's round (max of the members' rounds), the same for every member
    redirect: Declaration | None = None
    reason: str = ""
    busy: tuple[PeerID, ...] = ()  # with "reject": peers known to be taken (a sealed group), to skip at once

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "group": self.group.to_wire() if self.group is not None else None,
            "round": self.round,
            "redirect": [bytes(self.redirect.peer_id), self.redirect.to_wire()] if self.redirect else None,
            "reason": self.reason,
            "busy": [bytes(p) for p in self.busy],
        }

    @classmethod
    def from_wire(cls, obj: Any) -> Decision:
        if not isinstance(obj, dict) or obj.get("kind") not in ("group", "redirect", "reject"):
            raise ValueError("malformed matchmaking answer")
        redirect = None
        if obj.get("redirect") is not None:
            peer_id, value = obj["redirect"]
            redirect = Declaration.from_wire(peer_id, value)
        group = GroupInfo.from_wire(obj["group"]) if obj.get("group") is not None else None
        if obj["kind"] == "group" and group is None:
            raise ValueError("a group answer without a group")
        return cls(obj["kind"], group, int(obj.get("round", 0)), redirect, str(obj.get("reason", "")),
                   tuple(PeerID(bytes(p)) for p in obj.get("busy", ())))


class Assembly:
    """The collector's side of one group, without I/O: who joined, whom we still wait for, when to seal.

    The driver feeds it joins, view updates, probe results and the time (DHT clock, as a number); it answers what
    to tell each joiner, whether to seal, and whether to step down into a lower collector. Sealing is final:
    later joins are rejected with the sealed member list, so the joiner can skip all of them at once. No trio:
    the driver holds each pending joiner's call until `answer_ready`.
    """

    def __init__(self, me: Declaration, *, key: str, target_group_size: int, min_group_size: int):
        self.me = me
        self.key = key
        self.target = target_group_size
        self.min_size = min_group_size
        self.joined: dict[PeerID, Declaration] = {me.peer_id: me}
        self.expected: set[PeerID] = set()
        self.dropped: set[PeerID] = set()
        self.group: GroupInfo | None = None
        self.closed = False  # sealed, with or without a group, or merged into another collector's group
        self.merged_into: Declaration | None = None
        self.handed_over: dict[PeerID, Declaration] = {}  # joiners passed on to a lower collector (hand_over)

    def merge_into(self, collector: Declaration) -> None:
        """Hand my joiners to a lower collector (they are answered with a redirect to it)."""
        self.merged_into = collector
        self.closed = True

    def abandon(self) -> None:
        """The collector leaves matchmaking without sealing (window over, cancelled): every pending joiner is
        answered "no group assembled"."""
        self.closed = True

    def hand_over(self, collector: Declaration, count: int) -> list[PeerID]:
        """Pass up to `count` joiners (highest peer ids first) to a lower collector with room: they are answered
        with a redirect to it. Rival collectors whose groups are too big to merge (3 + 3 + 2 out of 8) thus fill
        the lowest one first, and the rest can merge. One that joins me again was turned away there: `offer`
        takes it back."""
        movable = sorted((p for p in self.joined if p != self.me.peer_id), reverse=True)[:max(0, count)]
        for peer_id in movable:
            del self.joined[peer_id]
            self.dropped.add(peer_id)  # it joins the lower collector now: not worth waiting for here
            self.handed_over[peer_id] = collector
        return movable

    def answer_ready(self, joiner: PeerID) -> bool:
        """The answer for this (accepted) joiner is final: the assembly is closed or the joiner was handed on.
        The driver holds the joiner's long-poll call until then."""
        return self.closed or joiner in self.handed_over

    @property
    def full(self) -> bool:
        return len(self.joined) >= self.target

    @property
    def round(self) -> int:
        return max(d.round for d in self.joined.values())

    def offer(self, joiner: Declaration, key: str) -> Decision | None:
        """A join request: None = accepted (the answer comes at sealing), else an immediate Decision."""
        if self.merged_into is not None:
            return Decision("redirect", redirect=self.merged_into)
        if joiner.peer_id in self.handed_over and not self.closed:
            # A joiner I passed on joins again: the lower collector turned it away (it filled up with others
            # between its probe and the joiner's arrival). Take it back: sending it there again left it alone for
            # the rest of the window while this group sealed one short (a first round of 64: 60 in groups of 4,
            # 3 in a group of 3, one alone).
            del self.handed_over[joiner.peer_id]
        if self.closed:
            if self.group is not None and joiner.peer_id in self.group:
                return Decision("group", group=self.group, round=self.round)
            busy = tuple(self.group.peer_ids) if self.group is not None else ()
            return Decision("reject", reason="sealed", busy=busy)
        if key != self.key:
            return Decision("reject", reason="different key")
        if joiner.schema != self.me.schema:
            return Decision("reject", reason="different schema")
        if joiner.peer_id not in self.joined and self.full:
            return Decision("reject", reason="full", busy=tuple(self.joined))
        self.joined[joiner.peer_id] = joiner
        self.dropped.discard(joiner.peer_id)
        return None

    def probed_by(self, prober: PeerID, their_size: Any, *, reachable: bool,
                  prober_patient: bool = False) -> str | None:
        """A lower collector probes me, saying how many joined it. Collectors whose views differed can split what
        should be one group (or wait for each other until the deadline). "merge": it has room for all of mine,
        so I step down into it (my joiners are redirected to it); "handover": too many to merge, so I pass it as
        many of my joiners as it has room for (`hand_over`), and with the rest I can still fill up or merge
        later; None: nothing to do (it is higher, unreachable, or I am closed, or it is still waiting for
        stragglers).

        `prober_patient`: the prober still expects peers of recent rounds that are not back yet (they are
        averaging their previous group). Its group is filling on its own, so giving it my joiners only takes them
        from a group that fills too: 4 + 2 where 4 + 4 was coming (a peer back early from its round probes a
        collector whose last member is on its way)."""
        if not reachable or not prober < self.me.peer_id or self.closed or not isinstance(their_size, int) \
                or prober_patient:
            return None
        if their_size + len(self.joined) <= self.target:
            return "merge"
        if 0 < their_size < self.target and len(self.joined) > 1:
            return "handover"
        return None

    def expect(self, peer_ids: Iterable[PeerID]) -> None:
        """Peers another collector is sending my way (it merges into me, or hands some joiners over)."""
        for peer_id in peer_ids:
            self.expected.add(peer_id)
            self.dropped.discard(peer_id)

    def set_expected(self, chunk: Iterable[Declaration], extra: Iterable[PeerID] = ()) -> None:
        """The members of my chunk in the newest view (and peers merging into my group): worth waiting for."""
        self.expected = ({d.peer_id for d in chunk} | set(extra)) - {self.me.peer_id}

    def drop(self, peer_id: PeerID) -> None:
        """An expected peer is dead or follows someone else: stop waiting for it."""
        if peer_id not in self.joined:
            self.dropped.add(peer_id)

    def readmit(self, peer_id: PeerID) -> None:
        """A dropped peer turned out to be free after all (it declared again after a stale declaration): wait for
        it again if it is in my chunk."""
        self.dropped.discard(peer_id)

    @property
    def waiting_for(self) -> set[PeerID]:
        return self.expected - set(self.joined) - self.dropped

    @property
    def seal_deadline(self) -> float:
        """The earliest deadline among me and the joined members: sealing then, nobody has given up yet."""
        return min(d.deadline for d in self.joined.values())

    def should_seal(self, now: float, quiet: bool) -> bool:
        """Full; or everyone still alive in my chunk joined and the view is quiet (the driver passes quiet=False
        while it still expects stragglers); or the seal deadline."""
        if self.full:
            return True
        if quiet and not self.waiting_for and len(self.joined) >= self.min_size:
            return True
        return now >= self.seal_deadline

    def group_id(self) -> bytes:
        """The id the collector seals under: unique (its declaration time differs every round) and reproducible
        in simulations, unlike random bytes."""
        return hashlib.sha256(b"swarmd-group|" + self.key.encode() + bytes(self.me.peer_id)
                              + repr(self.me.declared_at).encode()
                              + b"".join(sorted(bytes(p) for p in self.joined))).digest()[:16]

    def seal(self, group_id: bytes) -> GroupInfo | None:
        """Fix the member list (None when too few joined: no group this round)."""
        if self.closed:
            raise LocalViolation("the assembly is already closed", operation="matchmaking.seal")
        self.closed = True
        if len(self.joined) >= self.min_size:
            self.group = GroupInfo.create(group_id, [d.member() for d in self.joined.values()])
        return self.group

    def answer(self, joiner: PeerID) -> Decision:
        """The final answer to a joiner whose join was accepted, once `answer_ready`."""
        if not self.answer_ready(joiner):
            raise LocalViolation("the joiner's answer is not final yet", operation="matchmaking.join")
        if self.merged_into is not None:
            return Decision("redirect", redirect=self.merged_into)
        if joiner in self.handed_over:
            return Decision("redirect", redirect=self.handed_over[joiner])
        if self.group is not None and joiner in self.group:
            return Decision("group", group=self.group, round=self.round)
        return Decision("reject", reason="no group assembled")


# --------------------------------------------------------------------------------------------- probes


@dataclass(frozen=True)
class ProbeAnswer:
    """What a probed chunk member's answer to `avg.mm.ping` means for a collector (see `read_probe_answer`).

    kind: "handover" (it is a rival collector passing me `members`), "merging" (it steps down into my group with
    `members`), "stale" (not matching under my key: a declaration left from its previous round;
    `between_rounds` when it is averaging or training and will declare again), "busy" (it collects a group of
    its own), "follows_other" (it follows another collector), "free" (matching, waiting, free to join me)."""

    kind: str
    members: tuple[PeerID, ...] = ()
    between_rounds: bool = False


def _peer_ids(value: Any) -> tuple[PeerID, ...]:
    return tuple(PeerID(m) for m in value if isinstance(m, bytes) and len(m) == 20)


def read_probe_answer(answer: Any, me: PeerID) -> ProbeAnswer:
    """Classify a probe's answer. Anything malformed reads as "busy": the collector stops waiting for that peer
    (a peer whose answers cannot be understood must not hold a group back)."""
    if not isinstance(answer, dict):
        return ProbeAnswer("busy")
    if isinstance(answer.get("handover"), list):
        return ProbeAnswer("handover", _peer_ids(answer["handover"]))
    if isinstance(answer.get("merging"), list):
        return ProbeAnswer("merging", _peer_ids(answer["merging"]))
    if not answer.get("matching"):
        return ProbeAnswer("stale", between_rounds=bool(answer.get("between_rounds")))
    if answer.get("collecting"):
        return ProbeAnswer("busy")
    following = answer.get("following")
    if following is not None and (not isinstance(following, bytes) or bytes(following) != bytes(me)):
        return ProbeAnswer("follows_other")
    return ProbeAnswer("free")
