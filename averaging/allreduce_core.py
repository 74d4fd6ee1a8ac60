"""Sans-I/O core of the butterfly all-reduce; the protocol itself is described in `averaging.allreduce`.

Why a module of its own: the protocol's decisions (which parts to push to whom, when a member may commit, what a
reducer owes whom, whom to stop waiting for and when, what to re-average after a lost reducer) used to live in
the trio driver, tangled with events, cancel scopes and clock reads, so they could only be tested through whole
rounds on a network. Here they are plain objects in the h11 style: messages and times (plain numbers) in,
decisions and events out; no trio, no sockets, no clock. `averaging.allreduce.AllReduceServer` is the driver: it
moves bytes over `peer.p2p.rpc`, copies averaged values under the tensor lock and wakes its tasks whenever the
core changed.

- `PartReducer`: one part on its reducer (chunks in, the weighted mean of the committed senders out).
- `RoundCore`: one member's round. The sender side: the state of every part it pushes (`PartState`: pushing,
  pushed, committed, i.e. owed a mean, pulling, averaged, no mean, excluded, failed), when it may commit, what a
  reducer's answers mean. The round coordination: whom it counts as failed (and which failures are hard
  evidence to share), the deadlines of the senders of its own part and of the pulls it serves, the events for
  the hook, and the round's result.
- `TransferBudget`: the deadline of one transfer from the measured throughput and the bytes queued on the link.
- `averaging.reducer_audit`: whether a reducer's returned part is believed (plausibility, cross-reduction);
  `averaging.pull_ledger`: when serving our part's mean is over. Questions of their own that RoundCore asks.
- `plan_retry` / `merge_retry`: the follow-up round on the parts whose reducer was lost.

Errors: a message from a peer that breaks the protocol raises `ChunkRejected` (a `RemoteViolation`): the
driver counts that peer as failed; a driver that asks the core for something out of turn gets a
`LocalViolation` (a bug here, nobody is blamed).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from averaging import robust
from averaging.errors import AveragingError, LocalViolation, RemoteViolation
from averaging.group import GroupInfo
from averaging.partition import (
    DEFAULT_CHUNK_BYTES,
    Part,
    Partition,
    chunk_views,
    segment_view,
)
from averaging.pull_ledger import PullLedger
from averaging.reducer_audit import CHECK_RTOL as CHECK_RTOL  # re-exported: it was defined here before
from averaging.reducer_audit import checker_disagrees, checker_of, cross_verdict, implausible, reducer_claims
from peer.p2p.identity import PeerID

NOTHING = -1  # chunk index of the one push a zero-weight member sends: "I contribute nothing to this part"

Event = tuple[str, dict[str, Any]]  # (hook name, info): what the driver passes to the hook and logs

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
    anything was measured; retry_lost_parts: re-average the parts of lost reducers among the survivors;
    aggregation: how a reducer combines the parts it receives and what a member believes of the reduced parts it
    pulls back (`averaging.robust`); cross_check_rate: the share of parts a second member reduces as well, to
    catch a lying reducer (`checker_of`; None: `check_rate`'s default)."""

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
    aggregation: robust.Aggregation = field(default_factory=robust.Aggregation)
    cross_check_rate: float | None = None

    @property
    def check_rate(self) -> float:
        """The share of parts cross-reduced by a second member (`checker_of`): `cross_check_rate` if set, else
        0.25 with a robust aggregation (where a lying reducer is the threat it guards against) and 0 with the
        mean."""
        if self.cross_check_rate is not None:
            return min(1.0, max(0.0, float(self.cross_check_rate)))
        return 0.25 if self.aggregation.robust else 0.0


# ------------------------------------------------------------------------------------------------ sans-I/O core


class ChunkRejected(RemoteViolation):
    """A chunk or commit that breaks the protocol (wrong index, size, dtype, weight, duplicate, out of order)."""


