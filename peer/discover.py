"""What experts the swarm serves, read from the peer directory: so `peer join` and `peer train` need no flags.

Why the directory: every daemon already keeps a signed entry in the DHT's peer directory (`peer.directory`); its
summary also says which expert grid the daemon serves from (a pattern such as `ffn.[0:12]`), how many experts it
serves there and their hidden size. One read of the directory's few shard keys then tells a trainer or a new
volunteer every *expert family* of the swarm without crawling the grid or calling anyone.

A family is the experts under one prefix with one hidden size (and one number of grid dimensions). Its grid is
the bounding box of its daemons' patterns: daemons serving `ffn.[0:4]`, `ffn.[4:8]` and `ffn.[8:12]` make the
family `ffn` with grid 12. The rules, the same for both commands:

- a value given on the command line (`--hidden-dim`, `--expert-prefix`, `--grid-size`'s number of dimensions)
  selects among the families; if none matches, the error names what was asked and what the swarm declares;
- among the families left, the one serving the most experts is taken (ties: the prefix that sorts first);
- a swarm whose directory declares no experts yet (daemons still starting) is read again for a bounded time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeGuard

import trio

from dht.client import DHTClient
from moe.grid import GridPattern, InvalidUID
from peer.directory import PeerEntry, list_peers

DEFAULT_WAIT = 15.0  # seconds a trainer waits for a swarm whose daemons have not declared experts yet


class SwarmMismatch(ValueError):
    """The swarm declares no expert matching what was asked; the message names both sides."""


class NoExpertsDeclared(SwarmMismatch):
    """No daemon of the swarm declared any expert within the wait."""


def summary_fields(pattern: str, experts: int, hidden_dim: int, kind: str | None = None) -> dict[str, Any]:
    """The directory-summary fields of a daemon serving `experts` experts of `kind` from `pattern` (the keys
    `families_from_entries` reads; `kind` is shown by `peer status` and the dashboard): kept here so that the
    writer and the reader cannot drift."""
    fields: dict[str, Any] = {"experts": experts, "grid": pattern, "hidden_dim": hidden_dim}
    if kind is not None:
        fields["kind"] = kind
    return fields


@dataclass(frozen=True)
class ExpertFamily:
    prefix: str
    grid: tuple[int, ...]  # per dimension, one past the largest coordinate any daemon serves from
    hidden_dim: int
    experts: int  # experts served, summed over the daemons (replicas count once per daemon)
    peers: int

    @property
    def pattern(self) -> str:
        return self.prefix + "".join(f".[0:{size}]" for size in self.grid)

    @property
    def grid_size(self) -> str:
        """The grid as `peer train --grid-size` writes it: `12`, `4x4`."""
        return "x".join(str(size) for size in self.grid)

    def describe(self) -> str:
        return (f"{self.prefix} ({self.experts} experts on {self.peers} peer{'s' * (self.peers != 1)}, "
                f"grid {self.grid_size}, hidden {self.hidden_dim})")


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def families_from_entries(entries: Iterable[PeerEntry], *, exclude_peer: str | None = None) -> list[ExpertFamily]:
    """The expert families described by directory entries, largest first. Entries that serve no expert, describe
    their experts badly (anyone can write a summary) or belong to `exclude_peer` (a restarted daemon's own
    previous entry) are skipped."""
    grids: dict[tuple[str, int, int], list[int]] = {}
    counts: dict[tuple[str, int, int], list[int]] = {}
    for entry in entries:
        if entry.peer_id == exclude_peer:
            continue
        summary = entry.summary
        experts, pattern, hidden = summary.get("experts"), summary.get("grid"), summary.get("hidden_dim")
        if not _positive_int(experts) or not _positive_int(hidden) or not isinstance(pattern, str):
            continue
        try:
            grid = GridPattern.parse(pattern)
        except InvalidUID:
            continue
        key = (grid.name, hidden, len(grid.dims))
        stops = [dim.stop for dim in grid.dims]
        known = grids.setdefault(key, stops)
        grids[key] = [max(a, b) for a, b in zip(known, stops)]
        count = counts.setdefault(key, [0, 0])
        count[0] += experts
        count[1] += 1
    families = [ExpertFamily(key[0], tuple(grids[key]), key[1], *counts[key]) for key in grids]
    return sorted(families, key=lambda f: (-f.experts, f.prefix, f.hidden_dim, len(f.grid)))


async def discover_families(dht: DHTClient, *, exclude_peer: str | None = None) -> list[ExpertFamily]:
    """The swarm's expert families, from one read of the peer directory (largest first)."""
    return families_from_entries(await list_peers(dht), exclude_peer=exclude_peer)


