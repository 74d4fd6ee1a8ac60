"""The resource accountant: what each remote peer, each protocol and the whole node may hold, in one place.

Why: a volunteer serves strangers. Without limits a few identities took every relay slot, every byte of the
receive budget, and hundreds of megabytes of handler memory (issue 40), and honest peers were refused because
everything was handed out first come. Every service charges what a remote makes it hold to this accountant
before it holds it, and gives it back when it is done:

- scopes: `("peer", PeerID)` for an authenticated remote, `("ip", group)` for a stage before authentication (a
  handshake, a relay request: keyed on the IP group the socket shows, never on a field the remote writes),
  `("protocol", name)` for one service or RPC method, and `("total", None)` for the node;
- resources: `connections`, `requests` (handlers running / queued calls), `message_bytes` (bytes of partly
  received messages), `handshakes`, `relay_requests`, `reservations`, `circuits`;
- limits: `(scope kind, resource) -> amount`; a scope kind without a limit for a resource is not bounded there.

A charge over any limit is refused at once with `LimitReached` (answered to the remote as `BudgetExceeded`),
whose message names the limit, its value and who hit it; nothing is queued. A per-peer limit is always below
the total, so one peer never takes the pool whole; when the total is full anyway (many identities), `heaviest`
names the scope that holds the most, and the service evicts from it rather than refusing a newcomer who holds
less (Bitcoin Core's inbound eviction, in its simplest form: the one that holds most goes first).

Sans-I/O: no trio, no clock, no sockets; services call it from their drivers and cores.
"""

from __future__ import annotations

import ipaddress
import math
from collections import defaultdict
from dataclasses import dataclass, field, fields, replace
from typing import Any, Hashable, Iterable, Mapping

Scope = tuple[str, Hashable]
TOTAL: Scope = ("total", None)

MIB = 1024 * 1024


class LimitReached(Exception):
    """A charge would take a scope past its limit; nothing was charged. `message` names the limit (as its
    `BudgetLimits` field), its value, who holds it and who was refused. Services answer the remote with
    `peer.p2p.rpc_protocol.BudgetExceeded` (or their own typed refusal) carrying this message: this module
    sits below the RPC core (the framing uses it), so it defines no RPC error itself."""

    def __init__(self, message: str, *, resource: str, scope: "Scope", limit: float):
        super().__init__(message)
        self.message = message
        self.resource = resource
        self.scope = scope
        self.limit = limit


