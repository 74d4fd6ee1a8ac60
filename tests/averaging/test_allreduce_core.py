"""The sans-I/O part reducer and the throughput-based deadlines, without any network."""

from __future__ import annotations

import random

import pytest
import torch

from averaging.allreduce_core import NOTHING, ChunkRejected, Excluded, PartReducer, ThroughputEstimator
from averaging.partition import Partition, chunk_views


def setup(members=4, seed=0, chunk_bytes=16):
    generator = torch.Generator().manual_seed(seed)
    tensor_sets = [[torch.randn(40, generator=generator), torch.randn(3, 5, generator=generator)]
                   for _ in range(members)]
    partition = Partition.for_tensors(tensor_sets[0], [1.0] * members, chunk_bytes=chunk_bytes)
    part = partition.parts[1]
    reducer = PartReducer(part, members, [t.dtype for t in tensor_sets[0]])
    return tensor_sets, part, reducer


def send_all(reducer, part, sender, tensors, weight, now=0.0):
    for index, chunk in enumerate(part.chunks):
        reducer.receive(sender, index, weight, [v.clone() for v in chunk_views(tensors, chunk)], now=now)


def expected_part(tensor_sets, part, weights):
    total = sum(weights.values())
    out = []
    for chunk in part.chunks:
        out.append([sum(chunk_views(tensor_sets[s], chunk)[j] * w for s, w in weights.items()) / total
                    for j in range(len(chunk))])
    return out


def assert_result(result, expected):
    for got_chunk, want_chunk in zip(result, expected):
        for got, want in zip(got_chunk, want_chunk):
            assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_weighted_mean_over_committed_members_in_any_arrival_order():
    tensor_sets, part, reducer = setup()
    weights = {0: 1.0, 1: 2.0, 2: 0.5, 3: 4.0}
    arrivals = [(s, i) for s in weights for i in range(len(part.chunks))]
    random.Random(3).shuffle(arrivals)
    for sender, index in arrivals:
        views = chunk_views(tensor_sets[sender], part.chunks[index])
        reducer.receive(sender, index, weights[sender], [v.clone() for v in views])
    assert reducer.data_complete and not reducer.ready
    for sender in weights:
        reducer.commit(sender, weights[sender])
    assert reducer.ready
    assert_result(reducer.finalize(), expected_part(tensor_sets, part, weights))
    assert reducer.contributors == [0, 1, 2, 3]


def test_member_lost_before_commit_is_removed_exactly_even_after_its_data_arrived():
    tensor_sets, part, reducer = setup()
    for sender in range(4):
        send_all(reducer, part, sender, tensor_sets[sender], 1.0)
    for sender in (0, 1, 3):
        reducer.commit(sender, 1.0)
    reducer.fail(2)
    assert reducer.ready
    assert_result(reducer.finalize(), expected_part(tensor_sets, part, {0: 1.0, 1: 1.0, 3: 1.0}))
    with pytest.raises(Excluded):
        reducer.receive(2, 0, 1.0, [])


def test_member_lost_after_commit_still_counts():
    tensor_sets, part, reducer = setup(members=3)
    for sender in range(3):
        send_all(reducer, part, sender, tensor_sets[sender], 1.0)
        reducer.commit(sender, 1.0)
    reducer.fail(1)
    assert 1 not in reducer.failed
    assert_result(reducer.finalize(), expected_part(tensor_sets, part, {0: 1.0, 1: 1.0, 2: 1.0}))


def test_zero_weight_member_and_nobody_with_weight():
    tensor_sets, part, reducer = setup(members=2)
    send_all(reducer, part, 0, tensor_sets[0], 3.0)
    reducer.receive(1, NOTHING, 0.0, [])
    reducer.commit(0, 3.0)
    reducer.commit(1, 0.0)
    assert_result(reducer.finalize(), expected_part(tensor_sets, part, {0: 1.0}))
    assert reducer.contributors == [0]

    _, part, lonely = setup(members=2)
    lonely.receive(0, NOTHING, 0.0, [])
    lonely.receive(1, NOTHING, 0.0, [])
    lonely.commit(0, 0.0)
    lonely.commit(1, 0.0)
    assert lonely.finalize() is None  # nothing to average: the part keeps its local values


