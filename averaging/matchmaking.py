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
3. **Join.** A non-collector waits until its view has been quiet for `q` (a few measured DHT reads and stores)
   and then sends one `avg.mm.join` call to its collector: a long poll answered with the final member list, a
   redirect, or a rejection.
4. **Collect and seal.** The collector accepts joins (same key and schema, room left, not sealed) and seals as
   soon as the group is full, or once every live member of its chunk has joined and the view is quiet, or at the
   seal deadline (the earliest deadline of its members, so nobody has given up). Chunk members that haven't
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
This module is the driver: DHT reads and writes, the join and ping calls and handlers, the long polls it holds
until the assembly's answer is final, and the adaptive waits (quiet period, straggler and follow waits).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import trio

from averaging.assembly import (
    WITHDRAWN,
    Assembly,
    Decision,
    Declaration,
    chunk_of,
    collector_of,
    plan_groups,
    read_probe_answer,
    round_salt,
)
from averaging.errors import LocalViolation
from averaging.group import GroupInfo
from averaging.schema import MISMATCHES, difference
from dht.client import DHTClient
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import CallContext, CallTimeout, RemoteError, RPCError, RPCNode

__all__ = ["JOIN_METHOD", "PING_METHOD", "MatchResult", "Matchmaker"]

logger = logging.getLogger(__name__)

JOIN_METHOD = "avg.mm.join"
PING_METHOD = "avg.mm.ping"
SCHEMA_METHOD = "avg.mm.schema"  # -> {"schema": [[name, shape, dtype], ...]}: what a peer of another model asks
SCHEMA_TIMEOUT = 3.0
# One DHT record holds about 42 signed declarations (one datagram, about 190 bytes each): a key's declarations
# overflow into shards `key#1`, `key#2`... A declarer that finds a crowded shard without its own declaration (the
# holders trimmed it, dht.records.fit) moves to the next shard; a reader reads the next shard whenever the one it
# just read is crowded. Small swarms never read more than the one key.
SHARD_CROWDED = 32
MAX_SHARDS = 16


def shard_key(key: str, shard: int) -> str:
    """The DHT key of a matchmaking key's `shard` (0 is the key itself)."""
    return key if shard == 0 else f"{key}#{shard}"



# --------------------------------------------------------------------------------------------- the driver


@dataclass
class MatchResult:
    """Outcome of one matchmaking: the group (None when none assembled), who turned out dead, and why."""

    group: GroupInfo | None
    round: int = 0  # the group's round, identical for every member (max of the members' declared rounds)
    failed_peers: list[PeerID] = field(default_factory=list)
    reason: str = ""
    collector: PeerID | None = None
    seconds: float = 0.0


class _EWMA:
    def __init__(self, initial: float, alpha: float = 0.3):
        self.value = initial
        self.alpha = alpha

    def update(self, sample: float) -> None:
        self.value = (1 - self.alpha) * self.value + self.alpha * max(0.0, sample)


