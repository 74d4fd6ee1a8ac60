"""Matchmaking's pure parts: declarations on the wire, the shared grouping plan, the collector's assembly."""

import pytest

from averaging.assembly import WITHDRAWN, Assembly, Decision, Declaration, chunk_of, collector_of, plan_groups
from peer.p2p.identity import PeerID

SCHEMA = b"s" * 8


def _decl(n: int, *, client: bool = False, round: int = 0, deadline: float = 10.0, schema: bytes = SCHEMA):
    peer_id = PeerID(bytes([n]) * 20)
    return Declaration(peer_id, None if client else (f"h{n}", 1000 + n), 1.0, client, schema, round, deadline, 0.0)


def test_declaration_round_trips_and_rejects_garbage():
    declaration = _decl(3)
    assert Declaration.from_wire(bytes(declaration.peer_id), declaration.to_wire()) == declaration
    client = _decl(4, client=True)
    assert Declaration.from_wire(bytes(client.peer_id), client.to_wire()) == client
    for junk in (WITHDRAWN, None, 5, "x", [2] + declaration.to_wire()[1:], declaration.to_wire()[:-1],
                 [1, "h", "port", 1.0, False, SCHEMA, 0, 1.0, 0.0], [1, "h", 1, float("nan"), False, SCHEMA, 0, 1, 0]):
        assert Declaration.from_wire(bytes(declaration.peer_id), junk) is None
    assert Declaration.from_wire(b"short", declaration.to_wire()) is None  # not a peer id


def test_plan_is_the_same_from_any_order_and_balanced():
    declarations = [_decl(n) for n in range(1, 10)]
    plan = plan_groups(declarations, 4, salt=b"k|0")
    assert plan == plan_groups(list(reversed(declarations)), 4, salt=b"k|0")
    assert sorted(len(c) for c in plan) == [3, 3, 3]  # 9 peers, target 4: three groups of 3, not 4 + 4 + 1
    assert sorted(d.peer_id for c in plan for d in c) == sorted(d.peer_id for d in declarations)
    assert plan != plan_groups(declarations, 4, salt=b"k|1")  # another round, another grouping
    assert [len(c) for c in plan_groups(declarations[:8], 4, salt=b"k|0")] == [4, 4]


def test_full_only_plan_keeps_full_groups_and_one_partial_chunk():
    declarations = [_decl(n) for n in range(1, 7)]
    plan = plan_groups(declarations, 4, salt=b"k", full_only=True)
    assert [len(c) for c in plan] == [4, 2]


def test_every_chunk_has_a_reachable_collector():
    declarations = [_decl(1), _decl(2, client=True), _decl(3, client=True), _decl(4, client=True), _decl(5)]
    plan = plan_groups(declarations, 2, salt=b"k")
    assert len(plan) == 2  # only two peers can collect
    for chunk in plan:
        collector = collector_of(chunk)
        assert collector is not None and not collector.client_mode
        assert collector.peer_id == min(d.peer_id for d in chunk if not d.client_mode)
    assert plan_groups([_decl(2, client=True)], 2) == []
    assert chunk_of(plan, _decl(9).peer_id) == []


def test_assembly_accepts_until_full_then_seals_and_answers_everyone_the_same():
    me, a, b, c = _decl(1), _decl(2), _decl(3), _decl(4)
    assembly = Assembly(me, key="k", target_group_size=3, min_group_size=2)
    assert assembly.offer(_decl(5, schema=b"other!!!"), "k").reason == "different schema"
    assert assembly.offer(a, "other key").reason == "different key"
    assert assembly.offer(a, "k") is None and assembly.offer(b, "k") is None
    rejected = assembly.offer(c, "k")
    assert rejected.kind == "reject" and set(rejected.busy) == {me.peer_id, a.peer_id, b.peer_id}
    assert assembly.should_seal(now=0.0, quiet=False)  # full
    group = assembly.seal(b"g" * 16)
    assert group.peer_ids == sorted([me.peer_id, a.peer_id, b.peer_id])
    assert assembly.answer(a.peer_id).group == assembly.answer(b.peer_id).group == group
    late = assembly.offer(c, "k")
    assert late.kind == "reject" and late.reason == "sealed" and set(late.busy) == set(group.peer_ids)


def test_assembly_waits_for_expected_members_unless_dropped_or_deadline():
    me, a, b = _decl(1, deadline=10.0), _decl(2, deadline=8.0), _decl(3)
    assembly = Assembly(me, key="k", target_group_size=4, min_group_size=2)
    assembly.set_expected([me, a, b])
    assembly.offer(a, "k")
    assert not assembly.should_seal(now=1.0, quiet=True)  # b is still expected
    assembly.drop(b.peer_id)  # b turned out dead
    assert assembly.should_seal(now=1.0, quiet=True)
    assert not assembly.should_seal(now=1.0, quiet=False)
    assembly.dropped.clear()
    assert assembly.should_seal(now=8.0, quiet=False)  # the earliest member deadline (a's), not mine


def test_assembly_with_too_few_members_seals_without_a_group_and_merging_redirects():
    me, a = _decl(1), _decl(2)
    lonely = Assembly(me, key="k", target_group_size=4, min_group_size=2)
    assert lonely.seal(b"g" * 16) is None and lonely.answer(a.peer_id).kind == "reject"
    merging = Assembly(_decl(5), key="k", target_group_size=4, min_group_size=2)
    merging.offer(a, "k")
    merging.merge_into(me)
    assert merging.answer_ready(a.peer_id)
    assert merging.answer(a.peer_id).kind == "redirect" and merging.answer(a.peer_id).redirect == me
    assert merging.offer(_decl(6), "k").redirect == me


def test_decision_round_trips():
    group_decision = Decision("group", group=None)
    with pytest.raises(ValueError):
        Decision.from_wire(group_decision.to_wire())
    redirect = Decision("redirect", redirect=_decl(2))
    assert Decision.from_wire(redirect.to_wire()).redirect == _decl(2)
    reject = Decision("reject", reason="full", busy=(_decl(1).peer_id,))
    assert Decision.from_wire(reject.to_wire()).busy == (_decl(1).peer_id,)
    with pytest.raises(ValueError):
        Decision.from_wire({"kind": "maybe"})
