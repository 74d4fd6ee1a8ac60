"""The quorum / grace-window core (averaging/quorum.py): the rules of docs/outer-rounds.md message by message, and
1,000 simulated trainers with heavy-tailed arrivals and churn under a mock clock."""

from __future__ import annotations

import math
import random

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from averaging.quorum import (
    Admission,
    Dropped,
    GraceEstimator,
    Late,
    Offer,
    OuterRound,
    Queued,
    QuorumPolicy,
    Resync,
    Start,
    check_start,
    contribution_weight,
    coordinator_order,
    quantile,
)


def peer(index: int) -> bytes:
    return index.to_bytes(20, "big")


def offer(index: int, base: int = 3, samples: int = 10, hash_: str = "h", intent: bool = False) -> Offer:
    return Offer(peer(index), base, samples, hash_, ("10.0.0.1", 1000 + index), 1.0, intent)


POLICY = QuorumPolicy(quorum_min=2, quorum_fraction=0.5, grace_min=0.01, grace_max=5.0, max_wait=30.0)


def test_every_expected_trainer_ready_starts_at_once():
    core = OuterRound(3, [peer(1), peer(2), peer(3)], POLICY, window=1.0)
    assert isinstance(core.offer(offer(1), 0.0), Queued)
    assert isinstance(core.offer(offer(2), 0.1), Queued)
    assert core.poll(0.1) is None
    core.offer(offer(3), 0.2)
    start = core.poll(0.2)
    assert start is not None and start.reason == "all ready" and start.peers == [peer(1), peer(2), peer(3)]
    assert [round(m.offset, 6) for m in start.members] == [0.0, 0.1, 0.2] and start.waited == pytest.approx(0.2)


def test_a_quorum_starts_when_the_window_closes_and_a_missing_trainer_is_not_waited_for_longer():
    core = OuterRound(3, [peer(i) for i in range(1, 5)], POLICY, window=0.5)
    core.offer(offer(1), 10.0)
    core.offer(offer(2), 10.1)
    assert core.deadline() == pytest.approx(10.5)  # quorum of 2 (of 4) ready: the window decides
    assert core.poll(10.49) is None
    start = core.poll(10.5)
    assert start is not None and start.reason == "quorum after grace" and len(start.members) == 2
    # the trainer that comes afterwards is late: it gets the start, and is not a member
    verdict = core.offer(offer(3), 10.6)
    assert isinstance(verdict, Late) and verdict.start is start


def test_after_the_window_the_round_starts_the_moment_a_quorum_is_ready():
    core = OuterRound(3, [peer(i) for i in range(1, 5)], POLICY, window=0.5)
    core.offer(offer(1), 0.0)
    assert core.deadline() == pytest.approx(30.0)  # only max_wait bounds a round below its quorum
    assert core.poll(2.0) is None
    core.offer(offer(2), 2.0)
    start = core.poll(2.0)
    assert start is not None and start.reason == "quorum" and start.waited == pytest.approx(2.0)


def test_a_trainer_found_dead_leaves_the_expected_set_so_the_rest_need_not_wait():
    core = OuterRound(3, [peer(1), peer(2), peer(3)], POLICY, window=2.0)
    core.offer(offer(1), 0.0)
    core.offer(offer(2), 0.0)
    assert core.to_notify() == [peer(3)] and core.to_notify() == []  # told once, when the window opens
    core.lost(peer(3))
    start = core.poll(0.01)
    assert start is not None and start.reason == "all ready"


def test_max_wait_starts_with_whoever_is_ready():
    core = OuterRound(3, [peer(i) for i in range(1, 5)], POLICY, window=0.5)
    core.offer(offer(1), 0.0)
    start = core.poll(30.0)
    assert start is not None and start.reason == "max wait" and start.peers == [peer(1)]


def test_stale_offers_are_weighted_down_and_too_stale_or_future_ones_dropped():
    core = OuterRound(5, [peer(1), peer(2), peer(3)], POLICY, window=0.5)
    core.offer(offer(1, base=5, samples=40), 0.0)
    core.offer(offer(2, base=4, samples=40), 0.0)
    assert isinstance(core.offer(offer(3, base=0), 0.0), Dropped)  # stale by 5 > 4
    assert isinstance(core.offer(offer(3, base=6), 0.0), Dropped)  # from the future
    start = core.poll(0.5)
    assert start is not None
    assert {m.peer: (m.staleness, m.weight) for m in start.members} == {peer(1): (0, 40.0), peer(2): (1, 20.0)}


