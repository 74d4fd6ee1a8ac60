"""The dashboard's trio side: a client-mode peer that refreshes the `SwarmView` every few seconds, and keeps
trying when the swarm cannot be reached.

Cost per refresh: one `peer.status` call per listed peer (`peer.status.gather_status` over the listing kept
here). The directory (8 shard keys), the runs and their training points are DHT reads done every
`directory_every` refreshes only: the directory entries live 30 s, so re-reading them every 10 s keeps a departed
peer on the page no longer than its entry lives. What each refresh sent is counted (RPC calls from the RPC node's
counters, DHT datagrams through `CountingNetwork`) and shown in the state as requests per peer per refresh.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import trio

from dht.errors import DHTError
from peer.client import open_client_peer
from peer.dashboard.training import read_points
from peer.dashboard.view import SwarmView
from peer.directory import PeerEntry, list_peers
from peer.p2p.net import Address, Network, RealNetwork, UDPEndpoint
from peer.p2p.rpc import RPCNode
from peer.status import gather_status

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
                 directory_every: int = 5, network: Network | None = None,
                 clock: Callable[[], float] = time.time, runs_reader: Any = None):
        self.initial_peers = list(initial_peers)
        self.refresh = refresh
        self.timeout = timeout
        self.directory_every = directory_every
        self.network = CountingNetwork(network or RealNetwork())
        self.clock = clock
        self.runs_reader = runs_reader if runs_reader is not None else _default_runs_reader()
        self.view = SwarmView([f"{host}:{port}" for host, port in self.initial_peers], started_at=clock())
        self.attachments = 0
        self._rpc: RPCNode | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Attach, refresh until the swarm stops answering, detach, retry; `started` at once (the page is served
        whether or not the swarm answers)."""
        task_status.started()
        while True:
            try:
                async with open_client_peer(self.initial_peers, network=self.network) as (rpc, dht):
                    self.attachments += 1
                    await self._watch(rpc, dht)
                reason = "no peer answered for a while; attaching again"
            except (DHTError, OSError) as error:  # BootstrapFailed: no initial peer answers
                reason = _describe(error)
            self.view.detached(reason, self.clock())
            await trio.sleep(self.refresh)

    async def _watch(self, rpc: RPCNode, dht: Any) -> None:
        """Refresh until UNANSWERED_REFRESHES refreshes in a row got no answer (then the caller reattaches)."""
        entries: list[PeerEntry] = []
        runs: list[dict[str, Any]] = []
        points: dict[str, dict[str, dict[str, Any]]] = {}
        unanswered = 0
        count = 0
        while unanswered < UNANSWERED_REFRESHES:
            started = trio.current_time()
            before = rpc.stats["calls_sent"] + self.network.datagrams_sent
            status: dict[str, Any] | None = None
            failure = "the refresh timed out"
            with trio.move_on_after(max(self.refresh, 3 * self.timeout)):
                try:
                    if count % self.directory_every == 0 or not entries:
                        now = dht.now()
                        entries = [entry for entry in await list_peers(dht) if entry.expiration_time > now]
                        runs = await self.runs_reader(dht) if self.runs_reader is not None else []
                        points = await read_points(dht, [run["run_id"] for run in runs])
                    status = await gather_status(rpc, dht, timeout=self.timeout, entries=entries)
                except DHTError as error:  # a DHT read failed outright: this refresh shows nothing new
                    failure = f"reading the directory failed: {error}"
            count += 1
            if status is None:
                unanswered += 1
                self.view.detached(failure, self.clock())
            else:
                unanswered = 0 if status["peers_reachable"] else unanswered + 1
                spent = rpc.stats["calls_sent"] + self.network.datagrams_sent - before
                self.view.observe(status, entries, runs, points, self.clock(), requests=spent)
            self.view.count_requests(rpc.stats["calls_sent"], self.network.datagrams_sent)
            await trio.sleep_until(started + self.refresh)

    def snapshot(self) -> dict[str, Any]:
        return self.view.snapshot(self.clock())


def _default_runs_reader() -> Any:
    from averaging.progress import list_runs

    return list_runs


def _describe(error: BaseException) -> str:
    if isinstance(error, trio.TooSlowError):
        return "no initial peer answered in time"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or error.__class__.__name__
