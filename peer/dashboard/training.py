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


def point_from_line(line: dict[str, Any]) -> list[Any]:
    """The wire value for one `peer train` progress line: [step, loss, accuracy, samples/s, epoch]."""
    return [int(line["step"]), float(line["loss"]), float(line["accuracy"]), float(line["samples_per_s"]),
            int(line.get("epoch") or 0)]


async def publish_point(dht: DHTClient, peer_id: PeerID, run_id: str, line: dict[str, Any]) -> bool:
    """Store this trainer's latest point (True when a replica acknowledged it)."""
    return await dht.store(trainlog_key(run_id), point_from_line(line), dht.now() + TTL, subkey=bytes(peer_id),
                           signed=True)


def parse_points(record: Any, now: float) -> dict[str, dict[str, Any]]:
    """trainer PeerID (hex) -> {"step", "loss", "accuracy", "samples_per_s", "epoch"} for every authentic,
    unexpired, well-formed entry of a trainlog record (anyone can write to the DHT: the rest is skipped)."""
    points: dict[str, dict[str, Any]] = {}
    for subkey, entry in (getattr(record, "subkeys", None) or {}).items():
        if not isinstance(subkey, (bytes, bytearray)) or len(subkey) != 20 or entry.expiration_time <= now:
            continue
        owner = getattr(entry, "owner", None)
        if owner is None or PeerID.from_public_key(owner) != bytes(subkey):
            continue
        value = entry.value
        if not (isinstance(value, list) and len(value) == 5 and all(
                isinstance(item, (int, float)) and not isinstance(item, bool) for item in value)):
            continue
        step, loss, accuracy, rate, epoch = value
        if not all(math.isfinite(float(item)) for item in value) or step < 0:
            continue
        points[bytes(subkey).hex()] = {"step": int(step), "loss": float(loss), "accuracy": float(accuracy),
                                       "samples_per_s": float(rate), "epoch": int(epoch)}
    return points


async def read_points(dht: DHTClient, run_ids: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """run id -> trainer -> its latest point, in one DHT read for all runs."""
    if not run_ids:
        return {}
    records = await dht.get_many([trainlog_key(run_id) for run_id in run_ids], latest=True)
    now = dht.now()
    return {run_id: parse_points(records.get(trainlog_key(run_id)), now) for run_id in run_ids}