def test_a_stale_offer_does_not_open_the_window_but_an_on_time_one_does():
    core = OuterRound(5, [peer(1), peer(2), peer(3)], POLICY, window=0.5)
    core.offer(offer(1, base=4), 0.0)
    assert core.opened_at is None and core.to_notify() == [] and core.deadline() is None
    core.offer(offer(2, base=5), 1.0)
    assert core.opened_at == 1.0 and core.to_notify() == [peer(3)]


def test_intent_makes_a_trainer_expected_without_a_contribution():
    core = OuterRound(2, [peer(1)], POLICY, window=0.5)
    core.offer(offer(2, base=2, intent=True), 0.0)
    core.offer(offer(1, base=2), 0.0)
    assert core.poll(0.0) is None  # peer 2 registered: expected
    assert core.to_notify() == [peer(2)]
    core.offer(offer(2, base=2), 0.1)
    start = core.poll(0.1)
    assert start is not None and start.peers == [peer(1), peer(2)]


def test_the_hash_most_ready_trainers_hold_wins_and_the_others_are_told_to_resync():
    core = OuterRound(3, [peer(i) for i in range(1, 5)], POLICY, window=0.5, own_hash="b")
    core.offer(offer(1, hash_="a"), 0.0)
    core.offer(offer(2, hash_="a"), 0.0)
    core.offer(offer(3, hash_="b"), 0.0)
    core.offer(offer(4, hash_="b"), 0.0)
    start = core.poll(0.0)
    assert start is not None and start.hash == "b"  # a tie: the coordinator's own
    assert start.peers == [peer(3), peer(4)] and start.resync == (peer(1), peer(2))
    assert isinstance(core.verdict(peer(1)), Resync) and isinstance(core.verdict(peer(3)), Start)


def test_trainers_behind_on_the_coordinators_chain_are_stale_members_and_do_not_vote():
    """A joiner the swarm outran, holding outer step 1 of the coordinator's chain, takes part in round 3 stale by
    2 (it downloads the result afterwards); a hash the coordinator never held is told to resync."""
    chain = {1: "h1", 2: "h2"}
    core = OuterRound(3, [peer(i) for i in range(1, 6)], POLICY, window=0.5, own_hash="h3", chain=chain)
    core.offer(offer(1, base=3, hash_="h3"), 0.0)
    core.offer(offer(2, base=1, hash_="h1"), 0.0)  # behind by 2, on the chain
    core.offer(offer(3, base=2, hash_="h2"), 0.0)  # behind by 1, on the chain
    core.offer(offer(4, base=2, hash_="x2"), 0.0)  # step 2 of another chain
    core.offer(offer(5, base=2, hash_="h3"), 0.0)  # late for round 2, caught up: stale as before
    start = core.poll(0.0)
    assert start is not None and start.hash == "h3"  # three offers of old states outvote no one
    assert start.peers == [peer(1), peer(2), peer(3), peer(5)] and start.resync == (peer(4),)
    assert [m.staleness for m in start.members] == [0, 2, 1, 1]
    assert isinstance(core.verdict(peer(2)), Start) and isinstance(core.verdict(peer(4)), Resync)


