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
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import trio

from dht.client import DHTClient
from dht.errors import DHTError
from moe.declare import ExpertLocation, get_prefixes, parse_location
from moe.grid import prefix_entries


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


# Heap entries are plain tuples (compared in C): (-priority, coords, kind, score, extra).
# - _PREFIX: coords of a prefix, score = its exact partial score, priority = score + what the remaining dimensions
#   can add at most. Its children may still be unknown (then the search must ask the oracle).
# - _CURSOR: the child at position `extra[1]` of a parent's children sorted best first (`extra[0]`); priority =
#   that child's score (+ the remaining dimensions' maximum). Popping it pushes the next sibling, so expanding a
#   prefix costs one sort and two pushes per popped child, never one push per child.
# - _EXPERT: a complete uid with its location in `extra`; priority = exact score.
# `coords` are unique within a sample's heap, so comparisons never reach the later fields.
_PREFIX, _CURSOR, _EXPERT = 0, 1, 2
# A heap entry: (-best reachable score, coords, kind, score so far, extra); extra depends on the kind: None for a
# prefix, (parent coords, parent score, ordered siblings, index) for a cursor, the ExpertLocation for an expert
_HeapItem = tuple[float, tuple[int, ...], int, float, Any]


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
        # prefix key -> valid children: {coord: location} at the last level, {coord: None} above it
        self._children: dict[str, dict[int, ExpertLocation | None]] = {}
        self._results: list[list[ExpertChoice]] = [[] for _ in range(self.batch_size)]
        self._heaps: list[list[_HeapItem]] = []
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
            self._heaps.append([(-suffix[0], (), _PREFIX, 0.0, None)] if self._k[b] > 0 else [])
        self._pending = [b for b in range(self.batch_size) if self._heaps[b]]
        self._advance_all()

    # ------------------------------------------------------------------------------------------------ driving

    @property
    def done(self) -> bool:
        return not self._pending

    def wanted(self) -> list[str]:
        """DHT prefix keys whose children the search needs next (deduplicated, stable order). Empty when done.

        For each unfinished sample this looks at as many of its best candidates as it still needs, so a
        sample whose best prefixes are all unexplored asks for them in one round instead of one per round."""
        keys: dict[str, None] = {}
        ndim = len(self.grid_size)
        for b in self._pending:
            # look at the sample's `missing` best candidates: pop them from a copy of its heap, letting cursors
            # bring in their next siblings as `_advance` would
            missing = self._k[b] - len(self._results[b])
            heap = list(self._heaps[b])
            while heap and missing > 0:
                _, coords, kind, _, extra = heapq.heappop(heap)
                missing -= 1
                if kind == _CURSOR:
                    parent_coords, parent_score, ordered, index = extra
                    if index + 1 < len(ordered):
                        sibling = ordered[index + 1]
                        sibling_score = parent_score + self._scores[len(parent_coords)][b][sibling]
                        heapq.heappush(heap, (-(sibling_score + self._suffix_max[b][len(coords)]),
                                              parent_coords + (sibling,), _CURSOR, sibling_score,
                                              (parent_coords, parent_score, ordered, index + 1)))
                if kind != _EXPERT and len(coords) < ndim:
                    key = self._key(coords)
                    if key not in self._children:
                        keys[key] = None
        return list(keys)

    def provide(self, children: Mapping[str, Children | None]) -> None:
        """Tell the search which coordinates exist below the given prefixes (None or {} = nothing there)."""
        prefix_dots = self.uid_prefix.count(".")
        ndim = len(self.grid_size)
        for key, found in children.items():
            depth = key.count(".") - prefix_dots  # coordinates fixed by this prefix
            valid: dict[int, ExpertLocation | None] = {}
            if found and 0 <= depth < ndim:
                for coord, value in found.items():
                    if not isinstance(coord, int) or isinstance(coord, bool) or not 0 <= coord < self.grid_size[depth]:
                        continue  # another grid's expert, or garbage from the DHT
                    if depth + 1 == ndim:
                        location = parse_location(value)
                        if location is None:
                            continue
                        valid[coord] = location
                    else:
                        valid[coord] = None
            self._children[key] = valid
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

    def _advance_all(self) -> None:
        if len(self.grid_size) == 1 and self.uid_prefix in self._children:
            self._choose_flat()
            return
        self._pending = [b for b in self._pending if self._advance(b)]

    def _choose_flat(self) -> None:
        """A one-dimensional grid, once its experts are known: each sample's top k directly (ties to the lower
        coordinate, as the heap orders them), checking bans once per expert instead of once per sample and
        candidate. Same answer as `_advance`; about 10x less Python for the grids a small model uses."""
        children = self._children[self.uid_prefix]
        candidates: list[tuple[int, str, ExpertLocation]] = []
        for coord, location in children.items():
            assert location is not None  # the last level's children carry locations
            uid = self._uid((coord,))
            if self._banned is None or not self._banned(uid, location):
                candidates.append((coord, uid, location))
        for b in self._pending:
            row = self._scores[0][b]
            pool = candidates
            if self._exclude is not None and self._exclude[b]:
                excluded = self._exclude[b]
                pool = [c for c in candidates if c[1] not in excluded]
            results = self._results[b]
            wanted = self._k[b] - len(results)
            for coord, uid, location in heapq.nlargest(wanted, pool, key=lambda c: (row[c[0]], -c[0])):
                results.append(ExpertChoice(uid, (coord,), 0.0 + row[coord], location))
            self._heaps[b].clear()
        self._pending = []

    def _advance(self, b: int) -> bool:
        """Emit complete experts and expand known prefixes until the best candidate is an unexplored prefix.
        Returns whether sample b still needs the oracle."""
        heap, results, k = self._heaps[b], self._results[b], self._k[b]
        ndim, suffix, children_of = len(self.grid_size), self._suffix_max[b], self._children
        push, pop = heapq.heappush, heapq.heappop
        while heap and len(results) < k:
            neg, coords, kind, score, extra = heap[0]
            if kind == _EXPERT:
                pop(heap)
                uid = self._uid(coords)
                if self._banned is not None and self._banned(uid, extra):
                    continue
                if self._exclude is not None and uid in self._exclude[b]:
                    continue
                results.append(ExpertChoice(uid, coords, score, extra))
            elif kind == _CURSOR:
                pop(heap)
                parent_coords, parent_score, ordered, index = extra
                depth = len(parent_coords)
                row = self._scores[depth][b]
                if index + 1 < len(ordered):  # the next sibling waits its turn
                    sibling = ordered[index + 1]
                    sibling_score = parent_score + row[sibling]
                    push(heap, (-(sibling_score + suffix[depth + 1]), parent_coords + (sibling,), _CURSOR,
                                sibling_score, (parent_coords, parent_score, ordered, index + 1)))
                if depth + 1 == ndim:
                    location = children_of[self._key(parent_coords)][coords[-1]]
                    push(heap, (neg, coords, _EXPERT, score, location))
                else:
                    push(heap, (neg, coords, _PREFIX, score, None))
            else:
                children = children_of.get(self._key(coords))
                if children is None:
                    return True  # the next move needs the oracle
                pop(heap)
                if children:
                    row = self._scores[len(coords)][b]
                    ordered = sorted(children, key=row.__getitem__, reverse=True)
                    best = ordered[0]
                    child_score = score + row[best]
                    push(heap, (-(child_score + suffix[len(coords) + 1]), coords + (best,), _CURSOR, child_score,
                                (coords, score, ordered, 0)))
        return False


