"""DHT nodes killed in the middle of a store and in the middle of a lookup (in-memory network, MockClock).

The kill lands at an exact protocol moment: the network below the nodes is watched, and a node is crashed (as
SIGKILL: its socket vanishes, its tasks stop) at the instant a request of the operation under test is on its way
to it, so that request is never answered. The operation still succeeds through the other nodes, and each test
checks that the kill happened inside that operation and hit a request of the expected kind."""

from __future__ import annotations

import random
from typing import Callable

import trio
from dht_swarm import RunningNode, start_swarm

from dht import protocol as proto
from peer.p2p.net import MemoryNetwork

STORE_REQUESTS = {"store", "swarmd_store_many", "swarmd_store_find"}
LOOKUP_REQUESTS = {"find_value", "find_node", "swarmd_find_many"}


class WatchedNetwork(MemoryNetwork):
    """Test-only observation point: `on_request(source host, destination host, request name)` runs for every DHT
    request datagram just before it is delivered, so a test may crash the destination right then."""

    on_request: Callable[[str, str, str], None] | None = None

    def _deliver_datagram(self, source, destination, data: bytes) -> None:
        if self.on_request is not None and data[:1] == bytes([proto.REQUEST]):
            name = proto.unpack(data[1 + proto.MSG_ID_BYTES:])[0]
            self.on_request(source[0], destination[0], name)
        super()._deliver_datagram(source, destination, data)


async def _swarm(nursery, count=12, seed=1):
    network = WatchedNetwork(latency=0.002, seed=seed)
    swarm = await start_swarm(nursery, [f"n{i}" for i in range(count)], network.host, random.Random(seed))
    return network, {running.node.address[0]: running for running in swarm}


def _kill_first(network: WatchedNetwork, nodes: dict[str, RunningNode], source: str, kinds: set[str], count: int,
                operation: dict) -> list[tuple[str, str]]:
    """Crash the destinations of `source`'s first `count` requests of `kinds` sent while `operation["running"]`;
    returns (victim, request name) as they happen."""
    killed: list[tuple[str, str]] = []

    def on_request(src: str, dst: str, name: str) -> None:
        if src != source or name not in kinds or not operation["running"] or len(killed) >= count:
            return
        if dst in nodes:
            network.crash(dst)  # the request in flight now reaches nobody
            nodes.pop(dst).kill()
            killed.append((dst, name))

    network.on_request = on_request
    return killed


async def test_replicas_killed_as_a_store_reaches_them(autojump_clock):
    async with trio.open_nursery() as nursery:
        network, nodes = await _swarm(nursery)
        writer = nodes["n2"].node
        operation = {"running": False}
        killed = _kill_first(network, nodes, "n2", STORE_REQUESTS, 3, operation)
        operation["running"] = True
        with trio.fail_after(60):  # virtual seconds: a dead replica costs a request timeout, not a hang
            stored = await writer.store("k", "v", writer.now() + 300)
        operation["running"] = False
        assert stored
        assert len(killed) == 3 and all(name in STORE_REQUESTS for _, name in killed)  # landed in the store
        holders = [host for host, running in nodes.items() if running.node.local_record("k") is not None]
        assert len(holders) >= 3 and not {victim for victim, _ in killed} & set(holders)
        reader = nodes["n9"].node
        assert (await reader.get("k", latest=True)).value == "v"
        nursery.cancel_scope.cancel()


async def test_nodes_killed_as_a_lookup_asks_them(autojump_clock):
    async with trio.open_nursery() as nursery:
        network, nodes = await _swarm(nursery)
        writer = nodes["n2"].node
        assert await writer.store("k", "v", writer.now() + 300)
        reader = nodes["n9"].node
        operation = {"running": False}
        # the reader's first three questions (the writer among them: it holds the value) are never answered
        killed = _kill_first(network, nodes, "n9", LOOKUP_REQUESTS, 3, operation)
        operation["running"] = True
        with trio.fail_after(60):
            record = await reader.get("k", latest=True)
        operation["running"] = False
        assert len(killed) == 3 and all(name in LOOKUP_REQUESTS for _, name in killed)  # landed in the lookup
        assert record is not None and record.value == "v"  # found on the replicas still alive
        nursery.cancel_scope.cancel()
