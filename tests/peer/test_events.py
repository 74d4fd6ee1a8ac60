"""peer/events.py: the structured events `peer join` prints for programs, and the one reader of them."""

from __future__ import annotations

import json

import pytest

from peer.daemon import DaemonInfo
from peer.events import SCHEMA_VERSION, EventError, Joined, JoinWatcher, event_line, joined_event, read_event

INFO = DaemonInfo("ab" * 20, ("10.0.0.7", 31337), ["ffn.4", "ffn.5"], "ffn.[0:8]", 64, "private, ...",
                  ("127.0.0.1", 9100), expert_kind="ffn", status="private", reached="relay")


def test_a_joined_event_is_one_versioned_json_line_with_the_documented_fields():
    line = event_line(joined_event(INFO))
    assert "\n" not in line
    event = json.loads(line)
    assert event == {"event": "joined", "v": SCHEMA_VERSION, "peer_id": "ab" * 20, "address": "10.0.0.7:31337",
                     "reachability": "private", "reached": "relay", "experts": ["ffn.4", "ffn.5"],
                     "pattern": "ffn.[0:8]", "hidden_dim": 64, "expert_kind": "ffn", "metrics": "127.0.0.1:9100",
                     "join_command": "peer join --initial-peers 10.0.0.7:31337"}


def test_the_watcher_reads_the_joined_event_among_other_lines():
    watcher = JoinWatcher()
    for line in ("serving 2 experts: words for people", '{"event": "progress", "step": 3}', "not {json", "{nope"):
        assert watcher.feed(line) is None
    assert watcher.feed(event_line(joined_event(INFO))) == Joined("ab" * 20, "10.0.0.7:31337", "private",
                                                                   ["ffn.4", "ffn.5"], "ffn.[0:8]", 64, "ffn")


def test_an_event_of_a_newer_schema_is_refused_rather_than_misread():
    newer = {**joined_event(INFO), "v": SCHEMA_VERSION + 1}
    with pytest.raises(EventError, match="schema version"):
        read_event(event_line(newer))
    assert read_event('{"event": "progress", "step": 1}') is None  # the trainer's lines carry no version yet
    with pytest.raises(EventError, match="peer_id"):
        JoinWatcher().feed(event_line({"event": "joined", "v": SCHEMA_VERSION, "address": "h:1"}))
