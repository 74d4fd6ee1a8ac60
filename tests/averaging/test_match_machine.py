"""The matchmaking round's machines (`averaging.match_machine`), decision by decision: no sockets, no trio, the
time passed in. What a joiner does with a quiet, a partial, a crowded or a patient view, where redirects lead,
when a collector probes, drops, rechecks, seals, steps down and merges; and, over random views and times, that
no machine waits past its window or joins itself."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

import averaging.match_machine
from averaging.assembly import Decision, Declaration
from averaging.group import GroupInfo
from averaging.match_machine import (
    MAX_REDIRECTS,
    Collect,
    CollectorMachine,
    GiveUp,
    Join,
    Phase,
    Planner,
    Recheck,
    RoundMachine,
    Seal,
    StepDown,
    Timeouts,
    Wait,
)
from averaging.match_round import MatchRound
from averaging.match_waits import Pacing, Patience
from peer.p2p.identity import PeerID

KEY = "run.averaging"
SCHEMA = b"schema"
WINDOW = 10.0


def peer(n: int) -> PeerID:
    return PeerID(bytes([n]) * 20)


def declaration(n: int, *, client: bool = False, deadline: float = WINDOW) -> Declaration:
    address = None if client else ("10.0.0.1", 1000 + n)
    return Declaration(peer(n), address, 1.0, client, SCHEMA, 0, deadline, 0.0)


class Round:
    """A round of peer `me` with `others` in view (all declared at time 0), and its machines' shared parts."""

    def __init__(self, me: int, others: list[int], *, target: int = 4, expected: int = 0, min_size: int = 2,
                 clients: tuple[int, ...] = ()):
        self.pacing = Pacing(WINDOW, min_quiet=0.125)  # quiet 1/8 s, settle 3/8 s on a fresh pace (exact in binary)
        self.patience = Patience(self.pacing, peer(me), set())
        self.planner = Planner(peer(me), target, self.patience)
        self.state = MatchRound(KEY, declaration(me), 0.0, expected, started=0.0)
        self.state.last_change = self.state.chunk_since = 0.0
        for n in others:
            self.state.view[peer(n)] = declaration(n, client=n in clients)
        self.stats = {"no_group": 0, "redirects": 0, "rejects": 0}
        self.min_size = min_size

    def joiner(self) -> RoundMachine:
        return RoundMachine(self.state, self.planner, self.pacing, deadline=WINDOW, stats=self.stats)

    def joining(self) -> tuple[RoundMachine, float]:
        """A joiner that looked at the view at time 0 (its quiet period starts there), and QUIET."""
        machine = self.joiner()
        assert isinstance(machine.next_action(0.0), Wait)
        return machine, self.timeouts.quiet

    def collector(self) -> CollectorMachine:
        return CollectorMachine(self.state, self.planner, self.pacing, min_size=self.min_size)

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts.of(self.pacing, WINDOW)


def group_of(*ns: int) -> Decision:
    info = GroupInfo(b"g" * 8, tuple(declaration(n).member() for n in sorted(ns)))
    return Decision("group", group=info, round=0)


def test_the_machines_are_plain_objects():
    assert "trio" not in vars(averaging.match_machine)


# ------------------------------------------------------------------------------------------- a joiner


def test_a_joiner_waits_for_a_quiet_view_then_joins_its_chunks_collector_and_is_done_with_the_group():
    r = Round(3, [1, 2, 4])
    machine = r.joiner()
    first = machine.next_action(0.0)
    assert isinstance(first, Wait) and 0.0 < first.until <= r.timeouts.quiet
    assert machine.phase is Phase.PLANNING
    action = machine.next_action(r.timeouts.quiet)  # a full chunk, quiet for QUIET: join its lowest peer
    assert action == Join(declaration(1))
    assert machine.answered(group_of(1, 2, 3, 4), r.timeouts.quiet + 0.01) is True
    assert machine.phase is Phase.DONE and machine.result is not None


def test_a_partial_chunk_waits_settle_and_a_newcomer_restarts_the_quiet_period():
    r = Round(3, [1, 2])  # 3 of 4
    machine = r.joiner()
    quiet = r.timeouts.quiet
    assert isinstance(machine.next_action(0.0), Wait)  # the first look at the view starts its quiet period
    assert isinstance(machine.next_action(quiet), Wait)  # partial: QUIET is not enough (SETTLE is)
    r.state.view[peer(5)] = declaration(5)  # a peer appears (the board sets last_change), my chunk changes
    r.state.last_change = 0.25
    assert isinstance(machine.next_action(0.375), Wait)
    assert isinstance(machine.next_action(0.375 + quiet - 0.01), Wait)
    assert machine.next_action(0.375 + quiet) == Join(declaration(1))  # now full, and quiet since it changed


def test_a_crowded_key_makes_a_full_chunk_wait_settle_too():
    r = Round(3, [1, 2, 4])
    r.state.crowded = True
    machine = r.joiner()
    assert isinstance(machine.next_action(0.0), Wait)
    assert isinstance(machine.next_action(r.timeouts.quiet), Wait)
    assert isinstance(machine.next_action(r.timeouts.settle), Join)


