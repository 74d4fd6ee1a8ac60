"""Finding the k best alive experts for each sample on an expert grid.

A gate scores every grid dimension separately: the score of expert `ffn.3.17` for a sample is
`scores[0][sample][3] + scores[1][sample][17]`. Experts are declared in the DHT under their uid prefixes (key
`ffn.`, subkey 3; key `ffn.3.`, subkey 17 -> `[uid, host, port, peer_id_hex]`), so learning which coordinates
exist below a prefix costs one DHT key and the whole grid never has to be enumerated.

A plain beam search (keep the k best prefixes per level) is NOT exact: a prefix with a high partial score may
have few or no alive children, and the prefixes it pushed out of the beam are lost. `GridSearch` is a best-first
search instead: a prefix's priority is its partial score plus the best score every remaining dimension could
add, an upper bound of any expert below it, so an expert is emitted only when nothing left can beat it. That
makes the result the true top-k among the experts the oracle reports (the tests check it against brute force),
and in the common case it still asks for one DHT level per round, like a beam search would.

`GridSearch` is sans-I/O: it says which prefixes it needs (`wanted`), is given their children (`provide`), and
never touches the network or a clock. `find_best_experts` drives it with any async oracle; `DHTGridOracle` is
the DHT-backed oracle with a small expiring cache, so a training loop calling the search every step costs one
batched DHT read per cache period, not one per step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import trio

from moe.grid import prefix_entries

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class ExpertLocation:
    """Where an expert is served: the RPC address and the PeerID (hex) it declared in the DHT."""

    host: str
    port: int
    peer_id_hex: str

    @property
    def address(self) -> Address:
        return (self.host, self.port)


@dataclass(frozen=True, slots=True)
class ExpertChoice:
    """One chosen expert for one sample: its grid coordinates, gate score and location."""

    uid: str
    coords: tuple[int, ...]
    score: float
    location: ExpertLocation


# children of a prefix: coordinate of the next dimension -> location (last level) or any value (upper levels)
Children = Mapping[int, Any]
# (uid, location) -> True when that expert must not be chosen (dead, recently failed, ...)
Banned = Callable[[str, ExpertLocation], bool]


def normalize_prefix(uid_prefix: str) -> str:
    """`ffn` and `ffn.` name the same grid; DHT prefix keys always end with a dot."""
    return uid_prefix if uid_prefix.endswith(".") else uid_prefix + "."


def parse_location(value: Any) -> ExpertLocation | None:
    """Read `[uid, host, port, peer_id_hex]` (prefix entries) or `[host, port, peer_id_hex]` (uid entries), or
    the `(uid, ExpertLocation)` pairs `moe.declare.get_prefixes` returns; None for anything malformed, since DHT
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


@dataclass(order=True, slots=True)
class _Node:
    neg_priority: float  # heapq is a min-heap: the best candidate has the most negative value
    coords: tuple[int, ...]
    score: float = field(compare=False)  # exact partial score of the coordinates fixed so far
    location: ExpertLocation | None = field(compare=False, default=None)  # set for complete experts only