@dataclass(frozen=True)
class BudgetLimits:
    """Every limit and its default; docs/budgets.md says why each default is what it is.

    Per peer (an authenticated PeerID) unless the name says otherwise; `*_total` bound the whole node."""

    connections_per_peer: int = 64
    connections_total: int = 4096
    requests_per_peer: int = 256  # handlers running for one peer at once
    requests_per_protocol: int = 1024  # handlers of one RPC method at once, over all peers
    requests_total: int = 2048
    message_bytes_per_peer: int = 256 * MIB  # bytes of partly received messages one peer holds
    message_bytes_total: int = 1024 * MIB
    message_stall_timeout: float = 30.0  # seconds a partly received message may go without a chunk arriving
    handshakes_per_ip: int = 64  # unauthenticated connections in their handshake, per IP group
    handshakes_total: int = 256
    relay_requests_per_ip: int = 32  # relay circuit streams whose request is being read, per IP group
    relay_requests_total: int = 256
    reservations_per_ip: int = 32  # relay reservations held by the identities of one IP group
    circuits_per_peer: int = 16  # relayed circuits to one reserved peer (the relay's `--relay-limit` bounds all)
    circuits_per_ip: int = 32  # relayed circuits dialed from one IP group
    circuit_bytes: int = 8 * 1024 * MIB  # bytes one relayed circuit carries (both ways) before the relay ends it

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @staticmethod
    def parse_override(text: str) -> tuple[str, float]:
        """`NAME=VALUE` (one `--budget` flag) as (name, value); ValueError naming what is wrong, and the names."""
        name, equals, value = text.partition("=")
        name = name.strip().replace("-", "_")
        if not equals or name not in BudgetLimits.names():
            raise ValueError(f"{text!r} is not NAME=VALUE with NAME one of {', '.join(BudgetLimits.names())}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{text!r}: {value.strip()!r} is not a number") from None
        if not number > 0 or not math.isfinite(number):
            raise ValueError(f"{text!r}: the limit must be a positive number")
        return name, number

    def with_overrides(self, overrides: Iterable[str]) -> "BudgetLimits":
        """These limits with `NAME=VALUE` overrides applied (the daemon's `--budget`), checked together (a limit
        per peer above its total is a ValueError naming both)."""
        changes: dict[str, Any] = {}
        for text in overrides:
            name, number = self.parse_override(text)
            changes[name] = number if name == "message_stall_timeout" else int(number)
        return replace(self, **changes)

    def table(self) -> dict[tuple[str, str], float]:
        """`(scope kind, resource) -> limit`, as `Accountant` reads it."""
        return {
            ("peer", "connections"): self.connections_per_peer,
            ("total", "connections"): self.connections_total,
            ("peer", "requests"): self.requests_per_peer,
            ("protocol", "requests"): self.requests_per_protocol,
            ("total", "requests"): self.requests_total,
            ("peer", "message_bytes"): self.message_bytes_per_peer,
            ("total", "message_bytes"): self.message_bytes_total,
            ("ip", "handshakes"): self.handshakes_per_ip,
            ("total", "handshakes"): self.handshakes_total,
            ("ip", "relay_requests"): self.relay_requests_per_ip,
            ("total", "relay_requests"): self.relay_requests_total,
            ("ip", "reservations"): self.reservations_per_ip,
            ("peer", "circuits"): self.circuits_per_peer,
            ("ip", "circuits"): self.circuits_per_ip,
        }

    def __post_init__(self) -> None:
        pairs = (("connections", self.connections_per_peer, self.connections_total),
                 ("requests", self.requests_per_peer, self.requests_total),
                 ("message_bytes", self.message_bytes_per_peer, self.message_bytes_total),
                 ("handshakes", self.handshakes_per_ip, self.handshakes_total),
                 ("relay_requests", self.relay_requests_per_ip, self.relay_requests_total))
        for name, per, total in pairs:
            if not 0 < per <= total:
                raise ValueError(f"the {name} limit per peer ({per}) must be positive and at most the total "
                                 f"({total})")
        if not min(self.reservations_per_ip, self.circuits_per_peer, self.circuits_per_ip, self.circuit_bytes) > 0:
            raise ValueError("the relay limits must be positive")
        if not self.message_stall_timeout > 0:
            raise ValueError("message_stall_timeout must be positive")


DEFAULT_BUDGET = BudgetLimits()