def test_patience_holds_a_full_chunk_while_peers_of_recent_rounds_are_missing():
    r = Round(3, [1, 2, 4], expected=6)  # two expected peers are not in view yet
    machine = r.joiner()
    straggler_wait = r.patience.straggler_wait
    assert isinstance(machine.next_action(0.0), Wait)
    assert isinstance(machine.next_action(r.timeouts.settle), Wait)
    assert isinstance(machine.next_action(straggler_wait - 0.01), Wait)
    assert machine.next_action(straggler_wait) == Join(declaration(1))  # ran out: act on what is there
    assert r.state.patience_ran_out


def test_the_lowest_peer_collects_and_a_collector_that_stepped_down_plans_again():
    r = Round(1, [2, 3, 4])
    machine = r.joiner()
    assert machine.next_action(0.0) == Collect() and machine.phase is Phase.COLLECTING
    machine.collected(False, 0.5)
    assert machine.phase is Phase.PLANNING and r.state.last_change == 0.5
    machine.collected(True, 0.6)
    assert machine.phase is Phase.DONE


def test_a_redirect_to_a_lower_peer_is_followed_at_once_and_a_higher_one_is_a_rejection():
    r = Round(4, [2, 3, 5])
    machine, t = r.joining()
    assert machine.next_action(t) == Join(declaration(2))
    assert machine.answered(Decision("redirect", redirect=declaration(1)), t) is False
    assert machine.phase is Phase.REDIRECTED and peer(2) in r.state.excluded and r.stats["redirects"] == 1
    assert machine.next_action(t) == Join(declaration(1))  # no planning, no quiet period: straight there
    assert machine.answered(Decision("reject", reason="full", busy=(peer(1), peer(6))), t) is False
    assert {peer(1), peer(6)} <= r.state.excluded and r.stats["rejects"] == 0  # counted for first joins only
    # a redirect upwards could loop: it is taken as a rejection
    r2 = Round(4, [2, 3, 5])
    machine2 = r2.joiner()
    assert isinstance(machine2.next_action(0.0), Wait)
    assert machine2.next_action(t) == Join(declaration(2))
    assert machine2.answered(Decision("redirect", redirect=declaration(3)), t) is False
    assert machine2.phase is Phase.PLANNING and r2.stats == {"no_group": 0, "redirects": 0, "rejects": 1}
    assert peer(2) in r2.state.excluded


def test_redirects_are_followed_at_most_max_redirects_times():
    r = Round(20, [10, 11, 12, 13, 14, 15, 16])  # one chunk of 4 from the 8: a collector among the lower ones
    machine = r.joiner()
    assert isinstance(machine.next_action(0.0), Wait)
    now = r.timeouts.settle
    followed = 0
    for lower in (9, 8, 7, 6, 5, 4):
        action = machine.next_action(now)
        while isinstance(action, Wait):  # my chunk lost its collector: quiet again first
            now = action.until
            action = machine.next_action(now)
        assert isinstance(action, Join), action
        # every answer redirects to a yet lower peer; the redirect's target answers "redirect" too
        machine.answered(Decision("redirect", redirect=declaration(lower)), now)
        if machine.phase is not Phase.REDIRECTED:
            break
        followed += 1
        assert machine.next_action(now) == Join(declaration(lower))
        machine.answered(None, now)  # there: unreachable, back to planning
    assert followed == MAX_REDIRECTS == r.stats["redirects"] and r.stats["rejects"] == 1


def test_an_unreachable_collector_restarts_the_quiet_period_and_the_window_ends_the_round():
    r = Round(3, [1, 2, 4])
    machine, t = r.joining()
    assert machine.next_action(t) == Join(declaration(1))
    r.state.excluded.add(peer(1))  # what the join does when the call fails
    assert machine.answered(None, t) is False and r.state.last_change == t
    assert isinstance(machine.next_action(t + 0.01), Wait)  # plans anew, on a view quiet from now
    assert machine.next_action(WINDOW) == GiveUp("no group before the deadline")
    assert machine.phase is Phase.DONE and r.stats["no_group"] == 1


def test_an_invitation_from_a_lower_collector_sends_the_next_join_there():
    r = Round(3, [2, 4])
    machine = r.joiner()
    r.state.invited_by = declaration(1)
    assert machine.next_action(0.0) == Join(declaration(1)) and r.state.invited_by is None


def test_only_client_mode_peers_in_view_means_waiting_for_a_reachable_one():
    r = Round(5, [1, 2], clients=(1, 2))
    r.state.me = declaration(5, client=True)
    machine = r.joiner()
    action = machine.next_action(1.0)
    assert isinstance(action, Wait) and action.until == 1.0 + r.timeouts.quiet


# ------------------------------------------------------------------------------------------- a collector


def test_a_full_assembly_seals_at_once():
    r = Round(1, [2, 3, 4])
    collector = r.collector()
    for n in (2, 3, 4):
        assert collector.assembly.offer(declaration(n), KEY) is None
    assert collector.next_action(0.0) == Seal()


