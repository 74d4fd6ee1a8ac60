"""Butterfly all-reduce inside an already formed group: every member ends with the weighted mean of everyone's
tensors, even when members fail on the way.

The flat vector of the registered tensors is split into one part per reducing member (`averaging.partition`).
Every member pushes its slice of part p to the owner of p, the owner averages what it received, and every member
pulls the averaged part back. All calls go FROM the member TO the reducer, so client-mode members (no listening
socket) take part without anyone calling them.

The round has three phases, and the middle one is what keeps failures clean:

1. push    a member sends every part to its reducer in chunks (concurrently to all reducers, a couple of chunks
           in flight per reducer) and feeds its own part to itself without the network.
2. commit  once ALL its pushes are done and (if it reduces) ALL data for its own part has arrived, a member
           commits to every reducer (`finish` call). A reducer averages only over members that committed.
3. pull    when every member has committed or is known to have failed, the reducer computes the mean and
           answers the pulls.

So a member that dies before committing (before the round, while sending, or while reducing its own part)
contributes to NO part: every element of a survivor is the survivors' weighted mean, or its own local value where
the lost member was the reducer. (A member dying in the instant between its commits to two reducers can still be
counted by one and not the other; the window is one small message wide.) A member that dies after committing
counts everywhere it committed; only its own part, if it reduces one, is lost.

A lost part (its reducer failed) is then averaged again among the survivors in a short follow-up round on just
that slice of the vector (`retry_lost_parts`); if that fails too, the part keeps the local values. So with one
failure the survivors normally end with their exact mean everywhere.

Failures are detected from the connection: every member keeps a `watch` call open to every reducer for the
round, so a crash on either side fails a call or cancels a handler at once. Hard evidence (connection refused or
lost, round left) is shared: a committing member tells each reducer whom it saw crash. Timeouts are not shared
(we may be the slow side). Silent peers are caught by deadlines that follow measured throughput: a transfer may
take max(floor, factor * bytes queued on the link / observed rate); a member never seen gets `join_wait`; a
sender that sent everything but has not committed gets a push's grace plus slack * the duration of the data
phase.

Tensors: registered tensors are read while the round runs WITHOUT the lock (a concurrent optimizer step makes
the contribution a mix of old and new values, never a crash), and the averaged values are written back part by
part UNDER the lock (`averaging.locking`), so the lock is held only for short copies.

The protocol state is a plain object, `PartReducer` (no I/O, no clock: time is passed in); `AllReduceServer` is
the trio driver that moves it over `peer.p2p.rpc`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import trio

from averaging.errors import BadChunk, GroupMismatch, RoundNotFound, SenderExcluded
from averaging.group import GroupInfo
from averaging.locking import TensorLock, check_lock, hold
from averaging.partition import DEFAULT_CHUNK_BYTES, Part, Partition, chunk_views, segment_view
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.rpc import CallContext, ConnectionFailed, RPCError, RPCNode

logger = logging.getLogger(__name__)

PUSH = "averaging.allreduce.push"
FINISH = "averaging.allreduce.finish"
PULL = "averaging.allreduce.pull"
WATCH = "averaging.allreduce.watch"

NOTHING = -1  # chunk index of the one push a zero-weight member sends: "I contribute nothing to this part"

Hook = Callable[[str, dict[str, Any]], None]


# ------------------------------------------------------------------------------------------------ timing


class ThroughputEstimator:
    """Smoothed bytes/second of our transfers, and the deadlines derived from it.

    Every finished transfer of a known size is an observation; the first rounds start from `initial_rate`,
    later ones use what the network actually delivered: a slower observation replaces the estimate at once, a
    faster one moves it gradually, so deadlines stay on the safe side of the slowest recent transfer."""

    def __init__(self, initial_rate: float = 1e6, *, smoothing: float = 0.3, min_rate: float = 1e3):
        self.rate = float(initial_rate)
        self.smoothing = smoothing
        self.min_rate = min_rate
        self.observations = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = max(self.min_rate, nbytes / seconds)
        if self.observations == 0 or rate < self.rate:
            self.rate = rate  # a slowdown is believed at once: deadlines must never be tighter than reality
        else:
            self.rate += self.smoothing * (rate - self.rate)  # a speed-up only gradually
        self.observations += 1

    def timeout(self, nbytes: int, *, floor: float, factor: float) -> float:
        return max(floor, factor * nbytes / self.rate)


@dataclass
class AllReduceConfig:
    """chunk_bytes: size of one push/pull message; timeout_floor/timeout_factor: a chunk may take
    max(floor, factor * bytes / observed rate); straggler_slack: after the data phase took T seconds, a missing
    commit is awaited max(floor, slack * T); join_wait: how long a message for a round that has not started here
    yet waits for it (members start a round at slightly different times); initial_rate: bytes/s assumed before
    anything was measured; retry_lost_parts: re-average the parts of lost reducers among the survivors."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_floor: float = 2.0
    timeout_factor: float = 4.0
    straggler_slack: float = 2.0
    join_wait: float = 5.0
    initial_rate: float = 1e6
    pushes_in_flight: int = 2
    pulls_in_flight: int = 2
    max_waiting_rounds: int = 64
    remembered_rounds: int = 256
    retry_lost_parts: bool = True


# ------------------------------------------------------------------------------------------------ sans-I/O core


class ChunkRejected(Exception):
    """A chunk or commit that breaks the protocol (wrong index, size, dtype, weight, duplicate, out of order)."""


