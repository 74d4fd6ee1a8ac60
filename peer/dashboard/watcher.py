"""The dashboard's trio side: a client-mode peer that refreshes the `SwarmView` every few seconds, and keeps
trying when the swarm cannot be reached.

Cost per refresh: one `peer.status` call per listed peer (`peer.status.gather_status` over the listing kept
here), and nothing else. The directory (8 shard keys), the runs and their training points are read with DHT
lookups when the watcher attaches; after that each status call also asks the peer for the records of those keys
it holds as a DHT replica (the k peers closest to a key hold it, and the dashboard asks every listed peer
anyway), and the watcher merges them as a DHT read merges replicas, signatures checked by the DHT's decoder.
What each refresh sent is counted (RPC calls from the RPC node's counters, DHT datagrams through
`CountingNetwork`) and shown in the state as requests per peer per refresh.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import trio

from averaging.progress import RUNS_KEY, list_runs, progress_key, run_targets, runs_from_records
from dht import records
from dht.errors import DHTError
from dht.node import key_id_of
from dht.records import Record
from peer.client import open_client_peer
from peer.dashboard.training import parse_points, read_points, trainlog_key
from peer.dashboard.view import SwarmView
from peer.directory import SHARD_KEYS, PeerEntry, entries_from_records, list_peers
from peer.p2p.identity import SwarmKey
from peer.p2p.net import Address, Network, RealNetwork, UDPEndpoint
from peer.p2p.rpc import RPCNode
from peer.status import MAX_REPLICA_KEYS, gather_status

logger = logging.getLogger(__name__)

UNANSWERED_REFRESHES = 3  # refreshes in a row without any peer answering before the client peer is reopened


class _CountingUDP(UDPEndpoint):
    def __init__(self, inner: UDPEndpoint, counter: "CountingNetwork"):
        self.inner, self.counter = inner, counter
        self.address = inner.address

    async def sendto(self, data: bytes, address: Address) -> None:
        self.counter.datagrams_sent += 1
        await self.inner.sendto(data, address)

    async def recvfrom(self) -> tuple[bytes, Address]:
        return await self.inner.recvfrom()

    def close(self) -> None:
        self.inner.close()


class CountingNetwork(Network):
    """A network that counts the datagrams sent through it: a client-mode DHT node answers nobody, so every
    datagram it sends is a request to the swarm."""

    def __init__(self, inner: Network):
        self.inner = inner
        self.datagrams_sent = 0

    async def connect_tcp(self, address: Address) -> trio.abc.Stream:
        return await self.inner.connect_tcp(address)

    async def serve_tcp(self, handler: Any, host: str, port: int, *,
                        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await self.inner.serve_tcp(handler, host, port, task_status=task_status)

    async def open_udp(self, host: str, port: int) -> UDPEndpoint:
        return _CountingUDP(await self.inner.open_udp(host, port), self)

    async def resolve(self, address: Address) -> Address:
        return await self.inner.resolve(address)


class Watcher:
    """Owns the view and the client peer that feeds it; `run` in a nursery until cancelled."""

    def __init__(self, initial_peers: Sequence[Address], *, refresh: float = 2.0, timeout: float = 3.0,
                 network: Network | None = None,
                 clock: Callable[[], float] = time.time, runs_reader: Any = None, swarm_key: SwarmKey | None = None):
        self.initial_peers = list(initial_peers)
        self.swarm_key = swarm_key  # `--swarm-key`: watch a private swarm
        self.refresh = refresh
        self.timeout = timeout
        self.network = CountingNetwork(network or RealNetwork())
        self.clock = clock
        self.runs_reader = runs_reader if runs_reader is not None else _default_runs_reader()
        self.view = SwarmView([f"{host}:{port}" for host, port in self.initial_peers], started_at=clock())
        self.attachments = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Attach, refresh until the swarm stops answering, detach, retry; `started` at once (the page is served
        whether or not the swarm answers)."""
        task_status.started()
        while True:
            try:
                async with open_client_peer(self.initial_peers, network=self.network,
                                            swarm_key=self.swarm_key) as (rpc, dht):
                    self.attachments += 1
                    await self._watch(rpc, dht)
                reason = "no peer answered for a while; attaching again"
            except (DHTError, OSError) as error:  # BootstrapFailed: no initial peer answers
                reason = _describe(error)
            self.view.detached(reason, self.clock())
            await trio.sleep(self.refresh)

    async def _watch(self, rpc: RPCNode, dht: Any) -> None:
        """Refresh until UNANSWERED_REFRESHES refreshes in a row got no answer (then the caller reattaches).

        The directory and the runs are read with DHT lookups once; after that they come from the records the
        peers hold as replicas, returned in the status call of each refresh (`Daemon.replicas_held`), so a
        refresh is one call per peer and nothing else. The lookups are done again only when no peer holds the
        directory any more."""
        entries: list[PeerEntry] = []
        runs: list[dict[str, Any]] = []
        points: dict[str, dict[str, dict[str, Any]]] = {}
        run_ids: list[str] = []
        unanswered = 0
        while unanswered < UNANSWERED_REFRESHES:
            started = trio.current_time()
            before = rpc.stats["calls_sent"] + self.network.datagrams_sent
            status: dict[str, Any] | None = None
            failure = "the refresh timed out"
            with trio.move_on_after(max(self.refresh, 3 * self.timeout)):
                try:
                    if not entries:
                        now = dht.now()
                        entries = [entry for entry in await list_peers(dht) if entry.expiration_time > now]
                        runs = await self.runs_reader(dht) if self.runs_reader is not None else []
                        run_ids = [run["run_id"] for run in runs]
                        points = await read_points(dht, run_ids)
                    status = await gather_status(rpc, dht, timeout=self.timeout, entries=entries,
                                                 replicas=replica_keys(run_ids))
                except DHTError as error:  # a DHT read failed outright: this refresh shows nothing new
                    failure = f"reading the directory failed: {error}"
            if status is None:
                unanswered += 1
                self.view.detached(failure, self.clock())
            else:
                unanswered = 0 if status["peers_reachable"] else unanswered + 1
                spent = rpc.stats["calls_sent"] + self.network.datagrams_sent - before
                self.view.observe(status, entries, runs, points, self.clock(), requests=spent)
                held = merge_replicas(status.get("replicas") or [], dht.now())
                entries, runs, points, run_ids = from_replicas(held, dht.now(), run_ids)
            self.view.count_requests(rpc.stats["calls_sent"], self.network.datagrams_sent)
            await trio.sleep_until(started + self.refresh)

    def snapshot(self) -> dict[str, Any]:
        return self.view.snapshot(self.clock())


