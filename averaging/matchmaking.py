"""Matchmaking through the DHT: who averages with whom this round, with no master and no leader chosen in advance.

Protocol (one round, seen from one peer; every peer runs the same code):

1. **Declare.** Store a declaration under the round's group key (`group_keys.py`), subkey = my peer id, with a
   short expiration: address (None in client mode), bandwidth, client mode, schema hash, round, my deadline and
   the time I declared. When I leave matchmaking I overwrite it with a withdrawal so latecomers don't count me.
   The store runs beside everything else (a dead replica must not delay the round).
2. **Gather.** Poll the key in the background and merge what is read into a view (a peer leaves the view only
   through its withdrawal or expiration, so partial reads don't make it flicker). All peers derive the same plan
   from the same visible set (`plan_groups`): compatible declarations (same schema) ordered by a hash of the key,
   the peer's own declared round and its peer id (a late arrival never reorders the others), cut into balanced
   chunks of about `target_group_size`. In each chunk the
   **collector** is the member with the lowest peer id that accepts connections. Nobody is appointed: it is a
   pure function of what everyone sees.
3. **Join.** A non-collector waits until its view has been quiet for `q` (a few measured DHT reads and stores;
   three times that before joining a partial chunk, `Pacing.settle_period`) and then sends one `avg.mm.join`
   call to its collector: a long poll answered with the final member list, a redirect, or a rejection. Quiet
   means no peer appeared and my chunk kept its members: peers leaving for groups sealed elsewhere don't count.
4. **Collect and seal.** The collector accepts joins (same key and schema, room left, not sealed) and seals as
   soon as the group is full, or once every live member of its chunk has joined and the view has been quiet for
   three quiet periods (as long as a joiner waits before joining a partial chunk: a partial group is final), or
   at the seal deadline (the earliest deadline of its members, so nobody has given up). Chunk members that haven't
   joined are probed (`avg.mm.ping`): a refused connection (dead) or two probe timeouts (frozen), a peer that
   follows another collector or collects itself is not waited for; before sealing a group with room left, the
   followers are asked once more (one turned away by a full collector comes here). Sealing answers every pending
   join with the same `GroupInfo` (same id, members sorted by peer id): that is how all members agree.
5. **Converge.** Views can differ (late declarations, withdrawals not yet visible), so plans can differ:
   - a peer asked to collect while it follows someone answers with a redirect to that collector (always a lower
     peer id: redirects cannot loop), and the joiner goes there directly;
   - a joiner whose collector is dead, sealed, full or gone excludes it (and the members a rejection names) and
     plans again from the rest: the next-lowest peer of its chunk becomes collector, possibly itself;
   - a collector that nobody joined steps down when it sees a lower peer in its chunk; and a collector probed by a
     lower collector that counts it in and has room for its members merges into it (its joiners are redirected);
     when both groups together are too big for that, it hands the lower one as many joiners as it has room for
     (3 + 3 + 2 out of 8 becomes 4 + 4 instead of sealing three partial groups);
   - a collector with room keeps waiting for a chunk member that follows another collector (that one may be full
     and turn it away) for `follow_wait`, re-probing it, rather than sealing without it and stranding it.
6. **Patience.** Peers leave their previous round at different times. Peers seen under the key in the last rounds
   are expected; while some are missing, nobody acts on a partial view (not even a full chunk: the missing peers
   would land in it) and the rest waits for the stragglers, for at most `straggler_wait`, which adapts to outcomes
   (it doubles after running out in vain, shrinks toward the wait that was needed). A probed peer that answers it
   is not matching has left a stale declaration (it is still averaging its previous round): it leaves the plan,
   and while it is between rounds the wait extends up to a quarter of the window, since it is on its way. Dead
   peers stop being expected after two rounds, or at once when the all-reduce saw them die.

A vanished peer therefore costs its group one connection attempt (refused at once on a dead host) or two probe
timeouts (frozen host), never the whole matchmaking window. The window (`matchmaking_time`) is only the upper
bound; typical rounds finish after one quiet period plus one RPC. Client-mode peers never collect (nobody can call
them): they join, and `plan_groups` puts at least one reachable peer in every chunk.

Bans: the averager bans peers it caught misbehaving in several all-reduce rounds (their parts rejected by its
reducer, or implausible parts returned as a reducer: `averaging.robust`). A banned peer is invisible to this
matchmaker: its declarations are skipped (so it is neither planned with nor expected), its joins are rejected,
its probes are answered "not matching" (so it cannot talk a collector into merging into it), and a redirect to
it is not followed. Bans are this peer's own decision, never exchanged: a group sealed by a collector that has
not banned the peer may still contain it, and the robust reducers deal with its data there.

Layout: the decisions that need no I/O live in `averaging.assembly` (declarations, `plan_groups`, the collector's
`Assembly`: joins in, answers and seal / step-down verdicts out, probe answers read by `read_probe_answer`),
with no trio and no clock inside, so they are tested message by message (tests/averaging/test_assembly_core.py).
This module is the driver: `Matchmaker.find_group` and the two loops of a round (join a collector, or collect and
seal). Each of its other jobs is a collaborator it owns, in a module of its own:
`match_round` (what one round knows, and the long polls held on it), `match_dht` (declare, read the view,
withdraw), `match_join` (`avg.mm.join`, both ways), `match_ping` (`avg.mm.ping`, both ways), `match_waits` (the
adaptive waits: quiet period, probe timeout, straggler and follow waits) and `match_schema` (peers of another
model, named once).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import trio

from averaging.assembly import Assembly, Decision, Declaration, chunk_of, collector_of, plan_groups, round_salt
from averaging.errors import LocalViolation
from averaging.group import GroupInfo
from averaging.match_dht import MAX_SHARDS, SHARD_CROWDED, DeclarationBoard, shard_key
from averaging.match_join import JOIN_METHOD, Joins
from averaging.match_ping import PING_METHOD, Prober
from averaging.match_round import MatchRound
from averaging.match_schema import SCHEMA_METHOD, SCHEMA_TIMEOUT, ForeignSchemas
from averaging.match_waits import Pacing, Patience
from dht.client import DHTClient
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import CallContext, RPCNode

# the protocol's names and limits live with the collaborators that use them, and are importable from here as ever
__all__ = ["JOIN_METHOD", "PING_METHOD", "SCHEMA_METHOD", "SCHEMA_TIMEOUT", "SHARD_CROWDED", "MAX_SHARDS",
           "shard_key", "MatchResult", "Matchmaker"]

logger = logging.getLogger(__name__)


@dataclass
class MatchResult:
    """Outcome of one matchmaking: the group (None when none assembled), who turned out dead, and why."""

    group: GroupInfo | None
    round: int = 0  # the group's round, identical for every member (max of the members' declared rounds)
    failed_peers: list[PeerID] = field(default_factory=list)
    reason: str = ""
    collector: PeerID | None = None
    seconds: float = 0.0


class Matchmaker:
    """Runs the protocol above for one peer; one `find_group` at a time (the averager serialises steps).

    `register()` adds the `avg.mm.join`, `avg.mm.ping` and `avg.mm.schema` handlers to the RPC node. A join that
    arrives while this peer is not matchmaking under the caller's key is rejected at once ("not matching"), never
    left hanging. `nursery` (optional) runs background withdrawals; without one, the withdrawal is awaited
    (bounded).

    The round itself runs here (`find_group`, `_assemble`, `_collect`); the rest is delegated to collaborators it
    owns (see "Layout" above). They share its `banned` set and `stats` counters (the same objects, never
    replaced), and the RPC handlers here hand them the current round, so no collaborator holds a round of its own.
    """

    def __init__(
        self,
        rpc: RPCNode,
        dht: DHTClient,
        *,
        schema: bytes,
        target_group_size: int,
        min_group_size: int = 2,
        matchmaking_time: float = 5.0,
        bandwidth: float = 1.0,
        client_mode: bool = False,
        min_quiet: float = 0.01,
        nursery: trio.Nursery | None = None,
        description: list[list[Any]] | None = None,
    ):
        if not 1 <= min_group_size <= target_group_size:
            raise ValueError("need 1 <= min_group_size <= target_group_size")
        self.rpc = rpc
        self.dht = dht
        self.peer_id: PeerID = rpc.peer_id
        self.schema = bytes(schema)
        self.target = target_group_size
        self.min_size = min_group_size
        self.matchmaking_time = matchmaking_time
        self.bandwidth = bandwidth
        self.client_mode = client_mode
        self.nursery = nursery
        self.spread = 0.0  # how far apart in time the last group's members declared
        self.banned: set[PeerID] = set()  # see "Bans" above
        self._round: MatchRound | None = None
        self.stats = {"attempts": 0, "groups": 0, "no_group": 0, "abandoned": 0, "collected": 0, "joins_served": 0,
                      "redirects": 0, "rejects": 0, "dead_peers": 0}
        self.pacing = Pacing(matchmaking_time, min_quiet)
        self.rtt = self.pacing.rtt  # the averager reports it
        self.patience = Patience(self.pacing, self.peer_id, self.banned)
        self.schemas = ForeignSchemas(rpc, self.schema, description, nursery)
        self.board = DeclarationBoard(dht, self.peer_id, self.schema, pacing=self.pacing, banned=self.banned,
                                      on_foreign=self.schemas.notice, nursery=nursery)
        self.prober = Prober(rpc, pacing=self.pacing, target=target_group_size, banned=self.banned, stats=self.stats)
        self.joins = Joins(rpc, pacing=self.pacing, target=target_group_size, banned=self.banned, stats=self.stats,
                           min_size=min_group_size, my_collector=self._my_collector)

    def register(self) -> None:
        self.rpc.register(JOIN_METHOD, self._handle_join)
        self.rpc.register(PING_METHOD, self._handle_ping)
        self.rpc.register(SCHEMA_METHOD, self.schemas.handle)

    def unregister(self) -> None:
        self.rpc.unregister(JOIN_METHOD)
        self.rpc.unregister(PING_METHOD)
        self.rpc.unregister(SCHEMA_METHOD)

    async def _handle_join(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        return await self.joins.answer(self._round, ctx, args)

    async def _handle_ping(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        return self.prober.answer(self._round, ctx, args)

    @property
    def address(self) -> Address | None:
        return None if self.client_mode else self.rpc.announced_address

    @property
    def quiet_period(self) -> float:
        """How long a view must stay unchanged before acting on it (`Pacing.quiet_period`)."""
        return self.pacing.quiet_period

    def forget(self, peer_ids: Iterable[bytes]) -> None:
        """Peers known dead (e.g. lost during the all-reduce): stop expecting them in the next rounds."""
        self.patience.forget(peer_ids)

    def ban(self, peer_ids: Iterable[bytes]) -> None:
        """Never group with these peers again (see "Bans" above); they stop being expected at once."""
        self.banned.update(PeerID(bytes(p)) for p in peer_ids)
        self.banned.discard(self.peer_id)

    # ------------------------------------------------------------------------------------------- planning

    def _plan(self, state: MatchRound) -> list[list[Declaration]]:
        visible = [d for p, d in state.view.items() if p not in state.excluded] + [state.me]
        return plan_groups(visible, self.target, salt=round_salt(state.key, visible),
                           full_only=self.patience.patient(state))

    def _quiet_for(self, state: MatchRound, now: float, chunk: list[Declaration]) -> float:
        """How long the part of the view that matters to me has been still: no peer appeared (the view may still
        be filling) and my chunk kept its members. Peers leaving the view for groups sealed elsewhere do not
        count unless they move my chunk: in a first round of 64 peers every seal withdraws a few declarations,
        and a peer whose full chunk none of them touched waited out every withdrawal, half a second, while its
        collector, short of it, handed its joiners over and sealed 2."""
        members = tuple(d.peer_id for d in chunk)
        if members != state.chunk:
            state.chunk, state.chunk_since = members, now
        return now - max(state.last_change, state.chunk_since)

    def _my_collector(self, state: MatchRound) -> Declaration | None:
        return collector_of(chunk_of(self._plan(state), self.peer_id))

    # ------------------------------------------------------------------------------------------- a round

    async def find_group(self, key: str, round: int, *, timeout: float | None = None, expected: int = 0,
                         left_behind: Callable[[], Awaitable[bool]] | None = None) -> MatchResult:
        """Declare under `key`, assemble a group, return it (or `group=None` with a reason). Peers that fail are
        reported in `failed_peers`, never raised. `expected`: how many peers (me included) the caller knows are
        on their way (e.g. DiLoCo trainers that said they are ready): expected like peers of recent rounds, even
        in a first round under the key, and waited for up to half the window (not only the straggler wait).
        `left_behind`: asked every tenth of the window while nobody else is in view, whether the peers the
        caller came for went on without it (the collaborative optimizer: all of them are in a later epoch); a
        True ends such a round at once without a group, instead of blocking the caller for the rest of the
        window. Once somebody is in view it is not asked again: there is someone to average with."""
        if self._round is not None:
            raise RuntimeError("find_group is already running on this matchmaker")
        started = trio.current_time()
        window = self.matchmaking_time if timeout is None else max(0.0, min(timeout, self.matchmaking_time))
        now = self.dht.now()
        me = Declaration(self.peer_id, self.address, self.bandwidth, self.client_mode, self.schema, round,
                         now + window, now)
        state = self._round = MatchRound(key, me, now - started, max(self.patience.expected(key), expected))
        state.promised = expected
        self.stats["attempts"] += 1
        expiration = state.expiration = now + window + 1.0
        try:
            with trio.move_on_at(started + window + self.pacing.grace):
                result: MatchResult | None = None
                async with trio.open_nursery() as nursery:
                    # Declaring runs beside gathering: live replicas have the declaration after one round trip,
                    # while the store call itself may wait out a dead replica's timeout.
                    state.declaring = 0
                    nursery.start_soon(self.board.declare, state, 0)
                    await self.board.refresh_view(state)
                    if left_behind is not None:  # judged on a view read at least once
                        nursery.start_soon(self._abandon_if_alone, left_behind, state, nursery.cancel_scope)
                    nursery.start_soon(self.board.poll, state)
                    result = await self._assemble(state, started + window)
                    nursery.cancel_scope.cancel()
                if result is None:  # `_abandon_if_alone` ended the round
                    self.stats["abandoned"] += 1
                    return MatchResult(None, reason="the peers it came for went on without it",
                                       failed_peers=state.failed, seconds=trio.current_time() - started)
                self.joins.last_group = (key, result.group) if result.group is not None else None
                result.seconds = trio.current_time() - started
                return result
            return MatchResult(None, reason="matchmaking window passed", failed_peers=state.failed,
                               seconds=trio.current_time() - started)
        finally:
            self._round = None
            self.patience.remember(state)
            if state.assembly is not None and not state.assembly.closed:
                state.assembly.abandon()
            state.poke()  # every held join gets its final answer
            shards = state.declared_in | ({state.declaring} if state.declaring is not None else set())
            for shard in sorted(shards):
                await self.board.withdraw(shard_key(key, shard), expiration)

    async def _abandon_if_alone(self, left_behind: Callable[[], Awaitable[bool]], state: MatchRound,
                                scope: trio.CancelScope) -> None:
        """`find_group`'s `left_behind`: while nobody else is in view, no group is being collected here and none
        joined, ask it every tenth of the window; end the round when it says so (anyone who shows up later finds
        my declaration withdrawn)."""

        def alone() -> bool:
            collecting_others = state.assembly is not None and len(state.assembly.joined) > 1
            others_in_view = any(peer_id != self.peer_id for peer_id in state.view)
            return not others_in_view and not collecting_others and state.following is None and not state.answered

        while alone():
            await trio.sleep(self.matchmaking_time / 10)
            if alone() and await left_behind() and alone():
                scope.cancel()
                return

    def _result(self, state: MatchRound, decision_or_assembly: Decision | Assembly, collector: PeerID) -> MatchResult:
        if isinstance(decision_or_assembly, Assembly):
            group, group_round = decision_or_assembly.group, decision_or_assembly.round
            times = [d.declared_at for d in decision_or_assembly.joined.values()]
            self.spread = max(times) - min(times)
        else:
            group, group_round = decision_or_assembly.group, decision_or_assembly.round
            if group is None:
                raise LocalViolation("a matchmaking result needs a decision that carries a group")
            times = [state.view[p].declared_at for p in group.peer_ids if p in state.view] + [state.me.declared_at]
            self.spread = max(times) - min(times)
        self.stats["groups"] += 1
        return MatchResult(group, round=group_round, failed_peers=list(state.failed), collector=collector)

    async def _assemble(self, state: MatchRound, deadline: float) -> MatchResult:
        redirects = 0
        redirected: Declaration | None = None  # where the last redirect pointed: join it next, skip planning
        while True:
            if state.invited_by is not None and state.assembly is None:
                redirected, state.invited_by = state.invited_by, None
            now = trio.current_time()
            chunk = chunk_of(self._plan(state), self.peer_id)  # one plan per pass: it sorts the whole view
            collector = collector_of(chunk)
            if redirected is not None and state.assembly is None:
                collector, redirected = redirected, None
                decision = await self._join(state, collector, deadline)
                if decision is not None and decision.kind == "group" and decision.group is not None \
                        and self.peer_id in decision.group:
                    return self._result(state, decision, collector.peer_id)
                if decision is not None and decision.kind == "reject":
                    state.exclude_busy([*decision.busy, collector.peer_id], self.peer_id)
                continue
            if state.assembly is not None or (collector is not None and collector.peer_id == self.peer_id):
                result = await self._collect(state)
                if result is not None:
                    return result
                state.last_change = trio.current_time()
                continue  # stepped down: a lower peer appeared in my chunk
            if now >= deadline:
                self.stats["no_group"] += 1
                return MatchResult(None, reason="no group before the deadline", failed_peers=state.failed)
            if collector is None:  # alone, or only client-mode peers around: wait for a reachable one
                await state.wait_changed(min(deadline, now + self.quiet_period))
                continue
            quiet_for = self._quiet_for(state, now, chunk)
            full = len(chunk) >= self.target
            patient = self.patience.patient(state)
            # under a crowded key, declarations trimmed from a full shard reappear in the next one a few quiet
            # periods late: a full chunk waits as long as a partial one, or the latecomers end in partial groups
            quiet_enough = self.pacing.settle_period if state.crowded else self.quiet_period
            settled = (full and not patient and quiet_for >= quiet_enough) or state.join_arrived \
                or (not patient and quiet_for >= self.pacing.settle_period)
            if not settled:
                await state.wait_changed(min(deadline, now + self.quiet_period / 2))
                continue
            logger.debug("matchmaking %s: joining %s (view %d, chunk %d, quiet %.3f/%.3f)", self.peer_id.short(),
                         collector.peer_id.short(), len(state.view), len(chunk),
                         quiet_for, self.quiet_period)
            decision = await self._join(state, collector, deadline)
            logger.debug("matchmaking %s: answer %s %s", self.peer_id.short(),
                         decision.kind if decision else None, decision.reason if decision else "")
            if decision is None:
                state.last_change = trio.current_time()
                continue  # collector unreachable: excluded, plan again
            if decision.kind == "group" and decision.group is not None and self.peer_id in decision.group:
                return self._result(state, decision, collector.peer_id)
            if decision.kind == "redirect" and decision.redirect is not None and redirects < 4 \
                    and decision.redirect.peer_id < collector.peer_id:
                redirects += 1
                self.stats["redirects"] += 1
                redirected = decision.redirect
                state.excluded.add(collector.peer_id)  # it follows someone else this round
                continue
            # a collector that already left (its withdrawal not visible yet) or a full one: plan again at once
            self.stats["rejects"] += 1
            state.exclude_busy([*decision.busy, collector.peer_id], self.peer_id)

    async def _join(self, state: MatchRound, collector: Declaration, deadline: float) -> Decision | None:
        """One long-poll join (`Joins.join`); None when the collector is unreachable."""
        return await self.joins.join(state, collector, deadline)

    async def _collect(self, state: MatchRound) -> MatchResult | None:
        """Collector role: accept joins until `Assembly.should_seal`. Returns None if I step down (nobody joined
        yet and a lower peer appeared in my chunk)."""
        if state.assembly is None:
            state.assembly = Assembly(state.me, key=state.key, target_group_size=self.target,
                                      min_group_size=self.min_size)
        assembly = state.assembly
        probed: dict[PeerID, float] = {}
        async with trio.open_nursery() as nursery:
            while True:
                chunk = chunk_of(self._plan(state), self.peer_id)
                assembly.set_expected(chunk, state.merging)
                now = trio.current_time()
                quiet_for = self._quiet_for(state, now, chunk)
                patient = state.patient = self.patience.patient(state)
                # a group with room left is final only on a view quiet for as long as a joiner waits before
                # joining a partial chunk (`Pacing.settle_period`); and a peer dropped because it followed another
                # collector may be turned away there (full) and come here next: leave it a moment too
                grace = self.quiet_period + 2 * self.rtt.value
                settled = quiet_for >= self.pacing.settle_period and now - state.last_drop >= grace
                if assembly.should_seal(now + state.offset, settled and not patient):
                    if assembly.full or now + state.offset >= assembly.seal_deadline \
                            or not await self.prober.recheck_followers(state, assembly):
                        break
                    continue
                if quiet_for >= self.quiet_period:
                    for peer_id in sorted(assembly.waiting_for):
                        declaration = state.view.get(peer_id)
                        if declaration is None:
                            logger.debug("matchmaking %s: %s left the view", self.peer_id.short(), peer_id.short())
                            assembly.drop(peer_id)
                        elif declaration.can_collect:
                            if now - probed.get(peer_id, -math.inf) >= self.quiet_period:
                                probed[peer_id] = now
                                nursery.start_soon(self.prober.probe, state, declaration, assembly)
                        elif quiet_for >= self.pacing.settle_period:
                            assembly.drop(peer_id)  # a client-mode peer cannot be probed: don't wait forever
                wake = min(assembly.seal_deadline - state.offset, now + self.quiet_period / 2)
                await state.wait_changed(wake)
                if state.invited_by is not None and not assembly.closed:
                    # a lower collector counts me in and has room for my joiners too: merge into it (_handle_ping)
                    assembly.merge_into(state.invited_by)
                    state.assembly = None
                    state.poke()
                    nursery.cancel_scope.cancel()
                    logger.debug("matchmaking %s: merging %d member(s) into %s", self.peer_id.short(),
                                 len(assembly.joined), state.invited_by.peer_id.short())
                    return None
                if len(assembly.joined) == 1 and not assembly.closed:
                    collector = self._my_collector(state)
                    if collector is not None and collector.peer_id != self.peer_id:
                        state.assembly = None  # step down; joins arriving from now on get redirected
                        nursery.cancel_scope.cancel()
                        return None
                    if state.nobody_left() and trio.current_time() - state.last_change >= self.pacing.settle_period:
                        break  # everyone I can see is dead or taken: waiting out the window helps nobody
            nursery.cancel_scope.cancel()
        group = assembly.seal(assembly.group_id())
        state.poke()
        logger.debug("matchmaking %s: sealed %d member(s) (waiting for %d, dropped %d, view %d)", self.peer_id.short(),
                     len(assembly.joined), len(assembly.waiting_for), len(assembly.dropped), len(state.view))
        if group is None:
            self.stats["no_group"] += 1
            return MatchResult(None, reason=f"only {len(assembly.joined)} peer(s) joined", failed_peers=state.failed,
                               collector=self.peer_id)
        self.stats["collected"] += 1
        return self._result(state, assembly, self.peer_id)