class Excluded(AveragingError):
    """The sender is already counted as failed in this round (not a protocol error: it may just be slow)."""


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class PartReducer:
    """The state of one part on its reducer: who sent which chunks with which weight, who committed, who failed,
    and the running weighted sum. No sockets, no clock (times are arguments), no trio.

    Senders are group member indices (the reducer itself is one of them and feeds its own data like anyone
    else). Received chunks are kept until the mean is computed so that a sender that fails before committing can
    be taken out exactly (the sum is recomputed without it), and so that every committed sender's whole part can
    be validated (finite; with a robust aggregation, its norm against the median norm) and, with a robust
    aggregation, combined as whole vectors (`averaging.robust`). `rejected`: the committed senders whose part
    failed validation (left out of the result); `median_norm`: the median norm of the finite parts (0.0 where
    a mean's finite running sum made the part-by-part check unnecessary; only robust aggregations use it).
    """

    def __init__(self, part: Part, group_size: int, dtypes: Sequence[torch.dtype], *, now: float = 0.0,
                 aggregation: robust.Aggregation | None = None):
        self.part = part
        self.aggregation = aggregation or robust.Aggregation()
        self.rejected: list[int] = []
        self.median_norm = 0.0
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

    def feed(self, sender: int, weight: float, tensors: Sequence[torch.Tensor], *, now: float) -> None:
        """A member's own slice of this part, read from its `tensors` without the network (the reducer's own, or a
        checker's): as the chunks (views, nothing is copied until summed), or the NOTHING marker at weight 0."""
        if self.n_chunks == 0:
            return
        if weight == 0:
            self.receive(sender, NOTHING, 0.0, [], now=now)
            return
        for index, chunk in enumerate(self.part.chunks):
            self.receive(sender, index, weight, chunk_views(tensors, chunk), now=now)

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
        """Validate the committed senders' parts and combine the valid ones (`aggregation`): per chunk, one
        tensor per segment; None when no sender with a positive weight and a valid part committed (the part
        keeps the local values)."""
        if not self.ready:
            raise LocalViolation("finalize() before every member committed or failed", operation="allreduce")
        if self.released:
            return self.result
        self.released = True
        senders = sorted(s for s in self.committed if self.weights.get(s, 0.0) > 0)
        # A mean only rejects non-finite parts, and a finite running sum proves every part in it finite (an inf
        # or NaN stays one in a sum), so one pass over the sum replaces a pass over each sender's part. A sum
        # that is not finite (a bad part, or finite parts that overflowed) takes the part-by-part check and is
        # rebuilt from the parts that pass it.
        trusted_sum = (bool(senders) and not self.aggregation.robust and not self._dirty and self.n_chunks > 0
                       and all(sums is not None for sums in self._sum)
                       and math.isfinite(robust.part_norm(t for sums in self._sum for t in sums or ())))
        if self.n_chunks and senders and not trusted_sum:
            norms = [robust.part_norm(t for chunk in range(self.n_chunks) for t in self._data[s][chunk])
                     for s in senders]
            rejected, self.median_norm = robust.validate_norms(norms, self.aggregation)
            self.rejected = [senders[i] for i in rejected]
            self._dirty = True
        self.contributors = [s for s in senders if s not in self.rejected]
        if self.n_chunks == 0:
            self.result = []
        elif not self.contributors:
            self.result = None
        elif self.aggregation.robust:
            claimed = [self.weights[s] for s in self.contributors]
            self.result = self._split(robust.aggregate(self._matrix(self.contributors),
                                                       robust.bounded_weights(claimed, self.aggregation),
                                                       self.aggregation))
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
            self.result = self._sum  # type: ignore[assignment]  # the loop above asserted every entry is set
        self._data.clear()
        return self.result

    def recompute(self, contributors: Sequence[int]) -> torch.Tensor | None:
        """What an honest reducer returns for exactly these contributors (as reported by the part's reducer), as
        one flat vector: the checker's side of a cross-reduction. None when this copy lacks the data of one of
        them (it failed to reach us, or sent nothing): the check is then inconclusive, nobody is blamed."""
        senders = sorted(set(contributors))
        if not senders or any(s not in self.complete or self.weights.get(s, 0.0) <= 0 for s in senders):
            return None
        matrix = self._matrix(senders)
        claimed = [self.weights[s] for s in senders]
        if self.aggregation.robust:
            return robust.aggregate(matrix, robust.bounded_weights(claimed, self.aggregation), self.aggregation)
        weights = torch.tensor(claimed, dtype=torch.float64)
        return (weights / weights.sum()) @ matrix.to(torch.float64)

    def _matrix(self, senders: Sequence[int]) -> torch.Tensor:
        """The senders' whole parts as the rows of one matrix (float64 if any segment is, else float32): one
        copy of the received data, which the robust aggregations need side by side."""
        dtypes = {_accumulate_dtype(d) for chunk in self._expected for _, d in chunk}
        dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        numel = sum(n for chunk in self._expected for n, _ in chunk)
        matrix = torch.empty(len(senders), numel, dtype=dtype)
        for row, sender in zip(matrix, senders):
            offset = 0
            for chunk in range(self.n_chunks):
                for piece in self._data[sender][chunk]:
                    row[offset:offset + piece.numel()].copy_(piece)
                    offset += piece.numel()
        return matrix

    def _split(self, vector: torch.Tensor) -> list[list[torch.Tensor]]:
        """A flat aggregated part back into chunks of segments, each in its accumulation dtype (views when it
        is the vector's)."""
        result, offset = [], 0
        for chunk in self._expected:
            pieces = []
            for numel, dtype in chunk:
                pieces.append(vector[offset:offset + numel].to(_accumulate_dtype(dtype)))
                offset += numel
            result.append(pieces)
        return result

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
    finished: the round ended before the deadline. rejected_peers: members whose part our reducer rejected
    (`averaging.robust.validate_norms`); lying_peers: reducers whose returned part we did not believe
    (`averaging.robust.plausible`; that part kept our local values).
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
    rejected_peers: set[PeerID] = field(default_factory=set)
    lying_peers: set[PeerID] = field(default_factory=set)

    @property
    def fully_averaged(self) -> bool:
        return self.finished and all(self.averaged)