# ---------------------------------------------------------------------------------------------------- drivers


class ChildrenOracle(Protocol):
    """Where the search reads which experts exist under each grid prefix."""

    async def children(self, prefixes: Sequence[str]) -> Mapping[str, Children | None]: ...

    def invalidate(self) -> None:
        """Forget what was read: the next `children` reads the source again (a step ran short of experts)."""


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

    def invalidate(self) -> None:
        """Nothing to read again: the table is fixed."""


class DHTGridOracle:
    """Children of grid prefixes read from the DHT's prefix entries, cached for `ttl` seconds.

    Caching is what keeps a training step cheap: a 2-level grid costs two `get_many` calls per `ttl`, not per
    step. Experts that died since are not a problem for correctness: calls to them fail fast and the mixture
    bans them (see `moe/mixture.py`); new experts appear after at most `ttl` seconds, and an expert that reads stop
    showing stays in view for `forget_after` (default 2 x ttl), since one read may reach only some replicas. A
    refresh of entries that are already known waits at most `refresh_timeout` (and survives DHT errors): if the
    DHT is slow, e.g. while its routing tables still hold a peer that just died, the step goes on with the
    previous answer and the refresh is retried `retry_after` seconds later. The record layout and its validation
    live in `moe.declare` (shared with the servers that write it)."""

    def __init__(
        self,
        dht: DHTClient,
        *,
        ttl: float = 5.0,
        refresh_timeout: float = 0.5,
        retry_after: float = 1.0,
        forget_after: float | None = None,
        clock: Callable[[], float] = trio.current_time,
    ):
        self.dht = dht
        self.ttl = ttl
        self.forget_after = 2 * ttl if forget_after is None else forget_after
        self._last_read: dict[str, dict[int, float]] = {}  # key -> child -> when a read last showed it
        self.refresh_timeout = refresh_timeout
        self.retry_after = retry_after
        self._clock = clock
        self._cache: dict[str, tuple[float, dict[int, Any]]] = {}  # key -> (fresh until, children)
        self.lookups = 0  # DHT get_many calls, for tests and benchmarks
        self.stale_answers = 0  # refreshes that gave up and served the previous answer

    def invalidate(self) -> None:
        """Age the cached prefixes out: the next search reads the DHT again instead of waiting out `ttl`. The
        children are kept: that read is a refresh, bounded by `refresh_timeout` with the previous answer as its
        fallback. Dropped instead, the read after a forward short of experts (a daemon just killed, still in
        the routing tables) was a first read with no timeout and no fallback: a slow or empty answer left the next
        step without any expert to ask."""
        self._cache = {key: (-math.inf, children) for key, (_, children) in self._cache.items()}

    async def children(self, prefixes: Sequence[str]) -> dict[str, dict[int, Any]]:
        now = self._clock()
        found: dict[str, dict[int, Any]] = {}
        missing = []
        for key in prefixes:
            cached = self._cache.get(key)
            if cached is not None and now < cached[0]:
                found[key] = cached[1]
            else:
                missing.append(key)
        if not missing:
            return found
        self.lookups += 1
        if all(key in self._cache for key in missing):
            fetched = None
            try:
                with trio.move_on_after(self.refresh_timeout):
                    fetched = await get_prefixes(self.dht, missing)
            except DHTError:
                pass
            if fetched is None:
                self.stale_answers += 1
                for key in missing:
                    children = self._cache[key][1]
                    self._cache[key] = (now + self.retry_after, children)
                    found[key] = children
                return found
        else:
            fetched = await get_prefixes(self.dht, missing)
        for key in missing:
            read = dict(fetched.get(key) or {})
            seen = self._last_read.setdefault(key, {})
            for coord in read:
                seen[coord] = now
            children = dict(read)
            known = self._cache.get(key)
            if known is not None:
                # Merged, not replaced: a read that reached only some replicas (a holder just died, a replica not
                # yet merged) showed one daemon's experts alone, or none at all, and when that daemon was killed
                # the step's replacement search found nobody else and failed (test_train's dead-daemon
                # scenario). A child missing from reads is kept `forget_after` since a read last showed it (calls
                # to one that died fail fast and ban it meanwhile), and such a read is repeated after
                # `retry_after`, not `ttl`.
                for coord, child in known[1].items():
                    if coord not in children and now - seen.get(coord, -math.inf) <= self.forget_after:
                        children[coord] = child
            for coord in [c for c in seen if c not in children]:
                del seen[coord]
            partial = len(children) > len(read)
            self.stale_answers += partial
            self._cache[key] = (now + (self.retry_after if partial else self.ttl), children)
            found[key] = children
        return found


__all__ = [
    "Banned",
    "ChildrenOracle",
    "DHTGridOracle",
    "ExpertChoice",
    "GridSearch",
    "StaticGridOracle",
    "find_best_experts",
    "normalize_prefix",
]