class GridSearch:
    """Exact best-first search for the top-k experts of every sample of a batch (sans-I/O)."""

    def __init__(
        self,
        uid_prefix: str,
        grid_size: Sequence[int],
        scores: Sequence[Sequence[Sequence[float]]],
        k: int | Sequence[int],
        *,
        banned: Banned | None = None,
        exclude: Sequence[set[str]] | None = None,
    ):
        """`scores[d][b][c]` is the gate score of coordinate c in dimension d for sample b. `k` is how many
        experts each sample wants (one number, or one per sample). `banned` filters experts for every sample;
        `exclude[b]` is a set of uids sample b must not get (e.g. experts already tried for it)."""
        if len(scores) != len(grid_size) or not grid_size:
            raise ValueError(f"need one score matrix per grid dimension ({len(grid_size)}), got {len(scores)}")
        self.uid_prefix = normalize_prefix(uid_prefix)
        self.grid_size = tuple(int(g) for g in grid_size)
        self._scores = scores
        self.batch_size = len(scores[0])
        for d, per_dim in enumerate(scores):
            if len(per_dim) != self.batch_size:
                raise ValueError(f"scores of dimension {d} have {len(per_dim)} rows, expected {self.batch_size}")
        self._k = [int(k)] * self.batch_size if isinstance(k, int) else [int(x) for x in k]
        if len(self._k) != self.batch_size:
            raise ValueError("need one k per sample")
        self._banned = banned
        self._exclude = exclude
        self._children: dict[str, dict[int, Any]] = {}
        self._results: list[list[ExpertChoice]] = [[] for _ in range(self.batch_size)]
        self._heaps: list[list[_Node]] = []
        # suffix_max[b][d]: the most that dimensions d.. can still add to sample b's score
        self._suffix_max: list[list[float]] = []
        for b in range(self.batch_size):
            suffix = [0.0] * (len(self.grid_size) + 1)
            for d in reversed(range(len(self.grid_size))):
                row = scores[d][b]
                if len(row) != self.grid_size[d]:
                    raise ValueError(f"scores[{d}][{b}] has {len(row)} entries, grid size is {self.grid_size[d]}")
                suffix[d] = suffix[d + 1] + max(row)
            self._suffix_max.append(suffix)
            self._heaps.append([_Node(-suffix[0], (), 0.0)] if self._k[b] > 0 else [])
        self._advance_all()

    # ------------------------------------------------------------------------------------------------ driving

    @property
    def done(self) -> bool:
        return not self._pending_samples()

    def wanted(self) -> list[str]:
        """DHT prefix keys whose children the search needs next (deduplicated, stable order). Empty when done.

        For each unfinished sample this looks at as many of its best candidates as it still needs, so a
        sample whose best prefixes are all unexplored asks for them in one round instead of one per round."""
        keys: dict[str, None] = {}
        for b in self._pending_samples():
            missing = self._k[b] - len(self._results[b])
            for node in heapq.nsmallest(missing, self._heaps[b]):
                if node.location is None:
                    key = self._key(node.coords)
                    if key not in self._children:
                        keys[key] = None
        return list(keys)

    def provide(self, children: Mapping[str, Children | None]) -> None:
        """Tell the search which coordinates exist below the given prefixes (None or {} = nothing there)."""
        for key, found in children.items():
            self._children[key] = dict(found) if found else {}
        self._advance_all()

    def results(self) -> list[list[ExpertChoice]]:
        """Per sample, the chosen experts best first (fewer than k when fewer are alive)."""
        if not self.done:
            raise RuntimeError("search is not finished: provide the wanted prefixes first")
        return self._results

    # ------------------------------------------------------------------------------------------------ internals

    def _key(self, coords: tuple[int, ...]) -> str:
        return self.uid_prefix + "".join(f"{c}." for c in coords)

    def _uid(self, coords: tuple[int, ...]) -> str:
        return self.uid_prefix + ".".join(str(c) for c in coords)

    def _pending_samples(self) -> list[int]:
        return [b for b in range(self.batch_size) if len(self._results[b]) < self._k[b] and self._heaps[b]]

    def _advance_all(self) -> None:
        for b in range(self.batch_size):
            self._advance(b)

    def _advance(self, b: int) -> None:
        """Emit complete experts and expand known prefixes until the best candidate is an unexplored prefix."""
        heap, results, ndim = self._heaps[b], self._results[b], len(self.grid_size)
        while heap and len(results) < self._k[b]:
            top = heap[0]
            if top.location is not None:
                heapq.heappop(heap)
                uid = self._uid(top.coords)
                if self._banned is not None and self._banned(uid, top.location):
                    continue
                if self._exclude is not None and uid in self._exclude[b]:
                    continue
                results.append(ExpertChoice(uid, top.coords, top.score, top.location))
                continue
            children = self._children.get(self._key(top.coords))
            if children is None:
                return  # the next move needs the oracle
            heapq.heappop(heap)
            depth = len(top.coords)
            row = self._scores[depth][b]
            for coord, value in children.items():
                if not isinstance(coord, int) or isinstance(coord, bool) or not 0 <= coord < self.grid_size[depth]:
                    continue  # another grid's expert, or garbage from the DHT
                score = top.score + float(row[coord])
                coords = top.coords + (coord,)
                if depth + 1 == ndim:
                    location = parse_location(value)
                    if location is None:
                        continue
                    heapq.heappush(heap, _Node(-score, coords, score, location))
                else:
                    heapq.heappush(heap, _Node(-(score + self._suffix_max[b][depth + 1]), coords, score))