class TransferBudget:
    """Deadlines of single transfers, shared by all rounds of one peer.

    A transfer shares our link with every other transfer in flight in the same direction, so its deadline covers
    all the bytes queued with it, and its duration measures the rate for that whole backlog. `begin` before the
    call, `end` after it (with its duration, or None when it failed: a failure measures nothing)."""

    def __init__(self, config: AllReduceConfig, estimator: ThroughputEstimator):
        self.config = config
        self.estimator = estimator
        self.in_flight = {"in": 0, "out": 0}

    def chunk_timeout(self, nbytes: int) -> float:
        return self.estimator.timeout(nbytes, floor=self.config.timeout_floor, factor=self.config.timeout_factor)

    def begin(self, direction: str, nbytes: int, *, first_contact: bool = False) -> tuple[int, float]:
        """Queue `nbytes` on the link; returns (backlog, timeout). A first contact adds `join_wait`: the reducer
        may not have started the round yet (its handler waits for it)."""
        backlog = self.in_flight[direction] + nbytes
        self.in_flight[direction] += nbytes
        timeout = self.chunk_timeout(backlog) + (self.config.join_wait if first_contact else 0.0)
        return backlog, timeout

    def end(self, direction: str, nbytes: int, backlog: int, seconds: float | None, *,
            first_contact: bool = False) -> None:
        """The transfer is over. A first contact's duration includes the wait for the reducer to start the
        round, so it stays out of the rate estimate."""
        self.in_flight[direction] -= nbytes
        if seconds is not None and nbytes and not first_contact:
            self.estimator.observe(backlog, seconds)


class PartState(enum.Enum):
    """Where one member's exchange with the reducer of one (other) part stands."""

    PUSHING = "pushing"  # our slice is on its way to the reducer
    PUSHED = "pushed"  # the reducer has all of our slice; we commit once every push and our own part are done
    COMMITTED = "committed"  # commit sent: we count in the reducer's mean, which it owes us
    PULLING = "pulling"  # the reducer has its mean: we fetch it
    AVERAGED = "averaged"  # the mean is in our tensors
    NO_MEAN = "no_mean"  # reduced, but nobody with a positive weight committed: local values kept
    EXCLUDED = "excluded"  # the reducer counts us as failed: local values kept, the reducer is not blamed
    FAILED = "failed"  # the reducer is lost or broke the protocol: local values kept (see plan_retry)


SETTLED = frozenset({PartState.AVERAGED, PartState.NO_MEAN, PartState.EXCLUDED, PartState.FAILED})


