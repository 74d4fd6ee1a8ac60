"""The all-reduce round core (`RoundCore`) driven message by message, without trio, sockets or a clock.

A tiny synchronous harness plays the network: it hands each member's pushes, commits and pulls to the reducer's
core and the answers back. Every scenario checks what the protocol promises: the weighted mean of the
committed members, a reducer lost at any step costs only its own part (and `plan_retry` names it), messages out
of turn and duplicates are refused or harmless, and deadlines are plain numbers.
"""

from __future__ import annotations

import pytest
import torch

from averaging.allreduce_core import (
    NOTHING,
    AllReduceConfig,
    ChunkRejected,
    Excluded,
    PartState,
    RoundCore,
    ThroughputEstimator,
    TransferBudget,
    merge_retry,
    plan_retry,
    retry_views,
)
from averaging.errors import LocalViolation, RemoteViolation
from averaging.group import GroupInfo, Member
from averaging.partition import Partition, chunk_views
from peer.p2p.identity import PeerID

CHUNK_BYTES = 64


def make_group(size: int, clients: tuple[int, ...] = ()) -> GroupInfo:
    members = [Member(PeerID(bytes([i + 1]) * 20), None if i in clients else ("127.0.0.1", 1000 + i), 1.0,
                      i in clients) for i in range(size)]
    return GroupInfo.create(b"g" * 16, members)


def make_round(size: int = 3, weights=None, clients: tuple[int, ...] = (), seed: int = 0, now: float = 0.0,
               config: AllReduceConfig | None = None):
    group = make_group(size, clients)
    generator = torch.Generator().manual_seed(seed)
    tensors = [[torch.randn(50, generator=generator), torch.randn(4, 3, generator=generator)] for _ in range(size)]
    originals = [torch.cat([t.reshape(-1) for t in ts]).clone() for ts in tensors]
    config = config or AllReduceConfig(chunk_bytes=CHUNK_BYTES, timeout_floor=1.0, timeout_factor=4.0)
    budget = TransferBudget(config, ThroughputEstimator(1e6))
    bandwidths = [m.bandwidth if m.reduces else 0.0 for m in group.members]
    partition = Partition.for_tensors(tensors[0], bandwidths, chunk_bytes=config.chunk_bytes)
    weights = weights or [1.0] * size
    cores = [RoundCore(group, partition, i, tensors[i], weights[i], budget=budget, now=now, deadline=now + 60)
             for i in range(size)]
    return group, partition, tensors, originals, weights, cores


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def mean_of(originals, weights, members):
    return sum(originals[i] * weights[i] for i in members) / sum(weights[i] for i in members)


class Harness:
    """Moves the messages of one round between cores, in steps a test can stop between."""

    def __init__(self, size=3, weights=None, clients=(), now=0.0):
        (self.group, self.partition, self.tensors, self.originals, self.weights,
         self.cores) = make_round(size, weights, clients, now=now)
        self.dead: set[int] = set()
        for core in self.cores:
            if core.reducer is not None:
                core.feed_own_part(now)
            core.advance()

    def others(self, member):
        return [p for p in self.partition.parts if p.owner != member]

    def push(self, member, part, chunks=None, now=0.0):
        core, reducer_core = self.cores[member], self.cores[part.owner]
        indices = range(len(part.chunks)) if chunks is None else chunks
        if core.weight == 0 and part.chunks:
            reducer_core.receive_push(member, part.index, NOTHING, 0.0, [], now)
            return
        for index in indices:
            data = [v.clone() for v in chunk_views(core.tensors, part.chunks[index])]
            reducer_core.receive_push(member, part.index, index, core.weight, data, now)
            core.chunk_pushed(part.index, index, self.partition.chunk_bytes_of(part.chunks[index]))

    def push_all(self, member, now=0.0):
        for part in self.others(member):
            self.push(member, part, now=now)
            self.cores[member].push_done(part.index)

    def start_reducing(self, member):
        core = self.cores[member]
        if core.reducer is not None and not core.reducing_started and core.reducer.data_complete:
            core.announce_reducing()
            core.start_reducing()

    def commit(self, member):
        core = self.cores[member]
        assert core.committed
        for part in self.others(member):
            request = core.finish_request(part.index)
            if request is not None:
                self.cores[part.owner].receive_commit(member, part.index, request["weight"], request["suspects"])

    def finalize(self, member, now=0.0):
        core = self.cores[member]
        if core.reducer is not None and core.reducer.ready and not core.released:
            result = core.finalize_own()
            if result is not None:
                for chunk, values in zip(core.own_part.chunks, result):
                    for view, value in zip(chunk_views(core.tensors, chunk), values):
                        view.copy_(value)
                core.own_part_written(now)

    def pull(self, member, now=0.0):
        core = self.cores[member]
        for part in self.others(member):
            if core.parts[part.index] is not PartState.COMMITTED:
                continue
            answer = self.cores[part.owner].finish_answer()
            if not core.finish_reply(part.index, answer):
                continue
            values = [core.check_pulled_chunk(part.index, i, self.cores[part.owner].serve_pull(
                member, part.index, i, now)) for i in range(len(part.chunks))]
            for chunk, chunk_values in zip(part.chunks, values):
                for view, value in zip(chunk_views(core.tensors, chunk), chunk_values):
                    view.copy_(value.reshape(-1))
            core.part_averaged(part.index)

    def run(self, members=None, until="pull"):
        """Each step of the round for every member given (all by default) before the next step, up to and
        including the step named `until`."""
        members = list(range(len(self.cores))) if members is None else members
        steps = [self.push_all, self.start_reducing, self.commit, self.finalize, self.pull]
        for step in steps[:[s.__name__ for s in steps].index(until) + 1]:
            for m in members:
                step(m)

    def kill(self, member):
        """Every other member learns it crashed (hard evidence, as a lost connection gives)."""
        self.dead.add(member)
        for i, core in enumerate(self.cores):
            if i != member:
                core.note_failed(member, crashed=True, reason="connection lost")


