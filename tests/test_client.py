"""The trainer's Swarm handle: attaches to a running DHT from synchronous code, clear errors otherwise."""

import pytest
import trio

from dht.errors import BootstrapFailed
from dht.node import DHTNode
from peer.p2p.bridge import Bridge
from peer.client import Swarm
from peer.p2p.net import parse_address


def test_parse_address_accepts_host_port_and_explains_mistakes():
    assert parse_address("127.0.0.1:31337") == ("127.0.0.1", 31337)
    assert parse_address("[::1]:8000") == ("::1", 8000)
    for bad, reason in [("localhost", "HOST:PORT"), (":80", "no host"), ("h:x", "not a number"),
                        ("h:70000", "outside")]:
        with pytest.raises(ValueError, match=reason):
            parse_address(bad)


def test_swarm_attaches_to_a_running_dht_and_stores_and_reads():
    with Bridge.start() as daemon:
        async def run_node(task_status=trio.TASK_STATUS_IGNORED):
            async with DHTNode.open("127.0.0.1", 0) as node:
                task_status.started(node.address)
                await trio.sleep_forever()

        address = daemon.start_and_wait(run_node)
        with Swarm([f"{address[0]}:{address[1]}"]) as swarm:
            expiration = swarm.dht.now() + 60
            assert swarm.run(swarm.dht.store, "greeting", "hello", expiration)
            record = swarm.run(swarm.dht.get, "greeting")
            assert record is not None and record.value == "hello"


def test_swarm_with_unreachable_peer_raises_bootstrap_failed_naming_it():
    with pytest.raises(BootstrapFailed, match="127.0.0.1:9"):
        Swarm(["127.0.0.1:9"])
