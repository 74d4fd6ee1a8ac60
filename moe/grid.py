"""Expert uids on a grid: `name.i.j...` (e.g. `ffn.3.17`), patterns like `ffn.[0:8].[0:8]`, and free-uid choice.

The grid is what makes beam search cheap: a client scores each grid coordinate with its gate and walks the grid
one dimension at a time through DHT prefix entries (`ffn.` -> first coordinates in use, `ffn.3.` -> second ones),
instead of looking up every expert. So the grammar is strict: a name without dots, then one or more
non-negative integer coordinates.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from typing import Collection, Iterator

_NAME = r"[A-Za-z_][A-Za-z0-9_\-]*"
_COORD = r"(?:0|[1-9][0-9]*)"
_UID_RE = re.compile(rf"^({_NAME})((?:\.{_COORD})+)$")
_PATTERN_PART_RE = re.compile(rf"^(?:({_COORD})|\[\s*({_COORD})\s*:\s*({_COORD})\s*\])$")
_NAME_RE = re.compile(rf"^{_NAME}$")
MAX_UID_LENGTH = 256


class InvalidUID(ValueError):
    """A string is not a grid uid (or a pattern is not a grid pattern)."""


def parse_uid(uid: object) -> tuple[str, tuple[int, ...]]:
    """`"ffn.3.17"` -> `("ffn", (3, 17))`."""
    if not isinstance(uid, str) or len(uid) > MAX_UID_LENGTH:
        raise InvalidUID(f"not an expert uid: {uid!r}")
    match = _UID_RE.match(uid)
    if match is None:
        raise InvalidUID(f"not an expert uid: {uid!r} (expected name.i.j..., e.g. ffn.3.17)")
    return match.group(1), tuple(int(c) for c in match.group(2)[1:].split("."))


def is_valid_uid(uid: object) -> bool:
    try:
        parse_uid(uid)
    except InvalidUID:
        return False
    return True


def make_uid(name: str, coords: Collection[int]) -> str:
    if not _NAME_RE.match(name) or not coords or any(int(c) < 0 for c in coords):
        raise InvalidUID(f"cannot make a uid from {name!r} and {tuple(coords)!r}")
    return ".".join([name, *(str(int(c)) for c in coords)])


def prefix_entries(uid: str) -> list[tuple[str, int]]:
    """The (prefix, next coordinate) pairs under which beam search finds `uid`:
    `ffn.3.17` -> `[("ffn.", 3), ("ffn.3.", 17)]`."""
    name, coords = parse_uid(uid)
    entries = []
    prefix = f"{name}."
    for coord in coords:
        entries.append((prefix, coord))
        prefix = f"{prefix}{coord}."
    return entries


@dataclass(frozen=True)
class GridPattern:
    """A set of uids: `ffn.[0:8].[0:8]` (half-open ranges) or fixed coordinates such as `ffn.3.[0:16]`."""

    name: str
    dims: tuple[range, ...]

    @classmethod
    def parse(cls, pattern: str) -> "GridPattern":
        if not isinstance(pattern, str):
            raise InvalidUID(f"not a grid pattern: {pattern!r}")
        name, sep, rest = pattern.partition(".")
        if not sep or not _NAME_RE.match(name) or not rest:
            raise InvalidUID(f"not a grid pattern: {pattern!r} (expected e.g. ffn.[0:8].[0:8])")
        dims = []
        for part in rest.split("."):
            match = _PATTERN_PART_RE.match(part.strip())
            if match is None:
                raise InvalidUID(f"bad grid dimension {part!r} in {pattern!r}")
            if match.group(1) is not None:
                value = int(match.group(1))
                dims.append(range(value, value + 1))
            else:
                low, high = int(match.group(2)), int(match.group(3))
                if high <= low:
                    raise InvalidUID(f"empty range {part!r} in {pattern!r}")
                dims.append(range(low, high))
        return cls(name, tuple(dims))

    @property
    def size(self) -> int:
        size = 1
        for dim in self.dims:
            size *= len(dim)
        return size

    def __contains__(self, uid: object) -> bool:
        try:
            name, coords = parse_uid(uid)
        except InvalidUID:
            return False
        return name == self.name and len(coords) == len(self.dims) and all(
            c in dim for c, dim in zip(coords, self.dims)
        )

    def uids(self) -> Iterator[str]:
        """Every uid of the pattern, in grid order (beware: the grid may be huge; see `size`)."""
        for coords in itertools.product(*self.dims):
            yield make_uid(self.name, coords)

    def sample(self, rng: random.Random) -> str:
        return make_uid(self.name, [dim[rng.randrange(len(dim))] for dim in self.dims])


def expand_pattern(pattern: str, *, limit: int = 1_000_000) -> list[str]:
    grid = GridPattern.parse(pattern)
    if grid.size > limit:
        raise InvalidUID(f"pattern {pattern!r} has {grid.size} uids, more than the limit {limit}")
    return list(grid.uids())


def choose_free_uids(
    pattern: str | GridPattern, count: int, taken: Collection[str] = (), rng: random.Random | None = None
) -> list[str]:
    """`count` distinct uids of the pattern, none of them in `taken`, in random order.

    Small grids are enumerated (exact: raises when fewer than `count` are free); large ones are sampled, which
    is cheap as long as the grid is not nearly full.
    """
    grid = pattern if isinstance(pattern, GridPattern) else GridPattern.parse(pattern)
    rng = rng or random.Random()
    taken_set = set(taken)
    if count <= 0:
        return []
    if grid.size <= max(4096, 8 * (count + len(taken_set))):
        free = [uid for uid in grid.uids() if uid not in taken_set]
        if len(free) < count:
            raise InvalidUID(f"grid {grid.name} has {len(free)} free uids, {count} requested")
        return rng.sample(free, count)
    chosen: list[str] = []
    seen = set(taken_set)
    for _ in range(64 * count + 1024):
        uid = grid.sample(rng)
        if uid not in seen:
            seen.add(uid)
            chosen.append(uid)
            if len(chosen) == count:
                return chosen
    raise InvalidUID(f"could not find {count} free uids in grid {grid.name} (size {grid.size})")