def test_a_clean_round_gives_everyone_the_weighted_mean():
    h = Harness(size=4, weights=[1.0, 2.0, 0.5, 3.0])
    h.run()
    want = mean_of(h.originals, h.weights, range(4))
    for core in h.cores:
        assert torch.allclose(flat(core.tensors), want, atol=1e-6)
        result = core.result(finished=True, now=1.0)
        assert result.fully_averaged and not result.failed_peers
        assert all(state is PartState.AVERAGED for state in core.parts.values())
        assert all(sorted(c) == sorted(h.group.peer_ids) for c in result.contributors)
        names = [name for name, _ in core.take_events()]
        # nothing counts before every push is done: the commit comes after the last chunk
        assert names.index("committed") > max(i for i, n in enumerate(names) if n == "chunk_pushed")
        assert "reducing" in names and "reduced" in names and names.count("part_received") == 3
        assert core.pull_service(0.0) is None  # no watch open, every chunk pulled: nothing left to serve
    assert plan_retry(h.cores[0].result(finished=True, now=1.0), h.partition, h.group, now=1.0,
                      deadline=60.0) is None


def test_a_zero_weight_member_receives_the_mean_and_a_client_member_reduces_nothing():
    h = Harness(size=3, weights=[1.0, 0.0, 2.0], clients=(2,))
    assert h.cores[2].reducer is None and len(h.partition.parts) == 2
    h.run()
    want = mean_of(h.originals, h.weights, [0, 2])
    for core in h.cores:
        assert torch.allclose(flat(core.tensors), want, atol=1e-6)
    assert h.cores[0].contributors[0] == [0, 2]


def test_commit_waits_for_every_push_and_the_own_part():
    h = Harness(size=3)
    me = h.cores[0]
    parts = h.others(0)
    h.push(0, parts[0])
    me.push_done(parts[0].index)
    assert not me.committed and me.pushes_left == 1
    h.push(0, parts[1])
    me.push_done(parts[1].index)
    assert not me.committed  # its own part has no data from members 1 and 2 yet
    with pytest.raises(LocalViolation):
        me.finish_request(parts[0].index)
    with pytest.raises(LocalViolation):
        me.start_reducing()  # the part's data is not complete
    h.push_all(1)
    h.push_all(2)
    h.start_reducing(0)
    assert me.committed


# ------------------------------------------------------------------------------------------- failures


STEPS = ["before_push", "mid_push", "pushed", "committed", "reduced", "pulled_some"]