class Excluded(Exception):
    """The sender is already counted as failed in this round."""


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class PartReducer:
    """The state of one part on its reducer: who sent which chunks with which weight, who committed, who failed,
    and the running weighted sum. No sockets, no clock (times are arguments), no trio.

    Senders are group member indices (the reducer itself is one of them and feeds its own data like anyone
    else). Received chunks are kept until the mean is computed so that a sender that fails before committing can
    be taken out exactly (the sum is recomputed without it).
    """

    def __init__(self, part: Part, group_size: int, dtypes: Sequence[torch.dtype], *, now: float = 0.0):
        self.part = part
        self.group_size = group_size
        self.n_chunks = len(part.chunks)
        self._expected = [[(s.numel, dtypes[s.tensor]) for s in chunk] for chunk in part.chunks]
        self._chunk_bytes = [
            sum(n * torch.empty((), dtype=d).element_size() for n, d in chunk) for chunk in self._expected
        ]
        self._sum: list[list[torch.Tensor] | None] = [None] * self.n_chunks
        self._data: dict[int, dict[int, list[torch.Tensor]]] = {}
        self.weights: dict[int, float] = {}
        self.complete: set[int] = set()
        self.committed: set[int] = set()
        self.failed: set[int] = set()
        self.opened_at = now
        self.last_activity: dict[int, float] = {}
        self.completed_at: dict[int, float] = {}
        self.data_complete_at: float | None = None
        self._dirty = False
        self.released = False
        self.result: list[list[torch.Tensor]] | None = None
        self.contributors: list[int] = []
        if self.n_chunks == 0:
            self.complete.update(range(group_size))
            self._note_data_complete(now)

    @property
    def max_chunk_bytes(self) -> int:
        return max(self._chunk_bytes, default=0)

    def chunk_bytes(self, chunk: int) -> int:
        return self._chunk_bytes[chunk]

    # --------------------------------------------------------------------------------------------- input

    def receive(self, sender: int, chunk: int, weight: float, tensors: Sequence[torch.Tensor], *,
                now: float = 0.0) -> None:
        """Take one chunk (or the NOTHING marker of a zero-weight sender). Raises Excluded or ChunkRejected."""
        self._check_sender(sender)
        if self.released:
            raise ChunkRejected("the part is already reduced")
        if sender in self.complete:
            raise ChunkRejected(f"member {sender} already sent all of this part")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) \
                or weight < 0:
            raise ChunkRejected(f"invalid weight {weight!r}")
        weight = float(weight)
        if sender in self.weights and self.weights[sender] != weight:
            raise ChunkRejected("a member's weight must be the same in all its chunks")
        if chunk == NOTHING:
            if weight != 0.0 or self._data.get(sender):
                raise ChunkRejected("only a zero-weight member that sent nothing may send the NOTHING marker")
            self.weights[sender] = 0.0
            self._mark_complete(sender, now)
            return
        if weight == 0.0:
            raise ChunkRejected("a zero-weight member sends no data")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 <= chunk < self.n_chunks:
            raise ChunkRejected(f"no chunk {chunk!r} in a part of {self.n_chunks} chunks")
        received = self._data.setdefault(sender, {})
        if chunk in received:
            raise ChunkRejected(f"chunk {chunk} received twice")
        expected = self._expected[chunk]
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(expected):
            raise ChunkRejected(f"chunk {chunk} holds {len(expected)} tensors")
        flat = []
        for tensor, (numel, dtype) in zip(tensors, expected):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tensor.numel() != numel:
                raise ChunkRejected(f"chunk {chunk} expects {numel} elements of {dtype}")
            flat.append(tensor.reshape(-1))
        self.weights[sender] = weight
        received[chunk] = flat
        self._add(chunk, flat, weight)
        self.last_activity[sender] = now
        if len(received) == self.n_chunks:
            self._mark_complete(sender, now)

    def joined(self, sender: int, now: float) -> None:
        """The sender showed up in the round (its watch call arrived): from now on it is held to chunk deadlines
        rather than the join wait."""
        self.last_activity.setdefault(sender, now)

    def commit(self, sender: int, weight: float) -> None:
        """The sender declares its contribution final (it finished ALL its pushes, not only this part)."""
        self._check_sender(sender)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) \
                or weight < 0:
            raise ChunkRejected(f"invalid weight {weight!r}")
        if sender not in self.complete:
            raise ChunkRejected(f"member {sender} commits before sending all of its part")
        if self.weights.get(sender, float(weight)) != float(weight):
            raise ChunkRejected("commit weight differs from the chunks' weight")
        self.weights.setdefault(sender, float(weight))
        self.committed.add(sender)

    def fail(self, sender: int) -> None:
        """The sender is lost. Before its commit its data is dropped; after its commit it counts (it reached the
        point from which every reducer may rely on it) and nothing changes."""
        if sender in self.committed or sender in self.failed or self.released:
            return
        self.failed.add(sender)
        self.complete.discard(sender)
        if self._data.pop(sender, None):
            self._dirty = True
        if self.data_complete_at is None and self.data_complete:
            self._note_data_complete(self.last_event_time())

    # --------------------------------------------------------------------------------------------- state

    @property
    def data_complete(self) -> bool:
        """Every member sent all its data or is known to have failed."""
        return len(self.complete) + len(self.failed) >= self.group_size

    @property
    def ready(self) -> bool:
        """Every member committed or failed: the mean can be computed."""
        return len(self.committed) + len(self.failed) >= self.group_size

    def missing(self) -> list[int]:
        return [s for s in range(self.group_size) if s not in self.complete and s not in self.failed]

    def uncommitted(self) -> list[int]:
        return [s for s in range(self.group_size) if s not in self.committed and s not in self.failed]

    def deadlines(self, chunk_time: float, commit_grace: float, *, floor: float, slack: float,
                  join_wait: float = 0.0) -> dict[int, float]:
        """When each member still awaited becomes overdue. A sender with data outstanding: `chunk_time` after
        its last sign of life (chunk or join); one never seen: `join_wait` after the round opened here (members
        start a round at slightly different times). A sender that sent everything but has not committed may
        still be pushing to slower reducers (or waiting for a push to a dead one to time out): `commit_grace`
        (the caller's bound on such a push) plus slack times the duration of the data phase."""
        result = {}
        for sender in self.missing():
            if sender in self.last_activity:
                result[sender] = self.last_activity[sender] + chunk_time
            else:
                result[sender] = self.opened_at + max(join_wait, chunk_time)
        reference = self.data_complete_at
        for sender in self.uncommitted():
            if sender in self.complete:
                done = max(self.completed_at.get(sender, self.opened_at), reference or self.opened_at)
                phase = (reference if reference is not None else done) - self.opened_at
                result[sender] = done + commit_grace + max(floor, slack * phase)
        return result

    def finalize(self) -> list[list[torch.Tensor]] | None:
        """Compute the weighted mean over committed senders: per chunk, one tensor per segment; None when nobody
        with a positive weight committed (the part keeps the local values)."""
        if not self.ready:
            raise RuntimeError("finalize() before every member committed or failed")
        if self.released:
            return self.result
        self.released = True
        self.contributors = sorted(s for s in self.committed if self.weights.get(s, 0.0) > 0)
        if self.n_chunks == 0:
            self.result = []
        elif not self.contributors:
            self.result = None
        else:
            if self._dirty:
                self._sum = [None] * self.n_chunks
                for sender in self.contributors:
                    for chunk, flat in self._data[sender].items():
                        self._add(chunk, flat, self.weights[sender])
            total = math.fsum(self.weights[s] for s in self.contributors)
            for sums in self._sum:
                assert sums is not None
                for tensor in sums:
                    tensor.div_(total)
            self.result = self._sum  # type: ignore[assignment]
        self._data.clear()
        return self.result

    def last_event_time(self) -> float:
        times = list(self.last_activity.values()) + list(self.completed_at.values())
        return max(times, default=self.opened_at)

    # --------------------------------------------------------------------------------------------- helpers

    def _check_sender(self, sender: int) -> None:
        if not 0 <= sender < self.group_size:
            raise ChunkRejected(f"no member {sender} in a group of {self.group_size}")
        if sender in self.failed:
            raise Excluded(f"member {sender} is counted as failed")

    def _add(self, chunk: int, flat: list[torch.Tensor], weight: float) -> None:
        sums = self._sum[chunk]
        if sums is None:
            # multiply allocates the accumulator: the received (or local) tensor itself is never modified
            self._sum[chunk] = [t.to(_accumulate_dtype(t.dtype)) * weight for t in flat]
        else:
            for acc, t in zip(sums, flat):
                acc.add_(t, alpha=weight)

    def _mark_complete(self, sender: int, now: float) -> None:
        self.complete.add(sender)
        self.completed_at[sender] = now
        self.last_activity[sender] = now
        if self.data_complete and self.data_complete_at is None:
            self._note_data_complete(now)

    def _note_data_complete(self, now: float) -> None:
        self.data_complete_at = now


