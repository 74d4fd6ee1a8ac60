"""The trainer's handle on the swarm: a client-mode peer on a background trio thread.

Why client mode: trainers are often behind NAT or on laptops; they call others (experts, averaging partners, the
DHT) and serve nothing, so nobody routes requests to them. Synchronous PyTorch code uses the swarm through the
bridge: `swarm.run(async_fn, ...)` blocks until the coroutine finishes in the swarm's trio thread.

A trainer that should be reached (to reduce a part of an all-reduce, to hand out its state) passes a
`reachability`: the swarm then listens, and a private trainer (found by dial-backs, or forced) holds relay
reservations like a private daemon and announces its relayed address (`peer.relays.serve_reachable`), so two
trainers behind NATs average with each other.
"""

from __future__ import annotations

import os
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import trio

from dht.node import DHTNode
from peer.p2p.addresses import announced_address, client_host, pick_free_port
from peer.p2p.bridge import Bridge
from peer.p2p.identity import Identity, PeerID, SwarmKey
from peer.p2p.net import Address, Network, RealNetwork, parse_address
from peer.p2p.rpc import RPCNode
from peer.relays import Reached, serve_reachable

T = TypeVar("T")


def normalize_peers(initial_peers: str | Sequence[str | Address]) -> list[Address]:
    """Addresses from a list of `HOST:PORT` strings or (host, port) pairs, or from one string of them separated by
    commas or spaces (`"h:p"` is one peer, not four characters). A bad entry is a one-line ValueError naming it."""
    if isinstance(initial_peers, str):
        initial_peers = [part for part in re.split(r"[,\s]+", initial_peers) if part]
    peers: list[Address] = []
    for peer in initial_peers:
        try:
            peers.append(parse_address(peer) if isinstance(peer, str) else (str(peer[0]), int(peer[1])))
        except (ValueError, TypeError, IndexError) as error:
            raise ValueError(f"initial peer {peer!r}: {error} (give HOST:PORT strings, e.g. "
                             f"['203.0.113.5:31337'])") from None
    return peers


@asynccontextmanager
async def open_client_peer(
    initial_peers: Sequence[str | Address],
    *,
    identity: Identity | None = None,
    network: Network | None = None,
    host: str | None = None,
    secure: bool = True,
    swarm_key: SwarmKey | None = None,
    allowed_peers: frozenset[PeerID] | None = None,
) -> AsyncIterator[tuple[RPCNode, DHTNode]]:
    """A client-mode peer for the duration of the block: an RPC node that calls others and a client-mode DHT node
    joined through `initial_peers` (`host`: see `peer.p2p.addresses.client_host`). The one composition `Swarm`
    and `peer status` share. `secure` False is `--insecure-transport`; `swarm_key` makes it a private swarm's member,
    `allowed_peers` refuses handshakes with others. Raises dht.BootstrapFailed when no initial peer answers."""
    peers = normalize_peers(initial_peers)
    identity = identity or Identity.generate()
    network = network or RealNetwork()
    async with RPCNode(identity, network, secure=secure, swarm_key=swarm_key, allowed_peers=allowed_peers) as rpc:
        resolved = [await network.resolve(peer) for peer in peers]
        async with DHTNode.open(host or client_host(resolved), 0, resolved, identity=identity, network=network,
                                client_mode=True, swarm_key=swarm_key) as dht:
            yield rpc, dht


@asynccontextmanager
async def open_bootstrap_peer(
    host: str,
    *,
    port: int = 0,
    identity: Identity,
    network: Network,
    secure: bool = True,
    swarm_key: SwarmKey | None = None,
    allowed_peers: frozenset[PeerID] | None = None,
) -> AsyncIterator[tuple[RPCNode, DHTNode]]:
    """The first peer of a new swarm: an RPC node listening on `host` and a DHT node in server mode on the same
    port, so that others join through it (`Swarm(initial_peers=[])`: the first trainer is its own bootstrap, as
    `peer join` without --initial-peers is). A wildcard host announces the interface toward the internet."""
    async with RPCNode(identity, network, secure=secure, swarm_key=swarm_key, allowed_peers=allowed_peers) as rpc:
        if port == 0 and isinstance(network, RealNetwork):
            port = pick_free_port(host)
        address = await rpc.listen(host, port)
        async with DHTNode.open(host, address[1], [], identity=identity, network=network,
                                swarm_key=swarm_key) as dht:
            if rpc.announce is None:
                rpc.announce = await announced_address(host, address[1], [], dht.observed_address)
            yield rpc, dht


