"""Collective training progress through the DHT: when has the swarm processed `target_batch_size` samples?

Collaborative training has no coordinator to say "the epoch is over". Instead every trainer publishes a small
progress record under one DHT key per run (subkey = its peer id): its epoch, the samples it accumulated in
that epoch, its throughput and when it reported. Every trainer reads all the records of the run and decides
on its own when the swarm's samples for the newest epoch reach the target; since they all read the same
records and extrapolate with the same rule, they reach that conclusion at about the same moment and meet in
the averager.

Why signed records: a progress record decides when everybody stops to average, so a peer must not be able to
speak for another. Records are stored `signed=True` (the DHT then refuses values for that subkey not signed by
the same key) and a reader only accepts a record whose subkey is the PeerID of the key that signed it.

Why short expirations: a trainer that dies simply stops refreshing its record; it vanishes from every estimate
after `ttl` seconds, with no goodbye needed.

Layout: `estimate()` is the pure part (records + clock in, a `SwarmProgress` out), unit-tested without any
network; `ProgressTracker` is the thin trio driver that publishes the local record and fetches the others,
refreshing more often as the estimated end of the epoch approaches.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import trio

from dht.client import DHTClient
from peer.p2p.identity import PeerID
from peer.p2p.periodic import run_periodic

logger = logging.getLogger(__name__)

_RECORD_VERSION = 1


RUNS_KEY = "swarmd.runs"  # subkey = run id, value = [target_batch_size]: how `peer status` finds the runs


def progress_key(run_id: str) -> str:
    """The DHT key holding every trainer's progress record for `run_id`."""
    if not run_id:
        raise ValueError("run_id must be a non-empty string")
    return f"{run_id}.progress"


_MAX_GROUP_SHOWN = 8  # keeps each trainer's record small: every trainer of a run shares one 8 KiB DHT value


def group_name(peer_id: bytes) -> str:
    """How a record names a member of its trainer's latest averaging group (`PeerProgress.last_group`): the first
    48 bits of the PeerID, enough to tell members apart and to vouch for them (`averaging.diloco_view`)."""
    return bytes(peer_id).hex()[:12]


@dataclass(frozen=True)
class PeerProgress:
    """One trainer's progress as published: `samples` accumulated in `epoch` at DHT time `time`."""

    peer_id: PeerID
    epoch: int
    samples: int
    samples_per_second: float
    time: float
    client_mode: bool = True
    left: bool = False  # the trainer finished and said goodbye: count it no more
    address: tuple[str, int] | None = None  # where it serves its state to trainers that catch up (None: nowhere)
    last_group: tuple[str, ...] = ()  # short PeerIDs of its latest averaging group, for `peer status`
    # what the training algorithm adds (DiLoCo: algorithm, readiness, outer state hash, bytes, utilization);
    # small scalar values only (see `_valid_info`), so the run's shared DHT value stays small
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_wire(self) -> list[Any]:
        address = [self.address[0], int(self.address[1])] if self.address is not None else None
        return [_RECORD_VERSION, int(self.epoch), int(self.samples), float(self.samples_per_second),
                float(self.time), bool(self.client_mode), bool(self.left), address, list(self.last_group),
                dict(self.info)]

    @classmethod
    def from_wire(cls, peer_id: bytes | bytearray, value: Any) -> "PeerProgress | None":
        """Parse a record read from the DHT; None for anything malformed (hostile or from another version)."""
        if not isinstance(value, (list, tuple)) or len(value) < 6 or value[0] != _RECORD_VERSION:
            return None
        _, epoch, samples, sps, time, client_mode = value[:6]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (epoch, samples)):
            return None
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (sps, time)):
            return None
        if epoch < 0 or samples < 0 or not math.isfinite(sps) or sps < 0 or not math.isfinite(time):
            return None
        left = len(value) > 6 and value[6] is True
        address = None
        raw = value[7] if len(value) > 7 else None
        if (isinstance(raw, (list, tuple)) and len(raw) == 2 and isinstance(raw[0], str) and isinstance(raw[1], int)
                and 0 < raw[1] < 65536):
            address = (raw[0], raw[1])
        group = value[8] if len(value) > 8 else []
        if not (isinstance(group, (list, tuple)) and len(group) <= _MAX_GROUP_SHOWN
                and all(isinstance(member, str) and len(member) <= 40 for member in group)):
            group = []
        info = value[9] if len(value) > 9 and _valid_info(value[9]) else {}
        return cls(PeerID(bytes(peer_id)), epoch, samples, float(sps), float(time), bool(client_mode), left,
                   address, tuple(group), dict(info))


