"""`peer.p2p.memory`: when freed heap memory goes back to the OS (the policy, sans-I/O), and that a trim does return
what a burst of large buffers left in the heap."""

from __future__ import annotations

import pytest

from peer.p2p import memory
from peer.p2p.memory import MB, TrimPolicy


def test_trims_once_grown_past_the_floor_at_most_once_per_interval_and_never_when_steady():
    policy = TrimPolicy(grown=64 * MB, interval=5.0)
    assert not policy.due(500 * MB, 0.0)  # the first reading is the floor
    assert not policy.due(450 * MB, 1.0) and policy.floor == 450 * MB  # the lowest seen is the level to return to
    assert not policy.due(513 * MB, 2.0)  # grown, but by less than 64 MB
    assert policy.due(514 * MB, 3.0)
    policy.trimmed(460 * MB, 3.0)
    assert not policy.due(600 * MB, 7.0)  # within 5 s of the last trim
    assert policy.due(600 * MB, 8.0)
    policy.trimmed(600 * MB, 8.0)  # nothing was free: the memory is in use, and the floor follows it
    assert not policy.due(640 * MB, 20.0) and policy.trims == 2


@pytest.mark.skipif(not memory.trim(), reason="this C library has no malloc_trim")
def test_a_trim_returns_the_pages_of_freed_buffers_that_the_heap_kept():
    import torch

    torch.ones(1 << 20)  # 4 MiB mapped and unmapped: glibc's mmap threshold rises past the buffers below
    before = memory.rss_bytes()
    held = [torch.ones(64 * 1024) for _ in range(2000)]  # 256 KiB each, 500 MB: past glibc's mmap threshold
    del held[::2]  # holes in the middle of the heap, freed but not returned
    del held[-1]
    grown = memory.rss_bytes() - before
    memory.trim()
    returned = grown - (memory.rss_bytes() - before)
    assert returned >= 100 * MB, (grown / MB, returned / MB)