# ------------------------------------------------------------------------------------------------ result


@dataclass
class AllReduceResult:
    """What one member saw of a round.

    averaged[i]: part i (in partition order) now holds the group mean in our tensors; False = local values kept.
    part_owners[i]: the member that reduced part i; contributors[i]: whose data is in part i's mean.
    failed_peers: members this member stopped waiting for (crashed, timed out, misbehaved); crashed_peers: those
    among them with hard evidence (connection refused or lost, or it left the round), shared with the group.
    finished: the round ended before the deadline.
    """

    group_id: bytes
    averaged: list[bool]
    part_owners: list[PeerID]
    contributors: list[list[PeerID]]
    failed_peers: set[PeerID]
    finished: bool
    elapsed: float
    crashed_peers: set[PeerID] = field(default_factory=set)
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def fully_averaged(self) -> bool:
        return self.finished and all(self.averaged)


# ------------------------------------------------------------------------------------------------ trio driver


class _Round:
    """One member's round in progress: the part it reduces (if any) plus what it knows about the others."""

    def __init__(self, server: "AllReduceServer", group: GroupInfo, partition: Partition, me: int,
                 tensors: list[torch.Tensor], weight: float, compression: wire.Compression, lock: TensorLock):
        now = trio.current_time()
        self.server = server
        self.group = group
        self.partition = partition
        self.me = me
        self.tensors = tensors
        self.weight = weight
        self.compression = compression
        self.lock = lock
        self.started_at = now
        own = partition.part_of(me)
        self.own_part = own
        dtypes = [t.dtype for t in tensors]
        self.reducer = PartReducer(own, group.size, dtypes, now=now) if own is not None else None
        self.failed: set[int] = set()  # every member we stopped waiting for, whatever the reason
        self.crashed: set[int] = set()  # those with hard evidence (see _is_hard): told to the others
        self.averaged = [False] * len(partition.parts)
        self.contributors: list[list[int]] = [[] for _ in partition.parts]
        self.pushes_left = sum(1 for p in partition.parts if p.owner != me)
        self.deadline = math.inf
        self.reducing_started = own is None
        self.committed = trio.Event()
        self.released = trio.Event()
        self.closed = trio.Event()
        self.aborted = False
        self.excluded_by: set[int] = set()
        self.done_with: set[int] = set()
        self.pulled: dict[int, set[int]] = {}
        self.last_pull: dict[int, float] = {}
        self.gone: set[int] = set()
        self.watching: set[int] = set()
        self.watch_scopes: dict[int, trio.CancelScope] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self._changed = trio.Event()

    # ------------------------------------------------------------------------------------------ events

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        self.maybe_commit()

    async def wait_changed(self, deadline: float) -> None:
        event = self._changed
        with trio.move_on_at(deadline):
            await event.wait()

    def hook(self, name: str, **info: Any) -> None:
        if self.server.hook is not None:
            self.server.hook(name, {"peer": self.server.rpc.peer_id, "group_id": self.group.group_id, **info})

    def note_failed(self, member: int, *, crashed: bool = False, reason: str = "") -> None:
        """Stop waiting for `member`. `crashed` marks hard evidence (its connection was refused or lost, or it
        left the round), which we pass on to the reducers we commit to; a timeout or a bad message is only our
        own view (our process may be the slow one) and is not spread, so one slow link cannot exclude a member
        everywhere."""
        if member == self.me:
            return
        if crashed and member not in self.crashed:
            self.crashed.add(member)
        if member in self.failed:
            return
        self.failed.add(member)
        if self.reducer is not None:
            self.reducer.fail(member)
        self.hook("member_failed", member=self.group.members[member].peer_id, crashed=crashed, reason=reason)
        logger.info("all-reduce %s: member %s failed (%s)", self.group.group_id.hex()[:12],
                    self.group.members[member].peer_id.short(), reason)
        self.notify()

    def maybe_commit(self) -> None:
        """Commit once every push is done and our own part has all its data: from here on we count."""
        if self.committed.is_set() or self.pushes_left > 0 or not self.reducing_started:
            return
        if self.reducer is not None:
            if not self.reducer.data_complete:
                return
            self.reducer.commit(self.me, self.weight)
        self.committed.set()
        self.hook("committed")
        self._changed.set()
        self._changed = trio.Event()

    def chunk_timeout(self, nbytes: int) -> float:
        config = self.server.config
        return self.server.estimator.timeout(nbytes, floor=config.timeout_floor, factor=config.timeout_factor)

    def close(self) -> None:
        if not self.released.is_set():
            self.aborted = True
            self.released.set()
        self.closed.set()
        self.notify()