class _Round:
    """Everything one `find_group` call knows; handlers read it to answer joins and probes."""

    def __init__(self, key: str, me: Declaration, offset: float, expected: int):
        self.key = key
        self.me = me
        self.offset = offset  # DHT clock minus trio clock
        self.started = trio.current_time()
        self.expected = expected  # peers (me included) seen under this key in recent rounds
        self.promised = 0  # peers (me included) the caller knows are on their way: waited for up to half the window
        self.seen: set[PeerID] = set()  # every peer seen under the key this round
        self.last_change = self.started  # when the set of visible peers (or of excluded ones) last changed
        self.population_reached_after: float | None = None  # seconds until every expected peer was visible
        self.patience_ran_out = False
        self.probe_timeouts: dict[PeerID, int] = {}
        self.invited_by: Declaration | None = None  # a lower collector asked me to merge into its group
        self.merging: set[PeerID] = set()  # peers a higher collector is handing over to me
        self.last_drop = -math.inf  # when a probe last found an expected peer following another collector
        self.following_others: set[PeerID] = set()  # those peers (rechecked once before sealing with room left)
        self.following_since: dict[PeerID, float] = {}  # when a probe first found a chunk member following another
        self.view: dict[PeerID, Declaration] = {}
        self.excluded: set[PeerID] = set()
        # peers excluded as taken (in a sealed or full group) -> declared_at of their declaration then: a newer
        # declaration means they finished that group's averaging and are matching again
        self.busy_as_of: dict[PeerID, float] = {}
        self.failed: list[PeerID] = []
        self.assembly: Assembly | None = None
        self.following: Declaration | None = None
        self.changed = trio.Event()
        self.answered: dict[PeerID, tuple[Assembly, trio.Event]] = {}  # joins held in a long poll
        self.join_arrived = False
        self.patient = False  # the collector loop's last verdict of Matchmaker._patient (sent with my probes)
        self.stale: dict[PeerID, float] = {}  # peer -> declared_at of a declaration its owner no longer runs
        self.returning: set[PeerID] = set()  # stale peers between two rounds (not matching elsewhere): coming back
        self.shard = 0  # where my declaration lives (see SHARD_CROWDED)
        self.declared_in: set[int] = set()  # shards holding a declaration of mine (all withdrawn at the end)
        self.declaring: int | None = None  # the shard my declaration is on its way to
        self.expiration = 0.0  # of my declaration
        self.crowded = False  # a read met a crowded shard: declarations may still be moving to the next ones

    def exclude_busy(self, peer_ids: Iterable[PeerID], me: PeerID) -> None:
        """Plan without peers a collector reported taken, until they declare again. Excluding them for the rest
        of the round split 8 peers 4 + 2 + 2: a peer turned away by a sealed group kept skipping its members
        after they came back from averaging, and sealed 2 while they were collecting 2 of their own."""
        for peer_id in peer_ids:
            if peer_id != me:
                self.excluded.add(peer_id)
                seen = self.view.get(peer_id)
                self.busy_as_of[peer_id] = seen.declared_at if seen is not None else -math.inf

    def poke(self) -> None:
        """Something changed: wake the matchmaking loop, and every held join whose answer became final."""
        self.changed.set()
        for joiner, (assembly, event) in self.answered.items():
            if assembly.answer_ready(joiner):
                event.set()

    async def answer_of(self, assembly: Assembly, joiner: PeerID) -> Decision:
        """Hold a joiner's long poll until the assembly's answer for it is final (every poke checks)."""
        entry = self.answered.setdefault(joiner, (assembly, trio.Event()))
        if assembly.answer_ready(joiner):
            entry[1].set()
        try:
            await entry[1].wait()
        finally:
            if self.answered.get(joiner) is entry:
                del self.answered[joiner]
        return assembly.answer(joiner)

    async def wait_changed(self, until_trio_time: float) -> None:
        self.changed = trio.Event()
        with trio.move_on_at(until_trio_time):
            await self.changed.wait()


