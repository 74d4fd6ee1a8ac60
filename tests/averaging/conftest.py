"""Fixtures of the averaging tests: the transport and clock of the all-reduce tests that run each scenario on both
transports, and the DHT bootstrap node of the collaborative trainers over real sockets."""

import pytest
import trio
import trio.testing

from dht import DHTNode
from peer.p2p.bridge import Bridge


@pytest.fixture(params=["memory", "real"])
def transport(request):
    """Each test that takes it runs on the in-memory network and over real sockets on 127.0.0.1."""
    return request.param


@pytest.fixture
def clock(transport):
    """Virtual time on the simulated network (deterministic); the real clock for real sockets."""
    return trio.testing.MockClock(autojump_threshold=0) if transport == "memory" else None


async def _bootstrap_node(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with DHTNode.open("127.0.0.1", 0) as node:
        task_status.started(node.address)
        await trio.sleep_forever()


@pytest.fixture
def bootstrap():
    """The address of a DHT node on 127.0.0.1, in a bridge thread of its own for the test's duration (the
    bootstrap peer of `peer.client.Swarm`s in tests/averaging/test_collaborative*.py)."""
    with Bridge.start() as bridge:
        yield bridge.start_and_wait(_bootstrap_node)