@pytest.mark.parametrize("step", STEPS)
def test_a_reducer_failing_at_every_step_costs_at_most_its_own_part(step):
    h = Harness(size=4, weights=[1.0, 2.0, 1.5, 0.5])
    victim = 2
    alive = [0, 1, 3]
    victim_part = h.partition.part_of(victim)
    if step == "before_push":
        h.kill(victim)
    elif step == "mid_push":
        for part in h.others(victim):
            h.push(victim, part, chunks=[0])
        h.kill(victim)
    elif step == "pushed":
        h.push_all(victim)
        h.kill(victim)
    elif step in ("committed", "reduced", "pulled_some"):
        h.push_all(victim)
    for m in alive:
        for part in h.others(m):
            if part.owner == victim and victim in h.dead:
                h.cores[m].reducer_failed(part.index, crashed=True, reason="push: connection lost")
            else:
                h.push(m, part)
                h.cores[m].push_done(part.index)
    for m in range(4):
        if m not in h.dead:
            h.start_reducing(m)
    if step in ("committed", "reduced", "pulled_some"):
        assert h.cores[victim].committed
        h.commit(victim)
    if step == "committed":
        h.kill(victim)  # it counts where it committed, but its own part is lost
    for m in alive:
        h.commit(m)
    if step in ("reduced", "pulled_some"):
        h.finalize(victim)
        assert h.cores[victim].released
    if step == "pulled_some":
        for m in alive:
            h.finalize(m)
        h.pull(victim)
    if step in ("reduced", "pulled_some"):
        h.kill(victim)  # after reducing: its mean is served already, or is lost with it
    for m in alive:
        h.finalize(m)
    for m in alive:
        core = h.cores[m]
        for part in h.others(m):
            if part.owner == victim and core.parts[part.index] is PartState.COMMITTED and victim in h.dead \
                    and step != "reduced" and step != "pulled_some":
                core.reducer_failed(part.index, crashed=True, reason="finish: connection lost")
        h.pull(m)

    counted = step in ("committed", "reduced", "pulled_some")  # the victim committed before it died
    contributors = [0, 1, 2, 3] if counted else alive
    want = mean_of(h.originals, h.weights, contributors)
    part_served = step in ("reduced", "pulled_some")  # its mean was ready before it died
    for m in alive:
        core = h.cores[m]
        result = core.result(finished=True, now=1.0)
        assert result.failed_peers == {h.group.members[victim].peer_id}
        values = flat(core.tensors)
        for part in h.partition.parts:
            piece = slice(part.start, part.stop)
            if part.owner == victim and not part_served:
                assert core.parts[part.index] is PartState.FAILED
                assert not result.averaged[part.index]
                assert torch.equal(values[piece], h.originals[m][piece])
            else:
                assert result.averaged[part.index]
                assert torch.allclose(values[piece], want[piece], atol=1e-6)
        retry = plan_retry(result, h.partition, h.group, now=1.0, deadline=60.0)
        if part_served:
            assert retry is None
        else:
            retry_group, lost = retry
            assert lost == [victim_part.index]
            assert h.group.members[victim].peer_id not in retry_group
            # every survivor derives the same follow-up round without a message
            other = plan_retry(h.cores[alive[0]].result(finished=True, now=1.0), h.partition, h.group, now=1.0,
                               deadline=60.0)
            assert other[0].group_id == retry_group.group_id
            views = retry_views(core.tensors, h.partition, lost)
            assert sum(v.numel() for v in views) == victim_part.numel


def test_a_member_lost_before_committing_is_taken_out_of_every_part():
    h = Harness(size=3)
    h.push_all(1)  # member 1 sends everything, then vanishes before its commit
    h.kill(1)
    h.run(members=[0, 2])
    want = mean_of(h.originals, h.weights, [0, 2])
    for m in (0, 2):
        core = h.cores[m]
        piece = slice(h.partition.part_of(1).start, h.partition.part_of(1).stop)
        for part in h.partition.parts:
            if part.owner != 1:
                values = flat(core.tensors)[part.start:part.stop]
                assert torch.allclose(values, want[part.start:part.stop], atol=1e-6)
                assert 1 not in core.contributors[part.index]
        assert torch.equal(flat(core.tensors)[piece], h.originals[m][piece])  # its own part: lost with it


def test_a_reducer_that_excluded_us_is_not_blamed():
    h = Harness(size=3)
    me = h.cores[0]
    part = h.partition.part_of(1)
    h.cores[1].note_failed(0, reason="missed its deadline")  # reducer 1 dropped us (a timeout: not shared)
    with pytest.raises(Excluded):
        h.push(0, part)
    me.excluded(part.index)
    assert me.parts[part.index] is PartState.EXCLUDED
    assert 1 not in me.failed
    assert me.pushes_left == 1
    assert 0 not in h.cores[1].crashed  # a timeout is our own view: never passed on as hard evidence


