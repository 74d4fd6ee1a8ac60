"""How long matchmaking waits, measured rather than configured.

Why a module of its own: every wait in matchmaking (how quiet a view must be before acting on it, how long a
probe may take, how long to hold out for peers of recent rounds) is derived from two things this peer learns as
it goes: the network's pace (`Pacing`: DHT reads and stores, RPC round trips) and who usually shows up under a
key (`Patience`). The window (`matchmaking_time`) only bounds them. Kept apart from the driver so the rules read
in one place and the driver only asks "is it quiet?" and "still waiting?".
"""

from __future__ import annotations

from collections.abc import Iterable

from averaging.match_round import MatchRound
from peer.p2p.identity import PeerID


class EWMA:
    """An exponentially weighted moving average of non-negative samples (latencies)."""

    def __init__(self, initial: float, alpha: float = 0.3):
        self.value = initial
        self.alpha = alpha

    def update(self, sample: float) -> None:
        self.value = (1 - self.alpha) * self.value + self.alpha * max(0.0, sample)


class Pacing:
    """The network's pace as this peer measured it, and the waits derived from it. The DHT side updates the
    read and store latencies, the join and ping calls the round trip."""

    def __init__(self, matchmaking_time: float, min_quiet: float):
        self.matchmaking_time = matchmaking_time
        self.min_quiet = min_quiet
        self.dht_latency = EWMA(0.01)
        self.store_latency = EWMA(0.01)
        self.rtt = EWMA(0.02)

    @property
    def quiet_period(self) -> float:
        """How long a view must stay unchanged before acting on it: a few measured DHT reads and about one
        measured store, so a declaration stored at the same time as mine has landed. (Waiting for peers that are
        late is `Patience.straggler_wait`'s job.)"""
        upper = max(self.min_quiet, self.matchmaking_time / 4)
        return min(upper, max(self.min_quiet, 3 * self.dht_latency.value, 1.5 * self.store_latency.value))

    @property
    def settle_period(self) -> float:
        """How long a view must stay unchanged before a partial chunk or group becomes final: three quiet
        periods. A full chunk is right on any view that shows it; a partial one may only mean that my reads have
        not met every declaration yet (in a first round everybody declares at once and the replicas fill up
        unevenly), so a joiner waits this long before joining a partial chunk and a collector before sealing a
        group with room left. A collector that sealed after one quiet period on a view of 8 out of 64 peers
        sealed 3, and its chunk's fourth peer, which saw all 64, ended in another group of 3 (3 of 190 seeded
        first rounds of tests/averaging/test_sim_faults.py)."""
        return 3 * self.quiet_period

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

    @property
    def grace(self) -> float:
        """Time past a deadline for the answer to arrive: a quiet period and a few round trips."""
        return self.quiet_period + 4 * self.rtt.value + 0.05


class Patience:
    """Whom a round expects and how long it holds out for the missing ones.

    Peers seen under a key in the last two rounds are expected (peers leave their previous round at different
    times); while some are missing, nobody acts on a partial view. `banned` is the matchmaker's own set (shared,
    not copied): a peer banned later stops being expected at once."""

    def __init__(self, pacing: Pacing, peer_id: PeerID, banned: set[PeerID]):
        self.pacing = pacing
        self.peer_id = peer_id
        self.banned = banned
        self.value = 0.0  # see straggler_wait
        self._recent: dict[str, list[set[PeerID]]] = {}  # key -> peers seen there in the last few rounds
        self._forgotten: set[PeerID] = set()

    @property
    def straggler_wait(self) -> float:
        """How long to hold out for peers seen in recent rounds but not here yet (peers leave their previous
        round at different times). Adapted from outcomes: it doubles after a round in which it ran out with peers
        still missing, and shrinks toward twice the wait that was actually needed when everyone arrived in time;
        bounded by a quarter of the window, so a dead peer costs at most that, and only for a round or two."""
        return min(self.pacing.matchmaking_time / 4, max(4 * self.pacing.quiet_period, self.value))

    def forget(self, peer_ids: Iterable[bytes]) -> None:
        """Peers known dead (e.g. lost during the all-reduce): stop expecting them in the next rounds."""
        self._forgotten.update(PeerID(bytes(p)) for p in peer_ids)
        for history in self._recent.values():
            for seen in history:
                seen.difference_update(self._forgotten)

    def expected(self, key: str) -> int:
        """How many peers (me included) a round under `key` expects: those seen there lately, still alive."""
        history = self._recent.get(key, [])
        return len(set().union(*history) - self._forgotten - self.banned | {self.peer_id}) if history else 0

    def remember(self, state: MatchRound) -> None:
        """A round is over: note who was there, and adapt the straggler wait to how the waiting went."""
        seen = (state.seen | set(state.view)) - set(state.failed) - {self.peer_id}
        history = self._recent.setdefault(state.key, [])
        history.append(seen)
        del history[:-2]  # a peer not seen for 2 rounds under this key is no longer expected
        if len(self._recent) > 64:
            self._recent.pop(next(iter(self._recent)))
        if state.patience_ran_out:
            self.value = min(self.pacing.matchmaking_time / 4, 2 * max(self.value, 4 * self.pacing.quiet_period))
        elif state.population_reached_after is not None:
            self.value = max(0.8 * self.value, 2 * state.population_reached_after)

    def patient(self, state: MatchRound, now: float) -> bool:
        """True while peers seen in recent rounds are missing and the straggler wait has not run out (`now`: the
        driver's clock, the one `state.started` is on)."""
        visible = 1 + sum(1 for p in state.view if p not in state.excluded)
        waited = now - state.started
        if visible >= state.expected:
            if state.population_reached_after is None and state.expected > 1:
                state.population_reached_after = waited
            return False
        if waited < self.straggler_wait:
            return True
        matchmaking_time = self.pacing.matchmaking_time
        if waited < matchmaking_time / 4 and any(p not in state.view for p in state.returning):
            return True  # a peer told us it is still averaging its previous round: it is on its way
        if visible < state.promised and waited < matchmaking_time / 2:
            return True  # the caller knows these peers are on their way (`find_group`'s `expected`)
        state.patience_ran_out = True
        return False
