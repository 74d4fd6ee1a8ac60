"""The structured events `peer join` prints for programs (`peer swarm up`, the tests, the benchmarks), so that none
of them parses the lines written for people, which may change with any release.

Schema, version 1 (`SCHEMA_VERSION`): one JSON object on its own stdout line, with `"event"` (its kind) and `"v"`
(the schema version; a reader refuses a newer one rather than misread it). Kinds:

- `joined`: the daemon is up and reachable (printed once, after the human lines). Fields: `peer_id` (hex),
  `address` (`HOST:PORT` others dial, the announced one), `reachability` (`public` or `private`), `reached`
  (`direct`, `relay` or `none`), `experts` (the uids served), `pattern` (their grid), `hidden_dim`,
  `expert_kind`, `metrics` (`HOST:PORT` of /metrics, or null), `join_command` (what others run to join).

A field is only ever added within a version; renaming or removing one makes the next version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the daemon imports torch: only its type here, so readers of events stay light
    from peer.daemon import DaemonInfo

SCHEMA_VERSION = 1
JOINED = "joined"


class EventError(ValueError):
    """A line that claims to be an event but cannot be read as one (a newer schema, a missing field)."""


def event_line(event: dict[str, Any]) -> str:
    """One event as the line it is printed as."""
    return json.dumps(event, separators=(",", ":"))


def read_event(line: str) -> dict[str, Any] | None:
    """The event a line holds, or None for any other line (human text, another program's JSON). EventError when
    it is an event of a newer schema version than this reader knows."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("event"), str) or "v" not in data:
        return None
    if not isinstance(data["v"], int) or data["v"] > SCHEMA_VERSION:
        raise EventError(f"event {data['event']!r} of schema version {data['v']!r}: this reader knows up to "
                         f"{SCHEMA_VERSION} (update swarmd)")
    return data


def joined_event(info: DaemonInfo) -> dict[str, Any]:
    """`peer join`'s `joined` event for a started daemon."""
    return {
        "event": JOINED, "v": SCHEMA_VERSION, "peer_id": info.peer_id,
        "address": f"{info.address[0]}:{info.address[1]}", "reachability": info.status, "reached": info.reached,
        "experts": list(info.experts), "pattern": info.pattern, "hidden_dim": info.hidden_dim,
        "expert_kind": info.expert_kind,
        "metrics": f"{info.metrics_address[0]}:{info.metrics_address[1]}" if info.metrics_address else None,
        "join_command": info.join_command,
    }


@dataclass
class Joined:
    """A started daemon as its `joined` event describes it."""

    peer_id: str
    address: str
    reachability: str | None = None
    experts: list[str] = field(default_factory=list)
    pattern: str | None = None
    hidden_dim: int | None = None
    expert_kind: str | None = None

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> Joined:
        try:
            return cls(str(event["peer_id"]), str(event["address"]), event.get("reachability"),
                       [str(uid) for uid in event.get("experts") or []], event.get("pattern"),
                       event.get("hidden_dim"), event.get("expert_kind"))
        except KeyError as error:
            raise EventError(f"a joined event without {error}") from None


class JoinWatcher:
    """Reads a `peer join`'s stdout, line by line, until its `joined` event: `feed` returns the `Joined` then (and
    None before); every other line (the human ones included) is ignored."""

    def __init__(self) -> None:
        self.joined: Joined | None = None

    def feed(self, line: str) -> Joined | None:
        event = read_event(line)
        if event is not None and event["event"] == JOINED:
            self.joined = Joined.from_event(event)
        return self.joined


__all__ = ["JOINED", "SCHEMA_VERSION", "EventError", "JoinWatcher", "Joined", "event_line", "joined_event",
           "read_event"]
