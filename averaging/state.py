"""State download: a newcomer fetches the current tensors and metadata (step number, ...) from a peer that has them.

The provider keeps training and averaging while it serves. Its lock is held only to take a SNAPSHOT (metadata and
a copy of every tensor, taken together so they belong to the same step); the download then streams chunks of
that snapshot with no lock held, so a slow downloader never stalls training (hivemind issue #445) and the state it
gets is consistent (never half one step and half the next). A snapshot lives until its last chunk is fetched, the
downloader closes it, or it sits idle for `snapshot_ttl`; at most `max_snapshots` exist at once (the memory cost
is one copy of the state each), further downloaders are told to ask another peer.

Chunks are laid out with `averaging.partition` (one part, `chunk_bytes` per message), so the downloader computes
the same layout from the header alone. Per-chunk deadlines follow measured throughput, like the all-reduce.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import trio

from averaging.allreduce import run_workers
from averaging.allreduce_core import ThroughputEstimator
from averaging.errors import BadChunk, StateDownloadFailed
from averaging.locking import TensorLock, check_lock, hold
from averaging.partition import DEFAULT_CHUNK_BYTES, Partition, chunk_views
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import CallContext, RemoteError, RPCError, RPCNode, register_error_code

OPEN = "averaging.state.open"
CHUNK = "averaging.state.chunk"
CLOSE = "averaging.state.close"

StateGetter = Callable[[], tuple[Any, Sequence[torch.Tensor]]]

class ProviderBusy(RemoteError):
    """The provider already serves as many downloads as it keeps snapshots for; ask another peer."""

    code = "averaging.state_busy"


class NoState(RemoteError):
    """The provider has no state to give (not ready, or the snapshot expired)."""

    code = "averaging.no_state"


for _cls in (ProviderBusy, NoState):
    register_error_code(_cls.code, _cls)


@dataclass
class StateConfig:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_snapshots: int = 2
    snapshot_ttl: float = 30.0
    timeout_floor: float = 1.0
    timeout_factor: float = 4.0
    initial_rate: float = 1e6
    chunks_in_flight: int = 2


class _Snapshot:
    def __init__(self, metadata: Any, tensors: list[torch.Tensor], chunk_bytes: int, now: float):
        self.metadata = metadata
        self.tensors = tensors
        self.partition = Partition.for_tensors(tensors, [1.0], chunk_bytes=chunk_bytes)
        self.chunks = self.partition.parts[0].chunks if self.partition.parts else ()
        self.served: set[int] = set()
        self.last_used = now


class StateServer:
    """Serves this peer's state to downloaders. `get_state()` returns (metadata, tensors); it is called with the
    lock held, and its tensors are copied before the lock is released. Install once per RPCNode."""

    def __init__(self, rpc: RPCNode, get_state: StateGetter, *, lock: TensorLock = None,
                 config: StateConfig | None = None):
        check_lock(lock)
        self.rpc = rpc
        self.get_state = get_state
        self.lock = lock
        self.config = config or StateConfig()
        self._snapshots: dict[int, _Snapshot] = {}
        self._ids = itertools.count(1)
        self.snapshots_taken = 0

    def install(self) -> "StateServer":
        self.rpc.register(OPEN, self._on_open)
        self.rpc.register(CHUNK, self._on_chunk)
        self.rpc.register(CLOSE, self._on_close)
        return self

    def uninstall(self) -> None:
        for name in (OPEN, CHUNK, CLOSE):
            self.rpc.unregister(name)
        self._snapshots.clear()

    def _evict_idle(self) -> None:
        now = trio.current_time()
        for key in [k for k, s in self._snapshots.items() if now - s.last_used > self.config.snapshot_ttl]:
            del self._snapshots[key]

    async def _on_open(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._evict_idle()
        if len(self._snapshots) >= self.config.max_snapshots:
            raise ProviderBusy("serving too many downloads right now")
        async with hold(self.lock):
            metadata, tensors = self.get_state()
            copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        for index, tensor in enumerate(copies):
            if wire.dtype_name(tensor.dtype) is None:
                raise NoState(f"tensor {index} has a dtype that cannot be sent ({tensor.dtype})")
        snapshot = _Snapshot(metadata, copies, self.config.chunk_bytes, trio.current_time())
        snapshot_id = next(self._ids)
        self._snapshots[snapshot_id] = snapshot
        self.snapshots_taken += 1
        return {
            "id": snapshot_id,
            "metadata": metadata,
            "tensors": [[wire.dtype_name(t.dtype), list(t.shape)] for t in copies],
            "chunk_bytes": self.config.chunk_bytes,
        }

    def _snapshot(self, args: Any) -> tuple[int, _Snapshot]:
        if not isinstance(args, dict) or not isinstance(args.get("id"), int):
            raise BadChunk("malformed state request")
        snapshot = self._snapshots.get(args["id"])
        if snapshot is None:
            raise NoState("no such snapshot (it expired or was closed)")
        return args["id"], snapshot

    async def _on_chunk(self, context: CallContext, args: Any) -> list[Any]:
        snapshot_id, snapshot = self._snapshot(args)
        index = args.get("chunk")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(snapshot.chunks):
            raise BadChunk(f"no chunk {index!r}")
        snapshot.last_used = trio.current_time()
        snapshot.served.add(index)
        if len(snapshot.served) == len(snapshot.chunks):
            del self._snapshots[snapshot_id]  # the reply below still holds the tensors it needs
        views = chunk_views(snapshot.tensors, snapshot.chunks[index])
        compression = args.get("compression") or 0
        try:
            compression = wire.Compression(compression)
        except ValueError:
            raise BadChunk(f"unknown compression {compression!r}") from None
        if compression == wire.Compression.NONE:
            return views
        return [wire.compressed(v, compression) if v.is_floating_point() else v for v in views]

    async def _on_close(self, context: CallContext, args: Any) -> None:
        if isinstance(args, dict) and isinstance(args.get("id"), int):
            self._snapshots.pop(args["id"], None)


def install_state_server(rpc: RPCNode, get_state: StateGetter, *, lock: TensorLock = None,
                         config: StateConfig | None = None) -> StateServer:
    """Serve `get_state()` (called under `lock`) to downloaders; returns the server (`.uninstall()` to stop)."""
    return StateServer(rpc, get_state, lock=lock, config=config).install()


@dataclass
class DownloadedState:
    metadata: Any
    tensors: list[torch.Tensor]
    peer: PeerID
    seconds: float


async def load_state_from_peers(
    rpc: RPCNode,
    candidates: Sequence[tuple[PeerID, Address]],
    *,
    into: Sequence[torch.Tensor] | None = None,
    lock: TensorLock = None,
    timeout: float = 60.0,
    compression: wire.Compression = wire.Compression.NONE,
    config: StateConfig | None = None,
    estimator: ThroughputEstimator | None = None,
) -> DownloadedState:
    """Download the state of the first candidate that can give it (in the order given).

    With `into`, the downloaded tensors are also copied into those tensors (same shapes and dtypes required),
    under `lock`, in one short hold at the end. Raises StateDownloadFailed when no candidate succeeded.
    """
    config = config or StateConfig()
    check_lock(lock)
    estimator = estimator or ThroughputEstimator(config.initial_rate)
    errors: list[str] = []
    started = trio.current_time()
    deadline = started + timeout
    for peer_id, address in candidates:
        if trio.current_time() >= deadline:
            break
        try:
            with trio.move_on_at(deadline):
                metadata, tensors = await _download(rpc, peer_id, address, deadline, compression, config,
                                                    estimator, into)
                if into is not None:
                    async with hold(lock):
                        for target, source in zip(into, tensors):
                            target.copy_(source)
                return DownloadedState(metadata, tensors, PeerID(peer_id), trio.current_time() - started)
            errors.append(f"{PeerID(peer_id).short()}: deadline passed")
        except (RPCError, StateDownloadFailed) as error:
            errors.append(f"{PeerID(peer_id).short()}: {error}")
    raise StateDownloadFailed("no peer could provide its state: " + ("; ".join(errors) or "no candidates"),
                              operation="state.download")


async def _download(rpc: RPCNode, peer_id: PeerID, address: Address, deadline: float,
                    compression: wire.Compression, config: StateConfig, estimator: ThroughputEstimator,
                    into: Sequence[torch.Tensor] | None) -> tuple[Any, list[torch.Tensor]]:
    remaining = max(0.0, deadline - trio.current_time())
    header = await rpc.call(address, OPEN, {}, timeout=remaining, peer_id=peer_id)
    peer = PeerID(peer_id)
    try:
        snapshot_id, metadata, layout, chunk_bytes = (header["id"], header["metadata"], header["tensors"],
                                                      int(header["chunk_bytes"]))
        dtypes = [wire.dtype_from_name(name) for name, _ in layout]
        if None in dtypes:
            raise ValueError(f"unknown dtype among {[name for name, _ in layout]}")
        tensors = [torch.empty([int(d) for d in shape], dtype=dtype) for (_, shape), dtype in zip(layout, dtypes)]
    except (KeyError, TypeError, ValueError) as error:
        raise StateDownloadFailed(f"malformed state header: {error}", peer=peer, operation="state.open") from None
    if chunk_bytes <= 0:
        raise StateDownloadFailed("malformed chunk size", peer=peer, operation="state.open")
    if into is not None:
        if len(into) != len(tensors) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in zip(into, tensors)):
            await _close_quietly(rpc, address, peer_id, snapshot_id)
            raise StateDownloadFailed("the peer's state has other shapes or dtypes than ours", peer=peer,
                                      operation="state.open")
    partition = Partition.for_tensors(tensors, [1.0], chunk_bytes=chunk_bytes)
    chunks = partition.parts[0].chunks if partition.parts else ()
    pending = iter(range(len(chunks)))

    async def worker() -> None:
        for index in pending:
            chunk = chunks[index]
            nbytes = partition.chunk_bytes_of(chunk)
            timeout = estimator.timeout(nbytes, floor=config.timeout_floor, factor=config.timeout_factor)
            started = trio.current_time()
            reply = await rpc.call(address, CHUNK, {"id": snapshot_id, "chunk": index,
                                                    "compression": int(compression)},
                                   timeout=min(timeout, max(0.0, deadline - started)), peer_id=peer_id)
            estimator.observe(nbytes, trio.current_time() - started)
            views = chunk_views(tensors, chunk)
            if not isinstance(reply, list) or len(reply) != len(views) or not all(
                    isinstance(r, torch.Tensor) and r.numel() == v.numel() for r, v in zip(reply, views)):
                raise StateDownloadFailed(f"malformed state chunk {index}", peer=peer, operation="state.chunk")
            for view, value in zip(views, reply):
                view.copy_(value.reshape(-1))

    try:
        if chunks:
            await run_workers(min(config.chunks_in_flight, len(chunks)), worker, (RPCError, StateDownloadFailed))
    except (RPCError, StateDownloadFailed):
        await _close_quietly(rpc, address, peer_id, snapshot_id)
        raise
    return metadata, tensors


async def _close_quietly(rpc: RPCNode, address: Address, peer_id: PeerID, snapshot_id: int) -> None:
    with trio.move_on_after(1.0):
        try:
            await rpc.call(address, CLOSE, {"id": snapshot_id}, timeout=1.0, peer_id=peer_id)
        except RPCError:
            pass  # it expires on its own
