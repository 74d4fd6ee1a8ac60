"""Shared fixtures: an in-memory network for simulated tests; the hypothesis profiles of the property tests.

Property tests run under the `ci` profile unless HYPOTHESIS_PROFILE names another: derandomized (the same examples
on every run, so a failure in CI reproduces locally and a green run means the same thing twice), a modest number
of examples, no per-example deadline (the machines running the suite are shared and loaded, so timing says
nothing) and no example database (nothing written into the checkout). `HYPOTHESIS_PROFILE=thorough` runs many
more random examples when hunting bugs by hand.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from peer.p2p.net import MemoryNetwork

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def memory_network() -> MemoryNetwork:
    return MemoryNetwork(latency=0.005, seed=1234)


@pytest.fixture
def processes():
    """A `peer.testing.peer_processes.ProcessGroup` for the test's child processes, all stopped when the test ends."""
    from peer.testing.peer_processes import ProcessGroup  # only the tests that start processes pay for the import

    group = ProcessGroup()
    yield group
    group.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests under the autojump clock run in virtual time: how busy the CPU is cannot change what they see, so
    `make test` runs the slow ones two at a time (`-m "slow and virtual_time" -n 2`) and the rest one by one."""
    for item in items:
        if "autojump_clock" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.virtual_time)