class AllReduceServer:
    """The all-reduce side of one peer: RPC handlers for the rounds this peer reduces in, and `run` to take part
    in a round. One per RPCNode (`install_allreduce`); rounds are told apart by their group id.

    `hook(name, info)`, if given, is called synchronously at protocol milestones ("chunk_pushed",
    "reducing", "committed", "reduced", "part_received", "member_failed"); tests use it to inject failures at
    exact moments, and it is the place for progress logging.
    """

    def __init__(self, rpc: RPCNode, *, config: AllReduceConfig | None = None, hook: Hook | None = None):
        self.rpc = rpc
        self.config = config or AllReduceConfig()
        self.hook = hook
        self.estimator = ThroughputEstimator(self.config.initial_rate)
        self._rounds: dict[bytes, _Round] = {}
        self._waiting: dict[bytes, list[Any]] = {}  # group id -> [Event, number of waiters]
        self._finished: OrderedDict[bytes, None] = OrderedDict()
        self._installed = False
        self._in_flight = {"in": 0, "out": 0}

    # ------------------------------------------------------------------------------------------ install

    def install(self) -> "AllReduceServer":
        if _SERVERS.get(self.rpc) is not None:
            raise RuntimeError("an AllReduceServer is already installed on this RPCNode")
        self.rpc.register(PUSH, self._on_push)
        self.rpc.register(FINISH, self._on_finish)
        self.rpc.register(PULL, self._on_pull)
        self.rpc.register(WATCH, self._on_watch)
        _SERVERS[self.rpc] = self
        self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            for name in (PUSH, FINISH, PULL, WATCH):
                self.rpc.unregister(name)
            _SERVERS.pop(self.rpc, None)
            self._installed = False

    # ------------------------------------------------------------------------------------------ handlers

    async def _lookup(self, context: CallContext, args: Any) -> tuple[_Round, int]:
        if not isinstance(args, dict) or not isinstance(args.get("group"), bytes):
            raise BadChunk("malformed all-reduce message")
        group_id = args["group"]
        round_ = self._rounds.get(group_id)
        if round_ is None:
            round_ = await self._wait_for_round(group_id)
        try:
            member = round_.group.index_of(context.peer_id)
        except KeyError:
            raise BadChunk("the caller is not a member of this group") from None
        if args.get("fp") != round_.partition.fingerprint:
            raise BadChunk("the caller split the tensors differently (other model or other group view)")
        return round_, member

    async def _wait_for_round(self, group_id: bytes) -> _Round:
        if group_id in self._finished:
            raise RoundNotFound("that round is over here")
        entry = self._waiting.get(group_id)
        if entry is None:
            if len(self._waiting) >= self.config.max_waiting_rounds:
                raise RoundNotFound("not running that round")
            entry = self._waiting[group_id] = [trio.Event(), 0]
        entry[1] += 1
        try:
            with trio.move_on_after(self.config.join_wait):
                await entry[0].wait()
        finally:
            entry[1] -= 1
            if entry[1] == 0 and self._waiting.get(group_id) is entry:
                del self._waiting[group_id]
        round_ = self._rounds.get(group_id)
        if round_ is None:
            raise RoundNotFound("not running that round")
        return round_

    @staticmethod
    def _part_arg(round_: _Round, args: dict) -> None:
        if round_.own_part is None or args.get("part") != round_.own_part.index:
            raise BadChunk("this member does not reduce that part")

    async def _on_push(self, context: CallContext, args: Any) -> None:
        round_, sender = await self._lookup(context, args)
        self._part_arg(round_, args)
        reducer = round_.reducer
        assert reducer is not None
        now = trio.current_time()
        previous = reducer.last_activity.get(sender)
        try:
            reducer.receive(sender, args.get("chunk"), args.get("weight"), args.get("data") or [], now=now)
        except Excluded:
            raise SenderExcluded("you are counted as failed in this round") from None
        except ChunkRejected as error:
            round_.note_failed(sender, reason=f"bad chunk: {error}")
            raise BadChunk(str(error)) from None
        chunk = args.get("chunk")
        if chunk != NOTHING:
            nbytes = reducer.chunk_bytes(chunk)
            round_.bytes_received += nbytes
            if previous is not None:
                self.estimator.observe(nbytes, now - previous)
        round_.notify()

    async def _on_finish(self, context: CallContext, args: Any) -> dict:
        round_, sender = await self._lookup(context, args)
        self._part_arg(round_, args)
        reducer = round_.reducer
        assert reducer is not None
        suspects = args.get("suspects")
        if isinstance(suspects, list):
            for suspect in suspects:
                if isinstance(suspect, int) and 0 <= suspect < round_.group.size and suspect != sender:
                    round_.note_failed(suspect, crashed=True, reason="reported by a member")
        try:
            reducer.commit(sender, args.get("weight", 0.0))
        except Excluded:
            raise SenderExcluded("you are counted as failed in this round") from None
        except ChunkRejected as error:
            round_.note_failed(sender, reason=f"bad commit: {error}")
            raise BadChunk(str(error)) from None
        round_.notify()
        try:
            await round_.released.wait()
        except trio.Cancelled:
            round_.gone.add(sender)  # it left before the mean was ready: do not wait for its pulls
            round_.notify()
            raise
        if round_.aborted:
            raise RoundNotFound("the reducer left the round before reducing")
        return {
            "averaged": reducer.result is not None,
            "contributors": list(reducer.contributors),
            "failed": sorted(round_.crashed),
        }

    async def _on_pull(self, context: CallContext, args: Any) -> list:
        round_, member = await self._lookup(context, args)
        self._part_arg(round_, args)
        reducer = round_.reducer
        assert reducer is not None
        if not reducer.released or round_.aborted or member not in reducer.committed:
            raise BadChunk("nothing to pull: commit first and wait for the mean")
        if reducer.result is None:
            raise BadChunk("this part has no mean")
        chunk = args.get("chunk")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 <= chunk < reducer.n_chunks:
            raise BadChunk(f"no chunk {chunk!r}")
        compression = _compression_arg(args.get("compression"))
        round_.pulled.setdefault(member, set()).add(chunk)
        round_.last_pull[member] = trio.current_time()
        round_.bytes_sent += reducer.chunk_bytes(chunk)
        round_.notify()
        tensors = reducer.result[chunk]
        if compression == wire.Compression.NONE:
            return list(tensors)
        return [wire.compressed(t, compression) for t in tensors]

    async def _on_watch(self, context: CallContext, args: Any) -> None:
        """Held open by each member for the whole round: if the member vanishes, the cancelled handler says so at
        once (and the member's failing call tells it that we vanished), so crashes cost no timeout."""
        round_, member = await self._lookup(context, args)
        self._part_arg(round_, args)
        round_.watching.add(member)
        if round_.reducer is not None:
            round_.reducer.joined(member, trio.current_time())
            round_.notify()
        try:
            await round_.closed.wait()
            if round_.aborted:
                raise RoundNotFound("left the round before reducing")  # cancelled or timed out here
        except trio.Cancelled:
            reducer = round_.reducer
            if reducer is not None and member not in reducer.committed:
                round_.note_failed(member, reason="left before committing")
            raise
        finally:
            round_.watching.discard(member)
            round_.gone.add(member)
            round_.notify()

    # ------------------------------------------------------------------------------------------ member side

    async def run(
        self,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float = 1.0,
        compression: wire.Compression = wire.Compression.NONE,
        timeout: float = 60.0,
        lock: TensorLock = None,
    ) -> AllReduceResult:
        """Take part in one round; see `run_allreduce`."""
        tensors = list(tensors)
        _check_tensors(tensors)
        check_lock(lock)
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        if self.rpc.peer_id not in group:
            raise GroupMismatch("this peer is not a member of the group", operation="allreduce")
        if group.group_id in self._rounds:
            raise GroupMismatch("this round is already running here", operation="allreduce")
        if not group.reducers:
            raise GroupMismatch("no member of the group can reduce (all in client mode)", operation="allreduce")
        deadline = trio.current_time() + timeout
        result, partition = await self._run_once(group, tensors, float(weight), wire.Compression(compression),
                                                 deadline, lock)
        if self.config.retry_lost_parts:
            await self._retry_lost_parts(result, partition, group, tensors, float(weight),
                                         wire.Compression(compression), deadline, lock)
        result.elapsed = trio.current_time() - (deadline - timeout)
        return result

    async def _retry_lost_parts(self, result: AllReduceResult, partition: Partition, group: GroupInfo,
                                tensors: list[torch.Tensor], weight: float, compression: wire.Compression,
                                deadline: float, lock: TensorLock) -> None:
        """Average the parts whose reducer was lost in a short follow-up round among the survivors.

        Every survivor that saw the same failures derives the same follow-up group (its id digests the failed
        peers) and the same tensors (views of the lost parts), so no message is needed to agree on it. A survivor
        with a different view of who failed lands in another follow-up group and keeps its local values there
        once the join wait expires. The lost parts are 1/N of the vector each, so this costs little."""
        failed = result.crashed_peers  # hard evidence is shared, so the survivors' views agree
        lost = [i for i, part in enumerate(partition.parts)
                if not result.averaged[i] and group.members[part.owner].peer_id in failed]
        survivors = [m for m in group.members if m.peer_id not in failed]
        if not lost or len(survivors) < 2 or not any(m.reduces for m in survivors):
            return
        if trio.current_time() >= deadline:
            return
        digest = hashlib.blake2b(group.group_id + b"|retry|" + b"".join(sorted(failed)), digest_size=16)
        retry_group = GroupInfo.create(digest.digest(), survivors)
        views = [segment_view(tensors, s) for i in lost for s in partition.parts[i].segments]
        retry, _ = await self._run_once(retry_group, views, weight, compression, deadline, lock)
        result.finished = result.finished and retry.finished
        result.failed_peers |= retry.failed_peers
        result.crashed_peers |= retry.crashed_peers
        if retry.fully_averaged:
            contributors = sorted({p for c in retry.contributors for p in c})
            for i in lost:
                result.averaged[i] = True
                result.contributors[i] = list(contributors)
        result.bytes_sent += retry.bytes_sent
        result.bytes_received += retry.bytes_received

    async def _run_once(self, group: GroupInfo, tensors: list[torch.Tensor], weight: float,
                        compression: wire.Compression, deadline: float, lock: TensorLock
                        ) -> tuple[AllReduceResult, Partition]:
        me = group.index_of(self.rpc.peer_id)
        bandwidths = [m.bandwidth if m.reduces else 0.0 for m in group.members]
        partition = Partition.for_tensors(tensors, bandwidths, chunk_bytes=self.config.chunk_bytes)
        round_ = _Round(self, group, partition, me, tensors, weight, compression, lock)
        round_.deadline = deadline

        self._rounds[group.group_id] = round_
        waiting = self._waiting.get(group.group_id)
        if waiting is not None:
            waiting[0].set()
        try:
            with trio.move_on_at(deadline) as scope:
                await self._run_round(round_)
            finished = not scope.cancelled_caught
        finally:
            round_.close()
            del self._rounds[group.group_id]
            self._finished[group.group_id] = None
            while len(self._finished) > self.config.remembered_rounds:
                self._finished.popitem(last=False)

        members = group.members
        result = AllReduceResult(
            group_id=group.group_id,
            averaged=list(round_.averaged),
            part_owners=[members[p.owner].peer_id for p in partition.parts],
            contributors=[[members[i].peer_id for i in c] for c in round_.contributors],
            failed_peers={members[i].peer_id for i in round_.failed},
            crashed_peers={members[i].peer_id for i in round_.crashed},
            finished=finished,
            elapsed=trio.current_time() - round_.started_at,
            bytes_sent=round_.bytes_sent,
            bytes_received=round_.bytes_received,
        )
        return result, partition

    async def _run_round(self, round_: _Round) -> None:
        others = [part for part in round_.partition.parts if part.owner != round_.me]
        async with trio.open_nursery() as watches:
            for part in others:
                watches.start_soon(self._watch, round_, part)
            async with trio.open_nursery() as nursery:
                for part in others:
                    nursery.start_soon(self._exchange, round_, part)
                if round_.reducer is not None:
                    self._feed_own_part(round_)
                    nursery.start_soon(self._reduce_own_part, round_)
                round_.maybe_commit()
            watches.cancel_scope.cancel()

    async def _watch(self, round_: _Round, part: Part) -> None:
        """Keep a call open to the reducer until we are done with it (crash detection both ways; ending it tells
        the reducer we have everything we need from it)."""
        scope = round_.watch_scopes.setdefault(part.owner, trio.CancelScope())
        with scope:
            await self._watch_call(round_, part)

    async def _watch_call(self, round_: _Round, part: Part) -> None:
        try:
            await self._call(round_, part, WATCH, {}, timeout=max(0.0, round_.deadline - trio.current_time()))
        except RPCError as error:
            if part.owner not in round_.done_with:
                round_.note_failed(part.owner, crashed=_is_hard(error), reason=f"watch: {error}")

    def _feed_own_part(self, round_: _Round) -> None:
        reducer = round_.reducer
        assert reducer is not None and round_.own_part is not None
        now = trio.current_time()
        if reducer.n_chunks == 0:
            return
        if round_.weight == 0:
            reducer.receive(round_.me, NOTHING, 0.0, [], now=now)
            return
        for index, chunk in enumerate(round_.own_part.chunks):
            reducer.receive(round_.me, index, round_.weight, chunk_views(round_.tensors, chunk), now=now)

    # ---------------------------------------------------------------------------------- own part (reducer)

    async def _reduce_own_part(self, round_: _Round) -> None:
        reducer = round_.reducer
        assert reducer is not None and round_.own_part is not None
        config = self.config
        await self._wait_for(round_, lambda: reducer.data_complete)
        round_.hook("reducing", part=round_.own_part.index)
        await trio.lowlevel.checkpoint()
        round_.reducing_started = True
        round_.maybe_commit()
        await self._wait_for(round_, lambda: reducer.ready)
        result = reducer.finalize()
        round_.hook("reduced", part=round_.own_part.index, contributors=list(reducer.contributors))
        round_.released.set()
        round_.notify()
        index = round_.own_part.index
        round_.contributors[index] = list(reducer.contributors)
        if result is not None:
            async with hold(round_.lock):
                for chunk, values in zip(round_.own_part.chunks, result):
                    for view, value in zip(chunk_views(round_.tensors, chunk), values):
                        view.copy_(value)
            round_.averaged[index] = True
            await self._serve_pulls(round_)

    async def _wait_for(self, round_: _Round, condition: Callable[[], bool]) -> None:
        """Wait until `condition()` holds, excluding members that miss their (adaptive) deadlines."""
        reducer = round_.reducer
        assert reducer is not None
        config = self.config
        while not condition():
            # every sender still sending shares our inbound link, each with a few chunks in flight; a sender
            # that is done with us may wait for its pushes to everyone else (as many chunks in flight each)
            chunk = reducer.max_chunk_bytes * config.pushes_in_flight
            chunk_time = round_.chunk_timeout(chunk * max(1, len(reducer.missing())))
            commit_grace = round_.chunk_timeout(chunk * round_.group.size)
            deadlines = reducer.deadlines(chunk_time, commit_grace, floor=config.timeout_floor,
                                          slack=config.straggler_slack, join_wait=config.join_wait)
            deadlines.pop(round_.me, None)  # our own commit waits only for our pushes, which have deadlines
            now = trio.current_time()
            overdue = [member for member, due in deadlines.items() if due <= now]
            if overdue:
                for member in overdue:
                    round_.note_failed(member, reason="missed its deadline")
                continue
            await round_.wait_changed(min(deadlines.values(), default=math.inf))

    async def _serve_pulls(self, round_: _Round) -> None:
        """Stay in the round until every committed member has its copy of our mean, or left, or missed its
        deadline. A member is done when it pulled every chunk AND ended its watch call: a pull handler returns
        before its reply has crossed the network, so leaving at that point could cut the last reply off."""
        reducer = round_.reducer
        assert reducer is not None
        released_at = trio.current_time()
        while True:
            waiting = [m for m in reducer.committed
                       if m != round_.me and m not in round_.failed and m not in round_.gone
                       and (m in round_.watching or len(round_.pulled.get(m, ())) < reducer.n_chunks)]
            if not waiting:
                return
            timeout = round_.chunk_timeout(reducer.max_chunk_bytes * len(waiting) * self.config.pulls_in_flight)
            deadlines = {m: round_.last_pull.get(m, released_at) + timeout for m in waiting}
            now = trio.current_time()
            late = [m for m, due in deadlines.items() if due <= now]
            if late:
                round_.gone.update(late)
                continue
            await round_.wait_changed(min(deadlines.values()))

    # ---------------------------------------------------------------------------------- other parts

    async def _exchange(self, round_: _Round, part: Part) -> None:
        """Push our slice of `part` to its reducer, commit, pull the mean back and write it into our tensors."""
        owner = round_.group.members[part.owner]
        try:
            try:
                await self._push_part(round_, part)
            except SenderExcluded:
                round_.excluded_by.add(part.owner)  # it dropped us; it is not at fault, we keep our values
            except RPCError as error:
                round_.note_failed(part.owner, crashed=_is_hard(error), reason=f"push: {error}")
            finally:
                round_.pushes_left -= 1
                round_.notify()
            await round_.committed.wait()
            if part.owner in round_.failed or part.owner in round_.excluded_by:
                return
            reply = await self._call(round_, part, FINISH, {
                "weight": round_.weight, "suspects": sorted(round_.crashed)},
                timeout=max(0.0, round_.deadline - trio.current_time()))
            if not isinstance(reply, dict):
                raise BadChunk("malformed finish reply")
            for member in reply.get("failed") or []:
                if isinstance(member, int) and 0 <= member < round_.group.size and member != part.owner:
                    round_.note_failed(member, crashed=True, reason="reported by a reducer")
            if not reply.get("averaged"):
                return
            values = await self._pull_part(round_, part)
            async with hold(round_.lock):
                for chunk, chunk_values in zip(part.chunks, values):
                    for view, value in zip(chunk_views(round_.tensors, chunk), chunk_values):
                        view.copy_(value.reshape(-1))
            round_.averaged[part.index] = True
            contributors = reply.get("contributors") or []
            round_.contributors[part.index] = [c for c in contributors if isinstance(c, int)]
            round_.hook("part_received", part=part.index, reducer=owner.peer_id)
        except SenderExcluded:
            round_.excluded_by.add(part.owner)
        except RPCError as error:
            round_.note_failed(part.owner, crashed=_is_hard(error),
                               reason=f"{error}")
        finally:
            round_.done_with.add(part.owner)
            round_.watch_scopes.setdefault(part.owner, trio.CancelScope()).cancel()

    async def _push_part(self, round_: _Round, part: Part) -> None:
        if not part.chunks:
            return
        if round_.weight == 0:
            await self._call(round_, part, PUSH, {"chunk": NOTHING, "weight": 0.0, "data": []}, nbytes=0,
                             first_contact=True)
            return
        pending = iter(range(len(part.chunks)))
        acknowledged = False

        async def worker() -> None:
            nonlocal acknowledged
            for index in pending:
                chunk = part.chunks[index]
                views = chunk_views(round_.tensors, chunk)
                data = views if round_.compression == wire.Compression.NONE else [
                    wire.compressed(v, round_.compression) for v in views]
                nbytes = round_.partition.chunk_bytes_of(chunk)
                await self._call(round_, part, PUSH, {"chunk": index, "weight": round_.weight, "data": data},
                                 nbytes=nbytes, first_contact=not acknowledged)
                acknowledged = True
                round_.bytes_sent += nbytes
                round_.hook("chunk_pushed", part=part.index, chunk=index)

        await run_workers(min(self.config.pushes_in_flight, len(part.chunks)), worker)

    async def _pull_part(self, round_: _Round, part: Part) -> list[list[torch.Tensor]]:
        values: list[list[torch.Tensor] | None] = [None] * len(part.chunks)
        pending = iter(range(len(part.chunks)))

        async def worker() -> None:
            for index in pending:
                chunk = part.chunks[index]
                nbytes = round_.partition.chunk_bytes_of(chunk)
                reply = await self._call(round_, part, PULL, {
                    "chunk": index, "compression": int(round_.compression)}, nbytes=nbytes)
                if not isinstance(reply, list) or len(reply) != len(chunk) or not all(
                        isinstance(t, torch.Tensor) and t.numel() == s.numel for t, s in zip(reply, chunk)):
                    raise BadChunk(f"malformed averaged chunk {index}")
                values[index] = reply
                round_.bytes_received += nbytes

        await run_workers(min(self.config.pulls_in_flight, len(part.chunks)), worker)
        return values  # type: ignore[return-value]

    async def _call(self, round_: _Round, part: Part, method: str, args: dict, *, nbytes: int = 0,
                    timeout: float | None = None, first_contact: bool = False) -> Any:
        """One call to the reducer of `part`. Without an explicit `timeout`, the deadline follows the measured
        rate; `first_contact` adds `join_wait` (the reducer may not have started the round yet: its handler waits
        for it) and keeps that call's duration out of the rate estimate."""
        owner = round_.group.members[part.owner]
        assert owner.address is not None
        message = {"group": round_.group.group_id, "fp": round_.partition.fingerprint, "part": part.index, **args}
        if timeout is not None:
            return await self.rpc.call(owner.address, method, message, timeout=timeout, peer_id=owner.peer_id)
        # A transfer shares our link with every other transfer in flight in the same direction: its deadline
        # covers all the bytes queued with it, and its duration measures the rate for that whole backlog.
        direction = "in" if method == PULL else "out"
        backlog = self._in_flight[direction] + nbytes
        self._in_flight[direction] += nbytes
        started = trio.current_time()
        timeout = round_.chunk_timeout(backlog) + (self.config.join_wait if first_contact else 0.0)
        try:
            result = await self.rpc.call(owner.address, method, message, timeout=timeout, peer_id=owner.peer_id)
        finally:
            self._in_flight[direction] -= nbytes
        if nbytes and not first_contact:
            self.estimator.observe(backlog, trio.current_time() - started)
        return result