def test_hard_evidence_is_passed_on_in_the_commit_and_in_the_answer():
    h = Harness(size=4)
    h.run(until="start_reducing")
    h.cores[0].note_failed(3, crashed=True, reason="connection lost")  # only member 0 saw it crash
    part = h.partition.part_of(1)
    request = h.cores[0].finish_request(part.index)
    assert request["suspects"] == [3]
    h.cores[1].receive_commit(0, part.index, request["weight"], request["suspects"])
    assert 3 in h.cores[1].crashed  # the reducer takes a member's hard evidence as its own
    h.cores[2].note_failed(3, reason="missed its deadline")  # a timeout is not evidence: not passed on
    request = h.cores[2].finish_request(part.index)
    assert request["suspects"] == []
    h.cores[1].receive_commit(2, part.index, request["weight"], request["suspects"])
    h.finalize(1)
    answer = h.cores[1].finish_answer()
    assert answer["failed"] == [3]  # the reducer tells every committing member whom it saw crash


def test_deadlines_are_plain_numbers():
    h = Harness(size=3, now=10.0)
    reducer = h.cores[0]
    h.push(1, h.partition.part_of(0), chunks=[0], now=10.5)  # member 1 started sending, member 2 never showed
    expired, wake = reducer.expire_senders(11.0)
    assert not expired and 11.0 < wake < 70.0
    expired, _ = reducer.expire_senders(wake)
    assert expired and reducer.failed  # whoever fell due first is out
    events = [name for name, _ in reducer.take_events()]
    assert "member_failed" in events
    while True:
        expired, wake = reducer.expire_senders(1e9)
        if not expired:
            break
    assert reducer.failed == {1, 2} and wake == float("inf")
    assert reducer.reducer.data_complete


def test_pulls_are_served_until_every_committed_member_has_its_copy_or_is_late():
    h = Harness(size=3)
    h.run(until="commit")
    reducer = h.cores[0]
    reducer.watch_started(1, 0, 0.0)
    h.finalize(0, now=5.0)
    h.finalize(1, now=5.0)
    h.finalize(2, now=5.0)
    wake = reducer.pull_service(5.0)
    assert wake is not None and wake > 5.0
    h.pull(1, now=5.5)
    reducer.watch_ended(1, cancelled=False)
    wake_after = reducer.pull_service(5.5)
    assert wake_after is not None  # member 2 has not pulled yet
    assert reducer.pull_service(wake_after) is None  # it missed its deadline: stop serving
    assert 2 in reducer.gone and 2 not in reducer.failed  # late to pull is not a failure of the round


def test_close_answers_pending_commits_with_left_the_round():
    h = Harness(size=2)
    h.push_all(0)
    h.push_all(1)
    h.start_reducing(0)
    h.start_reducing(1)
    h.commit(1)
    core = h.cores[0]
    with pytest.raises(LocalViolation):
        core.finish_answer()  # not reduced yet: the commit still waits
    core.close()
    assert core.released and core.closed and core.aborted
    assert core.finish_answer() is None  # the driver answers "left the round"
    with pytest.raises(RemoteViolation):
        core.serve_pull(1, 0, 0, 0.0)


# ------------------------------------------------------------------------------------------- out of turn


def test_messages_out_of_order_are_refused_and_the_sender_is_blamed():
    h = Harness(size=3)
    reducer = h.cores[0]
    part = h.partition.part_of(0)
    with pytest.raises(ChunkRejected) as caught:
        reducer.receive_commit(1, part.index, 1.0, [])  # commit before any data
    assert caught.value.peer == h.group.members[1].peer_id and caught.value.operation == "allreduce.finish"
    assert 1 in reducer.failed and 1 not in reducer.crashed  # a bad message is our view only
    with pytest.raises(Excluded):
        h.push(1, part)  # from now on it is excluded
    with pytest.raises(RemoteViolation):
        reducer.serve_pull(2, part.index, 0, 0.0)  # a pull before the commit and the mean
    with pytest.raises(RemoteViolation):
        reducer.receive_push(2, h.partition.part_of(1).index, 0, 1.0, [], 0.0)  # not our part
    with pytest.raises(RemoteViolation):
        reducer.watch_started(2, True, 0.0)  # a bool is not a part index
    sender = h.cores[2]
    with pytest.raises(LocalViolation):
        sender.finish_reply(part.index, {"averaged": True})  # no commit pending
    with pytest.raises(LocalViolation):
        sender.part_averaged(part.index)  # nothing pulled
    with pytest.raises(LocalViolation):
        h.cores[1].feed_own_part(0.0) if h.cores[1].reducer is None else h.cores[2].start_reducing()