# ---------------------------------------------------------------------------------------------------- drivers


class ChildrenOracle(Protocol):
    async def children(self, prefixes: Sequence[str]) -> Mapping[str, Children | None]: ...


async def find_best_experts(
    oracle: ChildrenOracle,
    uid_prefix: str,
    grid_size: Sequence[int],
    scores: Sequence[Sequence[Sequence[float]]],
    k: int | Sequence[int],
    *,
    banned: Banned | None = None,
    exclude: Sequence[set[str]] | None = None,
) -> list[list[ExpertChoice]]:
    """Run `GridSearch` against an oracle: one batched oracle call per round."""
    search = GridSearch(uid_prefix, grid_size, scores, k, banned=banned, exclude=exclude)
    while not search.done:
        search.provide(await oracle.children(search.wanted()))
    return search.results()


class StaticGridOracle:
    """Children of grid prefixes from a fixed uid -> location table: a mixture over a known set of experts, with
    no DHT (benchmarks, private deployments, tests)."""

    def __init__(self, experts: Mapping[str, ExpertLocation]):
        self.table: dict[str, dict[int, tuple[str, ExpertLocation]]] = {}
        for uid, location in experts.items():
            for prefix, coord in prefix_entries(uid):
                self.table.setdefault(prefix, {})[coord] = (uid, location)

    async def children(self, prefixes: Sequence[str]) -> dict[str, dict[int, Any]]:
        return {key: self.table.get(key, {}) for key in prefixes}


class DHTGridOracle:
    """Children of grid prefixes read from the DHT's prefix entries, cached for `ttl` seconds.

    Caching is what keeps a training step cheap: a 2-level grid costs two `get_many` calls per `ttl`, not per
    step. Experts that died since are not a problem for correctness: calls to them fail fast and the mixture
    bans them (see `moe/mixture.py`); new experts appear after at most `ttl` seconds. The record layout and its
    validation live in `moe.declare` (shared with the servers that write it)."""

    def __init__(self, dht: Any, *, ttl: float = 5.0, clock: Callable[[], float] = trio.current_time):
        self.dht = dht
        self.ttl = ttl
        self._clock = clock
        self._cache: dict[str, tuple[float, dict[int, Any]]] = {}
        self.lookups = 0  # number of DHT get_many calls, for tests and benchmarks

    def invalidate(self) -> None:
        self._cache.clear()

    async def children(self, prefixes: Sequence[str]) -> dict[str, dict[int, Any]]:
        from moe.declare import get_prefixes  # moe.declare imports this module's ExpertLocation

        now = self._clock()
        found: dict[str, dict[int, Any]] = {}
        missing = []
        for key in prefixes:
            cached = self._cache.get(key)
            if cached is not None and now - cached[0] < self.ttl:
                found[key] = cached[1]
            else:
                missing.append(key)
        if missing:
            self.lookups += 1
            fetched = await get_prefixes(self.dht, missing)
            for key in missing:
                children = dict(fetched.get(key) or {})
                self._cache[key] = (now, children)
                found[key] = children
        return found


__all__ = [
    "Banned",
    "ChildrenOracle",
    "DHTGridOracle",
    "ExpertChoice",
    "ExpertLocation",
    "GridSearch",
    "StaticGridOracle",
    "find_best_experts",
    "normalize_prefix",
    "parse_location",
]