class RoundCore:
    """One member's all-reduce round, without I/O: the parts it pushes, the part it reduces (if any), what it
    knows about the others, and its deadlines. Times are arguments (the driver's clock, in seconds).

    Every mutator may append to `events` (drained by `take_events`) and may flip the flags the driver's tasks
    wait for: `committed` (our contribution is final: send the commits), `released` (our part's mean is ready or
    the round was aborted: answer the pending commits), `closed` (the round is over here: end the watch calls).
    """

    def __init__(self, group: GroupInfo, partition: Partition, me: int, tensors: Sequence[torch.Tensor],
                 weight: float, *, budget: TransferBudget, now: float, deadline: float = math.inf):
        if not 0 <= me < group.size:
            raise LocalViolation(f"no member {me} in a group of {group.size}", operation="allreduce")
        self.group = group
        self.partition = partition
        self.me = me
        self.tensors = list(tensors)
        self.weight = float(weight)
        self.budget = budget
        self.config = budget.config
        self.started_at = now
        self.deadline = deadline
        self.own_part = partition.part_of(me)
        dtypes = [t.dtype for t in self.tensors]
        self.reducer = PartReducer(self.own_part, group.size, dtypes, now=now, aggregation=self.config.aggregation) \
            if self.own_part is not None else None
        self.parts: dict[int, PartState] = {p.index: PartState.PUSHING for p in partition.parts if p.owner != me}
        self.failed: set[int] = set()  # every member we stopped waiting for, whatever the reason
        self.crashed: set[int] = set()  # those with hard evidence: told to the reducers we commit to
        self.rejected: set[int] = set()  # members whose part our reducer rejected
        self.liars: set[int] = set()  # reducers whose returned part we did not believe
        self._reply_norms: dict[int, float] = {}  # part -> the median norm its reducer reported
        # cross-reduction (`checker_of`): part -> its checker; the parts we check, as a second PartReducer each
        rate = self.config.check_rate
        self.checkers: dict[int, int] = {
            p.index: c for p in partition.parts if (c := checker_of(group, partition, p.index, rate)) is not None}
        self.checks: dict[int, PartReducer] = {
            index: PartReducer(partition.parts[index], group.size, dtypes, now=now,
                               aggregation=self.config.aggregation)
            for index, checker in self.checkers.items() if checker == me}
        self.averaged = [False] * len(partition.parts)
        self.contributors: list[list[int]] = [[] for _ in partition.parts]
        self._reply_contributors: dict[int, list[int]] = {}
        self.done_with: set[int] = set()  # reducers whose exchange is over (their watch may end quietly)
        self.reducing_started = self.own_part is None
        self.committed = False
        self.released = False
        self.aborted = False
        self.closed = False
        self.pulls = PullLedger()  # serving our part's mean
        self.bytes_sent = 0
        self.bytes_received = 0
        self.events: list[Event] = []

    # ------------------------------------------------------------------------------------------ bookkeeping

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def peer(self, member: int) -> PeerID:
        return self.group.members[member].peer_id

    @property
    def pushes_left(self) -> int:
        return sum(1 for state in self.parts.values() if state is PartState.PUSHING)

    def owner_of(self, part_index: int) -> int:
        return self.partition.parts[part_index].owner

    def note_failed(self, member: int, *, crashed: bool = False, reason: str = "") -> bool:
        """Stop waiting for `member`; True when it is news. `crashed` marks hard evidence (its connection was
        refused or lost, or it left the round), which we pass on to the reducers we commit to; a timeout or a bad
        message is only our own view (our process may be the slow one) and is not spread, so one slow link
        cannot exclude a member everywhere."""
        if member == self.me or not 0 <= member < self.group.size:
            return False
        if crashed:
            self.crashed.add(member)
        if member in self.failed:
            return False
        self.failed.add(member)
        if self.reducer is not None:
            self.reducer.fail(member)
        self.events.append(("member_failed", {"member": self.peer(member), "crashed": crashed, "reason": reason}))
        self.advance()
        return True

    def advance(self) -> None:
        """Commit once every push is done and our own part has all its data: from here on we count. Every mutator
        calls it; the driver calls it once more after starting the round (a member with nothing to push)."""
        if self.committed or self.pushes_left > 0 or not self.reducing_started:
            return
        if self.reducer is not None:
            if not self.reducer.data_complete:
                return
            self.reducer.commit(self.me, self.weight)
        self.committed = True
        self.events.append(("committed", {}))

    # ------------------------------------------------------------------------------------------ sender side

    def chunk_pushed(self, part_index: int, chunk: int, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.events.append(("chunk_pushed", {"part": part_index, "chunk": chunk}))

    def push_done(self, part_index: int) -> None:
        """The reducer acknowledged every chunk of our slice."""
        if self.parts[part_index] is PartState.PUSHING:
            self.parts[part_index] = PartState.PUSHED
        self.advance()

    def excluded(self, part_index: int) -> None:
        """The reducer answered that it counts us as failed: it dropped us, it is not at fault."""
        if self.parts[part_index] not in SETTLED:
            self.parts[part_index] = PartState.EXCLUDED
        self.advance()

    def reducer_failed(self, part_index: int, *, crashed: bool, reason: str) -> None:
        """A call to the part's reducer failed (crashed: hard evidence), or its answer broke the protocol."""
        if self.parts[part_index] not in SETTLED:
            self.parts[part_index] = PartState.FAILED
        if not self.note_failed(self.owner_of(part_index), crashed=crashed, reason=reason):
            self.advance()

    def finish_request(self, part_index: int) -> dict[str, Any] | None:
        """Once committed: the commit for this part's reducer, or None when there is nothing to ask it (it failed,
        or dropped us). Sending it moves the part to COMMITTED: the reducer now owes us its mean."""
        if not self.committed:
            raise LocalViolation("commit before every push and the own part are done", operation="allreduce")
        state = self.parts[part_index]
        if state in SETTLED:
            return None
        if self.owner_of(part_index) in self.failed:
            self.parts[part_index] = PartState.FAILED
            return None
        if state is not PartState.PUSHED:
            raise LocalViolation(f"part {part_index} is {state.value}, not pushed", operation="allreduce")
        self.parts[part_index] = PartState.COMMITTED
        return {"weight": self.weight, "suspects": sorted(self.crashed)}

    def finish_reply(self, part_index: int, reply: Any) -> bool:
        """The reducer's answer to our commit; True when there is a mean to pull. Members it saw crash are
        hard evidence for us too. Raises RemoteViolation for a malformed answer."""
        if self.parts[part_index] is not PartState.COMMITTED:
            raise LocalViolation(f"part {part_index} has no commit pending", operation="allreduce.finish")
        owner = self.owner_of(part_index)
        if not isinstance(reply, dict):
            raise RemoteViolation("malformed finish reply", peer=self.peer(owner), operation="allreduce.finish")
        for member in reply.get("failed") or []:
            if isinstance(member, int) and not isinstance(member, bool) and 0 <= member < self.group.size \
                    and member != owner:
                self.note_failed(member, crashed=True, reason="reported by a reducer")
        if not reply.get("averaged"):
            self.parts[part_index] = PartState.NO_MEAN
            return False
        self._reply_contributors[part_index], self._reply_norms[part_index] = reducer_claims(reply)
        self.parts[part_index] = PartState.PULLING
        return True

    def check_pulled_chunk(self, part_index: int, chunk: int, reply: Any) -> list[torch.Tensor]:
        """An averaged chunk as pulled: the right number of tensors of the right sizes, or RemoteViolation."""
        spec = self.partition.parts[part_index].chunks[chunk]
        if not isinstance(reply, list) or len(reply) != len(spec) or not all(
                isinstance(t, torch.Tensor) and t.numel() == s.numel for t, s in zip(reply, spec)):
            raise RemoteViolation(f"malformed averaged chunk {chunk}", peer=self.peer(self.owner_of(part_index)),
                                  operation="allreduce.pull")
        return reply

    def chunk_pulled(self, nbytes: int) -> None:
        self.bytes_received += nbytes

    def check_reduced(self, part_index: int, values: Sequence[Sequence[torch.Tensor]]) -> bool:
        """Before writing a pulled part into our tensors: could an honest reducer have produced it from what we
        sent (`reducer_audit.implausible`)? If not, the reducer is a liar: the part keeps our local values (it
        counts as failed, so it is not retried) and the averager counts a strike against the reducer."""
        lie = implausible(self.partition.parts[part_index], values, self.tensors, self.weight,
                          self._reply_norms.get(part_index, 0.0), self.config.aggregation)
        if lie is not None:
            self._caught(part_index, lie)
        return lie is None

    def _caught(self, part_index: int, reason: str) -> None:
        owner = self.owner_of(part_index)
        self.liars.add(owner)
        self.parts[part_index] = PartState.FAILED
        self.events.append(("reducer_lied", {"part": part_index, "reducer": self.peer(owner), "reason": reason}))
        self.note_failed(owner, reason=reason)

    # ------------------------------------------------------------------------------------------ cross-reduction

    def feed_checks(self, now: float) -> None:
        """Our own slice of every part we cross-reduce goes to its copy without the network."""
        for check in self.checks.values():
            check.feed(self.me, self.weight, self.tensors, now=now)

    def receive_check_push(self, sender: int, part_index: Any, chunk: Any, weight: Any, data: Any,
                           now: float) -> None:
        """A sender's slice of a part we cross-reduce. Raises ChunkRejected; a bad one only makes the check
        inconclusive for that sender (the reducer holds it to the protocol, not us)."""
        check = self.checks.get(part_index) if isinstance(part_index, int) and not isinstance(part_index, bool) \
            else None
        if check is None or not 0 <= sender < self.group.size:
            raise ChunkRejected("this member does not cross-reduce that part")
        try:
            check.receive(sender, chunk, weight, data, now=now)
        except Excluded as error:
            raise ChunkRejected(str(error)) from None

    def check_ready(self, part_index: int) -> bool:
        """We hold the data of every contributor the part's reducer reported (or it reported none)."""
        check = self.checks[part_index]
        return all(c in check.complete for c in self._reply_contributors.get(part_index, []))

    def cross_check(self, part_index: int, values: Sequence[Sequence[torch.Tensor]]) -> bool | None:
        """As the part's checker, with the reducer's part pulled (`reducer_audit.cross_verdict`). True: it matches;
        False: the reducer lied (the part keeps our local values, a strike against it); None: inconclusive."""
        contributors = self._reply_contributors.get(part_index, [])
        verdict, lie = cross_verdict(self.checks[part_index], contributors, values)
        if verdict is False:
            self._caught(part_index, lie)
        return verdict

    def peer_verdict(self, part_index: int, answer: Any, values: Sequence[Sequence[torch.Tensor]]) -> bool:
        """The checker's verdict on a part we pulled (`reducer_audit.checker_disagrees`). False: the reducer lied,
        so the part keeps our local values and the reducer gets a strike."""
        lie = checker_disagrees(answer, values)
        if lie is not None:
            self._caught(part_index, lie)
        return lie is None

    def part_averaged(self, part_index: int) -> None:
        """The pulled mean is written into our tensors."""
        if self.parts[part_index] is not PartState.PULLING:
            raise LocalViolation(f"part {part_index} was not being pulled", operation="allreduce.pull")
        self.parts[part_index] = PartState.AVERAGED
        self.averaged[part_index] = True
        self.contributors[part_index] = self._reply_contributors.pop(part_index, [])
        self.events.append(("part_received", {"part": part_index, "reducer": self.peer(self.owner_of(part_index))}))

    def exchange_over(self, part_index: int) -> None:
        """We need nothing more from this part's reducer: a failing watch call to it no longer means anything."""
        self.done_with.add(self.owner_of(part_index))

    def watch_failed(self, part_index: int, *, crashed: bool, reason: str) -> None:
        owner = self.owner_of(part_index)
        if owner not in self.done_with:
            self.note_failed(owner, crashed=crashed, reason=reason)

    def time_left(self, now: float) -> float:
        return max(0.0, self.deadline - now)

    # ------------------------------------------------------------------------------------------ own part

    def feed_own_part(self, now: float) -> None:
        """Our own slice of our own part goes to our reducer without the network."""
        self._need_reducer().feed(self.me, self.weight, self.tensors, now=now)

    def expire_senders(self, now: float) -> tuple[bool, float]:
        """Count the senders of our part that missed their (adaptive) deadline as failed; returns (whether any
        did, when the next one falls due). Every sender still sending shares our inbound link, each with a few
        chunks in flight; a sender done with us may wait for its pushes to everyone else (as many chunks in
        flight each). Our own commit waits only for our pushes, which have deadlines of their own."""
        reducer = self._need_reducer()
        config = self.config
        chunk = reducer.max_chunk_bytes * config.pushes_in_flight
        chunk_time = self.budget.chunk_timeout(chunk * max(1, len(reducer.missing())))
        commit_grace = self.budget.chunk_timeout(chunk * self.group.size)
        deadlines = reducer.deadlines(chunk_time, commit_grace, floor=config.timeout_floor,
                                      slack=config.straggler_slack, join_wait=config.join_wait)
        deadlines.pop(self.me, None)
        overdue = [member for member, due in deadlines.items() if due <= now]
        for member in overdue:
            self.note_failed(member, reason="missed its deadline")
        return bool(overdue), min(deadlines.values(), default=math.inf)

    def announce_reducing(self) -> None:
        assert self.own_part is not None
        self.events.append(("reducing", {"part": self.own_part.index}))

    def start_reducing(self) -> None:
        """All data of our part is in (or its senders failed): our own commit no longer waits for it."""
        if not self._need_reducer().data_complete:
            raise LocalViolation("reducing before the part's data is complete", operation="allreduce")
        self.reducing_started = True
        self.advance()

    def finalize_own(self) -> list[list[torch.Tensor]] | None:
        """Every sender committed or failed: compute our part's mean (None: no mean, local values stay) and
        release the pending commits."""
        reducer = self._need_reducer()
        assert self.own_part is not None
        result = reducer.finalize()
        index = self.own_part.index
        self.rejected.update(reducer.rejected)
        self.events.append(("reduced", {"part": index, "contributors": list(reducer.contributors),
                                        "rejected": [self.peer(m) for m in reducer.rejected]}))
        self.released = True
        self.contributors[index] = list(reducer.contributors)
        return result

    def own_part_written(self, now: float) -> None:
        """The mean of our part is in our tensors; from now on we serve it to the committed members."""
        assert self.own_part is not None
        self.averaged[self.own_part.index] = True
        self.pulls.released_at = now

    def pull_service(self, now: float) -> float | None:
        """Serving our mean (`PullLedger.next_due`): None once every committed member has its copy, left, or
        missed its deadline, else when the next one falls due. Every member pulling shares our outbound link."""
        reducer = self._need_reducer()
        served = [m for m in reducer.committed if m != self.me and m not in self.failed]
        return self.pulls.next_due(served, reducer.n_chunks, lambda pulling: self.budget.chunk_timeout(
            reducer.max_chunk_bytes * pulling * self.config.pulls_in_flight), now)

    @property
    def gone(self) -> set[int]:
        """The members we no longer serve our mean (`PullLedger.gone`)."""
        return self.pulls.gone

    # ------------------------------------------------------------------------------------------ reducer side

    def receive_push(self, sender: int, part_index: Any, chunk: Any, weight: Any, data: Any, now: float,
                     wire_nbytes: int | None = None) -> None:
        """A chunk from `sender`. Raises Excluded (it is counted as failed) or ChunkRejected (it broke the
        protocol: it is counted as failed from now on). `wire_nbytes`: its encoded size, counted as received
        (default: its nominal size); the rate estimate always uses the nominal size, as the budget does."""
        reducer = self._reducer_for(sender, part_index, "allreduce.push")
        previous = reducer.last_activity.get(sender)
        try:
            reducer.receive(sender, chunk, weight, data, now=now)
        except ChunkRejected as error:
            self._blame(error, sender, "allreduce.push")
            self.note_failed(sender, reason=f"bad chunk: {error}")
            raise
        if chunk != NOTHING:
            nbytes = reducer.chunk_bytes(chunk)
            self.bytes_received += nbytes if wire_nbytes is None else wire_nbytes
            if previous is not None:
                self.budget.estimator.observe(nbytes, now - previous)
        self.advance()

    def watch_started(self, sender: int, part_index: Any, now: float) -> None:
        reducer = self._reducer_for(sender, part_index, "allreduce.watch")
        self.pulls.watching.add(sender)
        reducer.joined(sender, now)

    def watch_ended(self, sender: int, *, cancelled: bool) -> None:
        """A member's watch call ended; `cancelled`: it vanished (or the round ended here)."""
        if cancelled and self.reducer is not None and sender not in self.reducer.committed:
            self.note_failed(sender, reason="left before committing")
        self.pulls.watch_ended(sender)

    def receive_commit(self, sender: int, part_index: Any, weight: Any, suspects: Any) -> None:
        """A member commits to our part, naming the members it saw crash (hard evidence, taken as ours)."""
        reducer = self._reducer_for(sender, part_index, "allreduce.finish")
        if isinstance(suspects, list):
            for suspect in suspects:
                if isinstance(suspect, int) and not isinstance(suspect, bool) \
                        and 0 <= suspect < self.group.size and suspect != sender:
                    self.note_failed(suspect, crashed=True, reason="reported by a member")
        try:
            reducer.commit(sender, weight)
        except ChunkRejected as error:
            self._blame(error, sender, "allreduce.finish")
            self.note_failed(sender, reason=f"bad commit: {error}")
            raise
        self.advance()

    def commit_abandoned(self, sender: int) -> None:
        """A member left before our mean was ready: do not wait for its pulls."""
        self.pulls.gone.add(sender)

    def finish_answer(self) -> dict[str, Any] | None:
        """The answer to a pending commit once `released`; None when we left the round before reducing."""
        if not self.released:
            raise LocalViolation("the part is not reduced yet", operation="allreduce.finish")
        if self.aborted:
            return None
        reducer = self._need_reducer()
        return {"averaged": reducer.result is not None, "contributors": list(reducer.contributors),
                "failed": sorted(self.crashed), "norm": reducer.median_norm}

    def serve_pull(self, member: int, part_index: Any, chunk: Any, now: float) -> list[torch.Tensor]:
        """One chunk of our mean for a committed member. Raises RemoteViolation when it may not have it."""
        reducer = self._reducer_for(member, part_index, "allreduce.pull")
        if not reducer.released or self.aborted or member not in reducer.committed:
            raise RemoteViolation("nothing to pull: commit first and wait for the mean",
                                  peer=self.peer(member), operation="allreduce.pull")
        if reducer.result is None:
            raise RemoteViolation("this part has no mean", peer=self.peer(member), operation="allreduce.pull")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 <= chunk < reducer.n_chunks:
            raise RemoteViolation(f"no chunk {chunk!r}", peer=self.peer(member), operation="allreduce.pull")
        self.pulls.served(member, chunk, now)
        return list(reducer.result[chunk])

    def chunk_served(self, nbytes: int) -> None:
        """A chunk of our mean went out (`nbytes`: as encoded)."""
        self.bytes_sent += nbytes

    def close(self) -> None:
        """The round is over here (finished, timed out or cancelled). Pending commits are answered: with the mean
        if it was computed, else with "left the round"."""
        if not self.released:
            self.aborted = True
            self.released = True
        self.closed = True

    # ------------------------------------------------------------------------------------------ result

    def result(self, *, finished: bool, now: float) -> AllReduceResult:
        members = self.group.members
        return AllReduceResult(
            group_id=self.group.group_id,
            averaged=list(self.averaged),
            part_owners=[members[p.owner].peer_id for p in self.partition.parts],
            contributors=[[members[i].peer_id for i in c] for c in self.contributors],
            failed_peers={members[i].peer_id for i in self.failed},
            crashed_peers={members[i].peer_id for i in self.crashed},
            finished=finished,
            elapsed=now - self.started_at,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            rejected_peers={members[i].peer_id for i in self.rejected},
            lying_peers={members[i].peer_id for i in self.liars},
        )

    # ------------------------------------------------------------------------------------------ helpers

    def _need_reducer(self) -> PartReducer:
        if self.reducer is None:
            raise LocalViolation("this member reduces no part", operation="allreduce")
        return self.reducer

    def _reducer_for(self, sender: int, part_index: Any, operation: str) -> PartReducer:
        if not 0 <= sender < self.group.size:
            raise RemoteViolation(f"no member {sender} in this group", operation=operation)
        if self.reducer is None or self.own_part is None or part_index != self.own_part.index \
                or isinstance(part_index, bool):
            raise RemoteViolation("this member does not reduce that part", peer=self.peer(sender),
                                  operation=operation)
        return self.reducer

    def _blame(self, error: AveragingError, sender: int, operation: str) -> None:
        error.peer = self.peer(sender)
        error.operation = operation


def plan_retry(result: AllReduceResult, partition: Partition, group: GroupInfo, *, now: float,
               deadline: float) -> tuple[GroupInfo, list[int]] | None:
    """The follow-up round on the parts whose reducer was lost: (its group, the indices of those parts), or None
    when there is nothing to retry (no lost part, fewer than 2 survivors, no reducer left, no time left).

    Every survivor that saw the same failures derives the same follow-up group (its id digests the failed peers)
    and the same tensors (views of the lost parts, `retry_views`), so no message is needed to agree on it. Only
    hard evidence counts, because that is what the members share; a survivor with a different view lands in
    another follow-up group and keeps its local values there once the join wait expires."""
    failed = result.crashed_peers
    lost = [i for i, part in enumerate(partition.parts)
            if not result.averaged[i] and group.members[part.owner].peer_id in failed]
    survivors = [m for m in group.members if m.peer_id not in failed]
    if not lost or len(survivors) < 2 or not any(m.reduces for m in survivors) or now >= deadline:
        return None
    digest = hashlib.blake2b(group.group_id + b"|retry|" + b"".join(sorted(failed)), digest_size=16)
    return GroupInfo.create(digest.digest(), survivors), lost


def retry_views(tensors: Sequence[torch.Tensor], partition: Partition, lost: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of the follow-up round: views of the lost parts' segments (averaging writes through them)."""
    return [segment_view(tensors, s) for i in lost for s in partition.parts[i].segments]


def merge_retry(result: AllReduceResult, lost: Sequence[int], retry: AllReduceResult) -> None:
    """Fold the follow-up round into the main round's result."""
    result.finished = result.finished and retry.finished
    result.failed_peers |= retry.failed_peers
    result.crashed_peers |= retry.crashed_peers
    if retry.fully_averaged:
        contributors = sorted({p for c in retry.contributors for p in c})
        for i in lost:
            result.averaged[i] = True
            result.contributors[i] = list(contributors)
    result.rejected_peers |= retry.rejected_peers
    result.lying_peers |= retry.lying_peers
    result.bytes_sent += retry.bytes_sent
    result.bytes_received += retry.bytes_received
