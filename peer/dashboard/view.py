"""What the dashboard knows about the swarm: the plain core that turns each refresh into the page's state.

Sans-I/O: no trio, no sockets, no clock inside. The watcher (peer/dashboard/watcher.py) feeds it one refresh at a
time — the directory listing, the peers' `peer status` answers (as `peer.status.gather_status` shapes them), the
training runs and their latest points, and the time — or tells it the swarm could not be reached. The core keeps
what a single refresh cannot say: each peer's previous counters (for requests/s), when a peer was first and last
seen, each run's loss history, and the failure timeline (a peer turning unreachable, leaving, coming back; failed
averaging rounds; the swarm lost and found). `snapshot()` is what /api/v1/state serves (schema: state.schema.json).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from peer.directory import PeerEntry
from peer.discover import families_from_entries
from peer.p2p.relay import is_relayed, show_address

STATE_VERSION = 1
HISTORY_POINTS = 720  # per run: an hour of points at one every 5 s
EVENTS_KEPT = 200


@dataclass
class _PeerTrack:
    first_seen: float
    last_seen: float | None = None  # last time it answered
    state: str = "joining"  # joining (listed, not asked yet), online, unreachable
    requests: int | None = None  # requests_served at the previous answer
    requests_at: float | None = None
    requests_per_s: float = 0.0
    averaging_failures: int | None = None
    row: dict[str, Any] = field(default_factory=dict)


@dataclass
class _RunTrack:
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    steps: dict[str, int] = field(default_factory=dict)  # trainer -> step of its last point taken
    failures: dict[str, int] = field(default_factory=dict)  # trainer -> averaging failures in its last point
    info: dict[str, Any] = field(default_factory=dict)
    points: dict[str, dict[str, Any]] = field(default_factory=dict)


class SwarmView:
    def __init__(self, initial_peers: Iterable[str], *, started_at: float):
        self.initial_peers = list(initial_peers)
        self.started_at = started_at
        self.reachable = False
        self.message = "connecting to the swarm"
        self.last_refresh_at: float | None = None
        self.refreshes = 0
        self.cost: dict[str, Any] = {"rpc_calls": 0, "dht_requests": 0, "per_peer_per_refresh": None,
                                     "last_per_peer": None}
        self._cost_sum = 0.0
        self._cost_count = 0
        self.peers: dict[str, _PeerTrack] = {}
        self.entries: dict[str, PeerEntry] = {}
        self.runs: dict[str, _RunTrack] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)

    # ------------------------------------------------------------------------------------------------- input

    def _event(self, now: float, kind: str, message: str, peer_id: str | None = None) -> None:
        self.events.append({"time": now, "kind": kind, "peer_id": peer_id, "message": message})

    def detached(self, reason: str, now: float) -> None:
        """The swarm could not be reached at all (no initial peer answers, or nobody answered for a while)."""
        if self.reachable or not any(event["kind"] == "swarm_unreachable" for event in self.events):
            self._event(now, "swarm_unreachable", f"swarm unreachable: {reason}")
        self.reachable = False
        self.message = f"swarm unreachable: {reason}; retrying"
        self.last_refresh_at = now
        for peer_id, track in self.peers.items():
            if track.state == "online":
                track.state = "unreachable"
                self._event(now, "peer_unreachable", f"{peer_id[:12]} stopped answering", peer_id)

    def observe(self, status: dict[str, Any], entries: list[PeerEntry], runs: list[dict[str, Any]],
                points: dict[str, dict[str, dict[str, Any]]], now: float, *, requests: int | None = None) -> None:
        """One refresh: `status` from gather_status over `entries` (the directory as last listed), `runs` from
        list_runs, `points` from read_points; `requests` is what this refresh cost the swarm (calls + DHT
        requests sent)."""
        self.refreshes += 1
        self.last_refresh_at = now
        listed = {entry.peer_id for entry in entries}
        self.entries = {entry.peer_id: entry for entry in entries}
        for peer_id in list(self.peers):
            if peer_id not in listed:
                track = self.peers.pop(peer_id)
                if track.state != "unreachable":  # an unreachable peer's departure was announced already
                    self._event(now, "peer_left", f"{peer_id[:12]} left the directory", peer_id)
                else:
                    self._event(now, "peer_expired", f"{peer_id[:12]} expired from the directory", peer_id)
        for row in status["peers"]:
            self._observe_peer(row, now)
        answered = sum(1 for row in status["peers"] if row["reachable"])
        if entries and not answered:
            message = f"none of the {len(entries)} peers in the directory answered"
            if self.reachable:
                self._event(now, "swarm_unreachable", f"swarm unreachable: {message}")
            self.reachable, self.message = False, message
        elif not entries:
            if self.reachable:
                self._event(now, "swarm_unreachable", "swarm unreachable: the directory is empty")
            self.reachable, self.message = False, "attached, but no peer is in the directory yet"
        else:
            if not self.reachable and any(event["kind"] == "swarm_unreachable" for event in self.events):
                self._event(now, "swarm_reachable", f"swarm reachable again: {answered} peers answer")
            self.reachable, self.message = True, f"{answered} of {len(entries)} peers answer"
        self._observe_runs(runs, points, now)
        if requests is not None and entries:
            per_peer = requests / len(entries)
            self._cost_sum += per_peer
            self._cost_count += 1
            self.cost["last_per_peer"] = round(per_peer, 3)
            self.cost["per_peer_per_refresh"] = round(self._cost_sum / self._cost_count, 3)

    def count_requests(self, rpc_calls: int, dht_requests: int) -> None:
        self.cost["rpc_calls"], self.cost["dht_requests"] = rpc_calls, dht_requests

    def _observe_peer(self, row: dict[str, Any], now: float) -> None:
        peer_id = row["peer_id"]
        track = self.peers.get(peer_id)
        if track is None:
            track = self.peers[peer_id] = _PeerTrack(first_seen=now)
            self._event(now, "peer_joined", f"{peer_id[:12]} joined at {row['address']}", peer_id)
        track.row = row
        if not row["reachable"]:
            if track.state != "unreachable":
                self._event(now, "peer_unreachable", f"{peer_id[:12]} stopped answering: {row.get('error')}",
                            peer_id)
            track.state = "unreachable"
            track.requests_per_s = 0.0
            return
        if track.state == "unreachable":
            self._event(now, "peer_returned", f"{peer_id[:12]} answers again", peer_id)
        track.state, track.last_seen = "online", now
        served = int(row.get("requests_served") or 0)
        if track.requests is not None and track.requests_at is not None and now > track.requests_at:
            track.requests_per_s = max(0.0, served - track.requests) / (now - track.requests_at)
        track.requests, track.requests_at = served, now
        failures = row.get("averaging_failures")
        if isinstance(failures, int):
            if track.averaging_failures is not None and failures > track.averaging_failures:
                self._event(now, "averaging_failed", f"{peer_id[:12]}: {failures - track.averaging_failures} "
                            f"replica averaging round(s) failed", peer_id)
            track.averaging_failures = failures

    def _observe_runs(self, runs: list[dict[str, Any]], points: dict[str, dict[str, dict[str, Any]]],
                      now: float) -> None:
        for run in runs:
            track = self.runs.setdefault(run["run_id"], _RunTrack())
            track.info = run
        for run_id, trainers in points.items():
            track = self.runs.setdefault(run_id, _RunTrack())
            track.points = trainers
            fresh = {peer: point for peer, point in trainers.items() if track.steps.get(peer) != point["step"]}
            if not fresh:
                continue
            for peer, point in fresh.items():
                track.steps[peer] = point["step"]
                before = track.failures.get(peer)
                if before is not None and point["averaging_failures"] > before:
                    self._event(now, "averaging_failed", f"run {run_id}: trainer {peer[:12]}: "
                                f"{point['averaging_failures'] - before} averaging round(s) failed", peer)
                track.failures[peer] = point["averaging_failures"]
            latest = list(trainers.values())
            track.history.append({
                "time": now,
                "loss": round(sum(p["loss"] for p in latest) / len(latest), 5),
                "accuracy": round(sum(p["accuracy"] for p in latest) / len(latest), 5),
                "samples_per_s": round(sum(p["samples_per_s"] for p in latest), 2),
                "step": max(p["step"] for p in latest),
                "epoch": max(p["epoch"] for p in latest),
                "trainers": len(latest),
            })

    # ------------------------------------------------------------------------------------------------ output

    def is_reachable(self, peer_id: str) -> dict[str, Any] | None:
        """The answer of /api/v1/is_reachable/<peer_id>; None for a peer the directory does not list."""
        track = self.peers.get(peer_id)
        if track is None:
            return None
        return {"peer_id": peer_id, "reachable": track.state == "online", "state": track.state,
                "last_seen": track.last_seen, "checked_at": self.last_refresh_at}

    def _experts(self) -> dict[str, Any]:
        """prefix -> {"grid": shape, "cells": one per uid served, with its hosts (several: replicas) and load}."""
        cells: dict[str, dict[str, dict[str, Any]]] = {}
        for peer_id, track in self.peers.items():
            if track.state != "online":
                continue  # a peer that does not answer serves nothing: its experts leave the grid
            row = track.row
            load = row.get("expert_requests") or {}
            for uid in row.get("experts") or ():
                prefix = uid.split(".")[0]
                cell = cells.setdefault(prefix, {}).setdefault(uid, {"uid": uid, "hosts": [], "requests": 0})
                if row.get("expert_kind"):
                    cell["kind"] = row["expert_kind"]
                cell["hosts"].append({"peer_id": peer_id, "address": row["address"]})
                cell["requests"] += int(load.get(uid) or 0)
        shapes = {family.prefix: list(family.grid) for family in families_from_entries(self.entries.values())}
        experts = {}
        for prefix in sorted(cells):
            items = sorted(cells[prefix].values(), key=lambda cell: _uid_order(cell["uid"]))
            grid = shapes.get(prefix) or []
            for cell in items:
                coords = _coords(cell["uid"])
                if coords is not None:
                    if len(grid) != len(coords):  # no family summary of this shape: grow from the uids
                        grid = [0] * len(coords)
                    grid = [max(size, coord + 1) for size, coord in zip(grid, coords)]
                cell["replicas"] = len(cell["hosts"])
            busiest = max((cell["requests"] for cell in items), default=0)
            for cell in items:
                cell["load"] = round(cell["requests"] / busiest, 3) if busiest else 0.0
            kinds = sorted({cell["kind"] for cell in items if cell.get("kind")})
            experts[prefix] = {"grid": grid, "cells": items, "kinds": kinds}
        return experts

    def snapshot(self, now: float) -> dict[str, Any]:
        peers = []
        for peer_id in sorted(self.peers):
            track, row = self.peers[peer_id], self.peers[peer_id].row
            entry = self.entries.get(peer_id)
            peers.append({
                "peer_id": peer_id,
                "address": row.get("address") or (show_address(entry.address) if entry else ""),
                "state": track.state,
                "reachability": _reachability(entry, track.state),
                "version": row.get("version") or (entry.summary.get("version") if entry else None),
                "uptime_s": row.get("uptime_s") if track.state == "online" else None,
                "experts": list(row.get("experts") or []) if track.state == "online" else [],
                "requests_served": row.get("requests_served") or 0,
                "requests_per_s": round(track.requests_per_s, 2),
                "failures_seen": row.get("failures_seen"),
                "bytes_sent": row.get("bytes_sent"),
                "bytes_received": row.get("bytes_received"),
                "dht_table_size": row.get("dht_table_size"),
                "averaging_rounds": row.get("averaging_rounds"),
                "budget": row.get("budget") if track.state == "online" else None,
                "first_seen": track.first_seen,
                "last_seen": track.last_seen,
                "error": row.get("error"),
            })
        runs = []
        for run_id in sorted(self.runs):
            run = self.runs[run_id]
            info = run.info
            runs.append({
                "run_id": run_id,
                "epoch": info.get("epoch"),
                "trainers": info.get("trainers", len(run.points)),
                "trainers_in_epoch": info.get("trainers_in_epoch"),
                "samples": info.get("samples"),
                "target_batch_size": info.get("target_batch_size"),
                "samples_per_s": info.get("samples_per_s"),
                "recent_groups": info.get("recent_groups", []),
                "averaging": _averaging(run.points.values()),
                "rounds": {key: info.get(key) for key in ROUND_KEYS},
                "latest": {peer: dict(point) for peer, point in sorted(run.points.items())},
                "history": list(run.history),
            })
        return {
            "version": STATE_VERSION,
            "time": now,
            "swarm": {"reachable": self.reachable, "message": self.message, "initial_peers": self.initial_peers,
                      "last_refresh_at": self.last_refresh_at, "refreshes": self.refreshes},
            "cost": dict(self.cost),
            "peers": peers,
            "experts": self._experts(),
            "runs": runs,
            "events": list(self.events),
        }


ROUND_KEYS = ("algorithm", "outer_step", "round_members", "round_started", "grace_window", "late_contributions",
              "joiner_first_contribution", "utilization", "hashes_agree")  # DiLoCo's rounds (progress.py)


def _averaging(points: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The run's averaging so far, summed over its live trainers (each counts the rounds it took part in)."""
    points = list(points)
    rounds = sum(point["averaging_rounds"] for point in points)
    seconds = sum(point["averaging_seconds"] for point in points)
    return {"rounds": rounds, "failures": sum(point["averaging_failures"] for point in points),
            "mean_seconds": round(seconds / rounds, 3) if rounds else None}


def _reachability(entry: PeerEntry | None, state: str) -> str:
    """How the swarm reaches a peer: through relays when its directory entry names a relayed address (a private
    peer), directly when it answers at its own address, unknown while it does not answer."""
    if entry is not None and is_relayed(entry.address):
        return "relayed"
    return "direct" if state == "online" else "unknown"


def _coords(uid: str) -> list[int] | None:
    parts = uid.split(".")[1:]
    if not parts or not all(part.isdigit() for part in parts):
        return None
    return [int(part) for part in parts]


def _uid_order(uid: str) -> tuple[Any, ...]:
    coords = _coords(uid)
    return (0, *coords) if coords is not None else (1, uid)