def test_behind_offers_need_a_coordinator_holding_the_round_and_one_member_that_does():
    # created before the coordinator held step 3: no own hash, so no chain to be behind on
    early = OuterRound(3, [peer(1), peer(2)], POLICY, window=0.5, own_hash=None, chain={2: "h2"})
    early.offer(offer(1, base=3, hash_="h3"), 0.0)
    early.offer(offer(2, base=2, hash_="h2"), 0.0)
    early.hold("h3", {2: "h2"})  # it applied round 2 meanwhile (the driver says so before each poll)
    start = early.poll(0.0)
    assert start is not None and start.peers == [peer(1), peer(2)] and start.resync == ()
    # nobody ready holds the round's state: no round starts that nobody can apply (test below)
    alone = OuterRound(3, [peer(1), peer(2)], POLICY, window=0.5, own_hash="h3", chain={2: "h2"})
    alone.offer(offer(1, base=2, hash_="h2"), 0.0)
    alone.offer(offer(2, base=2, hash_="h2"), 0.0)
    assert alone.poll(0.0) is None and alone.poll(100.0) is None and alone.deadline() is None
    # a coordinator that is behind itself: the chains of the offers holding the round's state vouch
    behind_me = OuterRound(3, [peer(1), peer(2), peer(3)], POLICY, window=0.5, own_hash=None, chain={1: "h1"})
    behind_me.offer(Offer(peer(1), 3, 10, "h3", None, chain=((1, "h1"), (2, "h2"), (3, "h3"))), 0.0)
    behind_me.offer(offer(2, base=1, hash_="h1"), 0.0)  # the coordinator's own offer, from outer step 1
    behind_me.offer(offer(3, base=2, hash_="z2"), 0.0)  # nobody held that
    start = behind_me.poll(0.0)
    assert start is not None and start.hash == "h3" and start.peers == [peer(1), peer(2)]
    assert start.resync == (peer(3),)
    # without a chain, an old state is told to resync, as before
    plain = OuterRound(3, [peer(1), peer(2), peer(3)], POLICY, window=0.5, own_hash="h3")
    for index, (base, hash_) in enumerate([(3, "h3"), (3, "h3"), (2, "h2")], start=1):
        plain.offer(offer(index, base=base, hash_=hash_), 0.0)
    start = plain.poll(0.0)
    assert start is not None and start.resync == (peer(3),)


def test_offers_from_behind_alone_never_start_a_round_they_could_only_wait_on():
    """What wedged tests/peer/test_train_sparse.py: round 4 started with two of four trainers; the two late for it
    offered to round 5 from outer step 4 (behind, stale by one) and made its quorum, so round 5 started with the
    two of them alone, before its coordinator (at outer step 5) offered. Members from behind apply nothing and
    download the round's result from a member holding its state: there was none, so both waited a whole
    `load_state_timeout` for outer step 6 (and the two that were late for round 5 did the same in round 6). The
    round waits for an offer holding its step; then the ones from behind are members of it."""
    core = OuterRound(5, [peer(i) for i in range(1, 5)], POLICY, window=0.1, own_hash="h5", chain={4: "h4", 5: "h5"})
    for index in (1, 2):
        core.offer(Offer(peer(index), 4, 10, "h4", None, chain=((3, "h3"), (4, "h4"))), 0.0)
    # a quorum from behind, but no window: it could never close (nobody holds outer step 5), and the others are
    # not told to cut their phase for a round that waits for them anyway
    assert core.opened_at is None and core.to_notify() == []
    assert core.deadline() is None and core.poll(0.1) is None and core.poll(30.0) is None
    assert isinstance(core.verdict(peer(1)), Queued)
    core.offer(offer(3, base=5, hash_="h5"), 30.5)  # the coordinator's own, holding outer step 5: the window opens
    assert core.opened_at == 30.5 and core.to_notify() == [peer(4)]
    assert core.poll(30.55) is None  # the quorum is there, the window is not over
    start = core.poll(30.6)
    assert start is not None and start.hash == "h5" and start.peers == [peer(1), peer(2), peer(3)]
    assert [m.staleness for m in start.members] == [1, 1, 0]
    assert start.waited == pytest.approx(0.1)  # one window, not the 30 s spent waiting for an on-time offer


def test_group_ids_name_the_round_and_its_members():
    one = OuterRound(3, [peer(1), peer(2)], POLICY, window=0.5)
    two = OuterRound(3, [peer(1), peer(2)], POLICY, window=0.5)
    for core in (one, two):
        core.offer(offer(2), 0.0)
        core.offer(offer(1), 0.3)
    a, b = one.poll(0.3), two.poll(0.3)
    assert a is not None and b is not None and a.group_id == b.group_id  # the same round, the same members
    three = OuterRound(4, [peer(1), peer(2)], POLICY, window=0.5)
    three.offer(offer(1, base=4), 0.0)
    three.offer(offer(2, base=4), 0.0)
    c = three.poll(0.0)
    assert c is not None and c.group_id != a.group_id


def test_policy_quorum_is_always_reachable():
    assert POLICY.quorum(1) == 1 and POLICY.quorum(2) == 2 and POLICY.quorum(4) == 2 and POLICY.quorum(9) == 5
    with pytest.raises(ValueError):
        QuorumPolicy(quorum_fraction=1.5)
    with pytest.raises(ValueError):
        QuorumPolicy(grace_max=10.0, max_wait=5.0)