_MAX_INFO = 12


def _valid_info(info: Any) -> bool:
    """An `info` map as a record may carry it: at most `_MAX_INFO` short string keys with scalar values."""
    return (isinstance(info, dict) and len(info) <= _MAX_INFO and all(
        isinstance(k, str) and len(k) <= 16 and (v is None or isinstance(v, (bool, int, float))
                                                 or (isinstance(v, str) and len(v) <= 64))
        for k, v in info.items()))


@dataclass(frozen=True)
class SwarmProgress:
    """What one trainer believes about the run at DHT time `time`.

    `epoch` is the newest epoch any live trainer reports; `samples` is the estimated number of samples the
    trainers in that epoch have accumulated by now (reported counts plus throughput times the age of each
    report); `eta` is the DHT time at which `samples` is expected to reach `target` (`time` when it already
    has, `inf` when nobody makes progress)."""

    epoch: int
    samples: int
    target: int
    samples_per_second: float
    num_peers: int
    eta: float
    time: float
    peers: tuple[PeerProgress, ...] = field(default=(), repr=False)

    @property
    def target_reached(self) -> bool:
        return self.samples >= self.target


def estimate(reports: Iterable[PeerProgress], *, target: int, now: float, max_extrapolation: float = math.inf
             ) -> SwarmProgress:
    """Combine the live reports into the swarm's progress toward `target` samples in its newest epoch.

    Peers behind the newest epoch contribute nothing: their samples belong to an epoch the swarm already
    closed (they will catch up). A report's extrapolation is capped at `max_extrapolation` seconds so a trainer
    that stalled without dying cannot make the epoch end on imaginary samples."""
    reports = list(reports)
    if not reports:
        return SwarmProgress(0, 0, target, 0.0, 0, math.inf, now, ())
    epoch = max(r.epoch for r in reports)
    current = [r for r in reports if r.epoch == epoch]
    samples = 0.0
    throughput = 0.0
    for report in current:
        age = min(max(0.0, now - report.time), max_extrapolation)
        samples += report.samples + report.samples_per_second * age
        throughput += report.samples_per_second
    if samples >= target:
        eta = now
    elif throughput > 0:
        eta = now + (target - samples) / throughput
    else:
        eta = math.inf
    return SwarmProgress(epoch, int(samples), target, throughput, len(current), eta, now, tuple(reports))


def parse_records(record: Any, now: float) -> dict[PeerID, PeerProgress]:
    """The authentic, unexpired progress records inside a DHT record of the progress key.

    A subkey counts only if it is the PeerID of the key that signed its entry: nobody can report for others."""
    found: dict[PeerID, PeerProgress] = {}
    for subkey, entry in (getattr(record, "subkeys", None) or {}).items():
        if not isinstance(subkey, (bytes, bytearray)) or len(subkey) != 20:
            continue
        owner = getattr(entry, "owner", None)
        if owner is None or PeerID.from_public_key(owner) != bytes(subkey):
            continue
        if entry.expiration_time <= now:
            continue
        progress = PeerProgress.from_wire(subkey, entry.value)
        if progress is not None and not progress.left:
            found[progress.peer_id] = progress
    return found


class _Rate:
    """Samples per second, smoothed over recent intervals (an EWMA weighted by interval length).

    The first observation only anchors the clock unless `start` anchors it earlier; samples seen at the same
    instant as the previous observation are kept for the next interval rather than dropped."""

    def __init__(self, horizon: float = 10.0, start: float | None = None):
        self.horizon = horizon
        self.value = 0.0
        self._last: float | None = start
        self._pending = 0

    def update(self, samples: int, now: float) -> None:
        if self._last is None:
            self._last = now
            return
        self._pending += samples
        interval = now - self._last
        if interval <= 0:
            return
        self._last = now
        instant, self._pending = self._pending / interval, 0
        alpha = min(1.0, interval / self.horizon) if self.value else 1.0
        self.value = (1 - alpha) * self.value + alpha * instant