def _is_hard(error: RPCError) -> bool:
    """Hard evidence that a member is out of the round: its connection was refused or lost, or it says it does
    not run (or no longer runs) the round. A timeout or a rejected message is not: we may be the slow side."""
    return isinstance(error, (ConnectionFailed, RoundNotFound))


async def run_workers(count: int, worker: Callable[[], Any],
                      errors: tuple[type[BaseException], ...] = (RPCError,)) -> None:
    """Run `count` copies of `worker`; the first error of the `errors` types stops the others and is raised as
    itself (not wrapped in an exception group), so callers can tell a failed peer from anything else."""
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(worker)
    except BaseExceptionGroup as group:
        matched, _ = group.split(errors)
        if matched is None:
            raise
        error = matched
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        raise error from None


def _compression_arg(value: Any) -> wire.Compression:
    try:
        return wire.Compression(value if value is not None else 0)
    except (ValueError, TypeError):
        raise BadChunk(f"unknown compression {value!r}") from None


def _check_tensors(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        raise GroupMismatch("nothing to average: no tensors", operation="allreduce")
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise GroupMismatch(f"tensor {index} is not a floating-point tensor", operation="allreduce")
        if not tensor.is_contiguous():
            raise GroupMismatch(f"tensor {index} is not contiguous (its views would not write through)",
                                operation="allreduce")


# ------------------------------------------------------------------------------------------------ entry points

_SERVERS: "weakref.WeakKeyDictionary[RPCNode, AllReduceServer]" = weakref.WeakKeyDictionary()


def install_allreduce(rpc: RPCNode, *, config: AllReduceConfig | None = None, hook: Hook | None = None
                      ) -> AllReduceServer:
    """Register the `averaging.allreduce.*` handlers on `rpc` (the averager does this once per peer)."""
    return AllReduceServer(rpc, config=config, hook=hook).install()


async def run_allreduce(
    rpc: RPCNode,
    group: GroupInfo,
    tensors: Sequence[torch.Tensor],
    *,
    weight: float = 1.0,
    compression: wire.Compression = wire.Compression.NONE,
    timeout: float = 60.0,
    lock: TensorLock = None,
) -> AllReduceResult:
    """Average `tensors` in place with the other members of `group` (each running the same call).

    Every member must pass tensors of the same shapes and dtypes in the same order. `weight` is this member's
    weight in the mean (0 = receive only). `compression` applies to everything this member sends and pulls.
    `lock` guards the writes of averaged values (see `averaging.locking`). Returns what was averaged and who
    failed; raises GroupMismatch when the call itself is wrong (not a member, no reducer, bad tensors).
    The `averaging.allreduce.*` handlers must be installed on `rpc` first (`install_allreduce`).
    """
    server = _SERVERS.get(rpc)
    if server is None:
        raise RuntimeError("install_allreduce(rpc) first: this RPCNode has no all-reduce handlers")
    return await server.run(group, tensors, weight=weight, compression=compression, timeout=timeout, lock=lock)