def test_grace_window_is_learned_from_arrival_offsets_and_bounded():
    grace = GraceEstimator(POLICY)
    assert grace.window() == POLICY.grace_initial
    grace.observe([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    assert grace.window(rtt=0.05) == pytest.approx(0.8 * 1.25 + 0.1)  # nearest rank: the 9th of 10
    grace.observe([100.0] * 64)
    assert grace.window() == POLICY.grace_max


@given(st.lists(st.floats(0, 10), min_size=1, max_size=50), st.floats(0.01, 1.0))
def test_quantile_is_an_element_and_monotone(values, q):
    result = quantile(values, q)
    assert result in values
    assert quantile(values, 1.0) == max(values) and quantile(values, q) <= quantile(values, 1.0)


def test_contribution_weight_and_coordinator_order():
    assert contribution_weight(30, 0) == 30.0 and contribution_weight(30, 2) == 10.0
    peers = [peer(i) for i in range(10)]
    order = coordinator_order("run", 7, peers)
    assert sorted(order) == sorted(peers) and order == coordinator_order("run", 7, reversed(peers))
    assert order != coordinator_order("run", 8, peers)  # the role moves from round to round


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.floats(0, 10), st.integers(0, 2)), min_size=1, max_size=40),
       st.floats(0.01, 5.0))
def test_any_sequence_of_offers_and_deaths_never_starts_past_its_rules(events, window):
    """Property: whatever arrives when, the round starts exactly when a rule says, never later, and every offer
    that arrived before the start is a member or told to resync."""
    policy = QuorumPolicy(quorum_min=2, quorum_fraction=0.5, grace_max=5.0, max_wait=20.0)
    core = OuterRound(3, [peer(i) for i in range(8)], policy, window=window)
    now = 0.0
    before_start: set[bytes] = set()
    for who, delay, kind in sorted(events, key=lambda e: e[1]):
        deadline = core.deadline()
        if deadline is not None and deadline <= delay and core.start is None:
            assert core.poll(deadline) is not None  # the deadline is when it starts, not later
        now = max(now, delay)
        if core.poll(now) is not None:
            break
        if kind == 2:
            core.lost(peer(who))
        else:
            core.offer(offer(who, base=3 - kind), now)  # kind 1: stale by one
            before_start.add(peer(who))
        core.poll(now)
    deadline = core.deadline()
    start = core.start or (core.poll(deadline) if deadline is not None else None)
    if start is not None:
        assert before_start <= set(start.peers) | set(start.resync)
        assert start.waited <= policy.max_wait + 1e-9


# ------------------------------------------------------------------------------ 1,000 trainers, mock clock


class _RoundState:
    """One simulated round: its core, who offered when, and an event renewed on every change."""

    def __init__(self, core: OuterRound):
        self.core = core
        self.offered: dict[int, float] = {}
        self.changed = trio.Event()

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


