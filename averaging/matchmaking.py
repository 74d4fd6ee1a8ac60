"""Matchmaking through the DHT: who averages with whom this round, with no master and no leader chosen in advance.

Every peer declares under the round's group key, reads the key's declarations into a view, and derives the same
plan from the same view: chunks of about `target_group_size`, in each the reachable peer with the lowest PeerID
collecting the others' joins and sealing the group. Views that differ converge through redirects, step-downs,
merges and hand-overs; waits are measured, never configured (the window only bounds them). The protocol, step by
step, with why each rule is there: docs/architecture/matchmaking.md.

Layout: the decisions live in cores with no trio and no clock inside, tested message by message:
`averaging.match_machine` (one round's machines: when a joiner joins whom, when a collector probes, seals, steps
down or merges; tests/averaging/test_match_machine.py) and `averaging.assembly` (declarations, `plan_groups`, the
collector's `Assembly`: joins in, answers and seal verdicts out; tests/averaging/test_assembly_core.py).
This module is the driver: `Matchmaker.find_group` runs a round, doing what the machines answer. Each of its other
jobs is a collaborator it owns, in a module of its own:
`match_round` (what one round knows, and the long polls held on it), `match_dht` (declare, read the view,
withdraw), `match_join` (`avg.mm.join`, both ways), `match_ping` (`avg.mm.ping`, both ways), `match_waits` (the
adaptive waits: quiet period, probe timeout, straggler and follow waits) and `match_schema` (peers of another
model, named once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import trio

from averaging.assembly import Assembly, Decision, Declaration
from averaging.errors import LocalViolation
from averaging.group import GroupInfo
from averaging.match_dht import MAX_SHARDS, SHARD_CROWDED, DeclarationBoard, shard_key
from averaging.match_join import JOIN_METHOD, Joins
from averaging.match_machine import (
    Collect,
    CollectorMachine,
    Join,
    Planner,
    Recheck,
    RoundMachine,
    StepDown,
    Wait,
)
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
    """Runs the protocol (docs/architecture/matchmaking.md) for one peer; one `find_group` at a time (the averager
    serialises steps).

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
        self.banned: set[PeerID] = set()  # docs/architecture/matchmaking.md, "Bans"
        self._round: MatchRound | None = None
        self.stats = {"attempts": 0, "groups": 0, "no_group": 0, "abandoned": 0, "collected": 0, "joins_served": 0,
                      "redirects": 0, "rejects": 0, "dead_peers": 0}
        self.pacing = Pacing(matchmaking_time, min_quiet)
        self.rtt = self.pacing.rtt  # the averager reports it
        self.patience = Patience(self.pacing, self.peer_id, self.banned)
        self.planner = Planner(self.peer_id, target_group_size, self.patience)
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
        """Never group with these peers again (docs/architecture/matchmaking.md, "Bans"); they stop being expected
        at once."""
        self.banned.update(PeerID(bytes(p)) for p in peer_ids)
        self.banned.discard(self.peer_id)

    def _my_collector(self, state: MatchRound) -> Declaration | None:
        """Whom I would join in `state` now (possibly myself): the join handler redirects by it."""
        return self.planner.collector(state, trio.current_time())

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
        state = self._round = MatchRound(key, me, now - started, max(self.patience.expected(key), expected), started)
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
        else:
            group, group_round = decision_or_assembly.group, decision_or_assembly.round
            if group is None:
                raise LocalViolation("a matchmaking result needs a decision that carries a group")
            times = [state.view[p].declared_at for p in group.peer_ids if p in state.view] + [state.me.declared_at]
        self.spread = max(times) - min(times)
        self.stats["groups"] += 1
        return MatchResult(group, round=group_round, failed_peers=list(state.failed), collector=collector)

    async def _assemble(self, state: MatchRound, deadline: float) -> MatchResult:
        """Drive the round's machine (`RoundMachine`): each action it answers is done here, and reported back."""
        machine = RoundMachine(state, self.planner, self.pacing, deadline=deadline, stats=self.stats)
        while True:
            action = machine.next_action(trio.current_time())
            if isinstance(action, Wait):
                await state.wait_changed(action.until)
            elif isinstance(action, Join):
                logger.debug("matchmaking %s: joining %s (view %d, phase %s)", self.peer_id.short(),
                             action.collector.peer_id.short(), len(state.view), machine.phase.value)
                decision = await self._join(state, action.collector, deadline)
                logger.debug("matchmaking %s: answer %s %s", self.peer_id.short(),
                             decision.kind if decision else None, decision.reason if decision else "")
                if machine.answered(decision, trio.current_time()):
                    assert machine.result is not None
                    return self._result(state, machine.result, action.collector.peer_id)
            elif isinstance(action, Collect):
                result = await self._collect(state)
                machine.collected(result is not None, trio.current_time())
                if result is not None:
                    return result
            else:
                return MatchResult(None, reason=action.reason, failed_peers=state.failed)

    async def _join(self, state: MatchRound, collector: Declaration, deadline: float) -> Decision | None:
        """One long-poll join (`Joins.join`); None when the collector is unreachable."""
        return await self.joins.join(state, collector, deadline)

    async def _collect(self, state: MatchRound) -> MatchResult | None:
        """Drive the collector's machine (`CollectorMachine`) until it seals; None if it stepped down (a lower
        peer appeared in my chunk, or I merged into a lower collector that invited me)."""
        machine = CollectorMachine(state, self.planner, self.pacing, min_size=self.min_size)
        assembly = machine.assembly
        async with trio.open_nursery() as probes:
            while True:
                action = machine.next_action(trio.current_time())
                if isinstance(action, Wait):
                    for declaration in action.probe:
                        probes.start_soon(self.prober.probe, state, declaration, assembly)
                    await state.wait_changed(action.until)
                elif isinstance(action, Recheck):
                    if not await self.prober.recheck_followers(state, assembly):
                        break
                elif isinstance(action, StepDown):
                    state.poke()  # held joins get their redirect
                    probes.cancel_scope.cancel()
                    if action.merged_into is not None:
                        logger.debug("matchmaking %s: merging %d member(s) into %s", self.peer_id.short(),
                                     len(assembly.joined), action.merged_into.peer_id.short())
                    return None
                else:
                    break
            probes.cancel_scope.cancel()
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