class Swarm:
    """`with Swarm(initial_peers=["127.0.0.1:31337"]) as swarm:` — then hand `swarm` to MoE layers and optimizers.

    `Swarm(initial_peers=[])` starts a new swarm: this trainer is its own bootstrap (its DHT node serves, its RPC
    node listens on `host`, default all interfaces; `swarm.address` is what the others pass as their initial
    peer). No `peer join` daemon is needed for data-parallel training (DiLoCo, collaborative averaging).

    Attributes used by the feature modules (`dht.client.SwarmHandle`): `bridge` (run coroutines from synchronous
    code), `rpc` (an RPCNode in client mode) and `dht` (a client-mode DHTNode), all living in the bridge's trio
    thread; reading them before `start()` or after `close()` raises RuntimeError.
    """

    def __init__(
        self,
        initial_peers: str | Sequence[str | Address],
        *,
        identity: Identity | None = None,
        host: str | None = None,
        port: int = 0,
        network: Network | None = None,
        start: bool = True,
        secure: bool = True,
        swarm_key: SwarmKey | str | os.PathLike[str] | None = None,
        allowed_peers: frozenset[PeerID] | None = None,
        reachability: str | None = None,
    ):
        """`initial_peers`: HOST:PORT strings (or one string of them) of any running peer, trainer or daemon; empty
        starts a new swarm (`host`, `port`: where this first peer listens). `swarm_key`: a private swarm's key, or
        the path of its key file (`--swarm-key`). `reachability`: None keeps the peer client-only (an optimizer
        may still open a listener); `auto`, `public` or `private` makes it listen and be reached, through relays
        when private (`peer train --reachability`)."""
        if reachability is not None and reachability not in ("auto", "public", "private"):
            raise ValueError(f"reachability is auto, public, private or None, not {reachability!r}")
        self.initial_peers = normalize_peers(initial_peers)
        if not self.initial_peers and reachability not in (None, "public"):
            raise ValueError(f"a new swarm's first peer is its bootstrap: it must be reachable, not {reachability}")
        self.port = port
        self.identity = identity or Identity.generate()
        self.peer_id: PeerID = self.identity.peer_id
        self.host = host
        self.network = network or RealNetwork()
        self.secure = secure  # False: `--insecure-transport`
        self.swarm_key = swarm_key if swarm_key is None or isinstance(swarm_key, SwarmKey) else SwarmKey.load(swarm_key)
        self.allowed_peers = allowed_peers
        self.reachability = reachability
        self.reached: Reached | None = None  # how the peer is reached, once started with a `reachability`
        self._bridge: Bridge | None = None
        self._nodes: tuple[RPCNode, DHTNode] | None = None
        if start:
            self.start()

    def start(self) -> "Swarm":
        bridge = Bridge.start()
        try:
            self._nodes = bridge.start_and_wait(self._serve)
        except BaseException:
            bridge.close()
            raise
        self._bridge = bridge
        return self

    @property
    def started(self) -> bool:
        return self._bridge is not None

    def _running(self) -> tuple[Bridge, RPCNode, DHTNode]:
        if self._bridge is None or self._nodes is None:
            raise RuntimeError("the swarm is not started (or closed already)")
        return self._bridge, *self._nodes

    @property
    def bridge(self) -> Bridge:
        return self._running()[0]

    @property
    def rpc(self) -> RPCNode:
        return self._running()[1]

    @property
    def dht(self) -> DHTNode:
        return self._running()[2]

    @property
    def address(self) -> str | None:
        """`HOST:PORT` where others reach this peer (the initial peer to give them when it started the swarm);
        None for a client-only peer."""
        announced = self.rpc.announced_address
        return f"{announced[0]}:{announced[1]}" if announced is not None else None

    async def _serve(self, task_status: trio.TaskStatus[tuple[RPCNode, DHTNode]] = trio.TASK_STATUS_IGNORED
                     ) -> None:
        if not self.initial_peers:
            async with open_bootstrap_peer(self.host or "0.0.0.0", port=self.port, identity=self.identity,
                                           network=self.network, secure=self.secure, swarm_key=self.swarm_key,
                                           allowed_peers=self.allowed_peers) as nodes:
                task_status.started(nodes)
                await trio.sleep_forever()
        async with open_client_peer(self.initial_peers, identity=self.identity, network=self.network,
                                    host=self.host, secure=self.secure, swarm_key=self.swarm_key,
                                    allowed_peers=self.allowed_peers) as nodes:
            if self.reachability is None:
                task_status.started(nodes)
                await trio.sleep_forever()
            rpc, dht = nodes
            async with trio.open_nursery() as nursery:
                peers = [await self.network.resolve(peer) for peer in self.initial_peers]
                host = self.host or client_host(peers)
                self.reached = await nursery.start(serve_reachable, rpc, dht, host, peers, self.reachability)
                task_status.started(nodes)

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run a coroutine function in the swarm's trio thread and wait for its result."""
        return self.bridge.run(async_fn, *args)

    def close(self) -> None:
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None
            self._nodes = None

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