def ip_group(host: str) -> str:
    """The IP group a stage before authentication is charged to: the IPv4 address itself, an IPv6 sender's /64
    (the block one host usually gets), or the name of an in-memory network's host."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def describe(scope: Scope) -> str:
    kind, key = scope
    if kind == "peer":
        short = getattr(key, "short", None)
        return f"peer {short() if short is not None else key}"
    if kind == "ip":
        return f"IP {key}"
    if kind == "protocol":
        return f"protocol {key}"
    return "this node"


@dataclass
class Accountant:
    """Amounts held per (scope, resource) against `limits`; see the module docstring."""

    limits: Mapping[tuple[str, str], float] = field(default_factory=DEFAULT_BUDGET.table)
    held: dict[str, dict[Scope, float]] = field(default_factory=lambda: defaultdict(dict))
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def __post_init__(self) -> None:
        # resource -> scope kind -> limit: `take` and `give_back` run several times per RPC call (issue 40's
        # target: the accountant costs at most 5% of an echo call), so they look limits up by kind, not by
        # building (kind, resource) tuples; `limits` is read-only after construction
        self._by_resource: dict[str, dict[str, float]] = defaultdict(dict)
        for (kind, resource), limit in self.limits.items():
            self._by_resource[resource][kind] = limit

    @classmethod
    def from_limits(cls, limits: BudgetLimits = DEFAULT_BUDGET) -> "Accountant":
        return cls(limits.table())

    def limit(self, kind: str, resource: str) -> float | None:
        return self.limits.get((kind, resource))

    def amount(self, scope: Scope, resource: str) -> float:
        return self.held[resource].get(scope, 0)

    def over(self, scopes: Iterable[Scope], resource: str, amount: float) -> tuple[Scope, float] | None:
        """The first of `scopes` (and the total) that `amount` more would take past its limit, with that limit."""
        held = self.held[resource]
        limits = self._by_resource[resource]
        for scope in scopes:
            limit = limits.get(scope[0])
            if limit is not None and held.get(scope, 0) + amount > limit:
                return scope, limit
        limit = limits.get("total")
        if limit is not None and held.get(TOTAL, 0) + amount > limit:
            return TOTAL, limit
        return None

    def take(self, scopes: Iterable[Scope], resource: str, amount: float = 1, *, peer: Any = None) -> None:
        """Charge `amount` of `resource` to every scope in `scopes` and to the total, or raise `LimitReached`
        (charging nothing) naming the limit that would be passed. `peer`: who is refused, for the message (the
        first scope when not given)."""
        scopes = scopes if isinstance(scopes, tuple) else tuple(scopes)
        refusal = self.over(scopes, resource, amount)
        if refusal is not None:
            scope, limit = refusal
            self.refused[resource] += 1
            raise LimitReached(self.refusal(scope, resource, limit, peer if peer is not None else
                                            (scopes[0] if scopes else None)),
                               resource=resource, scope=scope, limit=limit)
        self.add(scopes, resource, amount)

    def refusal(self, scope: Scope, resource: str, limit: float, who: Any) -> str:
        """The one-line refusal: which limit (its option name), its value, who holds what, who was refused."""
        name = f"{resource}_total" if scope[0] == "total" else f"{resource}_per_{scope[0]}"
        refused = describe(who) if isinstance(who, tuple) else describe(("peer", who)) if who is not None else "?"
        return (f"limit {name}={describe_amount(limit, resource)} reached: {describe(scope)} holds "
                f"{describe_amount(self.amount(scope, resource), resource)}; refused for {refused}")

    def add(self, scopes: Iterable[Scope], resource: str, amount: float) -> None:
        """Charge without checking (what already arrived, or a holder the caller decided to let in)."""
        held = self.held[resource]
        for scope in scopes:
            held[scope] = held.get(scope, 0) + amount
        held[TOTAL] = held.get(TOTAL, 0) + amount

    def give_back(self, scopes: Iterable[Scope], resource: str, amount: float = 1) -> None:
        held = self.held[resource]
        for scope in scopes:
            left = held.get(scope, 0) - amount
            if left > 0:
                held[scope] = left
            else:
                held.pop(scope, None)
        left = held.get(TOTAL, 0) - amount
        if left > 0:
            held[TOTAL] = left
        else:
            held.pop(TOTAL, None)

    def heaviest(self, kind: str, resource: str) -> tuple[Scope, float] | None:
        """The scope of `kind` holding the most of `resource` (whom to evict from when the total is full)."""
        best: tuple[Scope, float] | None = None
        for scope, amount in self.held[resource].items():
            if scope[0] == kind and (best is None or amount > best[1]):
                best = (scope, amount)
        return best

    def usage(self) -> dict[str, Any]:
        """Use against each limit, for `peer status` and the dashboard: per resource, the total held and its
        limit, the largest holder of each scope kind with its limit, and how many requests were refused."""
        report: dict[str, Any] = {}
        resources = {resource for _, resource in self.limits}
        for resource in sorted(resources):
            entry: dict[str, Any] = {"held": self.amount(TOTAL, resource),
                                     "limit": self.limits.get(("total", resource)),
                                     "refused": self.refused.get(resource, 0)}
            for kind in ("peer", "ip", "protocol"):
                limit = self.limits.get((kind, resource))
                if limit is None:
                    continue
                top = self.heaviest(kind, resource)
                entry[f"max_per_{kind}"] = top[1] if top is not None else 0
                entry[f"limit_per_{kind}"] = limit
            report[resource] = entry
        return report


def fullest(usage: Mapping[str, Mapping[str, Any]]) -> tuple[str, str, float] | None:
    """Of `Accountant.usage()` (or several merged), the limit nearest to full: (resource, which: "total" or
    "per_peer"/"per_ip"/..., the share of it in use); None when nothing has a limit."""
    best: tuple[str, str, float] | None = None
    for resource, entry in usage.items():
        pairs = [("total", entry.get("held"), entry.get("limit"))]
        pairs += [(f"per_{kind}", entry.get(f"max_per_{kind}"), entry.get(f"limit_per_{kind}"))
                  for kind in ("peer", "ip", "protocol")]
        for which, held, limit in pairs:
            if held is not None and limit:
                share = held / limit
                if best is None or share > best[2]:
                    best = (resource, which, share)
    return best


def describe_usage(usage: Mapping[str, Mapping[str, Any]]) -> str:
    """One line for `peer status` and the dashboard: the fullest limit, and the requests refused per resource
    since the start ("connections per_ip 3/8 (38%); refused: 12 requests")."""
    top = fullest(usage)
    if top is None:
        return "no limits"
    resource, which, share = top
    entry = usage[resource]
    held, limit = (entry["held"], entry["limit"]) if which == "total" else \
        (entry[f"max_{which}"], entry[f"limit_{which}"])
    line = (f"fullest: {resource}_{which} {describe_amount(held, resource)}/{describe_amount(limit, resource)} "
            f"({share:.0%})")
    refused = {resource: entry.get("refused", 0) for resource, entry in sorted(usage.items())
               if entry.get("refused", 0)}
    line += "; refused: " + (", ".join(f"{count} {resource}" for resource, count in refused.items()) or "none")
    return line


def describe_amount(value: float, resource: str) -> str:
    """`value` of `resource` as a refusal shows it (bytes in MiB/GiB)."""
    if resource.endswith("bytes") and value >= 1024 * MIB:
        return f"{value / (1024 * MIB):.1f} GiB"
    if resource.endswith("bytes") and value >= MIB:
        return f"{value / MIB:.1f} MiB"
    return f"{value:g}"


class OldestFirst:
    """Admission for unauthenticated work (handshakes, relay requests) that always lets a newcomer in: when its
    IP group, or the node, is at its limit, the oldest pending item of that group (of the heaviest group, for
    the node's total) is evicted to make room. Honest handshakes finish in a round trip, trickling ones wait
    for their deadline, so the oldest is almost always the trickler's: a flood from one address cannot lock out
    a newcomer from the same or another address (slowloris; Bitcoin Core evicts rather than refuses too)."""

    def __init__(self, accountant: Accountant, resource: str):
        self.accountant = accountant
        self.resource = resource
        self._pending: dict[str, dict[Hashable, None]] = {}  # group -> tokens, oldest first
        self.evicted = 0

    def admit(self, group: str, token: Hashable) -> list[Hashable]:
        """Count `token` under `group`; returns the tokens evicted to make room (the caller ends their work)."""
        scopes: tuple[Scope, ...] = (("ip", group),)
        victims: list[Hashable] = []
        while (refusal := self.accountant.over(scopes, self.resource, 1)) is not None:
            scope = refusal[0]
            if scope == TOTAL:
                heaviest = self.accountant.heaviest("ip", self.resource)
                if heaviest is None:
                    break
                scope = heaviest[0]
            queue = self._pending.get(str(scope[1]))
            if not queue:
                break
            victim = next(iter(queue))
            self.leave(str(scope[1]), victim)
            victims.append(victim)
            self.evicted += 1
        self.accountant.add(scopes, self.resource, 1)
        self._pending.setdefault(group, {})[token] = None
        return victims

    def leave(self, group: str, token: Hashable) -> None:
        """`token`'s work ended (or was evicted): no longer counted. Idempotent."""
        queue = self._pending.get(group)
        if queue is None or token not in queue:
            return
        del queue[token]
        if not queue:
            del self._pending[group]
        self.accountant.give_back((("ip", group),), self.resource, 1)