def test_a_collector_probes_the_missing_once_a_quiet_period_and_rechecks_before_sealing_with_room():
    r = Round(1, [2, 3, 4])
    collector = r.collector()
    collector.assembly.offer(declaration(2), KEY)
    quiet, settle = r.timeouts.quiet, r.timeouts.settle
    assert collector.next_action(0.0) == Wait(quiet / 2)  # not quiet yet: no probes
    assert collector.next_action(quiet) == Wait(quiet * 1.5, (declaration(3), declaration(4)))
    assert collector.next_action(quiet * 1.5) == Wait(quiet * 2)  # probed less than a QUIET ago: not again
    assert collector.next_action(quiet * 2).probe == (declaration(3), declaration(4))
    del r.state.view[peer(3)], r.state.view[peer(4)]  # both withdrew: my chunk is 1 and 2 now
    assert collector.next_action(settle) == Wait(settle + quiet / 2)
    assert isinstance(collector.next_action(2 * settle - 0.01), Wait)
    # on a view settled for SETTLE, a group with room is final, after one more word with the followers
    assert collector.next_action(2 * settle) == Recheck() and collector.assembly.waiting_for == set()


def test_at_the_seal_deadline_a_collector_seals_without_a_recheck():
    r = Round(1, [2, 3, 4])
    collector = r.collector()
    collector.assembly.offer(declaration(2, deadline=1.0), KEY)
    assert collector.next_action(1.0) == Seal()


def test_a_client_mode_member_is_dropped_after_settle_not_probed():
    r = Round(1, [2, 3], clients=(3,))
    collector = r.collector()
    collector.assembly.offer(declaration(2), KEY)
    assert isinstance(collector.next_action(0.0), Wait)
    assert collector.next_action(r.timeouts.quiet).probe == ()  # nobody can call it
    assert peer(3) in collector.assembly.waiting_for
    assert isinstance(collector.next_action(r.timeouts.settle), Wait)
    assert peer(3) in collector.assembly.dropped
    assert collector.next_action(r.timeouts.settle + 0.01) == Recheck()


def test_a_collector_nobody_joined_steps_down_for_a_lower_peer_and_merges_into_an_inviting_one():
    r = Round(2, [3, 4])
    collector = r.collector()
    assert isinstance(collector.next_action(0.0), Wait)
    r.state.view[peer(1)] = declaration(1)  # a lower peer of my chunk appears
    assert collector.next_action(0.05) == StepDown() and r.state.assembly is None
    r2 = Round(2, [3, 4])
    collector2 = r2.collector()
    collector2.assembly.offer(declaration(3), KEY)
    assert isinstance(collector2.next_action(0.0), Wait)
    r2.state.invited_by = declaration(1)
    assert collector2.next_action(0.05) == StepDown(merged_into=declaration(1))
    assert r2.state.assembly is None and collector2.assembly.merged_into == declaration(1)


def test_a_lone_collector_seals_when_everyone_in_view_is_taken():
    r = Round(1, [2, 3])
    r.state.excluded.update({peer(2), peer(3)})
    collector = r.collector()
    assert isinstance(collector.next_action(0.0), Wait)
    assert collector.next_action(r.timeouts.settle) == Seal()


# ------------------------------------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(me=st.integers(1, 30), others=st.sets(st.integers(1, 30), max_size=12), target=st.integers(2, 6),
       clients=st.sets(st.integers(1, 30), max_size=4), expected=st.integers(0, 15),
       steps=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=60))
def test_no_machine_waits_past_its_window_or_joins_itself(me, others, target, clients, expected, steps):
    others.discard(me)
    r = Round(me, sorted(others), target=target, expected=expected, clients=tuple(clients - {me}))
    joiner = r.joiner()
    collector: CollectorMachine | None = None
    now = 0.0
    for dt in steps:
        now += dt
        if collector is not None:
            action = collector.next_action(now)
            if isinstance(action, Wait):
                assert now <= action.until <= now + r.timeouts.quiet
                assert all(d.peer_id != peer(me) and d.can_collect for d in action.probe)
            elif isinstance(action, (Seal, StepDown)):
                collector = None
                joiner.collected(isinstance(action, Seal), now)
                if joiner.phase is Phase.DONE:
                    return
            continue
        action = joiner.next_action(now)
        if isinstance(action, Wait):
            assert now < action.until <= WINDOW or (now >= WINDOW and math.isclose(action.until, WINDOW))
        elif isinstance(action, Join):
            assert action.collector.peer_id != peer(me) and action.collector.can_collect
            joiner.answered(None, now)
            r.state.excluded.add(action.collector.peer_id)
        elif isinstance(action, Collect):
            collector = r.collector()
        else:
            assert isinstance(action, GiveUp) and now >= WINDOW
            return
    # past the window, a joiner gives up at its next question
    if collector is None and joiner.phase is not Phase.DONE:
        assert isinstance(joiner.next_action(WINDOW + 1.0), (GiveUp, Collect))