class ProgressTracker:
    """Publishes this trainer's progress record and keeps an up-to-date view of the swarm's.

    Lives in a trio thread: `run()` is a background task (start it in the owner's nursery); the training side
    calls `report(samples)` after each local step and `new_epoch(epoch)` when it moves on, and reads
    `progress()` (an estimate at the current time from the latest fetched records and the live local state).

    Refresh policy: the local record is republished when it is `publish_interval` old (at once on a new epoch),
    and well before it expires; the swarm's records are fetched every `max_refresh` seconds, more often as the
    estimated end of the epoch approaches (half the remaining time, at least `min_refresh` apart), so every
    trainer notices the end within about `min_refresh` of it.
    """

    def __init__(
        self,
        dht: DHTClient,
        run_id: str,
        target_batch_size: int,
        *,
        epoch: int = 0,
        client_mode: bool = True,
        address: tuple[str, int] | None = None,
        ttl: float = 20.0,
        publish_interval: float = 1.0,
        min_refresh: float = 0.1,
        max_refresh: float = 2.0,
        rate_horizon: float = 5.0,
        foreign: Callable[[PeerProgress], bool] | None = None,
    ):
        if target_batch_size < 1:
            raise ValueError("target_batch_size must be positive")
        if not 0 < min_refresh <= max_refresh:
            raise ValueError("need 0 < min_refresh <= max_refresh")
        self.dht = dht
        self.run_id = run_id
        self.key = progress_key(run_id)
        self.peer_id = PeerID(bytes(dht.peer_id))
        self.target = int(target_batch_size)
        self.client_mode = client_mode
        self.address = address
        self.ttl = ttl
        self.publish_interval = publish_interval
        self.min_refresh = min_refresh
        self.max_refresh = max_refresh
        self.epoch = epoch
        self._samples = 0
        self._unrated = 0  # samples counted since the rate last saw them (see `samples`)
        self._unrated_lock = threading.Lock()
        self.last_group: tuple[str, ...] = ()
        self.info: dict[str, Any] = {}  # published with every record (PeerProgress.info)
        self._rate = _Rate(rate_horizon)
        self._others: dict[PeerID, PeerProgress] = {}
        # True for a record of another kind of trainer under this run (e.g. another model): left out of the view,
        # so nothing counts it, waits for it or downloads from it; the callable says so to the operator, once
        self.foreign = foreign
        self._published: PeerProgress | None = None
        self._published_at = -math.inf  # trio time
        self._fetched_at = -math.inf  # trio time
        self._listed_at = -math.inf  # trio time of the last refresh of the run's entry under RUNS_KEY
        self._wake = trio.Event()
        self.stats = {"published": 0, "publish_failures": 0, "fetches": 0, "fetch_failures": 0}

    # -------------------------------------------------------------------------------------- local state

    @property
    def samples(self) -> int:
        """Samples accumulated in the current epoch. Why a property: a driver may add to it directly from its
        training thread (DiLoCo does, to keep its steps off the bridge) instead of calling `report`; every
        increase is counted toward the published throughput either way, so `peer status` shows the samples/s
        of whatever loop drives the optimizer."""
        return self._samples

    @samples.setter
    def samples(self, value: int) -> None:
        with self._unrated_lock:
            if value > self._samples:
                self._unrated += value - self._samples
            self._samples = int(value)

    def _rate_now(self) -> float:
        """The throughput with the samples counted since the last look (trio thread)."""
        with self._unrated_lock:
            fresh, self._unrated = self._unrated, 0
        if fresh:
            self._rate.update(fresh, trio.current_time())
        return self._rate.value

    def local(self) -> PeerProgress:
        return PeerProgress(self.peer_id, self.epoch, self.samples, self._rate_now(), self.dht.now(),
                            self.client_mode, address=self.address, last_group=self.last_group,
                            info=dict(self.info))

    def note_group(self, peer_ids: list[bytes]) -> None:
        """Remember the latest averaging group; it travels with the next published record."""
        self.last_group = tuple(group_name(p) for p in peer_ids[:_MAX_GROUP_SHOWN])

    def report(self, samples: int) -> None:
        """Count `samples` more samples accumulated in the current epoch."""
        self.samples += int(samples)
        self._rate_now()
        self._wake.set()  # the background loop re-plans its next publish and fetch

    def new_epoch(self, epoch: int) -> None:
        """Move to `epoch` with nothing accumulated; published right away so others stop counting us."""
        self.epoch = int(epoch)
        self.samples = 0
        self._wake.set()

    def progress(self) -> SwarmProgress:
        """The swarm's estimated progress now: the last fetched records of others plus my live state."""
        reports = dict(self._others)
        reports[self.peer_id] = self.local()
        return estimate(reports.values(), target=self.target, now=self.dht.now(), max_extrapolation=self.ttl / 2)

    @property
    def last_fetch_age(self) -> float:
        return trio.current_time() - self._fetched_at

    # -------------------------------------------------------------------------------------- DHT I/O

    async def publish(self) -> bool:
        record = self.local()
        try:
            stored = await self.dht.store(self.key, record.to_wire(), record.time + self.ttl,
                                          subkey=bytes(self.peer_id), signed=True)
        except Exception as error:  # one missed refresh; the record lives on until its expiration
            logger.debug("progress: publishing under %s failed: %s", self.key, error)
            stored = False
        if stored:
            self.stats["published"] += 1
        else:
            self.stats["publish_failures"] += 1
        self._published = record
        self._published_at = trio.current_time()
        if self._published_at - self._listed_at >= self.ttl / 3:
            self._listed_at = self._published_at
            try:
                await self.dht.store(RUNS_KEY, [self.target], record.time + self.ttl, subkey=self.run_id)
            except Exception as error:
                logger.debug("progress: listing run %s failed: %s", self.run_id, error)
        return stored

    async def fetch(self) -> SwarmProgress:
        """Read every trainer's record now (the newest replicas) and return the fresh estimate."""
        try:
            record = await self.dht.get(self.key, latest=True)
        except Exception as error:
            logger.debug("progress: reading %s failed: %s", self.key, error)
            self.stats["fetch_failures"] += 1
            self._fetched_at = trio.current_time()  # retry after the usual interval, not in a busy loop
            return self.progress()
        self.stats["fetches"] += 1
        others = parse_records(record, self.dht.now())
        others.pop(self.peer_id, None)
        if self.foreign is not None:
            others = {peer: report for peer, report in others.items() if not self.foreign(report)}
        self._others = others
        self._fetched_at = trio.current_time()
        return self.progress()

    async def leave(self, timeout: float = 2.0) -> bool:
        """Overwrite my record with a goodbye so the others stop counting me at once (a trainer that finished;
        one that crashes just expires). Call after cancelling `run()`."""
        record = self.local()
        goodbye = PeerProgress(record.peer_id, record.epoch, record.samples, 0.0, record.time, record.client_mode,
                               left=True, address=None)
        with trio.move_on_after(timeout):
            try:
                return await self.dht.store(self.key, goodbye.to_wire(), record.time + self.ttl,
                                            subkey=bytes(self.peer_id), signed=True)
            except Exception as error:
                logger.debug("progress: goodbye under %s failed: %s", self.key, error)
        return False

    def _publish_due(self, now: float) -> float:
        """Trio time at which the local record should next be published."""
        published = self._published
        if published is None:
            return now
        if published.epoch != self.epoch:
            # trainers of my old epoch must stop counting my samples at once; with nobody else in view (a lone
            # trainer, maybe many epochs per second) a newcomer can wait a publish interval to see my epoch
            return now if self._others else self._published_at + self.publish_interval
        if published.samples == self.samples:  # nothing new: only keep it alive
            return self._published_at + self.ttl / 3
        return self._published_at + min(self.publish_interval, self.ttl / 3)

    def _fetch_due(self, now: float) -> float:
        progress = self.progress()
        remaining = progress.eta - progress.time  # DHT-clock seconds until the estimated end of the epoch
        interval = min(self.max_refresh, max(self.min_refresh, remaining / 2))
        return self._fetched_at + interval

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish and fetch until cancelled. Starts with one publish and one fetch, so the first `progress()`
        after `started` already reflects the swarm; `report` and `new_epoch` wake it to re-plan."""
        await run_periodic(self._due_work, self.max_refresh, name=f"tracking progress under {self.key}",
                           step_plans=True, retry=self.min_refresh, max_retry=self.max_refresh,
                           wake=self._wake_event, log=logger, task_status=task_status)

    async def _due_work(self) -> float:
        """Publish and fetch what is due now; returns the seconds until something is due again."""
        now = trio.current_time()
        if self._publish_due(now) <= now:
            await self.publish()
            now = trio.current_time()
        if self._fetch_due(now) <= now:
            await self.fetch()
            now = trio.current_time()
        return min(self._publish_due(now), self._fetch_due(now)) - now

    def _wake_event(self) -> trio.Event:
        self._wake = trio.Event()
        return self._wake


def algorithm_summary(reports: Iterable[PeerProgress]) -> dict[str, Any]:
    """For `peer status`: what the trainers' `info` says about the run (DiLoCo: outer step, bytes per outer step,
    utilization, whether the outer parameter hashes of the trainers at the newest outer step agree)."""
    reports = list(reports)
    infos = [r.info for r in reports if r.info.get("alg")]
    if not infos:
        return {"algorithm": "collaborative"}
    newest = max(r.epoch for r in reports)
    hashes = {r.info.get("hash") for r in reports if r.epoch == newest and r.info.get("hash")}
    numbers = [float(i["bytes"]) for i in infos if isinstance(i.get("bytes"), (int, float))]
    utilization = [float(i["util"]) for i in infos if isinstance(i.get("util"), (int, float))]

    def values(key: str) -> list[float]:
        return [float(i[key]) for i in infos if isinstance(i.get(key), (int, float)) and not isinstance(i[key], bool)]

    members, windows, late, joins = values("mem"), values("win"), values("late"), values("join")
    reasons = [str(i["why"]) for i in infos if isinstance(i.get("why"), str) and i["why"]]
    return {
        "algorithm": str(infos[0]["alg"]),
        "outer_step": newest,
        "bytes_per_outer_step": int(sum(numbers) / len(numbers)) if numbers else None,
        "utilization": round(sum(utilization) / len(utilization), 3) if utilization else None,
        "hashes_agree": len(hashes) <= 1,
        # DiLoCo's rounds under churn (averaging/diloco.py): the last round's members, why it started (most
        # trainers' last round), the grace window, late contributions, and the slowest joiner's first round
        "round_members": int(max(members)) if members else None,
        "round_started": max(set(reasons), key=reasons.count) if reasons else None,
        "grace_window": round(max(windows), 3) if windows else None,
        "late_contributions": int(sum(late)),
        "joiner_first_contribution": int(max(joins)) if joins else None,
    }


async def list_runs(dht: DHTClient) -> list[dict[str, Any]]:
    """Every training run with live trainers, as `peer status` shows it: run id, epoch, trainers in that epoch,
    estimated samples toward the target, and the swarm's throughput."""
    listing = await dht.get(RUNS_KEY, latest=True)
    run_ids = run_targets(listing)
    if not run_ids:
        return []
    records = await dht.get_many([progress_key(run_id) for run_id in run_ids], latest=True)
    return runs_from_records(listing, records, dht.now())


