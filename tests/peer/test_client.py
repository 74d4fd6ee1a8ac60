"""The trainer's Swarm handle: attaches to a running DHT from synchronous code, clear errors otherwise."""

import pytest
import trio

from dht.errors import BootstrapFailed
from dht.node import DHTNode
from peer.client import Swarm
from peer.p2p.bridge import Bridge
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


def test_client_host_is_loopback_only_for_a_loopback_swarm():
    from peer.p2p.addresses import client_host

    assert client_host([("127.0.0.1", 1), ("127.0.0.2", 2)]) == "127.0.0.1"
    assert client_host([("127.0.0.1", 1), ("10.0.0.5", 2)]) == "0.0.0.0"


async def test_open_client_peer_joins_as_a_client_and_calls_others():
    """The one client composition (Swarm and `peer status` use it): a client-mode DHT node that reads what a
    server stored, and an RPC node that calls that server, both gone when the block ends."""
    from peer.client import open_client_peer
    from peer.p2p.identity import Identity
    from peer.p2p.net import MemoryNetwork
    from peer.p2p.rpc import RPCNode

    memory = MemoryNetwork(seed=3)
    async with trio.open_nursery() as nursery:
        async def serve(task_status=trio.TASK_STATUS_IGNORED):
            identity = Identity.from_seed(b"server" * 6)
            async with RPCNode(identity, memory.host("server")) as rpc:
                async def echo(context, args):
                    return args

                rpc.register("echo", echo)
                address = await rpc.listen("server", 0)
                async with DHTNode.open("server", address[1], identity=identity, network=memory.host("server")) as dht:
                    await dht.store("k", "v", dht.now() + 60)
                    task_status.started(address)
                    await trio.sleep_forever()

        address = await nursery.start(serve)
        with trio.fail_after(30):
            async with open_client_peer([address], network=memory.host("client"), host="client") as (rpc, dht):
                assert dht.client_mode
                assert (await dht.get("k")).value == "v"
                assert await rpc.call(address, "echo", [1, 2], timeout=10) == [1, 2]
        nursery.cancel_scope.cancel()
