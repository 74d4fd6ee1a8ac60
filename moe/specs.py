"""Models' expert specs in the DHT: what a swarmified model needs served, so that a plain `peer join` serves it.

Why publish: a volunteer who runs nothing but `peer join --initial-peers X` cannot guess that a trainer's model
has 2 layers of 4 `gpt2_ffn@3072` experts of hidden size 768. `swarmify` stores each of its specs under one DHT
key (`SPECS_KEY`, one subkey per spec: `PREFIX.FIRST_LAYER`) and refreshes it while the swarm handle lives; a
starting daemon without `--experts` reads them (`read_specs`) and serves free uids of an advertised spec with its
kind and hidden size, never a layer beyond it.

A value is `[prefix, first_layer, stop_layer, experts_per_layer, kind, hidden_dim]`; anyone can write the key, so
everything read is checked and malformed entries are skipped.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import trio

from dht.client import DHTClient
from moe.experts import UnknownExpertKind, get_expert_kind
from moe.grid import is_valid_uid
from peer.p2p.periodic import run_periodic

logger = logging.getLogger(__name__)
SPECS_KEY = "swarmd.expert_specs"
SPEC_TTL = 120.0  # seconds an advertisement outlives its trainer


@dataclass(frozen=True)
class ExpertSpec:
    """What daemons must serve for the swarmified layers `layers` (one grid prefix `prefix.i` per layer)."""

    prefix: str
    layers: tuple[int, ...]
    experts_per_layer: int
    kind: str
    hidden_dim: int

    @property
    def pattern(self) -> str:
        first, last = min(self.layers), max(self.layers)
        return f"{self.prefix}.[{first}:{last + 1}].[0:{self.experts_per_layer}]"

    @property
    def inner_width(self) -> int | None:
        """The experts' inner width (`KIND@N`), None for a kind without one."""
        _, _, width = self.kind.partition("@")
        return int(width) if width.isdigit() else None

    def join_command(self, initial_peers: str = "HOST:PORT") -> str:
        """The `peer join` line that serves this spec; run on several machines, each takes `experts_per_layer`
        free uids of it (one layer's worth), and one started once it is all served serves nothing of it."""
        return (f"peer join --initial-peers {initial_peers} --experts '{self.pattern}' --expert-kind {self.kind} "
                f"--hidden-dim {self.hidden_dim} --num-experts {self.experts_per_layer}")

    def describe(self) -> str:
        return (f"{self.pattern}: {len(self.layers)} layer{'s' * (len(self.layers) != 1)} of "
                f"{self.experts_per_layer} {self.kind} experts, hidden {self.hidden_dim}")


def spec_value(spec: ExpertSpec) -> list[Any]:
    """An `ExpertSpec` as stored (its layers must be consecutive, as `swarmify.expert_specs` makes them)."""
    layers = sorted(spec.layers)
    return [spec.prefix, layers[0], layers[-1] + 1, spec.experts_per_layer, spec.kind, spec.hidden_dim]


def spec_subkey(spec: ExpertSpec) -> str:
    return f"{spec.prefix}.{min(spec.layers)}"


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def parse_spec(value: Any) -> ExpertSpec | None:
    """An `ExpertSpec` from a stored value, or None when it is malformed."""
    if not isinstance(value, list) or len(value) != 6:
        return None
    prefix, first, stop, per_layer, kind, hidden = value
    if (not isinstance(prefix, str) or not is_valid_uid(f"{prefix}.0.0") or not isinstance(first, int)
            or isinstance(first, bool) or first < 0 or not _positive(stop) or stop <= first or stop - first > 1024
            or not _positive(per_layer) or per_layer > 65536 or not isinstance(kind, str) or not _positive(hidden)):
        return None
    try:
        get_expert_kind(kind)
    except UnknownExpertKind:
        return None
    return ExpertSpec(prefix, tuple(range(first, stop)), per_layer, kind, hidden)


async def publish_specs(dht: DHTClient, specs: Sequence[ExpertSpec], ttl: float = SPEC_TTL) -> bool:
    """Store every spec once, expiring `ttl` seconds from now; True when every store was acknowledged."""
    expiration = dht.now() + ttl
    stored = await dht.store_many([(SPECS_KEY, spec_value(spec), expiration, spec_subkey(spec)) for spec in specs])
    return all(stored)


async def advertise_specs(dht: DHTClient, specs: Sequence[ExpertSpec], *, ttl: float = SPEC_TTL,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Publish `specs` now and every `ttl / 3` seconds until cancelled (the swarm handle's lifetime)."""
    await run_periodic(functools.partial(publish_specs, dht, specs, ttl), ttl / 3,
                       name="advertising the model's expert specs", retry=ttl / 12, log=logger,
                       task_status=task_status)


async def read_specs(dht: DHTClient) -> list[ExpertSpec]:
    """The advertised specs still alive, ordered by prefix and first layer."""
    record = await dht.get(SPECS_KEY)
    if record is None:
        return []
    now = dht.now()
    specs = []
    for _subkey, entry in record.subkeys.items():
        if entry.expiration_time < now:
            continue
        spec = parse_spec(entry.value)
        if spec is not None:
            specs.append(spec)
    return sorted(specs, key=lambda spec: (spec.prefix, min(spec.layers)))


__all__ = ["SPECS_KEY", "advertise_specs", "parse_spec", "publish_specs", "read_specs", "spec_value"]