def run_targets(listing: Any) -> dict[str, int]:
    """run id -> target batch size, from the record of RUNS_KEY."""
    targets: dict[str, int] = {}
    for subkey, entry in (getattr(listing, "subkeys", None) or {}).items():
        value = entry.value
        if isinstance(subkey, str) and subkey and isinstance(value, list) and value and isinstance(value[0], int):
            targets[subkey] = max(1, value[0])
    return targets


def runs_from_records(listing: Any, records: Mapping[Any, Any], now: float) -> list[dict[str, Any]]:
    """`list_runs`'s answer from the record of RUNS_KEY and the runs' progress records (keyed by
    `progress_key(run_id)`), however they were read."""
    runs = []
    for run_id, target in sorted(run_targets(listing).items()):
        reports = parse_records(records.get(progress_key(run_id)), now)
        if not reports:
            continue
        progress = estimate(reports.values(), target=target, now=now)
        groups = sorted({report.last_group for report in reports.values() if report.last_group})
        runs.append({**algorithm_summary(reports.values()),
            "run_id": run_id,
            "recent_groups": [list(group) for group in groups],
            "epoch": progress.epoch,
            "trainers": len(reports),
            "trainers_in_epoch": progress.num_peers,
            "samples": min(progress.samples, target),
            "target_batch_size": target,
            "samples_per_s": round(progress.samples_per_second, 1),
        })
    return runs