def choose_family(families: list[ExpertFamily], *, hidden_dim: int | None = None, prefix: str | None = None,
                  ndim: int | None = None) -> ExpertFamily:
    """The largest family matching what was given (None: anything); SwarmMismatch names both sides otherwise."""
    if not families:
        raise NoExpertsDeclared("the swarm declares no experts")
    declared = "; ".join(family.describe() for family in families)
    matching = families
    if prefix is not None:
        matching = [family for family in matching if family.prefix == prefix]
        if not matching:
            raise SwarmMismatch(f"no expert under prefix {prefix!r}: the swarm declares {declared}")
    under = f"under prefix {prefix!r} " if prefix is not None else "in the swarm "
    if hidden_dim is not None:
        matching = [family for family in matching if family.hidden_dim == hidden_dim]
        if not matching:
            raise SwarmMismatch(f"no expert {under}takes --hidden-dim {hidden_dim}: the swarm declares {declared}")
    if ndim is not None:
        matching = [family for family in matching if len(family.grid) == ndim]
        if not matching:
            raise SwarmMismatch(f"no expert {under}has a {ndim}-dimensional grid: the swarm declares {declared}")
    return matching[0]


@dataclass(frozen=True)
class ExpertSettings:
    """What a trainer's mixture-of-experts layer needs, each value as given or as the swarm declares it."""

    prefix: str
    grid_size: str
    hidden_dim: int
    family: ExpertFamily


async def discover_experts(
    dht: DHTClient,
    *,
    hidden_dim: int | None = None,
    prefix: str | None = None,
    grid_size: str | None = None,
    wait: float = DEFAULT_WAIT,
    poll: float = 0.5,
    on_wait: Callable[[float, float], None] | None = None,
    progress_every: float = 3.0,
) -> ExpertSettings:
    """The trainer's expert settings: given values are checked against the swarm, missing ones (None) are taken
    from the family chosen by `choose_family`. `grid_size` is `N` or `AxB`; only its number of dimensions selects
    a family, its sizes are kept as given.

    While the directory declares no expert at all (daemons starting up), it is read again every `poll` seconds
    for at most `wait` seconds; `on_wait(waited, wait)` is called about every `progress_every` seconds meanwhile.
    Raises NoExpertsDeclared after the wait, SwarmMismatch at once when experts exist but none matches."""
    ndim = None if grid_size is None else len(str(grid_size).lower().split("x"))
    started = trio.current_time()
    deadline = started + wait
    next_progress = started + progress_every
    while True:
        families: list[ExpertFamily] = []
        # a directory read is a few DHT lookups; bound it so that the whole wait stays bounded
        with trio.move_on_after(max(poll, deadline - trio.current_time())):
            families = await discover_families(dht)
        if families:
            break
        now = trio.current_time()
        if now >= deadline:
            raise NoExpertsDeclared(f"no experts declared in the swarm after waiting {wait:g} s: is a `peer join` "
                                    "serving experts reachable? (`peer status` lists what the swarm serves)")
        if on_wait is not None and now >= next_progress:
            on_wait(now - started, wait)
            next_progress = now + progress_every
        await trio.sleep(min(poll, max(0.0, deadline - now)))
    family = choose_family(families, hidden_dim=hidden_dim, prefix=prefix, ndim=ndim)
    return ExpertSettings(
        prefix=family.prefix, grid_size=str(grid_size) if grid_size is not None else family.grid_size,
        hidden_dim=family.hidden_dim, family=family,
    )
