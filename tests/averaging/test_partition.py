import random

import pytest
import torch

from averaging.partition import Partition, Segment, chunk_views, segment_view, split_sizes


def test_split_sizes_are_proportional_and_add_up():
    assert split_sizes(100, [1, 1, 1, 1]) == [25, 25, 25, 25]
    assert split_sizes(10, [1, 1, 1]) == [4, 3, 3]
    assert split_sizes(100, [3, 1, 0, 1]) == [60, 20, 0, 20]
    rng = random.Random(5)
    for _ in range(200):
        weights = [rng.choice([0.0, rng.random() * 10]) for _ in range(rng.randint(1, 9))]
        if sum(weights) == 0:
            weights[0] = 1.0
        total = rng.randint(0, 10_000)
        sizes = split_sizes(total, weights)
        assert sum(sizes) == total
        for size, weight in zip(sizes, weights):
            assert (size == 0) if weight == 0 else abs(size - total * weight / sum(weights)) < 1.0 + 1e-9


def test_split_sizes_refuses_nobody_to_reduce():
    with pytest.raises(ValueError):
        split_sizes(10, [0, 0])
    with pytest.raises(ValueError):
        split_sizes(10, [1, -1])


def _tensors():
    return [torch.randn(7, 3), torch.randn(100), torch.randn(2, 2, 2), torch.randn(1), torch.randn(50)]


def test_parts_cover_the_flat_vector_once_and_skip_client_members():
    tensors = _tensors()
    partition = Partition.for_tensors(tensors, [1.0, 0.0, 2.0, 1.0], chunk_bytes=64)
    assert [p.owner for p in partition.parts] == [0, 2, 3]
    assert partition.part_of(1) is None
    assert [p.numel for p in partition.parts] == [45, 90, 45]

    covered = torch.zeros(partition.total, dtype=torch.int64)
    starts = [0]
    for t in tensors:
        starts.append(starts[-1] + t.numel())
    for part in partition.parts:
        from_chunks = [s for chunk in part.chunks for s in chunk]
        # chunks re-assemble the part's segments in order, each chunk within the byte budget
        assert sum(s.numel for s in from_chunks) == part.numel
        for chunk in part.chunks:
            assert partition.chunk_bytes_of(chunk) <= 64
        for s in from_chunks:
            flat = starts[s.tensor]
            assert part.start <= flat + s.start and flat + s.stop <= part.stop
            covered[flat + s.start: flat + s.stop] += 1
    assert bool((covered == 1).all())


def test_views_write_through_to_the_tensors():
    tensors = _tensors()
    partition = Partition.for_tensors(tensors, [1.0, 1.0], chunk_bytes=4 * 16)
    flat_before = torch.cat([t.flatten() for t in tensors])
    for part in partition.parts:
        for chunk in part.chunks:
            for view in chunk_views(tensors, chunk):
                view.mul_(2)
    assert torch.equal(torch.cat([t.flatten() for t in tensors]), flat_before * 2)
    assert segment_view(tensors, Segment(1, 10, 20)).data_ptr() == tensors[1][10:20].data_ptr()


def test_small_tensors_share_a_chunk_and_large_ones_are_cut():
    tensors = [torch.zeros(3), torch.zeros(3), torch.zeros(1000)]
    partition = Partition.for_tensors(tensors, [1.0], chunk_bytes=400)
    chunks = partition.parts[0].chunks
    assert chunks[0][:2] == (Segment(0, 0, 3), Segment(1, 0, 3))
    assert sum(len(c) for c in chunks) == len(chunks) + 2
    assert len(chunks) == -(-(1006 * 4) // 400)


def test_every_member_computes_the_same_split_and_fingerprint():
    a = Partition([10, 20, 30], [4, 4, 4], [1.0, 0.5, 2.0], chunk_bytes=32)
    b = Partition([10, 20, 30], [4, 4, 4], [1.0, 0.5, 2.0], chunk_bytes=32)
    assert [(p.start, p.stop, p.chunks) for p in a.parts] == [(p.start, p.stop, p.chunks) for p in b.parts]
    assert a.fingerprint == b.fingerprint
    assert Partition([10, 20, 31], [4, 4, 4], [1.0, 0.5, 2.0], chunk_bytes=32).fingerprint != a.fingerprint
    assert Partition([10, 20, 30], [4, 4, 4], [1.0, 0.5, 1.0], chunk_bytes=32).fingerprint != a.fingerprint
