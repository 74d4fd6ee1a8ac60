"""Who is in an outer round and when it starts: the quorum and grace-window rule, with no I/O.

The contract is docs/outer-rounds.md. In short: the coordinator of round N collects offers (a trainer's ready
message: its contribution's base round, samples, the hash of the outer state it holds); the round starts when
every expected trainer is ready, or once the grace window has passed with a quorum ready, or, past the window,
as soon as a quorum is; `max_wait` after the window opened it starts with whoever is ready. Never with offers
from behind alone (stale: nobody among them holds the round's state). Offers that come after the start are late:
they are told so, with the start, and go to the next round, stale.

Why a core: the rule decides whether a volunteer's work counts and whether the swarm waits, so it must be exact
and testable at scale. Here it is plain objects: offers and `now` in, verdicts, deadlines and a `Start` out; no
trio, no sockets, no clock. `averaging.rounds` drives it over RPC; the tests drive 1,000 simulated trainers
through it under a mock clock.

- `QuorumPolicy`: the knobs (quorum count and fraction, grace bounds, staleness limit), validated once.
- `GraceEstimator`: the window, learned from the arrival offsets of recent rounds (never fixed).
- `OuterRound`: one round at its coordinator.
- `coordinator_order`: the candidates of a round, ranked the same way by everyone.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Address = tuple[str, int]

__all__ = [
    "Admission", "Dropped", "GraceEstimator", "Late", "Offer", "OuterRound", "Queued", "QuorumPolicy", "Resync",
    "Start", "Verdict", "check_start", "contribution_weight", "coordinator_order", "quantile", "samples_cap",
]


@dataclass(frozen=True)
class QuorumPolicy:
    """How long an outer round waits, and for how many.

    quorum_min, quorum_fraction: the quorum is max(quorum_min, ceil(quorum_fraction * live)), at most the number
    of trainers live (those expected plus those ready), so it can always be met. grace_*: bounds and shape of the
    learned window (`GraceEstimator`). max_wait: the hard bound after the window opened. max_staleness: older
    contributions are dropped, with a reason. max_samples_ratio: a contribution counts at most this many times
    the samples of the round's (lower) median contribution, so weight cannot be bought by claiming it."""

    quorum_min: int = 2
    quorum_fraction: float = 0.5
    grace_min: float = 0.05
    grace_max: float = 5.0
    grace_initial: float = 2.5
    grace_percentile: float = 0.9
    grace_margin: float = 0.25
    max_wait: float = 30.0
    max_staleness: int = 4
    history: int = 64
    max_samples_ratio: float = 4.0

    def __post_init__(self) -> None:
        if self.quorum_min < 1:
            raise ValueError("quorum_min must be at least 1")
        if not 0.0 <= self.quorum_fraction <= 1.0:
            raise ValueError("quorum_fraction must be within [0, 1]")
        if not 0.0 <= self.grace_min <= self.grace_max:
            raise ValueError("need 0 <= grace_min <= grace_max")
        if not 0.0 < self.grace_percentile <= 1.0:
            raise ValueError("grace_percentile must be within (0, 1]")
        if self.grace_margin < 0 or self.grace_initial < 0:
            raise ValueError("grace_margin and grace_initial must be >= 0")
        if self.max_wait < self.grace_max:
            raise ValueError("max_wait must be at least grace_max")
        if self.max_staleness < 0 or self.history < 1:
            raise ValueError("max_staleness must be >= 0 and history >= 1")
        if not self.max_samples_ratio >= 1.0:
            raise ValueError("max_samples_ratio must be at least 1")

    def quorum(self, live: int) -> int:
        """Ready trainers needed to start after the window, when `live` trainers are expected or ready."""
        wanted = max(self.quorum_min, math.ceil(self.quorum_fraction * live))
        return max(1, min(wanted, live))