def replica_keys(run_ids: Sequence[str]) -> list[str]:
    """The DHT keys a refresh asks the peers' replicas of: the directory's shards, the runs' listing, and each
    known run's progress and training points."""
    keys = [*SHARD_KEYS, RUNS_KEY]
    for run_id in run_ids:
        keys += [progress_key(run_id), trainlog_key(run_id)]
    return keys[:MAX_REPLICA_KEYS]


def merge_replicas(replies: list[dict[str, Any]], now: float) -> dict[str, Record]:
    """key -> the records the peers returned for it, decoded (forged and expired entries dropped by the DHT's
    own decoder) and merged as a DHT read merges replicas."""
    merged: dict[str, Record] = {}
    for reply in replies:
        for key, stored in reply.items():
            if not isinstance(key, str):
                continue
            record = records.decode(key_id_of(key), stored, now)
            combined = records.merge(merged.get(key), record, now)
            if combined is not None:
                merged[key] = combined
    return merged


def from_replicas(held: dict[str, Record], now: float, run_ids: Sequence[str]) -> tuple[
        list[PeerEntry], list[dict[str, Any]], dict[str, dict[str, dict[str, Any]]], list[str]]:
    """The directory, the runs, their points and the run ids to ask about next time, from merged replicas (no
    directory at all: empty entries, so the next refresh reads the DHT)."""
    entries = [entry for entry in entries_from_records([held.get(key) for key in SHARD_KEYS], now)
               if entry.expiration_time > now]
    listing = held.get(RUNS_KEY)
    runs = runs_from_records(listing, held, now)
    known = sorted(set(run_ids) | set(run_targets(listing)))
    points = {run_id: parse_points(held.get(trainlog_key(run_id)), now) for run_id in known}
    return entries, runs, {run_id: found for run_id, found in points.items() if found}, known


def _default_runs_reader() -> Any:
    return list_runs


def _describe(error: BaseException) -> str:
    if isinstance(error, trio.TooSlowError):
        return "no initial peer answered in time"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or error.__class__.__name__
