"""Fixtures of the all-reduce tests that run each scenario on both transports."""

import pytest
import trio.testing


@pytest.fixture(params=["memory", "real"])
def transport(request):
    """Each test that takes it runs on the in-memory network and over real sockets on 127.0.0.1."""
    return request.param


@pytest.fixture
def clock(transport):
    """Virtual time on the simulated network (deterministic); the real clock for real sockets."""
    return trio.testing.MockClock(autojump_threshold=0) if transport == "memory" else None
