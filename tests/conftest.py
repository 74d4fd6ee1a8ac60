"""Shared fixtures: an in-memory network for simulated tests."""

import pytest

from peer.p2p.net import MemoryNetwork


@pytest.fixture
def memory_network() -> MemoryNetwork:
    return MemoryNetwork(latency=0.005, seed=1234)
