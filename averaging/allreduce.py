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

Every decision above lives in `averaging.allreduce_core` (plain objects: no trio, no sockets, no clock; times are
passed in as numbers): `PartReducer` for the part a member reduces, `RoundCore` for the rest of its round (the
state of each part it pushes, its commit, the failures it knows of, the deadlines). This module is only the trio
driver: it moves bytes over `peer.p2p.rpc`, writes averaged values under the lock, waits where the core says and
turns the core's verdicts into wire errors. The split keeps the protocol testable message by message
(tests/averaging/test_sender_core.py) and leaves the driver nothing to decide.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypedDict, Unpack

import torch
import trio

from averaging.allreduce_core import (
    NOTHING,
    AllReduceConfig,
    AllReduceResult,
    ChunkRejected,
    Excluded,
    RoundCore,
    ThroughputEstimator,
    TransferBudget,
    merge_retry,
    plan_retry,
    retry_views,
)
from averaging.errors import (
    BadChunk,
    GroupMismatch,
    RemoteViolation,
    RoundNotFound,
    SenderExcluded,
)
from averaging.group import GroupInfo
from averaging.locking import TensorLock, check_lock, hold
from averaging.partition import Part, Partition, chunk_views
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.rpc import CallContext, ConnectionFailed, RPCError, RPCNode

__all__ = ["AllReduceServer", "install_allreduce", "run_allreduce", "run_workers"]

logger = logging.getLogger(__name__)

PUSH = "averaging.allreduce.push"
FINISH = "averaging.allreduce.finish"
PULL = "averaging.allreduce.pull"
WATCH = "averaging.allreduce.watch"
CHECK_PUSH = "averaging.allreduce.check_push"  # a slice of a part, to the member that cross-reduces it
VERDICT = "averaging.allreduce.verdict"  # a member asks a part's checker whether the reducer's part matched

Hook = Callable[[str, dict[str, Any]], None]

# a failed call to a reducer: the RPC layer's errors, or an answer that breaks the protocol
_PEER_ERRORS = (RPCError, RemoteViolation)


# ------------------------------------------------------------------------------------------------ trio driver


class _Round:
    """One member's round in progress: the core, plus the trio side of it (the events its tasks wait on, the
    watch calls' cancel scopes, the lock and the hook)."""

    def __init__(self, server: AllReduceServer, group: GroupInfo, partition: Partition, me: int,
                 tensors: list[torch.Tensor], weight: float, compression: wire.Compression, lock: TensorLock,
                 deadline: float):
        self.server = server
        self.core = RoundCore(group, partition, me, tensors, weight, budget=server.budget,
                              now=trio.current_time(), deadline=deadline)
        self.group = group
        self.partition = partition
        self.tensors = tensors
        self.compression = compression
        self.lock = lock
        self.committed = trio.Event()
        self.released = trio.Event()
        self.closed = trio.Event()
        self.watch_scopes: dict[int, trio.CancelScope] = {}
        self._changed = trio.Event()

    def update(self) -> None:
        """After every call into the core: pass its events to the hook and the log, mirror its flags into the
        events the tasks wait on, and wake the tasks waiting for any change."""
        core = self.core
        for name, info in core.take_events():
            if name == "member_failed":
                logger.info("all-reduce %s: member %s failed (%s)", self.group.group_id.hex()[:12],
                            info["member"].short(), info["reason"])
            self.hook(name, **info)
        if core.committed:
            self.committed.set()
        if core.released:
            self.released.set()
        if core.closed:
            self.closed.set()
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self, deadline: float) -> None:
        event = self._changed
        with trio.move_on_at(deadline):
            await event.wait()

    def hook(self, name: str, **info: Any) -> None:
        if self.server.hook is not None:
            self.server.hook(name, {"peer": self.server.rpc.peer_id, "group_id": self.group.group_id, **info})

    def close(self) -> None:
        self.core.close()
        self.update()


