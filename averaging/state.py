"""State download: a newcomer, or a trainer that fell behind, fetches the current tensors and metadata (step number,
...) from the peers that hold them, in parallel verified blocks.

The provider keeps training and averaging while it serves. Its lock is held only to take a SNAPSHOT (metadata and
a copy of every tensor, taken together so they belong to the same step: the all-reduce holds that lock only for
its short copies, so a snapshot is never blocked by a round); the download then fetches blocks of that snapshot
with no lock held, so a slow downloader never stalls training (hivemind issue #445) and the state it gets is
consistent (never half one step and half the next). A snapshot lives until every block was fetched from it, the
downloader closes it, or it sits idle for `snapshot_ttl`; at most `max_snapshots` exist at once (the memory cost
is one copy of the state each), further downloaders are told to ask another peer.

Every snapshot carries its manifest (`averaging.state_hash`: layout, one sha256 per block of the concatenated raw
bytes, and the root over them; computed once per snapshot, in a worker thread when the state is large). A block
is served as raw bytes (uncompressed: a lossy codec's output could not be checked against the digest).

The downloader (`load_state`) opens snapshots at up to `max_sources` holders at once and keeps those whose manifest
has the wanted root: the `expected_hash` the caller passes (the hash the round's members agree on), or, without one,
the root of the first candidate in the given order that answered (callers order candidates most advanced first;
should every holder of that root fail, the download starts over with the candidates that held another root, as
trying the next candidate did before). Then per-source workers (`blocks_in_flight` requests each, deadlines from
each source's measured throughput) take block indices from one shared queue; every block is checked against its
digest before it is written into a staging copy. A source that fails (dies, times out, is busy) gives its in-flight
blocks back to the queue and the next candidate is opened in its place; one that sends bytes not matching their
digest (or a manifest that is not the hash of its own blocks) is dropped and reported (`StateSourceCorrupt`, naming
it); blocks already verified are kept either way. When the queue runs dry, idle workers also ask for blocks still in
flight at a slower source (the first verified answer wins, the other request is cancelled). At the end, one short
hold of the caller's lock copies the staging tensors into `into`.

The metadata is not covered by the hash: it is taken from the source that comes first in the candidate order among
those that held the wanted root and were not caught lying (holders of the same tensors may differ in details such
as a round counter; the first in order is the one the caller trusts most).

Wire methods: `averaging.state.open` {"block_bytes"} -> {"id", "metadata", "manifest"};
`averaging.state.block` {"id", "block"} -> [uint8 tensors, concatenated: the block's bytes];
`averaging.state.close` {"id"}.
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, Sequence, TypedDict, Unpack

import torch
import trio

from averaging.allreduce_core import ThroughputEstimator
from averaging.errors import (
    BadChunk,
    StateDownloadFailed,
    StateHashMismatch,
    StateModelMismatch,
    StateSourceCorrupt,
    StateSourceError,
)
from averaging.locking import TensorLock, check_lock, hold
from averaging.schema import MISMATCHES, difference
from averaging.state_hash import (
    BLOCK_BYTES,
    MAX_BLOCK_BYTES,
    Manifest,
    ManifestError,
    byte_view,
    dtype_label,
    state_manifest,
)
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import CallContext, RemoteError, RPCError, RPCNode

logger = logging.getLogger(__name__)

OPEN = "averaging.state.open"
BLOCK = "averaging.state.block"
CLOSE = "averaging.state.close"

StateGetter = Callable[[], tuple[Any, Sequence[torch.Tensor]]]


class ProviderBusy(RemoteError, code="averaging.state_busy"):
    """The provider already serves as many downloads as it keeps snapshots for; ask another peer."""


class NoState(RemoteError, code="averaging.no_state"):
    """The provider has no state to give (not ready, or the snapshot expired)."""


@dataclass
class StateConfig:
    """Server: `max_snapshots`, `snapshot_ttl`, `min_block_bytes` (smallest block a downloader may ask for),
    `hash_in_thread_bytes` (states at least this big are hashed in a worker thread).
    Downloader: `block_bytes` (asked of the servers; `expected_hash` must be the root for this block size, which
    for the default is `state_digest`), `max_sources` (snapshots open at once), `blocks_in_flight` (requests per
    source), `open_timeout`, per-block deadlines max(`timeout_floor`, `timeout_factor` * bytes in flight / that
    source's measured rate) starting from `initial_rate`, `max_state_bytes` (refuse bigger manifests)."""

    block_bytes: int = BLOCK_BYTES
    max_snapshots: int = 2
    snapshot_ttl: float = 30.0
    min_block_bytes: int = 4096
    hash_in_thread_bytes: int = 8 << 20
    max_sources: int = 4
    blocks_in_flight: int = 2
    open_timeout: float = 20.0
    timeout_floor: float = 1.0
    timeout_factor: float = 4.0
    initial_rate: float = 1e6
    max_state_bytes: int = 1 << 40


# ------------------------------------------------------------------------------------------------------ server


class _Snapshot:
    def __init__(self, metadata: Any, tensors: list[torch.Tensor], manifest: Manifest, now: float):
        self.metadata = metadata
        self.tensors = tensors
        self.bytes = [t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
                      for t in tensors]
        self.manifest = manifest
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
        self._opening = 0  # snapshots being taken or hashed: they count against max_snapshots
        self._ids = itertools.count(1)
        self.snapshots_taken = 0
        self.blocks_served = 0

    def install(self) -> "StateServer":
        self.rpc.register(OPEN, self._on_open)
        self.rpc.register(BLOCK, self._on_block)
        self.rpc.register(CLOSE, self._on_close)
        return self

    def uninstall(self) -> None:
        for name in (OPEN, BLOCK, CLOSE):
            self.rpc.unregister(name)
        self._snapshots.clear()

    def _evict_idle(self) -> None:
        now = trio.current_time()
        for key in [k for k, s in self._snapshots.items() if now - s.last_used > self.config.snapshot_ttl]:
            del self._snapshots[key]

    async def _on_open(self, context: CallContext, args: Any) -> dict[str, Any]:
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise BadChunk("malformed state request")
        block_bytes = args.get("block_bytes", BLOCK_BYTES)
        if type(block_bytes) is not int or not self.config.min_block_bytes <= block_bytes <= MAX_BLOCK_BYTES:
            raise BadChunk(f"block size {block_bytes!r} outside [{self.config.min_block_bytes}, {MAX_BLOCK_BYTES}]")
        self._evict_idle()
        if len(self._snapshots) + self._opening >= self.config.max_snapshots:
            raise ProviderBusy("serving too many downloads right now")
        self._opening += 1
        try:
            async with hold(self.lock):
                metadata, tensors = self.get_state()
                copies = [t.detach().to(device="cpu", copy=True, memory_format=torch.contiguous_format)
                          for t in tensors]
            for index, tensor in enumerate(copies):
                if wire.dtype_name(tensor.dtype) is None:
                    raise NoState(f"tensor {index} has a dtype that cannot be sent ({tensor.dtype})")
            if sum(t.numel() * t.element_size() for t in copies) >= self.config.hash_in_thread_bytes:
                manifest = await trio.to_thread.run_sync(state_manifest, copies, block_bytes)
            else:
                manifest = state_manifest(copies, block_bytes)
        finally:
            self._opening -= 1
        snapshot = _Snapshot(metadata, copies, manifest, trio.current_time())
        snapshot_id = next(self._ids)
        self._snapshots[snapshot_id] = snapshot
        self.snapshots_taken += 1
        return {"id": snapshot_id, "metadata": metadata, "manifest": manifest.to_wire()}

    def _snapshot(self, args: Any) -> tuple[int, _Snapshot]:
        if not isinstance(args, dict) or type(args.get("id")) is not int:
            raise BadChunk("malformed state request")
        snapshot = self._snapshots.get(args["id"])
        if snapshot is None:
            raise NoState("no such snapshot (it expired or was closed)")
        return args["id"], snapshot

    async def _on_block(self, context: CallContext, args: Any) -> list[torch.Tensor]:
        snapshot_id, snapshot = self._snapshot(args)
        index = args.get("block")
        if type(index) is not int or not 0 <= index < snapshot.manifest.num_blocks:
            raise BadChunk(f"no block {index!r}")
        snapshot.last_used = trio.current_time()
        snapshot.served.add(index)
        if len(snapshot.served) == snapshot.manifest.num_blocks:
            del self._snapshots[snapshot_id]  # the reply below still holds the tensors it needs
        self.blocks_served += 1
        return self._block_reply(snapshot, index)

    def _block_reply(self, snapshot: _Snapshot, index: int) -> list[torch.Tensor]:
        """The bytes of block `index`: views of the snapshot's tensors (sent without a copy)."""
        return [snapshot.bytes[tensor][start:end] for tensor, start, end in snapshot.manifest.segments(index)]

    async def _on_close(self, context: CallContext, args: Any) -> None:
        if isinstance(args, dict) and type(args.get("id")) is int:
            self._snapshots.pop(args["id"], None)


def install_state_server(rpc: RPCNode, get_state: StateGetter, *, lock: TensorLock = None,
                         config: StateConfig | None = None) -> StateServer:
    """Serve `get_state()` (called under `lock`) to downloaders; returns the server (`.uninstall()` to stop)."""
    return StateServer(rpc, get_state, lock=lock, config=config).install()


# ------------------------------------------------------------------------------------------------------ downloader


@dataclass
class DownloadedState:
    """`peer`: the source whose metadata was taken; `root`: the manifest root the tensors were verified against
    (`state_digest(tensors)` for the default block size); `sources`: the holders of that root that were used;
    `blocks_from`: verified blocks each delivered; `blocks_fetched`: block replies received, duplicates and
    rejected ones included; `failures`: the sources dropped or not used, and why."""

    metadata: Any
    tensors: list[torch.Tensor]
    peer: PeerID
    seconds: float
    root: str = ""
    sources: list[PeerID] = field(default_factory=list)
    blocks_from: dict[PeerID, int] = field(default_factory=dict)
    blocks_fetched: int = 0
    failures: list[StateSourceError] = field(default_factory=list)


@dataclass(eq=False)
class _Source:
    """A candidate that opened a snapshot: what it serves, how fast it delivers (`estimator`, started at `rate`),
    the scope its worker runs in, and why it stopped (`failure`). eq=False: a source is one worker's, told apart by
    identity (two candidates may serve equal snapshots)."""

    order: int
    peer: PeerID
    address: Address
    snapshot_id: int
    metadata: Any
    manifest: Manifest
    rate: InitVar[float]
    estimator: ThroughputEstimator = field(init=False)
    scope: trio.CancelScope = field(init=False, default_factory=trio.CancelScope)
    failure: StateSourceError | None = field(init=False, default=None)
    delivered: int = field(init=False, default=0)

    def __post_init__(self, rate: float) -> None:
        self.estimator = ThroughputEstimator(rate)


class _Download:
    """One download: the candidates' openers, the per-source workers and the shared block queue."""

    def __init__(self, rpc: RPCNode, candidates: Sequence[tuple[PeerID, Address]], *,
                 into: Sequence[torch.Tensor] | None, expected_hash: str | None, config: StateConfig,
                 initial_rate: float, deadline: float):
        self.rpc = rpc
        self.candidates = [(PeerID(bytes(p)), (str(a[0]), int(a[1]))) for p, a in candidates]
        self.into = into
        self.expected = expected_hash.lower() if expected_hash is not None else None
        self.root = self.expected
        self.config = config
        self.initial_rate = initial_rate
        self.deadline = deadline
        self.pending = collections.deque(range(len(self.candidates)))  # candidates not opened yet, in order
        self.attempt: list[int] = []  # candidates opened for the current root, in order
        self.opening: set[int] = set()
        self.opened: dict[int, _Source] = {}  # the last snapshot opened at each candidate (to close at the end)
        self.failed: set[int] = set()  # candidates that failed before their manifest was accepted
        self.waiting: list[_Source] = []  # opened, the root not chosen yet
        self.other_roots: list[int] = []  # without an expected hash: candidates holding another root than chosen
        self.sources: list[_Source] = []  # holders of the root: working or worked
        self.failures: list[StateSourceError] = []
        self.manifest: Manifest | None = None
        self.staging: list[torch.Tensor] = []
        self.staging_bytes: list[torch.Tensor] = []
        self.done: list[bool] = []
        self.remaining = -1
        self.todo: collections.deque[int] = collections.deque()
        self.fetching: dict[int, dict[_Source, trio.CancelScope]] = {}
        self.blocks_fetched = 0
        self.changed = trio.Event()
        self.finished = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.closer: trio.Nursery | None = None  # closes snapshots as soon as they are not needed

    # ---------------------------------------------------------------------------------- bookkeeping

    @property
    def complete(self) -> bool:
        return self.remaining == 0

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _alive(self) -> int:
        return len(self.opening) + len(self.waiting) + sum(1 for s in self.sources if s.failure is None)

    def _check_end(self) -> None:
        if not self.complete and self._alive() == 0 and not self.pending and self.other_roots:
            self._restart()
        if self.complete or (self._alive() == 0 and not self.pending):
            self.finished.set()
            self._notify()

    def _restart(self) -> None:
        """Without an expected hash, every holder of the chosen root failed: start over with the candidates that
        held other roots (in order: the first that answers gives the root), as trying the next candidate did
        before downloads were parallel. Blocks of the old root are not kept."""
        logger.info("state download: no holder of %s left, trying the other states", (self.root or "")[:12])
        self.root, self.manifest = None, None
        self.staging, self.staging_bytes, self.done, self.remaining = [], [], [], -1
        self.todo.clear()
        self.sources = []
        self.attempt = []
        self.pending = collections.deque(sorted(self.other_roots))
        self.other_roots = []
        self._refill()

    def _refill(self) -> None:
        """Open more candidates until `max_sources` are open or being opened."""
        assert self.nursery is not None
        while not self.complete and self.pending and self._alive() < self.config.max_sources:
            order = self.pending.popleft()
            self.attempt.append(order)
            self.opening.add(order)
            self.nursery.start_soon(self._open, order)

    def _report(self, error: StateSourceError) -> None:
        self.failures.append(error)
        if isinstance(error, StateModelMismatch):
            return  # logged once per peer by MISMATCHES, where it was found
        if isinstance(error, StateSourceCorrupt):
            logger.warning("state download: dropped a source: %s", error)
        else:
            logger.info("state download: %s", error)

    # ---------------------------------------------------------------------------------- opening

    async def _open(self, order: int) -> None:
        peer, address = self.candidates[order]
        try:
            source = await self._open_snapshot(order, peer, address)
        except StateSourceError as error:
            self._report(error)
            self.failed.add(order)
        else:
            self.waiting.append(source)
        finally:
            self.opening.discard(order)
        self._decide()
        self._refill()
        self._check_end()

    async def _open_snapshot(self, order: int, peer: PeerID, address: Address) -> _Source:
        timeout = min(self.config.open_timeout, max(0.0, self.deadline - trio.current_time()))
        try:
            header = await self.rpc.call(address, OPEN, {"block_bytes": self.config.block_bytes}, timeout=timeout,
                                         peer_id=peer)
        except RPCError as error:
            raise StateSourceError(f"could not open a snapshot: {error}", peer=peer, operation="state.open") from None
        snapshot_id = header.get("id") if isinstance(header, dict) else None
        if type(snapshot_id) is not int:
            raise StateSourceCorrupt("malformed snapshot header", peer=peer, operation="state.open")
        self.opened[order] = source = _Source(order, peer, address, snapshot_id, header.get("metadata"),
                                              _EMPTY, self.initial_rate)
        if "manifest" not in header:
            self._close_soon(source)
            raise StateSourceError("no manifest in the snapshot header (an older version?)", peer=peer,
                                   operation="state.open")
        try:
            manifest = Manifest.from_wire(header["manifest"])
        except ManifestError as error:
            self._close_soon(source)
            raise StateSourceCorrupt(f"bad manifest: {error}", peer=peer, operation="state.open") from None
        source.manifest = manifest
        problem = None
        if manifest.block_bytes != self.config.block_bytes:
            problem = f"blocks of {manifest.block_bytes} bytes, not the {self.config.block_bytes} asked for"
        elif manifest.total_bytes > self.config.max_state_bytes:
            problem = f"a state of {manifest.total_bytes} bytes, beyond max_state_bytes"
        elif self.into is not None and not manifest.same_layout(self.into):
            differs = _layout_difference(manifest, self.into)
            MISMATCHES.report(bytes(peer), differs, logger, f"state download from {peer.short()}")
            self._close_soon(source)
            raise StateModelMismatch(f"the source holds another model ({differs})", peer=peer,
                                     operation="state.open")
        elif self.expected is not None and manifest.root != self.expected:
            problem = f"state {manifest.root[:12]}, not the expected {self.expected[:12]}"
        if problem is not None:
            self._close_soon(source)
            raise StateHashMismatch(f"the source holds {problem}", peer=peer, operation="state.open")
        return source

    def _decide(self) -> None:
        """Choose the root (without an expected hash: that of the first candidate in order that answered, once
        every candidate before it has failed), then start the waiting holders of it and turn the others away."""
        if self.root is None:
            for order in self.attempt:
                if order in self.failed:
                    continue
                if order in self.opening:
                    return
                self.root = self.opened[order].manifest.root
                break
            else:
                return
        for source in self.waiting:
            if source.manifest.root == self.root:
                self._start(source)
            else:
                self._close_soon(source)
                self.other_roots.append(source.order)
                self._report(StateHashMismatch(
                    f"the source holds state {source.manifest.root[:12]}, not the chosen {self.root[:12]}",
                    peer=source.peer, operation="state.open"))
        self.waiting = []

    def _start(self, source: _Source) -> None:
        assert self.nursery is not None
        if self.manifest is None:
            manifest = self.manifest = source.manifest
            self.staging = [torch.empty(shape, dtype=wire.DTYPES[dtype])
                            for dtype, shape in zip(manifest.dtypes, manifest.shapes)]
            self.staging_bytes = [t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
                                  for t in self.staging]
            self.done = [False] * manifest.num_blocks
            self.remaining = manifest.num_blocks
            self.todo.extend(range(manifest.num_blocks))
        self.sources.append(source)
        if self.complete:
            return
        self.nursery.start_soon(self._run_source, source)

    # ---------------------------------------------------------------------------------- fetching

    async def _run_source(self, source: _Source) -> None:
        with source.scope:
            async with trio.open_nursery() as nursery:
                for _ in range(max(1, self.config.blocks_in_flight)):
                    nursery.start_soon(self._worker, source)

    def _next_block(self, source: _Source) -> int | None:
        while self.todo:
            index = self.todo.popleft()
            if not self.done[index] and not self.fetching.get(index):
                return index
        # the end game: nothing queued, so ask for a block that another source is still sending
        for index, fetchers in self.fetching.items():
            if len(fetchers) == 1 and source not in fetchers and not self.done[index]:
                return index
        return None

    async def _worker(self, source: _Source) -> None:
        while not self.complete and source.failure is None:
            index = self._next_block(source)
            if index is None:
                await self.changed.wait()
                continue
            scope = trio.CancelScope()
            self.fetching.setdefault(index, {})[source] = scope
            try:
                with scope:
                    parts = await self._fetch(source, index)
                if not scope.cancelled_caught:
                    self._store(source, index, parts)
            except StateSourceError as error:
                self._drop(source, error)
                return
            finally:
                fetchers = self.fetching.get(index)
                if fetchers is not None:
                    fetchers.pop(source, None)
                    if not fetchers:
                        del self.fetching[index]

    async def _fetch(self, source: _Source, index: int) -> list[torch.Tensor]:
        assert self.manifest is not None
        nbytes = self.manifest.block_size(index)
        started = trio.current_time()
        timeout = source.estimator.timeout(nbytes * max(1, self.config.blocks_in_flight),
                                           floor=self.config.timeout_floor, factor=self.config.timeout_factor)
        try:
            reply = await self.rpc.call(source.address, BLOCK, {"id": source.snapshot_id, "block": index},
                                        timeout=min(timeout, max(0.0, self.deadline - started)), peer_id=source.peer)
        except RPCError as error:
            raise StateSourceError(f"block {index}: {error}", peer=source.peer, operation="state.block") from None
        source.estimator.observe(nbytes, trio.current_time() - started)
        self.blocks_fetched += 1
        if not isinstance(reply, list) or not all(
                isinstance(part, torch.Tensor) and part.dtype == torch.uint8 and part.dim() == 1 for part in reply):
            raise StateSourceCorrupt(f"malformed reply for block {index}", peer=source.peer, operation="state.block")
        return reply

    def _store(self, source: _Source, index: int, parts: list[torch.Tensor]) -> None:
        """Check block `index` against its digest and write it into the staging tensors (the first copy wins)."""
        manifest = self.manifest
        assert manifest is not None
        if self.done[index]:
            return
        if not manifest.verify_block(index, [byte_view(part) for part in parts]):
            raise StateSourceCorrupt(f"block {index} does not match its digest", peer=source.peer,
                                     operation="state.block")
        data = parts[0] if len(parts) == 1 else torch.cat(parts)
        position = 0
        for tensor, start, end in manifest.segments(index):
            self.staging_bytes[tensor][start:end].copy_(data[position:position + end - start])
            position += end - start
        self.done[index] = True
        self.remaining -= 1
        source.delivered += 1
        for other, scope in self.fetching.get(index, {}).items():
            if other is not source:
                scope.cancel()  # the end game's other request for this block
        if self.complete:
            self.finished.set()
        self._notify()

    def _drop(self, source: _Source, error: StateSourceError) -> None:
        """The source failed or lied: its in-flight blocks go back to the queue (front), the next candidate is
        opened in its place."""
        if source.failure is not None:
            return
        source.failure = error
        self._report(error)
        source.scope.cancel()
        # forget its requests now (its cancelled workers clean up later): a block nobody else is fetching goes
        # back to the queue at once, and is never mistaken for one still in flight
        returned = []
        for index in list(self.fetching):
            fetchers = self.fetching[index]
            if fetchers.pop(source, None) is not None and not fetchers:
                del self.fetching[index]
                if not self.done[index]:
                    returned.append(index)
        self.todo.extendleft(reversed(returned))
        self._close_soon(source)
        self._notify()
        self._refill()
        self._check_end()

    def _close_soon(self, source: _Source) -> None:
        if self.closer is not None and source.snapshot_id >= 0:
            self.closer.start_soon(_close_quietly, self.rpc, source.address, source.peer, source.snapshot_id)
            source.snapshot_id = -1  # closed once

    # ---------------------------------------------------------------------------------- the whole

    async def run(self) -> None:
        async with trio.open_nursery() as closer:  # waits for the closes (each bounded by its own deadline)
            self.closer = closer
            with trio.move_on_at(self.deadline):
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    self._refill()
                    self._check_end()
                    await self.finished.wait()
                    nursery.cancel_scope.cancel()
            self.nursery = None
            for source in self.opened.values():
                self._close_soon(source)

    def metadata_source(self) -> _Source:
        honest = [s for s in self.sources if not isinstance(s.failure, StateSourceCorrupt)]
        return min(honest or self.sources, key=lambda s: s.order)


_EMPTY = Manifest((), (), (), BLOCK_BYTES, (), "")


async def load_state(
    rpc: RPCNode,
    candidates: Sequence[tuple[PeerID, Address]],
    *,
    into: Sequence[torch.Tensor] | None = None,
    lock: TensorLock = None,
    timeout: float = 60.0,
    expected_hash: str | None = None,
    config: StateConfig | None = None,
    estimator: ThroughputEstimator | None = None,
) -> DownloadedState:
    """Download a state in parallel verified blocks from several of `candidates` (see the module doc).

    `expected_hash`: the root the state must have (`state_digest` of the tensors for the default block size);
    without it, the root of the first candidate (in the order given) that answers is taken, and every candidate
    holding that root serves. With `into`, the tensors are also copied into those tensors (same shapes and
    dtypes required; other holders are not used) under `lock`, in one short hold at the end; nothing is written
    when the download fails. `estimator`: its rate is the starting estimate of every source's throughput.
    Raises StateDownloadFailed (with `.failures`, one typed error per source) when no complete state could be
    fetched before `timeout`.
    """
    config = config or StateConfig()
    check_lock(lock)
    started = trio.current_time()
    download = _Download(rpc, candidates, into=into, expected_hash=expected_hash, config=config,
                         initial_rate=estimator.rate if estimator is not None else config.initial_rate,
                         deadline=started + timeout)
    await download.run()
    if not download.complete:
        if download.manifest is not None:
            reason = (f"{download.remaining} of {download.manifest.num_blocks} blocks missing when the "
                      f"{'deadline passed' if trio.current_time() >= download.deadline else 'sources ran out'}")
        elif expected_hash is not None and download.failures and all(
                isinstance(f, StateHashMismatch) for f in download.failures):
            reason = f"no source holds the expected state {expected_hash[:12]}"
        elif trio.current_time() >= download.deadline:
            reason = "the deadline passed"
        else:
            reason = "no source could provide it"
        details = "; ".join(str(f) for f in download.failures) or "no candidates"
        raise StateDownloadFailed(f"state download failed, {reason}: {details}", operation="state.download",
                                  failures=download.failures)
    assert download.manifest is not None
    if into is not None:
        async with hold(lock):
            for target, source in zip(into, download.staging):
                target.copy_(source)
    first = download.metadata_source()
    return DownloadedState(
        first.metadata, download.staging, first.peer, trio.current_time() - started, root=download.manifest.root,
        sources=[s.peer for s in download.sources], blocks_from={s.peer: s.delivered for s in download.sources},
        blocks_fetched=download.blocks_fetched, failures=download.failures)


class LoadOptions(TypedDict, total=False):
    """The keywords `load_state_from_peers` passes on to `load_state` (defaults there): one list, so that the
    older entry point follows the newer one."""

    into: Sequence[torch.Tensor] | None
    lock: TensorLock
    timeout: float
    config: StateConfig | None
    estimator: ThroughputEstimator | None


async def load_state_from_peers(rpc: RPCNode, candidates: Sequence[tuple[PeerID, Address]], *,
                                compression: wire.Compression = wire.Compression.NONE,
                                **options: Unpack[LoadOptions]) -> DownloadedState:
    """`load_state` without an agreed hash (the root of the first candidate that answers, candidates ordered most
    advanced first), for existing callers. `compression` is ignored: blocks travel exact, so that they can be
    checked against their digests."""
    del compression
    return await load_state(rpc, candidates, **options)


async def _close_quietly(rpc: RPCNode, address: Address, peer_id: PeerID, snapshot_id: int) -> None:
    with trio.move_on_after(1.0):
        try:
            await rpc.call(address, CLOSE, {"id": snapshot_id}, timeout=1.0, peer_id=peer_id)
        except RPCError:
            pass  # it expires on its own


def _layout_difference(manifest: Manifest, tensors: Sequence[torch.Tensor]) -> str:
    """How a source's state layout differs from ours, in words (tensors named by position: a manifest carries
    no names)."""
    theirs = [[f"tensor {i}", list(shape), dtype] for i, (dtype, shape) in enumerate(zip(manifest.dtypes,
                                                                                          manifest.shapes))]
    ours = [[f"tensor {i}", list(t.shape), dtype_label(t.dtype)] for i, t in enumerate(tensors)]
    return difference(ours, theirs) or "another layout"