def test_protocol_violations_are_rejected():
    tensor_sets, part, reducer = setup()
    views = chunk_views(tensor_sets[0], part.chunks[0])
    reducer.receive(0, 0, 1.0, [v.clone() for v in views])
    with pytest.raises(ChunkRejected):
        reducer.receive(0, 0, 1.0, [v.clone() for v in views])  # duplicate
    with pytest.raises(ChunkRejected):
        reducer.receive(1, 0, 1.0, [v.clone()[:-1] for v in views])  # wrong size
    with pytest.raises(ChunkRejected):
        reducer.receive(1, 0, 1.0, [v.double() for v in views])  # wrong dtype
    with pytest.raises(ChunkRejected):
        reducer.receive(1, len(part.chunks), 1.0, [])  # no such chunk
    with pytest.raises(ChunkRejected):
        reducer.receive(0, 1, 2.0, [v.clone() for v in chunk_views(tensor_sets[0], part.chunks[1])])  # weight
    with pytest.raises(ChunkRejected):
        reducer.receive(1, 0, float("nan"), [v.clone() for v in views])
    with pytest.raises(ChunkRejected):
        reducer.receive(7, 0, 1.0, [])  # not a member
    with pytest.raises(ChunkRejected):
        reducer.commit(1, 1.0)  # commits before sending anything
    with pytest.raises(ChunkRejected):
        reducer.receive(1, NOTHING, 1.0, [])


def test_local_data_is_never_modified_by_the_reduction():
    tensor_sets, part, reducer = setup(members=2)
    own = [chunk_views(tensor_sets[0], c) for c in part.chunks]
    before = [[v.clone() for v in views] for views in own]
    for index, views in enumerate(own):
        reducer.receive(0, index, 2.0, views)  # the reducer's own part: views of its live tensors
    send_all(reducer, part, 1, tensor_sets[1], 1.0)
    reducer.commit(0, 2.0)
    reducer.commit(1, 1.0)
    reducer.finalize()
    for views, saved in zip(own, before):
        for view, copy in zip(views, saved):
            assert torch.equal(view, copy)


def test_deadlines_follow_activity_and_the_data_phase():
    tensor_sets, part, reducer = setup(members=3)
    reducer.opened_at = 10.0
    send_all(reducer, part, 0, tensor_sets[0], 1.0, now=11.0)
    reducer.receive(1, 0, 1.0, [v.clone() for v in chunk_views(tensor_sets[1], part.chunks[0])], now=12.0)
    deadlines = reducer.deadlines(0.5, 3.0, floor=1.0, slack=2.0)
    assert deadlines[1] == 12.5  # one chunk time after its last chunk
    assert deadlines[2] == 10.5  # one chunk time after the round opened: it never sent anything
    assert deadlines[0] == 11.0 + 3.0 + 2.0 * 1.0  # complete, not committed: grace + slack * its 1 s of sending
    reducer.fail(2)
    for index in range(1, len(part.chunks)):
        reducer.receive(1, index, 1.0, [v.clone() for v in chunk_views(tensor_sets[1], part.chunks[index])],
                        now=14.0)
    assert reducer.data_complete and reducer.data_complete_at == 14.0
    deadlines = reducer.deadlines(0.5, 3.0, floor=1.0, slack=2.0)
    assert deadlines == {0: 14.0 + 3.0 + 2.0 * 4.0, 1: 14.0 + 3.0 + 2.0 * 4.0}  # slack * the 4 s of data phase


def test_throughput_estimate_believes_slowdowns_at_once_and_speedups_gradually():
    estimator = ThroughputEstimator(initial_rate=1e6)
    assert estimator.timeout(4_000_000, floor=1.0, factor=2.0) == 8.0
    estimator.observe(100_000_000, 1.0)
    assert estimator.rate == 1e8
    estimator.observe(10_000_000, 1.0)
    assert estimator.rate == 1e7
    estimator.observe(100_000_000, 1.0)
    assert 1e7 < estimator.rate < 1e8
    assert estimator.timeout(1000, floor=0.25, factor=4.0) == 0.25