@contextlib.contextmanager
def _answering(round_: _Round) -> Iterator[None]:
    """What a handler tells the sender of a message its round's core refused (the typed error the caller
    raises), and the round updated whatever happened: the push and the commit handlers answer alike."""
    try:
        yield
    except Excluded:
        raise SenderExcluded("you are counted as failed in this round") from None
    except RemoteViolation as error:
        raise BadChunk(str(error)) from None
    finally:
        round_.update()


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
        self.budget = TransferBudget(self.config, self.estimator)
        self._rounds: dict[bytes, _Round] = {}
        self._waiting: dict[bytes, list[Any]] = {}  # group id -> [Event, number of waiters]
        self._finished: OrderedDict[bytes, None] = OrderedDict()
        # (group id, part) -> the verdict of our cross-reduction, kept a while after our round ended: members
        # ask for it after pulling the part, possibly after we left
        self._verdicts: OrderedDict[tuple[bytes, int], _Verdict] = OrderedDict()
        self._installed = False

    # ------------------------------------------------------------------------------------------ install

    def install(self) -> AllReduceServer:
        if _SERVERS.get(self.rpc) is not None:
            raise RuntimeError("an AllReduceServer is already installed on this RPCNode")
        self.rpc.register(PUSH, self._on_push)
        self.rpc.register(FINISH, self._on_finish)
        self.rpc.register(PULL, self._on_pull)
        self.rpc.register(WATCH, self._on_watch)
        self.rpc.register(CHECK_PUSH, self._on_check_push)
        self.rpc.register(VERDICT, self._on_verdict)
        _SERVERS[self.rpc] = self
        self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            for name in (PUSH, FINISH, PULL, WATCH, CHECK_PUSH, VERDICT):
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

    async def _on_push(self, context: CallContext, args: Any) -> None:
        round_, sender = await self._lookup(context, args)
        with _answering(round_):
            data = args.get("data") or []
            round_.core.receive_push(sender, args.get("part"), args.get("chunk"), args.get("weight"), data,
                                     trio.current_time(), wire_nbytes=_wire_nbytes(data, round_.compression))

    async def _on_check_push(self, context: CallContext, args: Any) -> None:
        round_, sender = await self._lookup(context, args)
        try:
            data = args.get("data") or []
            round_.core.receive_check_push(sender, args.get("part"), args.get("chunk"), args.get("weight"), data,
                                           trio.current_time())
        except ChunkRejected as error:
            raise BadChunk(str(error)) from None
        finally:
            round_.update()

    async def _on_verdict(self, context: CallContext, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict) or not isinstance(args.get("group"), bytes):
            raise BadChunk("malformed verdict request")
        entry = self._verdicts.get((args["group"], args.get("part")))  # type: ignore[arg-type]
        if entry is None:
            raise RoundNotFound("not cross-reducing that part")
        if context.peer_id not in entry.members:
            raise BadChunk("the caller is not a member of this group")
        await entry.event.wait()  # set when the check is decided, at the latest when our round ends
        return {"verdict": entry.verdict, "norm": entry.norm}

    async def _on_finish(self, context: CallContext, args: Any) -> dict[str, Any]:
        round_, sender = await self._lookup(context, args)
        with _answering(round_):
            round_.core.receive_commit(sender, args.get("part"), args.get("weight", 0.0), args.get("suspects"))
        try:
            await round_.released.wait()
        except trio.Cancelled:
            round_.core.commit_abandoned(sender)
            round_.update()
            raise
        answer = round_.core.finish_answer()
        if answer is None:
            raise RoundNotFound("the reducer left the round before reducing")
        return answer

    async def _on_pull(self, context: CallContext, args: Any) -> list[Any]:
        round_, member = await self._lookup(context, args)
        compression = _compression_arg(args.get("compression"))
        try:
            tensors = round_.core.serve_pull(member, args.get("part"), args.get("chunk"), trio.current_time())
        except RemoteViolation as error:
            raise BadChunk(str(error)) from None
        finally:
            round_.update()
        reply: list[Any] = tensors if compression == wire.Compression.NONE else [
            wire.compressed(t, compression) for t in tensors]
        round_.core.chunk_served(_wire_nbytes(reply, compression))
        return reply

    async def _on_watch(self, context: CallContext, args: Any) -> None:
        """Held open by each member for the whole round: if the member vanishes, the cancelled handler says so at
        once (and the member's failing call tells it that we vanished), so crashes cost no timeout."""
        round_, member = await self._lookup(context, args)
        try:
            round_.core.watch_started(member, args.get("part"), trio.current_time())
        except RemoteViolation as error:
            raise BadChunk(str(error)) from None
        finally:
            round_.update()
        cancelled = False
        try:
            await round_.closed.wait()
            if round_.core.aborted:
                raise RoundNotFound("left the round before reducing")  # cancelled or timed out here
        except trio.Cancelled:
            cancelled = True
            raise
        finally:
            round_.core.watch_ended(member, cancelled=cancelled)
            round_.update()

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
        compression = wire.Compression(compression)
        result, partition = await self._run_once(group, tensors, float(weight), compression, deadline, lock)
        if self.config.retry_lost_parts:
            # the parts of lost reducers, averaged again among the survivors (see plan_retry); cheap: 1/N each
            retry = plan_retry(result, partition, group, now=trio.current_time(), deadline=deadline)
            if retry is not None:
                retry_group, lost = retry
                retried, _ = await self._run_once(retry_group, retry_views(tensors, partition, lost),
                                                  float(weight), compression, deadline, lock)
                merge_retry(result, lost, retried)
        result.elapsed = trio.current_time() - (deadline - timeout)
        return result

    async def _run_once(self, group: GroupInfo, tensors: list[torch.Tensor], weight: float,
                        compression: wire.Compression, deadline: float, lock: TensorLock
                        ) -> tuple[AllReduceResult, Partition]:
        me = group.index_of(self.rpc.peer_id)
        bandwidths = [m.bandwidth if m.reduces else 0.0 for m in group.members]
        partition = Partition.for_tensors(tensors, bandwidths, chunk_bytes=self.config.chunk_bytes)
        round_ = _Round(self, group, partition, me, tensors, weight, compression, lock, deadline)
        if compression != wire.Compression.NONE:
            # a lossy codec: the reducer's own slice is exact and everyone else's decoded, so a checker cannot
            # reproduce the part bit for bit within CHECK_RTOL; only the plausibility check runs (docs/integrity.md)
            round_.core.checkers.clear()
            round_.core.checks.clear()
        for index in round_.core.checks:
            self._verdicts[(group.group_id, index)] = _Verdict(set(group.peer_ids))
        while len(self._verdicts) > self.config.remembered_rounds:
            self._verdicts.popitem(last=False)[1].event.set()

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
            for index in round_.core.checks:
                entry = self._verdicts.get((group.group_id, index))
                if entry is not None:
                    entry.event.set()  # undecided: inconclusive
            del self._rounds[group.group_id]
            self._finished[group.group_id] = None
            while len(self._finished) > self.config.remembered_rounds:
                self._finished.popitem(last=False)
        return round_.core.result(finished=finished, now=trio.current_time()), partition

    async def _run_round(self, round_: _Round) -> None:
        core = round_.core
        others = [part for part in round_.partition.parts if part.owner != core.me]
        async with trio.open_nursery() as watches:
            for part in others:
                watches.start_soon(self._watch, round_, part)
            async with trio.open_nursery() as nursery:
                for part in others:
                    nursery.start_soon(self._exchange, round_, part)
                if core.reducer is not None:
                    core.feed_own_part(trio.current_time())
                    nursery.start_soon(self._reduce_own_part, round_)
                core.feed_checks(trio.current_time())
                for index, checker in core.checkers.items():
                    if checker != core.me:
                        nursery.start_soon(self._push_check, round_, round_.partition.parts[index], checker)
                core.advance()
                round_.update()
            watches.cancel_scope.cancel()

    async def _watch(self, round_: _Round, part: Part) -> None:
        """Keep a call open to the reducer until we are done with it (crash detection both ways; ending it tells
        the reducer we have everything we need from it)."""
        scope = round_.watch_scopes.setdefault(part.owner, trio.CancelScope())
        with scope:
            try:
                await self._call(round_, part, WATCH, {}, timeout=round_.core.time_left(trio.current_time()))
            except RPCError as error:
                round_.core.watch_failed(part.index, crashed=_is_hard(error), reason=f"watch: {error}")
                round_.update()

    # ---------------------------------------------------------------------------------- own part (reducer)

    async def _reduce_own_part(self, round_: _Round) -> None:
        core = round_.core
        reducer = core.reducer
        assert reducer is not None and core.own_part is not None
        await self._wait_for(round_, lambda: reducer.data_complete)
        core.announce_reducing()
        round_.update()
        await trio.lowlevel.checkpoint()
        core.start_reducing()
        round_.update()
        await self._wait_for(round_, lambda: reducer.ready)
        result = core.finalize_own()
        round_.update()
        if result is not None:
            lossy = round_.compression != wire.Compression.NONE
            async with hold(round_.lock):
                for chunk, values in zip(core.own_part.chunks, result):
                    for view, value in zip(chunk_views(round_.tensors, chunk), values):
                        # with a lossy codec the others get the decoded mean: hold exactly what they hold
                        view.copy_(wire.roundtrip(value, round_.compression) if lossy else value)
            core.own_part_written(trio.current_time())
            await self._serve_pulls(round_)

    async def _wait_for(self, round_: _Round, condition: Callable[[], bool]) -> None:
        """Wait until `condition()` holds, excluding members that miss their deadlines (the core keeps them)."""
        while not condition():
            expired, wake = round_.core.expire_senders(trio.current_time())
            round_.update()
            if not expired:
                await round_.wait_changed(wake)

    async def _serve_pulls(self, round_: _Round) -> None:
        """Stay in the round until every committed member has its copy of our mean (see RoundCore.pull_service)."""
        while (wake := round_.core.pull_service(trio.current_time())) is not None:
            await round_.wait_changed(wake)

    # ---------------------------------------------------------------------------------- other parts

    async def _exchange(self, round_: _Round, part: Part) -> None:
        """Push our slice of `part` to its reducer, commit, pull the mean back and write it into our tensors."""
        core = round_.core
        try:
            try:
                await self._push_part(round_, part)
            except SenderExcluded:
                core.excluded(part.index)  # it dropped us; it is not at fault, we keep our values
            except _PEER_ERRORS as error:
                core.reducer_failed(part.index, crashed=_is_hard(error), reason=f"push: {error}")
            else:
                core.push_done(part.index)
            round_.update()
            await round_.committed.wait()
            request = core.finish_request(part.index)
            if request is None:
                return
            reply = await self._call(round_, part, FINISH, request, timeout=core.time_left(trio.current_time()))
            pull = core.finish_reply(part.index, reply)
            round_.update()
            if not pull:
                return
            values = await self._pull_part(round_, part)
            if not core.check_reduced(part.index, values):
                return
            if not await self._cross_checked(round_, part, values):
                return
            async with hold(round_.lock):
                for chunk, chunk_values in zip(part.chunks, values):
                    for view, value in zip(chunk_views(round_.tensors, chunk), chunk_values):
                        view.copy_(value.reshape(-1))
            core.part_averaged(part.index)
        except SenderExcluded:
            core.excluded(part.index)
        except _PEER_ERRORS as error:
            core.reducer_failed(part.index, crashed=_is_hard(error), reason=f"{error}")
        finally:
            core.exchange_over(part.index)
            round_.update()
            round_.watch_scopes.setdefault(part.owner, trio.CancelScope()).cancel()

    async def _cross_checked(self, round_: _Round, part: Part, values: list[list[torch.Tensor]]) -> bool:
        """Whether the part pulled from its reducer may be written: not checked this round, or the checker (we,
        or the member `checker_of` drew) found it matches, or could not tell. False: the reducer lied."""
        core = round_.core
        checker = core.checkers.get(part.index)
        if checker is None:
            return True
        if checker == core.me:
            give_up = min(core.deadline, trio.current_time() + self.config.join_wait + self.budget.chunk_timeout(
                round_.partition.part_bytes(part) * round_.group.size))
            while not core.check_ready(part.index) and trio.current_time() < give_up:
                await round_.wait_changed(give_up)
            verdict = core.cross_check(part.index, values)
            round_.update()
            entry = self._verdicts.get((round_.group.group_id, part.index))
            if entry is not None:
                entry.verdict = verdict
                entry.norm = float(sum(float(v.double().pow(2).sum()) for c in values for v in c) ** 0.5)
                entry.event.set()
            return verdict is not False
        member = round_.group.members[checker]
        assert member.address is not None
        message = {"group": round_.group.group_id, "part": part.index}
        try:
            answer = await self.rpc.call(member.address, VERDICT, message, peer_id=member.peer_id,
                                         timeout=max(0.0, core.time_left(trio.current_time())))
        except RPCError as error:
            logger.info("all-reduce %s: no verdict from checker %s on part %d: %s",
                        round_.group.group_id.hex()[:12], member.peer_id.short(), part.index, error)
            return True  # the checker is gone or slow: as if the part were not checked this round
        ok = core.peer_verdict(part.index, answer, values)
        round_.update()
        return ok

    async def _push_check(self, round_: _Round, part: Part, checker: int) -> None:
        """Our slice of `part` to the member that cross-reduces it. Best effort: a failure only leaves that check
        inconclusive, it fails nothing in the round."""
        core = round_.core
        member = round_.group.members[checker]
        assert member.address is not None
        base = {"group": round_.group.group_id, "fp": round_.partition.fingerprint, "part": part.index}
        try:
            if core.weight == 0:
                await self.rpc.call(member.address, CHECK_PUSH, {**base, "chunk": NOTHING, "weight": 0.0,
                                                                 "data": []},
                                    timeout=self.budget.chunk_timeout(0) + self.config.join_wait,
                                    peer_id=member.peer_id)
                return
            for index, chunk in enumerate(part.chunks):
                views = chunk_views(round_.tensors, chunk)
                data = views if round_.compression == wire.Compression.NONE else [
                    wire.compressed(v, round_.compression) for v in views]
                timeout = self.budget.chunk_timeout(round_.partition.chunk_bytes_of(chunk)) \
                    + (self.config.join_wait if index == 0 else 0.0)
                await self.rpc.call(member.address, CHECK_PUSH, {**base, "chunk": index, "weight": core.weight,
                                                                 "data": data},
                                    timeout=min(timeout, core.time_left(trio.current_time())),
                                    peer_id=member.peer_id)
        except _PEER_ERRORS as error:
            logger.info("all-reduce %s: cross-check push to %s failed: %s", round_.group.group_id.hex()[:12],
                        member.peer_id.short(), error)

    async def _push_part(self, round_: _Round, part: Part) -> None:
        if not part.chunks:
            return
        core = round_.core
        if core.weight == 0:
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
                await self._call(round_, part, PUSH, {"chunk": index, "weight": core.weight, "data": data},
                                 nbytes=nbytes, first_contact=not acknowledged)
                acknowledged = True
                core.chunk_pushed(part.index, index, _wire_nbytes(data, round_.compression))
                round_.update()

        await run_workers(min(self.config.pushes_in_flight, len(part.chunks)), worker)

    async def _pull_part(self, round_: _Round, part: Part) -> list[list[torch.Tensor]]:
        values: list[list[torch.Tensor] | None] = [None] * len(part.chunks)
        pending = iter(range(len(part.chunks)))
        core = round_.core

        async def worker() -> None:
            for index in pending:
                nbytes = round_.partition.chunk_bytes_of(part.chunks[index])
                reply = await self._call(round_, part, PULL, {
                    "chunk": index, "compression": int(round_.compression)}, nbytes=nbytes)
                pulled = core.check_pulled_chunk(part.index, index, reply)
                values[index] = pulled
                core.chunk_pulled(_wire_nbytes(pulled, round_.compression))

        await run_workers(min(self.config.pulls_in_flight, len(part.chunks)), worker, errors=_PEER_ERRORS)
        return values  # type: ignore[return-value]  # run_workers returned, so every chunk was pulled

    async def _call(self, round_: _Round, part: Part, method: str, args: dict[str, Any], *, nbytes: int = 0,
                    timeout: float | None = None, first_contact: bool = False) -> Any:
        """One call to the reducer of `part`. Without an explicit `timeout`, the deadline follows the measured
        rate and the bytes queued on the link (`TransferBudget`)."""
        owner = round_.group.members[part.owner]
        assert owner.address is not None
        message = {"group": round_.group.group_id, "fp": round_.partition.fingerprint, "part": part.index, **args}
        if timeout is not None:
            return await self.rpc.call(owner.address, method, message, timeout=timeout, peer_id=owner.peer_id)
        direction = "in" if method == PULL else "out"
        backlog, timeout = self.budget.begin(direction, nbytes, first_contact=first_contact)
        started = trio.current_time()
        seconds = None
        try:
            result = await self.rpc.call(owner.address, method, message, timeout=timeout, peer_id=owner.peer_id)
            seconds = trio.current_time() - started
        finally:
            self.budget.end(direction, nbytes, backlog, seconds, first_contact=first_contact)
        return result