async def _simulate(trainers: int, rounds: int, seed: int) -> dict[str, float]:
    """One coordinator task per round, 1,000 trainer tasks. Each round a trainer finishes its phase after a
    heavy-tailed delay (Pareto, alpha 1.5: most within ~0.1 s, a few seconds late); 2% die per round (their
    death is noticed when the window opens, after a probe of 0.2 s) and 1% freeze (never noticed: only the
    window bounds them). A late trainer's contribution goes to the next round, stale by one; new trainers join
    with an intent. Returns the figures the test checks."""
    rng = random.Random(seed)
    policy = QuorumPolicy(quorum_min=2, quorum_fraction=0.5, grace_min=0.05, grace_max=2.0, grace_initial=0.5,
                          max_wait=10.0, max_staleness=4)
    grace = GraceEstimator(policy)
    alive = set(range(trainers))
    frozen: set[int] = set()
    next_id = trainers
    pending: dict[int, int] = {}  # trainer -> base of a contribution that was late
    counted = completed = late = violations = 0
    members_before: set[int] = set(alive)
    for step in range(rounds):
        core = OuterRound(step, [peer(i) for i in members_before if i in alive], policy, grace.window(0.01))
        state = _RoundState(core)

        async def arrive(state: _RoundState, index: int, delay: float, base: int, intent: bool = False) -> None:
            await trio.sleep(delay)
            if index not in alive or index in frozen:
                return
            state.core.offer(offer(index, base=base, samples=10, intent=intent), trio.current_time())
            if not intent:
                state.offered[index] = trio.current_time()
            state.wake()

        async def probe(state: _RoundState, index: int) -> None:
            await trio.sleep(0.2)
            if index not in alive:
                state.core.lost(peer(index))
                state.wake()

        async with trio.open_nursery() as nursery:
            for index in list(alive):
                if rng.random() < 0.02:
                    alive.discard(index)  # dies during its phase
                    continue
                if index not in frozen and rng.random() < 0.01:
                    frozen.add(index)
                if index in pending:
                    nursery.start_soon(arrive, state, index, 0.0, pending.pop(index))  # stale: offered at once
                else:
                    nursery.start_soon(arrive, state, index, 1.0 + 0.02 * rng.paretovariate(1.5), step)
            for _ in range(trainers // 100):  # newcomers
                alive.add(next_id)
                nursery.start_soon(arrive, state, next_id, 0.5, step, True)
                nursery.start_soon(arrive, state, next_id, 1.0 + 0.02 * rng.paretovariate(1.5), step)
                next_id += 1
            while core.poll(trio.current_time()) is None:
                for target in core.to_notify():
                    nursery.start_soon(probe, state, int.from_bytes(target, "big"))
                deadline = core.deadline()
                waiting = state.changed
                with trio.move_on_at(deadline if deadline is not None else math.inf):
                    await waiting.wait()
            started_at = trio.current_time()
            start = core.start
            assert start is not None
            # the rules: never later than the window once a quorum is ready, never later than max_wait
            assert core.opened_at is not None
            quorum_ready_at = sorted(state.offered.values())[min(len(state.offered), policy.quorum(len(core.expected |
                                                                                          set(core.offers)))) - 1]
            bound = min(core.opened_at + policy.max_wait, max(core.opened_at + start.window, quorum_ready_at))
            if started_at > bound + 1e-9:
                violations += 1
            nursery.cancel_scope.cancel()  # the stragglers of this round arrive late: below
        members = {int.from_bytes(p, "big") for p in start.peers}
        counted += len(members)
        completed += len(state.offered)
        assert set(state.offered) <= members | {int.from_bytes(p, "big") for p in start.resync}
        for index in alive - members - frozen:
            if index < next_id and index not in state.offered:
                pending[index] = step  # finished after the start: late, offered to the next round
                late += 1
        grace.observe(start.offsets)
        members_before = members
    stale_counted = sum(1 for _ in pending)
    return {"counted": counted, "completed": completed, "late": late, "violations": violations,
            "window": grace.window(0.01), "pending": stale_counted}


@pytest.mark.parametrize("seed", [1, 2])
def test_a_thousand_trainers_with_heavy_tails_and_churn_no_round_waits_past_its_window(seed):
    figures: dict[str, float] = {}

    async def run() -> None:
        figures.update(await _simulate(1000, 12, seed))

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))  # virtual time: a few seconds of CPU
    assert figures["violations"] == 0, figures
    assert figures["counted"] == figures["completed"], figures  # every completed contribution is in its round
    assert figures["late"] > 0, figures  # the heavy tail made some trainers late (the window did not wait)
    assert 0.05 <= figures["window"] <= 2.0, figures


def test_claimed_samples_are_capped_and_claimed_bandwidth_ignored():
    core = OuterRound(3, [peer(i) for i in range(1, 5)], POLICY, window=0.5)
    for i in range(1, 4):
        core.offer(offer(i, samples=100), 0.0)
    core.offer(Offer(peer(4), 3, 10**6, "h", ("10.0.0.1", 1004), 1e9), 0.0)  # claims weight and bandwidth
    start = core.poll(0.0)
    assert start is not None
    liar = start.member(peer(4))
    assert liar is not None and liar.samples == 400 and liar.weight == 400.0 and liar.bandwidth == 1.0
    assert check_start(start, POLICY) is None
    forged = Start(start.step, start.hash, tuple(
        m if m.peer != peer(4) else Admission(m.peer, m.address, 1.0, 10**6, 0, 1e6, 0.0) for m in start.members),
        (), "all ready", 0.0, 0.5)
    assert "cap" in (check_start(forged, POLICY) or "")
