"""What one matchmaking round knows, shared by the parts of `averaging.matchmaking` that act on it.

Why a module of its own: the round's state is read and written by several collaborators (the DHT view reader,
the join and ping sides, the waits, the driver's loops), each in a module of its own; keeping the state here lets
them all name its type without importing the driver. It holds trio events (the long polls and the loop's wake-up),
so it is not part of the pure core in `averaging.assembly`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

import trio

from averaging.assembly import Assembly, Decision, Declaration
from peer.p2p.identity import PeerID
from peer.p2p.rpc import RPCNode

if TYPE_CHECKING:  # averaging.match_waits reads MatchRound: imported for the annotation only
    from averaging.match_waits import Pacing


class MatchRound:
    """Everything one `Matchmaker.find_group` call knows; handlers read it to answer joins and probes."""

    def __init__(self, key: str, me: Declaration, offset: float, expected: int, started: float | None = None):
        self.key = key
        self.me = me
        self.offset = offset  # DHT clock minus trio clock
        self.started = trio.current_time() if started is None else started  # trio time
        self.expected = expected  # peers (me included) seen under this key in recent rounds
        self.promised = 0  # peers (me included) the caller knows are on their way: waited for up to half the window
        self.seen: set[PeerID] = set()  # every peer seen under the key this round
        self.last_change = self.started  # when a peer last appeared in view (or the excluded ones changed)
        self.chunk: tuple[PeerID, ...] = ()  # my chunk in the driver's latest plan, and since when it is that
        self.chunk_since = self.started
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
        self.patient = False  # the collector loop's last verdict of Patience.patient (sent with my probes)
        self.stale: dict[PeerID, float] = {}  # peer -> declared_at of a declaration its owner no longer runs
        self.returning: set[PeerID] = set()  # stale peers between two rounds (not matching elsewhere): coming back
        self.shard = 0  # where my declaration lives (see match_dht.SHARD_CROWDED)
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

    def nobody_left(self) -> bool:
        """True when every other peer in view is excluded (dead, or in a sealed group) and there is at least one:
        I came late to a round that has already assembled."""
        return bool(self.view) and all(p in self.excluded for p in self.view)

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
        """Sleep until something pokes the round or until `until_trio_time`, whichever comes first."""
        self.changed = trio.Event()
        with trio.move_on_at(until_trio_time):
            await self.changed.wait()


@dataclass(eq=False)
class MatchCalls:
    """What both calling sides of matchmaking (`Prober`, `Joins`) hold of the matchmaker: its RPC node, its pacing,
    the group size it aims for (`target`), its ban set and its counters, the last two shared, not copied (a ban or
    a count either side makes is the matchmaker's). One base, so that the bundle is declared and built once."""

    rpc: RPCNode
    _: KW_ONLY
    pacing: Pacing
    target: int
    banned: set[PeerID]
    stats: dict[str, int]
    peer_id: PeerID = field(init=False)

    def __post_init__(self) -> None:
        self.peer_id = self.rpc.peer_id
