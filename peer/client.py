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
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import trio

from dht.node import DHTNode
from peer.p2p.bridge import Bridge
from peer.p2p.identity import Identity, PeerID, SwarmKey
from peer.p2p.net import Address, Network, RealNetwork, parse_address
from peer.p2p.rpc import RPCNode
from peer.relays import Reached, serve_reachable

T = TypeVar("T")


def normalize_peers(initial_peers: Sequence[str | Address]) -> list[Address]:
    return [parse_address(p) if isinstance(p, str) else (str(p[0]), int(p[1])) for p in initial_peers]


def client_host(initial_peers: Sequence[Address]) -> str:
    """The local host a client peer binds: a loopback swarm is reached from loopback, anything else from all
    interfaces (a client serves nothing, so binding them all exposes nothing)."""
    return "127.0.0.1" if all(host.startswith("127.") for host, _ in initial_peers) else "0.0.0.0"


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
    joined through `initial_peers` (`host`: see `client_host`). The one composition `Swarm` and `peer status`
    share. `secure` False is `--insecure-transport`; `swarm_key` makes it a private swarm's member,
    `allowed_peers` refuses handshakes with others. Raises dht.BootstrapFailed when no initial peer answers."""
    peers = normalize_peers(initial_peers)
    identity = identity or Identity.generate()
    network = network or RealNetwork()
    async with RPCNode(identity, network, secure=secure, swarm_key=swarm_key, allowed_peers=allowed_peers) as rpc:
        resolved = [await network.resolve(peer) for peer in peers]
        async with DHTNode.open(host or client_host(resolved), 0, resolved, identity=identity, network=network,
                                client_mode=True, swarm_key=swarm_key) as dht:
            yield rpc, dht


class Swarm:
    """`with Swarm(initial_peers=["127.0.0.1:31337"]) as swarm:` — then hand `swarm` to MoE layers and optimizers.

    Attributes used by the feature modules (`dht.client.SwarmHandle`): `bridge` (run coroutines from synchronous
    code), `rpc` (an RPCNode in client mode) and `dht` (a client-mode DHTNode), all living in the bridge's trio
    thread; reading them before `start()` or after `close()` raises RuntimeError.
    """

    def __init__(
        self,
        initial_peers: Sequence[str | Address],
        *,
        identity: Identity | None = None,
        host: str | None = None,
        network: Network | None = None,
        start: bool = True,
        secure: bool = True,
        swarm_key: SwarmKey | str | os.PathLike[str] | None = None,
        allowed_peers: frozenset[PeerID] | None = None,
        reachability: str | None = None,
    ):
        """`swarm_key`: a private swarm's key, or the path of its key file (`--swarm-key`). `reachability`:
        None keeps the peer client-only (an optimizer may still open a listener); `auto`, `public` or `private`
        makes it listen and be reached, through relays when private (`peer train --reachability`)."""
        if reachability is not None and reachability not in ("auto", "public", "private"):
            raise ValueError(f"reachability is auto, public, private or None, not {reachability!r}")
        self.initial_peers = normalize_peers(initial_peers)
        if not self.initial_peers:
            raise ValueError("a Swarm needs at least one initial peer (HOST:PORT of any running `peer join`)")
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

    async def _serve(self, task_status: trio.TaskStatus[tuple[RPCNode, DHTNode]] = trio.TASK_STATUS_IGNORED
                     ) -> None:
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