class _Verdict:
    """The outcome of a cross-reduction we run, for the members that ask (`VERDICT`)."""

    def __init__(self, members: set[PeerID]):
        self.members = members
        self.event = trio.Event()
        self.verdict: bool | None = None
        self.norm: float | None = None


def _is_hard(error: Exception) -> bool:
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
        error: BaseException = matched
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        raise error from None


def _wire_nbytes(tensors: Sequence[Any], compression: wire.Compression) -> int:
    """The tensor data bytes `tensors` take in a message, as the codec encodes them with `compression`
    (`wire.data_nbytes`: from shapes and dtypes, no encoding): what the traffic counts add, not the tensors'
    nominal sizes. A received tensor was decoded from that encoding and the codecs keep sizes, so the receiver
    counts what the sender sent. Anything but tensors (a hostile chunk) counts 0."""
    if not isinstance(tensors, (list, tuple)) or not all(
            isinstance(t, (torch.Tensor, wire.Compressed)) for t in tensors):
        return 0
    return sum(wire.data_nbytes(t, compression) for t in tensors)


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

_SERVERS: weakref.WeakKeyDictionary[RPCNode, AllReduceServer] = weakref.WeakKeyDictionary()


def install_allreduce(rpc: RPCNode, *, config: AllReduceConfig | None = None, hook: Hook | None = None
                      ) -> AllReduceServer:
    """Register the `averaging.allreduce.*` handlers on `rpc` (the averager does this once per peer)."""
    return AllReduceServer(rpc, config=config, hook=hook).install()


class RoundOptions(TypedDict, total=False):
    """The keywords `run_allreduce` passes on to `AllReduceServer.run` (defaults there): one list, so that the
    entry point and the method cannot drift apart."""

    weight: float
    compression: wire.Compression
    timeout: float
    lock: TensorLock


async def run_allreduce(rpc: RPCNode, group: GroupInfo, tensors: Sequence[torch.Tensor],
                        **options: Unpack[RoundOptions]) -> AllReduceResult:
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
    return await server.run(group, tensors, **options)
