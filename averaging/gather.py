"""All-gather of compressed contributions: every member of a round sends its (sparse, low-bit) update to every
other member, then all of them combine the same set, in the same order, so all hold bit-identical results.

Why not the butterfly (`averaging.allreduce`): a reducer averages parts from members whose sparse supports differ,
and the mean of k-sparse vectors is dense: sending it back costs the dense bytes and loses what sparsity saved.
With an all-gather a member uploads its compressed update to each of the n-1 others, which is cheaper than the
butterfly's compressed push and dense (int8) return whenever n < 1 + int8 / compressed: for top-k at 2% with
2-bit values (1/154 of fp32) up to 40 members (see `prefer_gather`); never for a dense codec beyond 2 members.
Nobody reduces for others, so no reducer can lie about an average: each member computes it from the contributions
themselves.

Agreement on the set. Members can lose contributions (a sender dies half-way through its pushes, a link drops),
and members combining different sets would hold different states. So after its pushes, every member reports the
senders it holds complete contributions of to the round's coordinator (`averaging.gather.report`, a long poll);
the coordinator decides once every member reported or its deadline passed: the set is the intersection of the
reports (a contribution some reporter lacks is left out; a member that did not report contributes only if every
reporter holds its update). Each report is answered with that set. A member that lacks part of the set, or gets
no decision, applies nothing (the round is lost for it; it catches up by download).

Malformed and hostile contributions. A push carries the sender's contribution as one encoded message (bytes) that
the receiving member decodes itself, so an encoding the codecs refuse (out-of-range or duplicate indices, NaN
scales, truncated blocks: `wire.MalformedTensor`) is known per sender and round: the push is answered with a typed
error (BadRequest), the member does not report holding it (so the decided set leaves it out), and the round's
result lists the sender with no tensors, which `combine` counts as rejected: a strike against the sender like any
other rejected update, and nobody else's round fails. A contribution that decodes is judged on its values by
`combine`: not finite, or its norm beyond `max_norm_ratio` times the median (values at the top of the range on
every coordinate, huge scales), rejected; then, since every member holds every contribution whole (a butterfly
reducer sees only parts), a contribution that stands out in its distance from the robust result (`far_from`:
sign-flipped and scaled, mass piled on a few coordinates, a consistent bias beyond the honest spread) is rejected
too, and the rest combined again without it.

Layout: `GatherRound` and `decide` are the pure parts (received contributions, the decision); `GatherService` is
the trio driver (pushes, reports, the coordinator's decisions), installed on a trainer's RPC node.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

import torch
import trio

from averaging.allreduce_core import ThroughputEstimator
from averaging.robust import Aggregation, aggregate, bounded_weights, norm, validate
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import BadRequest, CallContext, RPCError, RPCNode

logger = logging.getLogger(__name__)

PUSH = "averaging.gather.push"
REPORT = "averaging.gather.report"

DISTANCE_RATIO = 3.0
"""With a robust aggregation and 3 or 4 contributions, one whose distance to the robust result exceeds this times
the median distance of the contributions to it is rejected (see the module doc and `far_from`)."""
DISTANCE_MADS = 6.0
DISTANCE_FLOOR = 1.15
"""With 5 contributions or more, one whose distance to the robust result exceeds the median distance by more than
`DISTANCE_MADS` median absolute deviations of the distances, and by more than `DISTANCE_FLOOR` times the median,
is rejected. Why a deviation rule: top-k updates of one round are nearly orthogonal to each other with nearly equal
norms (error feedback evens them out), so their distances to the result cluster tightly
(tests/averaging/test_sparse_byzantine.py: 0.91 to 1.04 times the median in every round of the digits run), while
an update carrying anything the others do not (a consistent bias, mass piled on a few coordinates) stands out by
many deviations even when its norm passes the norm check (ALIE-style at 1.22-1.33x the median, piled mass at 2x);
a fixed ratio wide enough for dense updates would let those through. Where the honest distances spread widely
the deviation widens the limit with them; the floor keeps a tight group from rejecting honest noise."""

__all__ = ["DISTANCE_FLOOR", "DISTANCE_MADS", "DISTANCE_RATIO", "GatherResult", "GatherRound", "GatherService",
           "PUSH", "REPORT", "combine", "decide", "far_from", "prefer_gather"]


def prefer_gather(members: int, compressed_bytes: int, returned_bytes: int) -> bool:
    """All-gather when each member's uploads, (n - 1) * compressed, cost less than the butterfly's: pushes of
    (n - 1) / n of its compressed update, and (n - 1) / n of the averaged vector sent back at `returned_bytes`
    (the compressed size again for a dense codec, so the butterfly wins from 3 members on; for a sparse codec
    the mean of sparse vectors is dense, so it goes back at int8's size at least)."""
    if members < 2:
        return False
    share = (members - 1) / members
    return (members - 1) * compressed_bytes < share * (compressed_bytes + returned_bytes)


def decide(members: Sequence[bytes], reports: Mapping[bytes, Iterable[bytes]]) -> list[bytes]:
    """The contributions every member combines: the members held by every reporter, in member order."""
    chosen = set(members)
    for have in reports.values():
        chosen &= set(have)
    return [m for m in members if m in chosen]


def far_from(distances: Sequence[float]) -> list[int]:
    """Indices of the contributions too far from the robust result, given their distances to it (robust
    aggregations only; at least 3: with 2 there is no majority to say which one is off)."""
    if len(distances) < 3:
        return []
    median = statistics.median(distances)
    if len(distances) < 5:
        limit = DISTANCE_RATIO * median
    else:
        deviation = statistics.median(abs(d - median) for d in distances)
        limit = median + max(DISTANCE_MADS * deviation, (DISTANCE_FLOOR - 1.0) * median)
    return [i for i, d in enumerate(distances) if limit > 0 and d > limit]


def combine(contributions: Sequence[tuple[bytes, list[torch.Tensor]]], weights: dict[bytes, float],
            aggregation: Aggregation, into: list[torch.Tensor]) -> list[bytes]:
    """Combine the decided contributions (in the order given, which every member shares) into `into`, with the
    robust rules of `averaging.robust` on the decoded values; returns the senders whose contribution was
    rejected (not finite, or far beyond the others' norms). Every member runs this on the same inputs in the same
    order, so every member gets the same bits."""
    size = sum(t.numel() for t in into)
    refused = [i for i, (_, tensors) in enumerate(contributions) if not tensors]  # malformed on arrival
    flat = [torch.cat([t.reshape(-1).to(into[0].dtype) for t in tensors]) if tensors else torch.zeros(size)
            for _, tensors in contributions]
    rejected_at, _ = validate(flat, aggregation)
    rejected_at = sorted(set(rejected_at) | set(refused))
    kept = [i for i in range(len(contributions)) if i not in set(rejected_at)]
    if not kept:
        return [contributions[i][0] for i in rejected_at]  # nothing believable: `into` keeps its own values

    def combined(rows: list[int]) -> torch.Tensor:
        matrix = torch.stack([flat[i] for i in rows])
        claimed = [weights.get(contributions[i][0], 0.0) or 1e-12 for i in rows]
        return aggregate(matrix, bounded_weights(claimed, aggregation), aggregation)

    result = combined(kept)
    if aggregation.robust:
        far = [kept[i] for i in far_from([norm(flat[i] - result) for i in kept])]
        if far:
            kept = [i for i in kept if i not in far]
            rejected_at = sorted(set(rejected_at) | set(far))
            result = combined(kept)
    rejected = [contributions[i][0] for i in rejected_at]
    offset = 0
    with torch.no_grad():
        for target in into:
            size = target.numel()
            target.copy_(result[offset:offset + size].reshape(target.shape))
            offset += size
    return rejected


@dataclass
class GatherRound:
    """What one member holds of a round: the contributions it received, checked against its own shapes."""

    group_id: bytes
    members: tuple[bytes, ...]
    shapes: tuple[tuple[int, ...], ...]
    received: dict[bytes, list[torch.Tensor]] = field(default_factory=dict)
    refused: set[bytes] = field(default_factory=set)  # senders whose contribution did not decode or fit

    def receive_encoded(self, sender: bytes, blob: Any) -> None:
        """Decode and keep `sender`'s contribution (an encoded message); ValueError for anything that does not
        decode or fit, and the sender is then remembered as refused for this round."""
        if sender not in self.members:
            raise ValueError("the sender is not a member of this round")
        if sender in self.received:
            return
        try:
            if not isinstance(blob, (bytes, bytearray)):
                raise ValueError("the contribution is not an encoded message")
            try:
                tensors = wire.decode(bytearray(blob))
            except wire.WireError as error:
                raise ValueError(f"malformed contribution: {error}") from None
            self.receive(sender, tensors)
        except ValueError:
            self.refused.add(sender)
            raise

    def receive(self, sender: bytes, tensors: Any) -> None:
        """Keep `sender`'s contribution; ValueError for anything that does not fit (not a member, other shapes)."""
        if sender not in self.members:
            raise ValueError("the sender is not a member of this round")
        if (not isinstance(tensors, list) or len(tensors) != len(self.shapes) or not all(
                isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.is_floating_point()
                for t, shape in zip(tensors, self.shapes))):
            raise ValueError("the contribution does not have this round's shapes")
        if sender not in self.received and sender not in self.refused:
            self.received[sender] = tensors

    def have(self) -> list[bytes]:
        return [m for m in self.members if m in self.received]


@dataclass
class GatherResult:
    """What a member ends a round with: the decided set (None: no decision), the contributions of it in member
    order (None when some are missing here) followed by `(sender, [])` for each sender whose contribution this
    member refused as malformed (`combine` counts them as rejected), traffic, and the senders it could not push
    to."""

    chosen: list[bytes] | None
    contributions: list[tuple[bytes, list[torch.Tensor]]] | None
    bytes_sent: int = 0
    bytes_received: int = 0
    failed: list[bytes] = field(default_factory=list)
    reason: str = ""
    refused: list[bytes] = field(default_factory=list)


class _Decision:
    def __init__(self, members: Sequence[bytes], deadline: float):
        self.members = list(members)
        self.deadline = deadline
        self.reports: dict[bytes, list[bytes]] = {}
        self.chosen: list[bytes] | None = None
        self.done = trio.Event()

    def report(self, peer: bytes, have: list[bytes]) -> None:
        if peer in self.members and self.chosen is None:
            self.reports[peer] = have
            if set(self.reports) >= set(self.members):
                self.close()

    def close(self) -> None:
        if self.chosen is None:
            self.chosen = decide(self.members, self.reports)
            self.done.set()


@dataclass(eq=False)
class GatherService:
    """One trainer's side of the all-gather (module doc). `members_of(group_id)`: the members of a round this
    trainer coordinates (None when it does not), for deciding its set."""

    rpc: RPCNode
    _: KW_ONLY
    members_of: Callable[[bytes], Sequence[bytes] | None]
    report_wait: float = 10.0
    timeout_floor: float = 2.0
    timeout_factor: float = 4.0
    initial_rate: InitVar[float] = 1e6
    keep_early: int = 64
    me: bytes = field(init=False)
    estimator: ThroughputEstimator = field(init=False)
    _rounds: dict[bytes, GatherRound] = field(init=False, default_factory=dict)
    _arrived: dict[bytes, trio.Event] = field(init=False, default_factory=dict)
    # pushes before the round started here
    _early: OrderedDict[bytes, dict[bytes, Any]] = field(init=False, default_factory=OrderedDict)
    _decisions: OrderedDict[bytes, _Decision] = field(init=False, default_factory=OrderedDict)
    stats: dict[str, int] = field(init=False, default_factory=lambda: {
        "rounds": 0, "pushes": 0, "rejected": 0, "decided": 0})

    def __post_init__(self, initial_rate: float) -> None:
        self.me = bytes(self.rpc.peer_id)
        self.estimator = ThroughputEstimator(initial_rate)

    def install(self) -> "GatherService":
        self.rpc.register(PUSH, self._on_push)
        self.rpc.register(REPORT, self._on_report)
        return self

    def uninstall(self) -> None:
        self.rpc.unregister(PUSH)
        self.rpc.unregister(REPORT)

    # ------------------------------------------------------------------------------------------ handlers

    async def _on_push(self, context: CallContext, args: Any) -> None:
        if not isinstance(args, dict) or not isinstance(args.get("group"), (bytes, bytearray)):
            raise BadRequest("malformed gather push")
        group, sender, blob = bytes(args["group"]), bytes(context.peer_id), args.get("update")
        round_ = self._rounds.get(group)
        if round_ is None:  # the sender started first: keep it (bounded) until this member starts the round
            early = self._early.setdefault(group, {})
            if len(early) < 4096:
                early[sender] = blob
            while len(self._early) > self.keep_early:
                self._early.popitem(last=False)
            return
        try:
            round_.receive_encoded(sender, blob)
        except ValueError as error:
            self.stats["rejected"] += 1
            self._wake(group)  # nothing more is expected from that sender this round
            raise BadRequest(f"gather push refused: {error}") from None
        self.stats["pushes"] += 1
        self._wake(group)

    async def _on_report(self, context: CallContext, args: Any) -> list[bytes]:
        if not isinstance(args, dict) or not isinstance(args.get("group"), (bytes, bytearray)):
            raise BadRequest("malformed gather report")
        group, have = bytes(args["group"]), args.get("have")
        if not isinstance(have, list) or not all(isinstance(p, (bytes, bytearray)) and len(p) == 20 for p in have):
            raise BadRequest("malformed gather report")
        decision = self._decision(group)
        if decision is None:
            raise BadRequest("this trainer does not coordinate that round")
        decision.report(bytes(context.peer_id), [bytes(p) for p in have])
        with trio.move_on_at(decision.deadline):
            await decision.done.wait()
        decision.close()
        assert decision.chosen is not None
        return decision.chosen

    def _decision(self, group: bytes) -> _Decision | None:
        decision = self._decisions.get(group)
        if decision is None:
            members = self.members_of(group)
            if members is None:
                return None
            decision = self._decisions[group] = _Decision(members, trio.current_time() + self.report_wait)
            self.stats["decided"] += 1
            while len(self._decisions) > self.keep_early:
                self._decisions.popitem(last=False)
        return decision

    def _wake(self, group: bytes) -> None:
        event = self._arrived.get(group)
        if event is not None:
            event.set()
            self._arrived[group] = trio.Event()

    # ------------------------------------------------------------------------------------------ a member's round

    async def run(self, group_id: bytes, members: Sequence[tuple[bytes, Address | None]], tensors: list[torch.Tensor],
                  compression: wire.Compression, coordinator: tuple[bytes, Address | None], *,
                  deadline: float) -> GatherResult:
        """Push `tensors` (compressed with `compression`) to every other member, wait for theirs, report to the
        `coordinator`, and return the decided contributions (mine included, as sent) in member order."""
        ids = tuple(m for m, _ in members)
        round_ = GatherRound(group_id, ids, tuple(tuple(t.shape) for t in tensors))
        self._rounds[group_id] = round_
        self._arrived[group_id] = trio.Event()
        self.stats["rounds"] += 1
        sent = [wire.roundtrip(t, compression) for t in tensors]  # what the others decode: mine counts the same
        round_.received[self.me] = sent
        for sender, payload in self._early.pop(group_id, {}).items():
            try:
                round_.receive_encoded(sender, payload)
            except ValueError:
                self.stats["rejected"] += 1
        nbytes = sum(wire.data_nbytes(t, compression) for t in tensors)
        update = wire.encode_bytes([wire.compressed(t, compression) for t in tensors])  # one copy, of a small update
        failed: list[bytes] = []
        try:
            async with trio.open_nursery() as nursery:
                for peer, address in members:
                    if peer != self.me and address is not None:
                        nursery.start_soon(self._push, group_id, peer, address, update, nbytes, deadline, failed)
                await self._await_contributions(round_, deadline, failed)
            chosen = await self._report(group_id, round_, coordinator, deadline)
        finally:
            del self._rounds[group_id]
            self._arrived.pop(group_id, None)
        received_bytes = nbytes * (len(round_.received) - 1)
        result = GatherResult(chosen, None, nbytes * (len(ids) - 1 - len(failed)), received_bytes, failed,
                              refused=[m for m in ids if m in round_.refused])
        if chosen is None:
            result.reason = "no decision from the coordinator"
        elif not set(chosen) <= set(round_.received):
            result.reason = f"{len(set(chosen) - set(round_.received))} decided contribution(s) missing here"
        else:
            result.contributions = [(peer, round_.received[peer]) for peer in chosen]
            result.contributions += [(peer, []) for peer in result.refused if peer not in chosen]
        return result

    async def _push(self, group: bytes, peer: bytes, address: Address, update: bytes, nbytes: int, deadline: float,
                    failed: list[bytes]) -> None:
        """One push; a failure goes to `failed` (and wakes the wait: nothing more is expected from a dead peer)."""
        started = trio.current_time()
        timeout = min(self.estimator.timeout(nbytes, floor=self.timeout_floor, factor=self.timeout_factor),
                      max(0.0, deadline - started))
        try:
            await self.rpc.call(address, PUSH, {"group": group, "update": update}, timeout=timeout,
                                peer_id=PeerID(peer))
            self.estimator.observe(nbytes, trio.current_time() - started)
        except RPCError as error:
            failed.append(peer)
            self._wake(group)
            logger.info("gather %s: pushing to %s failed: %s", group.hex()[:8], PeerID(peer).short(), error)

    async def _await_contributions(self, round_: GatherRound, deadline: float, dead: list[bytes]) -> None:
        """Until every member's contribution is here (but for members our pushes found dead), or no more can be
        expected by the transfer deadline."""
        waited_from = trio.current_time()
        while set(round_.received) | set(dead) | round_.refused < set(round_.members):
            event = self._arrived[round_.group_id]
            # a missing sender gets as long as a transfer of our own size would take, from when we started
            expected_size = sum(math.prod(s) for s in round_.shapes) * 4
            limit = min(deadline, waited_from + 2 * self.estimator.timeout(
                expected_size, floor=self.timeout_floor, factor=self.timeout_factor))
            with trio.move_on_at(limit) as scope:
                await event.wait()
            if scope.cancelled_caught:
                return

    async def _report(self, group: bytes, round_: GatherRound, coordinator: tuple[bytes, Address | None],
                      deadline: float) -> list[bytes] | None:
        peer, address = coordinator
        have = round_.have()
        try:
            if peer == self.me:
                decision = self._decision(group)
                if decision is None:
                    return None
                decision.report(self.me, have)
                with trio.move_on_at(min(deadline, decision.deadline)):
                    await decision.done.wait()
                decision.close()
                return decision.chosen
            if address is None:
                return None
            reply = await self.rpc.call(address, REPORT, {"group": group, "have": have},
                                        timeout=max(0.0, min(deadline - trio.current_time(), self.report_wait + 5.0)),
                                        peer_id=PeerID(peer))
        except RPCError as error:
            logger.info("gather %s: no decision from the coordinator: %s", group.hex()[:8], error)
            return None
        if not isinstance(reply, list) or not all(isinstance(p, (bytes, bytearray)) for p in reply):
            return None
        chosen = [bytes(p) for p in reply]
        return chosen if set(chosen) <= set(round_.members) else None
