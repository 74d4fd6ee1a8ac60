"""The typed interface the feature layers program against: `DHTClient` (what they call on a DHT node) and
`SwarmHandle` (the trainer's handle: a bridge into a trio thread with an RPC node and a DHT node in it).

Why Protocols, not `DHTNode`: moe, averaging and the application use a handful of the node's methods, and their
tests drive them with small fakes (a dict-backed DHT, a DHT that fails on purpose); one structural type lets
mypy check both against the same signatures. `dht.DHTNode` satisfies `DHTClient`, `peer.client.Swarm` satisfies
`SwarmHandle`. Extend these only with what a caller outside `dht` really uses.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable, Mapping, Protocol, TypeVar

from dht.records import Record, Subkey
from peer.p2p.bridge import Bridge
from peer.p2p.identity import PeerID
from peer.p2p.rpc import RPCNode

T = TypeVar("T")

# (key, value, expiration_time[, subkey]): one item of `store_many`
StoreItem = tuple[Any, ...]


class DHTClient(Protocol):
    """What callers outside `dht` use of a DHT node (see `dht.node.DHTNode` for the semantics)."""

    @property
    def peer_id(self) -> PeerID: ...

    def now(self) -> float:
        """The DHT clock: expiration times are absolute values of it."""
        ...

    async def store(self, key: str | bytes, value: Any, expiration_time: float, subkey: Subkey | None = None,
                    signed: bool = False) -> bool: ...

    async def store_many(self, items: Iterable[StoreItem], *, signed: bool = False) -> list[bool]: ...

    async def get(self, key: str | bytes, latest: bool = False, quorum: int | None = None,
                  frugal: bool = False) -> Record | None: ...

    async def get_many(self, keys: Iterable[str | bytes], latest: bool = False, quorum: int | None = None,
                       frugal: bool = False) -> Mapping[Any, Record | None]: ...


class SwarmHandle(Protocol):
    """What MoE layers and the collaborative optimizer need from the trainer's swarm handle, once started: `bridge`
    runs coroutines in the trio thread where `rpc` and `dht` live."""

    @property
    def bridge(self) -> Bridge: ...

    @property
    def rpc(self) -> RPCNode: ...

    @property
    def dht(self) -> DHTClient: ...

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...


__all__ = ["DHTClient", "StoreItem", "SwarmHandle"]
