"""The collector's `Assembly` driven without trio: joins, probes and times in, answers and verdicts out.

Valid sequences, a joiner or collector lost at each step, messages out of order and duplicates.
"""

from __future__ import annotations

import pytest

from averaging.assembly import Assembly, Declaration, read_probe_answer
from averaging.errors import LocalViolation
from peer.p2p.identity import PeerID

SCHEMA = b"s" * 8


def decl(n: int, *, deadline: float = 10.0, round: int = 0, client: bool = False) -> Declaration:
    return Declaration(PeerID(bytes([n]) * 20), None if client else (f"h{n}", 1000 + n), 1.0, client, SCHEMA,
                       round, deadline, 0.0)


def assembly(me: int = 5, target: int = 4, min_size: int = 2) -> Assembly:
    return Assembly(decl(me), key="k", target_group_size=target, min_group_size=min_size)


def test_a_valid_sequence_every_member_gets_the_same_group():
    a = assembly()
    chunk = [decl(n) for n in (5, 6, 7, 8)]
    a.set_expected(chunk)
    assert a.waiting_for == {decl(n).peer_id for n in (6, 7, 8)}
    for n in (6, 7):
        assert a.offer(decl(n, round=n), "k") is None
        assert not a.answer_ready(decl(n).peer_id)  # held until sealing
    assert not a.should_seal(1.0, quiet=True)  # 8 is still expected
    assert a.offer(decl(8), "k") is None
    assert a.full and a.should_seal(1.0, quiet=False)
    group = a.seal(b"g" * 16)
    answers = [a.answer(decl(n).peer_id) for n in (6, 7, 8)]
    assert all(x.kind == "group" and x.group == group and x.round == 7 for x in answers)  # max of the rounds
    assert group.peer_ids == sorted(decl(n).peer_id for n in (5, 6, 7, 8))


def test_seal_at_the_earliest_deadline_of_the_joined_members():
    a = assembly()
    a.set_expected([decl(6), decl(7)])
    a.offer(decl(6, deadline=4.0), "k")
    assert not a.should_seal(3.9, quiet=False)
    assert a.should_seal(4.0, quiet=False)  # 6 gives up at 4.0: seal before it does
    group = a.seal(b"g" * 16)
    assert len(group.peer_ids) == 2


@pytest.mark.parametrize("step", ["before_join", "after_join", "after_seal"])
def test_a_member_lost_at_each_step(step):
    a = assembly(min_size=2)
    a.set_expected([decl(6), decl(7)])
    a.offer(decl(6), "k")
    lost = decl(7).peer_id
    if step == "after_join":
        a.offer(decl(7), "k")
    if step == "after_seal":
        a.offer(decl(7), "k")
        group = a.seal(b"g" * 16)
        a.drop(lost)  # too late to matter: the group is final (the all-reduce handles its loss)
        assert lost in group
        return
    a.drop(lost)  # its probe failed
    if step == "before_join":
        assert a.waiting_for == set() and a.should_seal(1.0, quiet=True)
        assert lost not in a.seal(b"g" * 16)
    else:
        assert lost not in a.dropped  # it joined: a failed probe does not unjoin it
        assert a.should_seal(1.0, quiet=True)


def test_too_few_members_no_group_and_everyone_is_told():
    a = assembly(min_size=3)
    a.offer(decl(6), "k")
    assert not a.should_seal(1.0, quiet=True)
    assert a.seal(b"g" * 16) is None
    assert a.answer_ready(decl(6).peer_id) and a.answer(decl(6).peer_id).kind == "reject"


def test_abandon_answers_every_held_join():
    a = assembly()
    a.offer(decl(6), "k")
    a.abandon()
    assert a.answer_ready(decl(6).peer_id)
    assert a.answer(decl(6).peer_id).reason == "no group assembled"
    assert a.offer(decl(7), "k").reason == "sealed"


def test_step_down_into_a_lower_collector():
    a = assembly(me=5, target=4)
    a.offer(decl(6), "k")
    assert a.probed_by(decl(3).peer_id, 2, reachable=True) == "merge"  # 2 + 2 <= 4
    assert a.probed_by(decl(7).peer_id, 2, reachable=True) is None  # a higher prober never wins
    assert a.probed_by(decl(3).peer_id, 2, reachable=False) is None  # nobody can call it
    assert a.probed_by(decl(3).peer_id, "2", reachable=True) is None  # junk size
    a.merge_into(decl(3))
    assert a.answer_ready(decl(6).peer_id) and a.answer(decl(6).peer_id).redirect == decl(3)
    assert a.offer(decl(8), "k").redirect == decl(3)  # later joiners go there too
    assert a.probed_by(decl(2).peer_id, 1, reachable=True) is None  # closed


