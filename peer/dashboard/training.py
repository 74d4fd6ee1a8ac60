"""Training points in the DHT: each trainer publishes its latest loss, accuracy and throughput; the dashboard
reads them and keeps the history it draws.

Why a record of its own, next to the averaging progress record: the progress record decides when the swarm
averages and must stay small and stable; the loss is only for people watching. One signed subkey per trainer
under one key per run (`swarmd.trainlog.RUN`), so a reader gets every trainer of a run in one DHT read, nobody can
write another trainer's points, and a trainer that stops simply expires.
"""

from __future__ import annotations

import math
from typing import Any

from dht.client import DHTClient
from peer.p2p.identity import PeerID

KEY_PREFIX = "swarmd.trainlog."
TTL = 120.0  # seconds a point stays readable: a trainer logs much more often than that


def trainlog_key(run_id: str) -> str:
    return f"{KEY_PREFIX}{run_id}"


FIELDS = ("step", "loss", "accuracy", "samples_per_s", "epoch", "averaging_rounds", "averaging_failures",
          "averaging_seconds")


def point_from_line(line: dict[str, Any], averaging: dict[str, Any] | None = None) -> list[Any]:
    """The wire value for one `peer train` progress line and its optimizer's stats (`averaging`, None without
    a collaborative optimizer): the values of FIELDS, in order."""
    averaging = averaging or {}
    return [int(line["step"]), float(line["loss"]), float(line["accuracy"]), float(line["samples_per_s"]),
            int(line.get("epoch") or 0), int(averaging.get("averaging_rounds") or 0),
            int(averaging.get("averaging_failures") or 0), float(averaging.get("averaging_seconds") or 0.0)]


async def publish_point(dht: DHTClient, peer_id: PeerID, run_id: str, line: dict[str, Any],
                        averaging: dict[str, Any] | None = None) -> bool:
    """Store this trainer's latest point (True when a replica acknowledged it)."""
    return await dht.store(trainlog_key(run_id), point_from_line(line, averaging), dht.now() + TTL,
                           subkey=bytes(peer_id), signed=True)


def parse_points(record: Any, now: float) -> dict[str, dict[str, Any]]:
    """trainer PeerID (hex) -> {FIELDS...} for every authentic, unexpired, well-formed entry of a trainlog record
    (anyone can write to the DHT: the rest is skipped)."""
    points: dict[str, dict[str, Any]] = {}
    for subkey, entry in (getattr(record, "subkeys", None) or {}).items():
        if not isinstance(subkey, (bytes, bytearray)) or len(subkey) != 20 or entry.expiration_time <= now:
            continue
        owner = getattr(entry, "owner", None)
        if owner is None or PeerID.from_public_key(owner) != bytes(subkey):
            continue
        value = entry.value
        if not (isinstance(value, list) and len(value) == len(FIELDS) and all(
                isinstance(item, (int, float)) and not isinstance(item, bool) for item in value)):
            continue
        if not all(math.isfinite(float(item)) for item in value) or min(value[0], *value[3:]) < 0:
            continue
        point = dict(zip(FIELDS, value))
        for name in ("step", "epoch", "averaging_rounds", "averaging_failures"):
            point[name] = int(point[name])
        for name in ("loss", "accuracy", "samples_per_s", "averaging_seconds"):
            point[name] = float(point[name])
        points[bytes(subkey).hex()] = point
    return points


async def read_points(dht: DHTClient, run_ids: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """run id -> trainer -> its latest point, in one DHT read for all runs."""
    if not run_ids:
        return {}
    records = await dht.get_many([trainlog_key(run_id) for run_id in run_ids], latest=True)
    now = dht.now()
    return {run_id: parse_points(records.get(trainlog_key(run_id)), now) for run_id in run_ids}