class Matchmaker:
    """Runs the protocol above for one peer; one `find_group` at a time (the averager serialises steps).

    `register()` adds the `avg.mm.join` and `avg.mm.ping` handlers to the RPC node. A join that arrives while this
    peer is not matchmaking under the caller's key is rejected at once ("not matching"), never left hanging.
    `nursery` (optional) runs background withdrawals; without one, the withdrawal is awaited (bounded).
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
        self.description = description  # averaging.schema.describe of my tensors, served to peers of other models
        self._foreign: set[PeerID] = set()  # peers declaring another schema, already looked into
        self.target = target_group_size
        self.min_size = min_group_size
        self.matchmaking_time = matchmaking_time
        self.bandwidth = bandwidth
        self.client_mode = client_mode
        self.min_quiet = min_quiet
        self.nursery = nursery
        self.dht_latency = _EWMA(0.01)
        self.store_latency = _EWMA(0.01)
        self.rtt = _EWMA(0.02)
        self.spread = 0.0  # how far apart in time the last group's members declared
        self._patience = 0.0  # see straggler_wait
        self._recent: dict[str, list[set[PeerID]]] = {}  # key -> peers seen there in the last few rounds
        self._forgotten: set[PeerID] = set()
        self.banned: set[PeerID] = set()  # see "Bans" above
        self._round: _Round | None = None
        self._last_group: tuple[str, GroupInfo] | None = None  # (key, group) of my last round, for late joiners
        self.stats = {"attempts": 0, "groups": 0, "no_group": 0, "abandoned": 0, "collected": 0, "joins_served": 0,
                      "redirects": 0, "rejects": 0, "dead_peers": 0}

    def register(self) -> None:
        self.rpc.register(JOIN_METHOD, self._handle_join)
        self.rpc.register(PING_METHOD, self._handle_ping)
        self.rpc.register(SCHEMA_METHOD, self._handle_schema)

    def unregister(self) -> None:
        self.rpc.unregister(JOIN_METHOD)
        self.rpc.unregister(PING_METHOD)
        self.rpc.unregister(SCHEMA_METHOD)

    async def _handle_schema(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        return {"schema": self.description}

    def _foreign_schema(self, declaration: Declaration) -> None:
        """A peer under my key declares another model: say so once, naming what differs. Both sides do this
        (each sees the other's declaration), so both print one line; they never group (the schema check)."""
        peer = declaration.peer_id
        if peer in self._foreign:
            return
        self._foreign.add(peer)
        if self.nursery is not None and declaration.address is not None and self.description is not None:
            self.nursery.start_soon(self._explain_schema, declaration)
        else:
            MISMATCHES.report(bytes(peer), f"model schema {declaration.schema.hex()} there, {self.schema.hex()} here",
                              logger, f"matchmaking: peer {peer.short()}")

    async def _explain_schema(self, declaration: Declaration) -> None:
        differs = f"model schema {declaration.schema.hex()} there, {self.schema.hex()} here"
        assert declaration.address is not None  # see _foreign_schema
        try:
            answer = await self.rpc.call(declaration.address, SCHEMA_METHOD, {}, timeout=SCHEMA_TIMEOUT,
                                         peer_id=declaration.peer_id)
            theirs = answer.get("schema") if isinstance(answer, dict) else None
            if isinstance(theirs, list) and all(isinstance(t, list) and len(t) == 3 for t in theirs):
                differs = difference(self.description or [], theirs) or differs
        except RPCError as error:  # an older peer, or gone: the hashes are all there is to say
            logger.debug("matchmaking: asking %s for its schema failed: %s", declaration.peer_id.short(), error)
        MISMATCHES.report(bytes(declaration.peer_id), differs, logger,
                          f"matchmaking: peer {declaration.peer_id.short()}")

    @property
    def address(self) -> Address | None:
        return None if self.client_mode else self.rpc.announced_address

    # ------------------------------------------------------------------------------------------- adaptivity

    @property
    def quiet_period(self) -> float:
        """How long a view must stay unchanged before acting on it: a few measured DHT reads and about one
        measured store, so a declaration stored at the same time as mine has landed. (Waiting for peers that are
        late is `straggler_wait`'s job.)"""
        upper = max(self.min_quiet, self.matchmaking_time / 4)
        return min(upper, max(self.min_quiet, 3 * self.dht_latency.value, 1.5 * self.store_latency.value))

    @property
    def straggler_wait(self) -> float:
        """How long to hold out for peers seen in recent rounds but not here yet (peers leave their previous
        round at different times). Adapted from outcomes: it doubles after a round in which it ran out with peers
        still missing, and shrinks toward twice the wait that was actually needed when everyone arrived in time;
        bounded by a quarter of the window, so a dead peer costs at most that, and only for a round or two."""
        return min(self.matchmaking_time / 4, max(4 * self.quiet_period, self._patience))

    def forget(self, peer_ids: Iterable[bytes]) -> None:
        """Peers known dead (e.g. lost during the all-reduce): stop expecting them in the next rounds."""
        self._forgotten.update(PeerID(bytes(p)) for p in peer_ids)
        for history in self._recent.values():
            for seen in history:
                seen.difference_update(self._forgotten)

    def ban(self, peer_ids: Iterable[bytes]) -> None:
        """Never group with these peers again (see "Bans" above); they stop being expected at once."""
        self.banned.update(PeerID(bytes(p)) for p in peer_ids)
        self.banned.discard(self.peer_id)

    def _expected_population(self, key: str) -> int:
        history = self._recent.get(key, [])
        return len(set().union(*history) - self._forgotten - self.banned | {self.peer_id}) if history else 0

    def _remember_population(self, state: _Round) -> None:
        seen = (state.seen | set(state.view)) - set(state.failed) - {self.peer_id}
        history = self._recent.setdefault(state.key, [])
        history.append(seen)
        del history[:-2]  # a peer not seen for 2 rounds under this key is no longer expected
        if len(self._recent) > 64:
            self._recent.pop(next(iter(self._recent)))
        if state.patience_ran_out:
            self._patience = min(self.matchmaking_time / 4, 2 * max(self._patience, 4 * self.quiet_period))
        elif state.population_reached_after is not None:
            self._patience = max(0.8 * self._patience, 2 * state.population_reached_after)

    def _patient(self, state: _Round) -> bool:
        """True while peers seen in recent rounds are missing and the straggler wait has not run out."""
        visible = 1 + sum(1 for p in state.view if p not in state.excluded)
        waited = trio.current_time() - state.started
        if visible >= state.expected:
            if state.population_reached_after is None and state.expected > 1:
                state.population_reached_after = waited
            return False
        if waited < self.straggler_wait:
            return True
        if waited < self.matchmaking_time / 4 and any(p not in state.view for p in state.returning):
            return True  # a peer told us it is still averaging its previous round: it is on its way
        if visible < state.promised and waited < self.matchmaking_time / 2:
            return True  # the caller knows these peers are on their way (`find_group`'s `expected`)
        state.patience_ran_out = True
        return False

    @property
    def probe_timeout(self) -> float:
        """A live peer answers a probe in one RTT, but a loaded one may take many: a probe that times out is only
        a suspicion; two in a row (or a refused connection) drop the peer."""
        return min(1.0, max(0.2, 10 * self.rtt.value))

    @property
    def follow_wait(self) -> float:
        """How long a collector with room keeps waiting for a member of its chunk that follows another collector:
        long enough for that collector to answer it (seal, or turn it away) and for it to come here, i.e. a few
        quiet periods and round trips; bounded, because two collectors could each wait for the other's
        followers."""
        return min(self.matchmaking_time / 4, max(8 * self.quiet_period, 2 * self.probe_timeout))

    def _grace(self) -> float:
        return self.quiet_period + 4 * self.rtt.value + 0.05

    # ------------------------------------------------------------------------------------------- planning

    def _plan(self, state: _Round) -> list[list[Declaration]]:
        visible = [d for p, d in state.view.items() if p not in state.excluded] + [state.me]
        return plan_groups(visible, self.target, salt=round_salt(state.key, visible), full_only=self._patient(state))

    def _my_collector(self, state: _Round) -> Declaration | None:
        return collector_of(chunk_of(self._plan(state), self.peer_id))

    async def _refresh_view(self, state: _Round) -> bool:
        """Read the key once and merge it into the view; True when the set of compatible peers changed.

        Merge, not replace: one read may reach only some replicas and miss a declaration another read saw, and a
        view that flickers never becomes quiet. A peer leaves the view only when its withdrawal (or a newer
        entry) is read, or when its declaration expires."""
        entries: list[tuple[Any, Any]] = []
        for shard in range(MAX_SHARDS):
            t0 = trio.current_time()
            try:
                # A frugal read of the DHT's usual three replicas (my own copy counts as one, dht/node.py `get`):
                # no query beyond those it still lacks, where a default get keeps alpha in flight and a fourth
                # started before the third answered. These reads are most of a round's DHT traffic. Two replicas
                # (quorum=2) were cheaper still, but with views built from them 7 of 12 runs (trio scheduler
                # seeded) of test_back_to_back_rounds_with_jitter_form_full_groups had a round with a group short.
                record = await self.dht.get(shard_key(state.key, shard), latest=False, frugal=True)
            except Exception as error:  # a DHT hiccup is one stale view, not a failed round
                logger.debug("matchmaking: reading %s failed: %s", shard_key(state.key, shard), error)
                return False
            # one read stalled by a dead replica must not inflate every later quiet period
            self.dht_latency.update(min(trio.current_time() - t0, 2 * self.dht_latency.value + 0.01))
            subkeys = getattr(record, "subkeys", None) or {}
            entries.extend(subkeys.items())
            crowded = self._note_shard(state, shard, subkeys)
            if not crowded and shard >= state.shard:
                break
        now = self.dht.now()
        view = {p: d for p, d in state.view.items() if d.deadline + 1.0 >= now}
        readmitted = False
        for subkey, entry in entries:
            if not isinstance(subkey, (bytes, bytearray)) or len(subkey) != 20:
                continue
            declaration = Declaration.from_wire(bytes(subkey), entry.value)
            if declaration is not None and declaration.peer_id in self.banned:
                view.pop(declaration.peer_id, None)
                continue
            if declaration is None or entry.expiration_time < now or declaration.deadline < state.me.declared_at:
                view.pop(PeerID(bytes(subkey)), None)  # withdrawn, or only an old round's entry is left
            elif declaration.declared_at <= state.stale.get(declaration.peer_id, -math.inf):
                view.pop(declaration.peer_id, None)  # its owner said it is not matching: see _probe
            elif declaration.schema != self.schema:
                self._foreign_schema(declaration)
            else:
                view[declaration.peer_id] = declaration
                if declaration.declared_at > state.busy_as_of.get(declaration.peer_id, math.inf):
                    del state.busy_as_of[declaration.peer_id]  # back from its group's averaging: matching again
                    state.excluded.discard(declaration.peer_id)
                    readmitted = True
                if state.stale.pop(declaration.peer_id, None) is not None and state.assembly is not None:
                    # back from averaging with a new declaration: it is matching now, worth waiting for again
                    state.assembly.readmit(declaration.peer_id)
        view.pop(self.peer_id, None)
        state.seen.update(view)
        if state.assembly is not None:  # peers that joined me count even if their declaration isn't visible
            for peer_id, declaration in state.assembly.joined.items():
                view.setdefault(peer_id, declaration)
        changed = set(view) != set(state.view) or readmitted
        state.view = view
        return changed

    # ------------------------------------------------------------------------------------------- a round

    async def find_group(self, key: str, round: int, *, timeout: float | None = None, expected: int = 0,
                         left_behind: Callable[[], Awaitable[bool]] | None = None) -> MatchResult:
        """Declare under `key`, assemble a group, return it (or `group=None` with a reason). Peers that fail are
        reported in `failed_peers`, never raised. `expected`: how many peers (me included) the caller knows are
        on their way (e.g. DiLoCo trainers that said they are ready): expected like peers of recent rounds, even
        in a first round under the key, and waited for up to half the window (not only `straggler_wait`).
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
        state = self._round = _Round(key, me, now - started, max(self._expected_population(key), expected))
        state.promised = expected
        self.stats["attempts"] += 1
        expiration = state.expiration = now + window + 1.0
        try:
            with trio.move_on_at(started + window + self._grace()):
                result: MatchResult | None = None
                async with trio.open_nursery() as nursery:
                    # Declaring runs beside gathering: live replicas have the declaration after one round trip,
                    # while the store call itself may wait out a dead replica's timeout.
                    state.declaring = 0
                    nursery.start_soon(self._declare, state, 0)
                    await self._refresh_view(state)
                    if left_behind is not None:  # judged on a view read at least once
                        nursery.start_soon(self._abandon_if_alone, left_behind, state, nursery.cancel_scope)
                    nursery.start_soon(self._poll, state)
                    result = await self._assemble(state, started + window)
                    nursery.cancel_scope.cancel()
                if result is None:  # `_abandon_if_alone` ended the round
                    self.stats["abandoned"] += 1
                    return MatchResult(None, reason="the peers it came for went on without it",
                                       failed_peers=state.failed, seconds=trio.current_time() - started)
                self._last_group = (key, result.group) if result.group is not None else None
                result.seconds = trio.current_time() - started
                return result
            return MatchResult(None, reason="matchmaking window passed", failed_peers=state.failed,
                               seconds=trio.current_time() - started)
        finally:
            self._round = None
            self._remember_population(state)
            if state.assembly is not None and not state.assembly.closed:
                state.assembly.abandon()
            state.poke()  # every held join gets its final answer
            shards = state.declared_in | ({state.declaring} if state.declaring is not None else set())
            for shard in sorted(shards):
                await self._withdraw(shard_key(key, shard), expiration)

    async def _abandon_if_alone(self, left_behind: Callable[[], Awaitable[bool]], state: _Round,
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

    async def _declare(self, state: _Round, shard: int) -> None:
        key = shard_key(state.key, shard)
        t0 = trio.current_time()
        try:
            if not await self.dht.store(key, state.me.to_wire(), state.expiration, subkey=bytes(self.peer_id),
                                        signed=True):
                logger.debug("matchmaking: no replica acknowledged my declaration under %s", key)
            self.store_latency.update(min(trio.current_time() - t0, 2 * self.store_latency.value + 0.01))
        except Exception as error:  # joins still work: peers that see me find me; others I join myself
            logger.debug("matchmaking: declaring under %s failed: %s", key, error)
        finally:
            state.declared_in.add(shard)
            if state.declaring == shard:
                state.declaring = None
        if state.crowded and state.declaring is None and shard == state.shard:
            # under a crowded key the holders may have dropped it: check now, not at the next poll, so that the
            # peers planning with the others see me the sooner (uncrowded keys skip this read)
            try:
                record = await self.dht.get(key, latest=False, frugal=True)
            except Exception as error:
                logger.debug("matchmaking: reading %s failed: %s", key, error)
                return
            self._note_shard(state, shard, getattr(record, "subkeys", None) or {})

    def _note_shard(self, state: _Round, shard: int, subkeys: dict[Any, Any]) -> bool:
        """What a read of `shard` says: whether it is crowded; and when it is my shard, my declaration has landed
        and the holders kept others' instead, declare in the next shard. The one place that decides to move."""
        crowded = len(subkeys) >= SHARD_CROWDED
        state.crowded = state.crowded or crowded
        if crowded and shard == state.shard and shard + 1 < MAX_SHARDS and state.declaring is None \
                and shard in state.declared_in and bytes(self.peer_id) not in subkeys:
            self._overflow(state, shard + 1)
        return crowded

    def _overflow(self, state: _Round, shard: int) -> None:
        """Declare again in `shard`: the previous one is full and its holders kept others' declarations."""
        logger.debug("matchmaking %s: %s is crowded, declaring in shard %d", self.peer_id.short(), state.key, shard)
        state.shard = state.declaring = shard
        if self.nursery is not None:
            try:
                self.nursery.start_soon(self._declare, state, shard)
                return
            except RuntimeError:  # the owner is shutting down
                pass
        state.declaring = None

    async def _withdraw(self, key: str, expiration: float) -> None:
        """Overwrite my declaration so latecomers don't plan with me. 1 ms later expiration wins the merge
        against this declaration but loses against my next one."""

        async def withdraw() -> None:
            with trio.move_on_after(2.0):
                try:
                    await self.dht.store(key, WITHDRAWN, expiration + 1e-3, subkey=bytes(self.peer_id), signed=True)
                except Exception as error:  # costs latecomers one rejected join at most
                    logger.debug("matchmaking: withdrawing from %s failed: %s", key, error)

        if self.nursery is not None:
            try:
                self.nursery.start_soon(withdraw)
            except RuntimeError:  # the owner is shutting down: nobody will plan with a dead peer for long
                pass
        else:
            with trio.CancelScope(shield=True):
                await withdraw()

    def _result(self, state: _Round, decision_or_assembly: Decision | Assembly, collector: PeerID) -> MatchResult:
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

    async def _poll(self, state: _Round) -> None:
        """Keep the view fresh in the background: a slow read (a dead replica answering nothing) delays only the
        view, never a join or a seal."""
        while True:
            await trio.sleep(max(self.min_quiet, self.quiet_period / 2))
            # Also while my join is held by its collector: skipping those reads (most of matchmaking's DHT
            # traffic) left followers planning their next rounds on stale views: in 9 of 16 runs of
            # test_back_to_back_rounds_with_jitter_form_full_groups some peer's round then ended without a group.
            if await self._refresh_view(state):
                state.last_change = trio.current_time()
                state.poke()

    async def _assemble(self, state: _Round, deadline: float) -> MatchResult:
        redirects = 0
        redirected: Declaration | None = None  # where the last redirect pointed: join it next, skip planning
        while True:
            if state.invited_by is not None and state.assembly is None:
                redirected, state.invited_by = state.invited_by, None
            now = trio.current_time()
            collector = self._my_collector(state)
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
            quiet_for = now - state.last_change
            full = len(chunk_of(self._plan(state), self.peer_id)) >= self.target
            patient = self._patient(state)
            # under a crowded key, declarations trimmed from a full shard reappear in the next one a few quiet
            # periods late: a full chunk waits as long as a partial one, or the latecomers end in partial groups
            quiet_enough = (3 if state.crowded else 1) * self.quiet_period
            settled = (full and not patient and quiet_for >= quiet_enough) or state.join_arrived \
                or (not patient and quiet_for >= 3 * self.quiet_period)
            if not settled:
                await state.wait_changed(min(deadline, now + self.quiet_period / 2))
                continue
            logger.debug("matchmaking %s: joining %s (view %d, chunk %d, quiet %.3f/%.3f)", self.peer_id.short(),
                         collector.peer_id.short(), len(state.view), len(chunk_of(self._plan(state), self.peer_id)),
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

    async def _join(self, state: _Round, collector: Declaration, deadline: float) -> Decision | None:
        """One long-poll join; None when the collector is unreachable (it is then excluded and reported)."""
        if collector.address is None or collector.peer_id in self.banned:  # client mode: nobody can join it
            state.excluded.add(collector.peer_id)
            return None
        state.following = collector  # (set before the return above, it stayed set for the rest of the round)
        args = {"key": state.key, "declaration": state.me.to_wire()}
        timeout = max(0.0, deadline - trio.current_time()) + self._grace()
        t0 = trio.current_time()
        try:
            answer = await self.rpc.call(collector.address, JOIN_METHOD, args, timeout=timeout,
                                         peer_id=collector.peer_id)
            decision = Decision.from_wire(answer)
            if decision.kind != "group":
                self.rtt.update(trio.current_time() - t0)
            return decision
        except RemoteError as error:  # it runs no averaging, or refused us: not dead, just not a collector
            logger.debug("matchmaking: %s refused the join: %s", collector.peer_id.short(), error)
        except RPCError as error:  # dead, frozen or unreachable
            logger.debug("matchmaking: collector %s failed: %s", collector.peer_id.short(), error)
            state.failed.append(collector.peer_id)
            self.stats["dead_peers"] += 1
        except (ValueError, KeyError, TypeError) as error:
            logger.debug("matchmaking: bad answer from %s: %s", collector.peer_id.short(), error)
        finally:
            state.following = None
        state.excluded.add(collector.peer_id)
        return None

    async def _collect(self, state: _Round) -> MatchResult | None:
        """Collector role: accept joins until `Assembly.should_seal`. Returns None if I step down (nobody joined
        yet and a lower peer appeared in my chunk)."""
        if state.assembly is None:
            state.assembly = Assembly(state.me, key=state.key, target_group_size=self.target,
                                      min_group_size=self.min_size)
        assembly = state.assembly
        probed: dict[PeerID, float] = {}
        async with trio.open_nursery() as nursery:
            while True:
                assembly.set_expected(chunk_of(self._plan(state), self.peer_id), state.merging)
                now = trio.current_time()
                quiet_for = now - state.last_change
                patient = state.patient = self._patient(state)
                # a peer dropped because it followed another collector may be turned away there (full) and come
                # here next: leave it a moment before sealing a group that still has room
                grace = self.quiet_period + 2 * self.rtt.value
                settled = quiet_for >= self.quiet_period and now - state.last_drop >= grace
                if assembly.should_seal(now + state.offset, settled and not patient):
                    if assembly.full or now + state.offset >= assembly.seal_deadline \
                            or not await self._recheck_followers(state, assembly):
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
                                nursery.start_soon(self._probe, state, declaration, assembly)
                        elif quiet_for >= 3 * self.quiet_period:
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
                    if self._nobody_left(state) and trio.current_time() - state.last_change >= 3 * self.quiet_period:
                        break  # everyone I can see is dead or taken: waiting out the window helps nobody
            nursery.cancel_scope.cancel()
        # unique (my declaration time differs every round) and reproducible in simulations, unlike random bytes
        group_id = hashlib.sha256(b"swarmd-group|" + state.key.encode() + bytes(self.peer_id)
                                  + repr(state.me.declared_at).encode()
                                  + b"".join(sorted(bytes(p) for p in assembly.joined))).digest()[:16]
        group = assembly.seal(group_id)
        state.poke()
        logger.debug("matchmaking %s: sealed %d member(s) (waiting for %d, dropped %d, view %d)", self.peer_id.short(),
                     len(assembly.joined), len(assembly.waiting_for), len(assembly.dropped), len(state.view))
        if group is None:
            self.stats["no_group"] += 1
            return MatchResult(None, reason=f"only {len(assembly.joined)} peer(s) joined", failed_peers=state.failed,
                               collector=self.peer_id)
        self.stats["collected"] += 1
        return self._result(state, assembly, self.peer_id)

    async def _recheck_followers(self, state: _Round, assembly: Assembly) -> bool:
        """Before sealing a group with room left: ask the peers that followed other collectors once more. True
        (keep waiting) when one of them is free again, e.g. turned away by a full collector."""
        followers = sorted(p for p in state.following_others if p not in assembly.joined)
        if not followers:
            return False
        freed = []

        async def ask(peer_id: PeerID) -> None:
            declaration = state.view.get(peer_id)
            if declaration is None or declaration.address is None:
                return
            try:
                answer = await self.rpc.call(declaration.address, PING_METHOD, {"key": state.key, "joined": 0},
                                             timeout=self.probe_timeout, peer_id=peer_id)
            except RPCError:
                return
            following = answer.get("following") if isinstance(answer, dict) else None
            if isinstance(answer, dict) and answer.get("matching") and not answer.get("collecting") \
                    and (following is None or bytes(following) == bytes(self.peer_id)):
                freed.append(peer_id)

        state.following_others.clear()
        async with trio.open_nursery() as nursery:
            for peer_id in followers:
                nursery.start_soon(ask, peer_id)
        for peer_id in freed:
            assembly.dropped.discard(peer_id)
        return bool(freed)

    @staticmethod
    def _nobody_left(state: _Round) -> bool:
        """True when every other peer in view is excluded (dead, or in a sealed group) and there is at least one:
        I came late to a round that has already assembled."""
        return bool(state.view) and all(p in state.excluded for p in state.view)

    async def _probe(self, state: _Round, declaration: Declaration, assembly: Assembly) -> None:
        if declaration.address is None:  # a client-mode peer cannot be called: it answers nobody's probes
            return
        t0 = trio.current_time()
        try:
            answer = await self.rpc.call(declaration.address, PING_METHOD,
                                         {"key": state.key, "joined": len(assembly.joined),
                                          "patient": state.patient},
                                         timeout=self.probe_timeout, peer_id=declaration.peer_id)
            self.rtt.update(trio.current_time() - t0)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("matchmaking %s: probed %s: %s", self.peer_id.short(), declaration.peer_id.short(),
                             {k: (bytes(v).hex()[:12] if isinstance(v, bytes) else v) for k, v in answer.items()}
                             if isinstance(answer, dict) else answer)
            verdict = read_probe_answer(answer, self.peer_id)
            if verdict.kind == "handover":  # a rival collector passes some of its joiners to me: wait for them
                assembly.expect(verdict.members)
                state.merging.update(verdict.members)
                assembly.drop(declaration.peer_id)
            elif verdict.kind == "merging":  # it steps down into my group: wait for it and for its joiners
                assembly.expect(verdict.members)
                state.merging.update(verdict.members)
            elif verdict.kind in ("stale", "busy"):
                if verdict.kind == "stale":
                    # a declaration left over from its previous round (it is averaging, its withdrawal not read
                    # yet): out of the plan until it declares again, and still expected (it will come back)
                    state.stale[declaration.peer_id] = declaration.declared_at
                    if verdict.between_rounds:
                        state.returning.add(declaration.peer_id)
                    if state.view.get(declaration.peer_id) is declaration:
                        del state.view[declaration.peer_id]
                        state.last_change = trio.current_time()
                assembly.drop(declaration.peer_id)
            elif verdict.kind == "follows_other":
                # It follows another collector, which may be full and turn it away (views differ for a moment):
                # then it comes here, and sealing without it would strand it (a 4 + 3 + 1 round). Keep waiting
                # for it (it is probed again every quiet period) until it has followed others for `follow_wait`.
                now = trio.current_time()
                since = state.following_since.setdefault(declaration.peer_id, now)
                if now - since >= self.follow_wait:
                    assembly.drop(declaration.peer_id)
                    state.last_drop = now
                    state.following_others.add(declaration.peer_id)
        except RemoteError:
            assembly.drop(declaration.peer_id)
        except CallTimeout as error:
            count = state.probe_timeouts[declaration.peer_id] = state.probe_timeouts.get(declaration.peer_id, 0) + 1
            logger.debug("matchmaking: %s timed out a probe (%d): %s", declaration.peer_id.short(), count, error)
            if count >= 2:
                assembly.drop(declaration.peer_id)
        except RPCError as error:
            logger.debug("matchmaking: %s failed a probe: %s", declaration.peer_id.short(), error)
            state.excluded.add(declaration.peer_id)  # dead: plan without it from now on
            if declaration.peer_id not in state.failed:
                state.failed.append(declaration.peer_id)
                self.stats["dead_peers"] += 1
            assembly.drop(declaration.peer_id)
        state.poke()

    # ------------------------------------------------------------------------------------------- handlers

    async def _handle_ping(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        state = self._round
        if ctx.peer_id in self.banned:  # not a collector to merge into, nor one to wait for
            return {"matching": False, "following": None, "between_rounds": False, "collecting": False}
        key = args.get("key") if isinstance(args, dict) else None
        matching = state is not None and key == state.key
        their_size = args.get("joined", 1) if isinstance(args, dict) else 1
        patient = bool(args.get("patient", False)) if isinstance(args, dict) else False
        assembly = state.assembly if state is not None and matching else None
        verdict = assembly.probed_by(ctx.peer_id, their_size, reachable=ctx.address is not None,
                                     prober_patient=patient) \
            if assembly is not None else None
        if verdict is not None and state is not None and assembly is not None:
            prober = state.view.get(ctx.peer_id)
            if prober is None:  # not in my view yet: the authenticated caller is enough to join it
                me = state.me
                prober = Declaration(ctx.peer_id, ctx.address, 1.0, False, me.schema, me.round, me.deadline,
                                     me.declared_at)
            if verdict == "merge":  # I step down into it (my loop notices), taking my joiners along
                state.invited_by = prober
                state.poke()
                return {"matching": True, "following": bytes(ctx.peer_id), "collecting": False,
                        "merging": [bytes(p) for p in assembly.joined]}
            moved = assembly.hand_over(prober, self.target - their_size)
            state.poke()
            logger.debug("matchmaking %s: handing %d joiner(s) over to %s", self.peer_id.short(), len(moved),
                         ctx.peer_id.short())
            return {"matching": True, "following": None, "collecting": True, "handover": [bytes(p) for p in moved]}
        following = state.following.peer_id if state is not None and matching and state.following is not None \
            else None
        return {"matching": matching, "following": bytes(following) if following is not None else None,
                "between_rounds": state is None,  # averaging or training: it will declare again
                # a collector nobody joined yet steps down as soon as it sees a lower peer: not a rival yet
                "collecting": matching and assembly is not None and not assembly.closed and len(assembly.joined) > 1}

    async def _handle_join(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        state = self._round
        claimed = Declaration.from_wire(ctx.peer_id, args.get("declaration")) if isinstance(args, dict) else None
        if claimed is None:
            return Decision("reject", reason="malformed join").to_wire()
        if ctx.peer_id in self.banned:
            return Decision("reject", reason="banned").to_wire()
        key = args.get("key")
        if state is None or key != state.key:
            if self._last_group is not None and self._last_group[0] == key:
                # my group for this key is sealed and gone: name its members so the joiner skips them all
                return Decision("reject", reason="sealed", busy=tuple(self._last_group[1].peer_ids)).to_wire()
            return Decision("reject", reason="not matching").to_wire()
        # who is calling and where it listens come from the authenticated connection, not from the claim
        client_mode = claimed.client_mode or ctx.address is None
        joiner = Declaration(ctx.peer_id, None if client_mode else ctx.address, claimed.bandwidth, client_mode,
                             claimed.schema, claimed.round, claimed.deadline, claimed.declared_at)
        self.stats["joins_served"] += 1
        if state.assembly is None:
            following = state.following or self._my_collector(state)
            if following is not None and following.peer_id < self.peer_id:
                return Decision("redirect", redirect=following).to_wire()
            # nobody lower in my view: the joiner saw me as its collector, so collect (my loop notices)
            state.assembly = Assembly(state.me, key=state.key, target_group_size=self.target,
                                      min_group_size=self.min_size)
        assembly = state.assembly
        decision = assembly.offer(joiner, key)
        if decision is not None:
            return decision.to_wire()
        state.view.setdefault(joiner.peer_id, joiner)
        state.join_arrived = True
        state.poke()
        return (await state.answer_of(assembly, joiner.peer_id)).to_wire()