def quantile(values: Iterable[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank on the sorted values); 0 for none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


class GraceEstimator:
    """The grace window: the `grace_percentile` of recent arrival offsets, times (1 + margin), plus two round
    trips, within [grace_min, grace_max]; `grace_initial` until a round has been seen (2.5 s by default: trainers
    that start together take their first steps seconds apart, and a first window of 1 s left one of four behind
    in most intercontinental runs of bench_wan.py; docs/outer-rounds.md).

    Why offsets from the window's opening: they measure how far apart ready trainers arrive, which is what the
    window must cover; they do not include how long a phase takes, so slow rounds do not inflate it."""

    def __init__(self, policy: QuorumPolicy):
        self.policy = policy
        self._offsets: deque[float] = deque(maxlen=policy.history)

    def observe(self, offsets: Iterable[float]) -> None:
        """The members' arrival offsets of one round (seconds after its window opened)."""
        for offset in offsets:
            if math.isfinite(offset):
                self._offsets.append(min(max(0.0, offset), self.policy.max_wait))

    @property
    def offsets(self) -> tuple[float, ...]:
        return tuple(self._offsets)

    def window(self, rtt: float = 0.0) -> float:
        policy = self.policy
        slack = 2.0 * max(0.0, rtt) if math.isfinite(rtt) else 0.0
        if self._offsets:
            base = quantile(self._offsets, policy.grace_percentile) * (1.0 + policy.grace_margin) + slack
        else:
            base = max(policy.grace_initial, slack)
        return min(max(base, policy.grace_min), policy.grace_max)


def contribution_weight(samples: int, staleness: int) -> float:
    """A contribution's averaging weight: its samples, discounted by staleness as samples / (1 + staleness)
    (the usual staleness-aware rule of asynchronous SGD: an update computed k steps ago counts 1/(k+1))."""
    return float(max(0, samples)) / (1.0 + max(0, staleness))


def samples_cap(samples: Iterable[int], ratio: float) -> int:
    """The most samples a contribution of a round may count: `ratio` times the lower median of the round's."""
    ordered = sorted(samples)
    if not ordered:
        return 0
    return int(ratio * ordered[(len(ordered) - 1) // 2])


def check_start(start: "Start", policy: QuorumPolicy) -> str | None:
    """What is wrong with a start a coordinator sent (None: nothing): a member checks the weights and shares it
    is told to use against the rules, so a coordinator cannot hand weight to anyone."""
    cap = samples_cap([m.samples for m in start.members], policy.max_samples_ratio)
    for member in start.members:
        if member.samples > cap:
            return f"{member.samples} samples above the cap of {cap}"
        if member.bandwidth != 1.0:
            return "a member with another share than the others"
        if not 0 <= member.staleness <= policy.max_staleness:
            return f"staleness {member.staleness} out of bounds"
        if abs(member.weight - contribution_weight(member.samples, member.staleness)) > 1e-9 * max(1.0, member.weight):
            return "a weight that is not samples / (1 + staleness)"
    return None


def coordinator_order(run: str, step: int, candidates: Iterable[bytes]) -> list[bytes]:
    """The candidates for coordinating round `step`, best first: ranked by sha256(run, step, peer id), so the
    role moves from round to round and everyone holding the same candidates ranks them the same way."""
    def rank(peer: bytes) -> bytes:
        return hashlib.sha256(b"swarmd-round|%s|%d|%s" % (run.encode(), step, peer)).digest()

    return sorted(set(bytes(c) for c in candidates), key=rank)


@dataclass(frozen=True)
class Offer:
    """A trainer's ready message for a round. `intent`: no contribution yet, only "expect me" (a trainer that
    just caught up registers so that it is told when the window opens). `chain`: (outer step, hash) of the recent
    outer states it held, which vouch for trainers behind on them (see `OuterRound`)."""

    peer: bytes
    base: int
    samples: int
    hash: str
    address: Address | None = None
    bandwidth: float = 1.0
    intent: bool = False
    chain: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Admission:
    """A member of a started round, as every member sees it."""

    peer: bytes
    address: Address | None
    bandwidth: float
    samples: int
    staleness: int
    weight: float
    offset: float  # seconds after the window opened that its offer arrived (0 when before)


@dataclass(frozen=True)
class Start:
    """A round's start: who averages (sorted by peer id), with what weights, on which outer state (`hash`)."""

    step: int
    hash: str
    members: tuple[Admission, ...]
    resync: tuple[bytes, ...]  # ready, but holding another outer state: told to download and come back stale
    reason: str  # "all ready", "quorum after grace", "quorum", "max wait"
    waited: float  # seconds from the window's opening to the start
    window: float  # the grace window the round used
    group_id: bytes = field(default=b"")
    coordinator: bytes = b""  # who started it (it decides an all-gather's set: averaging.gather)
    coordinator_address: Address | None = None
    attempt: int = 0  # a round that produced nothing is started again by its coordinator, as the next attempt

    def __post_init__(self) -> None:
        if not self.group_id:
            digest = hashlib.sha256(b"swarmd-round|%d|%d|%s|%s|" % (self.step, self.attempt, self.hash.encode(),
                                                                     self.coordinator))
            for member in self.members:
                digest.update(member.peer)
            object.__setattr__(self, "group_id", digest.digest()[:16])

    @property
    def peers(self) -> list[bytes]:
        return [m.peer for m in self.members]

    def member(self, peer: bytes) -> Admission | None:
        for admission in self.members:
            if admission.peer == peer:
                return admission
        return None

    @property
    def offsets(self) -> list[float]:
        return [m.offset for m in self.members]


@dataclass(frozen=True)
class Queued:
    """Wait: the round has not started; `deadline` is when it will at the latest by time alone (None: unknown
    yet, e.g. the window is not open)."""

    deadline: float | None


@dataclass(frozen=True)
class Late:
    """The round started without this offer; the contribution goes to the next round."""

    start: Start


@dataclass(frozen=True)
class Resync:
    """This trainer holds another outer state than the round's: download `start.hash`, come back stale."""

    start: Start


@dataclass(frozen=True)
class Dropped:
    """The offer cannot enter this round at all (too stale, from the future, or malformed)."""

    reason: str


Verdict = Queued | Start | Late | Resync | Dropped


class OuterRound:
    """One round at its coordinator: offers and deaths in, the start out (see the module doc).

    `expected`: trainers the coordinator counts on (members of the previous round not seen failing); offers
    with `intent` add to them. `own_hash`: the coordinator's outer state hash at this step, the tie-breaker of
    the agreement (None when it does not hold this step). `chain`: the hashes of the outer steps before this one
    that the coordinator held (step -> hash). `window`: the grace window, from the estimator.

    A trainer that holds an older outer state of the same chain (a joiner whose download the swarm outran, a
    trainer that fell behind) is a member, stale by the steps it is behind: its pseudo-gradient was computed on
    that state, which is all a stale contribution ever is, and it downloads the round's result afterwards. So
    it contributes now instead of after a download that the swarm outruns again. Its offer's (base, hash) must
    be vouched for by the chain of a trainer holding the round's state: an offer's `chain`, or mine when the
    round's state is my own. Offers behind on a chain do not vote on the round's state; any other hash is told
    to resync (`Resync`)."""

    def __init__(self, step: int, expected: Iterable[bytes], policy: QuorumPolicy, window: float,
                 own_hash: str | None = None, coordinator: tuple[bytes, Address | None] = (b"", None),
                 attempt: int = 0, chain: Mapping[int, str] | None = None):
        self.step = step
        self.coordinator = coordinator
        self.attempt = attempt
        self.policy = policy
        self.window = min(max(window, policy.grace_min), policy.grace_max)
        self.own_hash = own_hash
        self.chain: dict[int, str] = dict(chain or {})
        self.expected: set[bytes] = {bytes(p) for p in expected}
        self.offers: dict[bytes, tuple[Offer, float]] = {}  # ready (non-intent) offers and their arrival times
        self.opened_at: float | None = None
        self.start: Start | None = None
        self.gone: set[bytes] = set()
        self._notified = False

    # ------------------------------------------------------------------------------------------ events

    def offer(self, offer: Offer, now: float) -> Verdict:
        """A ready message (or an intent). Returns what to answer: Queued, or the verdict of a started round."""
        peer = bytes(offer.peer)
        if self.start is not None:
            return self._verdict_after_start(peer)
        staleness = self.step - offer.base
        if staleness < 0:
            return Dropped(f"its base round {offer.base} is ahead of round {self.step}")
        if staleness > self.policy.max_staleness:
            return Dropped(f"stale by {staleness} rounds (at most {self.policy.max_staleness})")
        if offer.samples < 0 or not math.isfinite(offer.bandwidth) or offer.bandwidth < 0:
            return Dropped("malformed offer")
        self.gone.discard(peer)
        self.expected.add(peer)
        if not offer.intent:
            self.offers[peer] = (offer, now)
            # the window opens at the first offer holding the round's step: one from behind cannot start the
            # round (`_holds_state`), so a window opened by such offers could not close, `waited` counted the
            # whole wait for an on-time trainer, and the others were told to cut a phase for nothing
            if self.opened_at is None and staleness == 0:
                self.opened_at = now
        return Queued(self.deadline())

    def hold(self, own_hash: str | None, chain: Mapping[int, str]) -> None:
        """What the coordinator holds now (its round may have been created before it held this step)."""
        if self.start is None:
            self.own_hash = own_hash
            self.chain = dict(chain)

    def _vouched(self, offers: Iterable[Offer], mine: bool) -> set[tuple[int, str]]:
        """The older outer states that `offers` (and I, with `mine`) say they held."""
        vouched = {(b, h) for offer in offers for b, h in offer.chain if b < self.step}
        if mine:
            vouched.update((b, h) for b, h in self.chain.items() if b < self.step)
        return vouched

    def lost(self, peer: bytes) -> None:
        """`peer` was found dead or unresponsive: it is no longer expected (an offer it made stays: if it is
        really gone, the all-reduce leaves it out)."""
        peer = bytes(peer)
        if self.start is None:
            self.expected.discard(peer)
            self.gone.add(peer)

    # ------------------------------------------------------------------------------------------ decisions

    def to_notify(self) -> list[bytes]:
        """Once, when the window opens: the expected trainers not ready yet (told to end their phase)."""
        if self.opened_at is None or self._notified or self.start is not None:
            return []
        self._notified = True
        return sorted(p for p in self.expected if p not in self.offers)

    def closes_in(self, now: float) -> float:
        """Seconds until the grace window closes (0 when closed or not open)."""
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.window - now)

    def _live(self) -> int:
        return len(self.expected | set(self.offers))

    def _quorum(self) -> int:
        return self.policy.quorum(self._live())

    def deadline(self) -> float | None:
        """When a start may next fire by time alone (None: only an event can start it)."""
        if self.start is not None or self.opened_at is None or not self._holds_state():
            return None
        if len(self.offers) >= self._quorum():
            return self.opened_at + self.window
        return self.opened_at + self.policy.max_wait

    def poll(self, now: float) -> Start | None:
        """The start, once a rule of the module doc fires (then for good)."""
        if self.start is not None:
            return self.start
        if not self._holds_state():
            return None
        ready = set(self.offers)
        reason = ""
        if self.expected <= ready:
            reason = "all ready"
        elif self.opened_at is not None:
            after_window = now >= self.opened_at + self.window
            if after_window and len(ready) >= self._quorum():
                reason = "quorum after grace" if self._quorum_since() <= self.opened_at + self.window else "quorum"
            elif now >= self.opened_at + self.policy.max_wait:
                reason = "max wait"
        if not reason:
            return None
        self.start = self._make_start(reason, now)
        return self.start

    def _holds_state(self) -> bool:
        """Whether a ready offer holds this round's outer step (staleness 0). Offers from behind (stale) count
        towards the quorum, but neither open the window nor start a round alone: every member of such a round
        waits to download the result from a member holding the round's state, and there would be none (two pairs
        of trainers, each late for the other's round, once wedged a run that way: each pair started the next
        round alone, stale, and waited a `load_state_timeout` for an outer step nobody produced, again and
        again). The round waits for a trainer holding its state instead (`max_wait` still bounds the wait once
        one is ready)."""
        return any(offer.base == self.step for offer, _ in self.offers.values())

    def _quorum_since(self) -> float:
        """When the quorum was reached (arrival time of its last offer)."""
        times = sorted(t for _, t in self.offers.values())
        return times[min(len(times), self._quorum()) - 1]

    def _make_start(self, reason: str, now: float) -> Start:
        # trainers behind on someone's chain do not vote on the round's state, and need a member holding it
        offers = {peer: offer for peer, (offer, _) in self.offers.items()}
        vouched = self._vouched(offers.values(), mine=self.own_hash is not None)
        # never every offer: one holds the round's step (`_holds_state`), and no chain vouches for that step
        behind = {peer for peer, offer in offers.items() if (offer.base, offer.hash) in vouched}
        counts = Counter(offer.hash for peer, offer in offers.items() if peer not in behind)
        top = max(counts.values())
        tied = sorted(h for h, n in counts.items() if n == top)
        canonical = self.own_hash if self.own_hash in tied else tied[0]
        opened = self.opened_at if self.opened_at is not None else now
        holders = [offer for peer, offer in offers.items() if peer not in behind and offer.hash == canonical]
        sure = self._vouched(holders, mine=canonical == self.own_hash)
        on_chain = {peer for peer, offer in offers.items()
                    if offer.hash == canonical or (peer in behind and (offer.base, offer.hash) in sure)}
        cap = samples_cap([self.offers[peer][0].samples for peer in on_chain], self.policy.max_samples_ratio)
        members = []
        resync = []
        for peer in sorted(self.offers):
            offer, arrived = self.offers[peer]
            if peer not in on_chain:
                resync.append(peer)
                continue
            staleness = self.step - offer.base
            samples = min(offer.samples, cap)
            # every member reduces an equal share: a claimed bandwidth would let a liar take the whole vector
            members.append(Admission(peer, offer.address, 1.0, samples, staleness,
                                     contribution_weight(samples, staleness), max(0.0, arrived - opened)))
        return Start(self.step, canonical, tuple(members), tuple(resync), reason, max(0.0, now - opened),
                     self.window, coordinator=self.coordinator[0], coordinator_address=self.coordinator[1],
                     attempt=self.attempt)

    def _verdict_after_start(self, peer: bytes) -> Verdict:
        start = self.start
        assert start is not None
        if start.member(peer) is not None:
            return start
        if peer in start.resync:
            return Resync(start)
        return Late(start)

    def verdict(self, peer: bytes) -> Verdict:
        """What to answer `peer` now (a waiting trainer polls this until it is no longer Queued)."""
        if self.start is not None:
            return self._verdict_after_start(bytes(peer))
        return Queued(self.deadline())