def test_malformed_answers_are_the_reducers_fault():
    h = Harness(size=3)
    h.run(until="start_reducing")
    core = h.cores[0]
    part = h.partition.part_of(1)
    core.finish_request(part.index)
    with pytest.raises(RemoteViolation) as caught:
        core.finish_reply(part.index, ["not", "a", "dict"])
    assert caught.value.peer == h.group.members[1].peer_id
    other = h.partition.part_of(2)
    core.finish_request(other.index)
    assert core.finish_reply(other.index, {"averaged": True, "contributors": [0, 1, True, "x"],
                                           "failed": [7, -1, "x", True, 2]})
    assert core._reply_contributors[other.index] == [0, 1]  # junk and bools dropped
    assert not core.failed  # out-of-range, junk and the reducer itself are ignored in "failed"
    with pytest.raises(RemoteViolation):
        core.check_pulled_chunk(other.index, 0, [torch.zeros(1)] * 99)
    core.reducer_failed(part.index, crashed=False, reason="malformed finish reply")
    assert core.parts[part.index] is PartState.FAILED and 1 in core.failed and 1 not in core.crashed


def test_duplicates_are_refused_or_harmless():
    h = Harness(size=3)
    reducer = h.cores[0]
    part = h.partition.part_of(0)
    h.push(1, part, chunks=[0])
    with pytest.raises(ChunkRejected):
        h.push(1, part, chunks=[0])  # the same chunk twice
    assert 1 in reducer.failed
    h2 = Harness(size=3)
    for m in range(3):
        h2.push_all(m)
        h2.cores[m].push_done(h2.others(m)[0].index)  # a second "push done": ignored
    for m in range(3):
        h2.start_reducing(m)
    for m in range(3):
        h2.commit(m)
    core = h2.cores[0]
    part = h2.partition.part_of(1)
    h2.cores[1].receive_commit(0, part.index, 1.0, [])  # the same commit again: idempotent
    with pytest.raises(LocalViolation):
        core.finish_request(part.index)  # a driver that commits twice to one reducer is a local bug
    assert h2.cores[0].note_failed(2, reason="x") and not h2.cores[0].note_failed(2, reason="x")
    assert [n for n, _ in h2.cores[0].take_events()].count("member_failed") == 1
    h2.finalize(1)
    h2.finalize(2)
    h2.pull(0)
    first = h2.cores[1].serve_pull(0, part.index, 0, 0.0)
    again = h2.cores[1].serve_pull(0, part.index, 0, 0.0)  # pulling a chunk twice returns the same mean
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    with pytest.raises(LocalViolation):
        core.finish_reply(part.index, h2.cores[1].finish_answer())  # a second answer to one commit


# ------------------------------------------------------------------------------------------- timing and retry


def test_transfer_budget_counts_the_backlog_and_the_first_contact():
    config = AllReduceConfig(timeout_floor=0.5, timeout_factor=2.0, join_wait=5.0)
    budget = TransferBudget(config, ThroughputEstimator(1e6))
    backlog_a, timeout_a = budget.begin("out", 1_000_000)
    backlog_b, timeout_b = budget.begin("out", 1_000_000, first_contact=True)
    assert (backlog_a, backlog_b) == (1_000_000, 2_000_000)
    assert timeout_a == 2.0 and timeout_b == 4.0 + 5.0
    assert budget.begin("in", 100)[1] == 0.5  # the floor; the other direction has its own backlog
    budget.end("out", 1_000_000, backlog_b, 100.0, first_contact=True)  # includes the join wait: not measured
    assert budget.estimator.rate == 1e6
    budget.end("out", 1_000_000, backlog_a, 0.5)
    assert budget.estimator.rate == 2e6 and budget.in_flight["out"] == 0
    budget.end("in", 100, 100, None)  # a failed call measures nothing
    assert budget.in_flight["in"] == 0 and budget.estimator.observations == 1


def test_merge_retry_marks_the_lost_part_averaged_only_when_the_retry_fully_averaged():
    h = Harness(size=3)
    h.kill(2)
    h.run(members=[0, 1])
    result = h.cores[0].result(finished=True, now=1.0)
    retry_group, lost = plan_retry(result, h.partition, h.group, now=1.0, deadline=60.0)
    assert plan_retry(result, h.partition, h.group, now=60.0, deadline=60.0) is None  # no time left
    import copy
    failed_retry = copy.deepcopy(result)
    failed_retry.averaged = [False]
    merged = copy.deepcopy(result)
    merge_retry(merged, lost, failed_retry)
    assert not merged.averaged[lost[0]]
    ok = copy.deepcopy(result)
    ok.averaged, ok.contributors = [True], [list(retry_group.peer_ids)]
    merge_retry(result, lost, ok)
    assert result.averaged[lost[0]] and result.contributors[lost[0]] == sorted(retry_group.peer_ids)