def test_hand_over_when_too_many_to_merge():
    a = assembly(me=5, target=4)
    for n in (6, 7):
        a.offer(decl(n), "k")
    assert a.probed_by(decl(3).peer_id, 3, reachable=True) == "handover"  # 3 + 3 > 4, it has room for 1
    moved = a.hand_over(decl(3), 1)
    assert moved == [decl(7).peer_id]  # the highest peer id goes first
    assert a.answer_ready(decl(7).peer_id) and not a.answer_ready(decl(6).peer_id)
    assert a.answer(decl(7).peer_id).redirect == decl(3)
    with pytest.raises(LocalViolation):
        a.answer(decl(6).peer_id)  # still pending: asking for its answer is a driver bug
    # the moved joiner joins again: the lower collector turned it away (it filled up meanwhile), so it is taken
    # back rather than sent there again (that left it alone for the rest of the window)
    assert a.offer(decl(7), "k") is None
    assert not a.answer_ready(decl(7).peer_id) and decl(7).peer_id not in a.dropped
    assert [p for p in a.seal(b"g").peer_ids] == [decl(n).peer_id for n in (5, 6, 7)]


def test_no_merge_nor_handover_for_a_prober_still_waiting_for_stragglers():
    a = assembly(me=5, target=4)
    for n in (6, 7):
        a.offer(decl(n), "k")
    # it expects peers that are still averaging their last round: its group fills on its own, mine too
    assert a.probed_by(decl(3).peer_id, 2, reachable=True, prober_patient=True) is None
    assert a.probed_by(decl(3).peer_id, 3, reachable=True, prober_patient=True) is None
    assert a.probed_by(decl(3).peer_id, 3, reachable=True) == "handover"  # once it waits for nobody


def test_a_dropped_peer_that_declares_again_is_waited_for():
    a = assembly()
    a.set_expected([decl(6), decl(7)])
    a.offer(decl(6), "k")
    a.drop(decl(7).peer_id)  # its probe said it is still averaging its previous round
    assert a.waiting_for == set() and a.should_seal(1.0, quiet=True)
    a.readmit(decl(7).peer_id)  # its new declaration was read
    assert a.waiting_for == {decl(7).peer_id} and not a.should_seal(1.0, quiet=True)


def test_the_expected_peers_of_a_merging_collector():
    a = assembly()
    a.set_expected([decl(6)])
    a.drop(decl(9).peer_id)
    a.expect([decl(9).peer_id, decl(10).peer_id])
    assert a.waiting_for == {decl(n).peer_id for n in (6, 9, 10)}
    a.set_expected([decl(6)], extra=[decl(9).peer_id])
    assert a.waiting_for == {decl(6).peer_id, decl(9).peer_id}


def test_duplicates_and_out_of_order_messages():
    a = assembly(target=3)
    assert a.offer(decl(6), "k") is None
    assert a.offer(decl(6), "k") is None  # a repeated join (a retry after a timeout) is the same join
    assert len(a.joined) == 2
    assert a.offer(decl(7), "k") is None
    assert a.offer(decl(6), "k") is None  # a joined member may repeat even when full
    assert a.offer(decl(8), "k").reason == "full"
    group = a.seal(b"g" * 16)
    with pytest.raises(LocalViolation):
        a.seal(b"h" * 16)  # sealing twice
    again = a.offer(decl(6), "k")  # a member asking again after the seal: the same group
    assert again.kind == "group" and again.group == group
    assert a.offer(decl(8), "k").busy == tuple(group.peer_ids)  # late: skip the sealed members at once
    a.drop(decl(6).peer_id)  # a stale probe result for a member: it stays
    assert decl(6).peer_id in a.group


def test_probe_answers_are_read_into_verdicts():
    me = decl(5).peer_id
    other = bytes(decl(3).peer_id)
    assert read_probe_answer({"handover": [bytes(decl(7).peer_id), b"short", 5]}, me).members == (decl(7).peer_id,)
    assert read_probe_answer({"merging": [bytes(decl(8).peer_id)]}, me).kind == "merging"
    stale = read_probe_answer({"matching": False, "between_rounds": True}, me)
    assert stale.kind == "stale" and stale.between_rounds
    assert read_probe_answer({"matching": True, "collecting": True}, me).kind == "busy"
    assert read_probe_answer({"matching": True, "following": other}, me).kind == "follows_other"
    assert read_probe_answer({"matching": True, "following": bytes(me)}, me).kind == "free"
    assert read_probe_answer({"matching": True, "following": None}, me).kind == "free"
    assert read_probe_answer("garbage", me).kind == "busy"
    assert read_probe_answer({"matching": True, "following": 12}, me).kind == "follows_other"
