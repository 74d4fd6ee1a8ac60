"""Reachability (peer/reachability.py): peers dial a newcomer back on TCP and UDP; a peer they cannot reach
stays a DHT client (never in anyone's routing table), one they can becomes a server.

On the in-memory network under MockClock. A peer "behind a NAT" is modelled by announcing an address where
nothing listens: its own outbound traffic works, a dial-back does not -- what a NAT that drops unsolicited
packets does to a dial-back; tests/p2p/test_nat_sim.py runs the same check behind the simulator's NAT routers.
"""

from __future__ import annotations

import pytest
import trio

from dht import DHTNode
from peer.daemon import Daemon, DaemonConfig
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.p2p.rpc import RPCNode
from peer.reachability import DIAL_BACK_METHOD, DialBackRefused, DialBackService, check_reachability


async def helper(nursery, network: MemoryNetwork, name: str):
    """A public peer offering dial-backs: RPC and a DHT server on name:4000."""
    rpc = RPCNode(Identity.from_seed(name.encode()), network.host(name))
    await nursery.start(_enter, rpc)
    await rpc.listen(name, 4000)
    dht = await nursery.start(_open_dht, name, network, [], False)
    DialBackService(rpc, dht).register()
    return rpc, dht


async def _enter(rpc: RPCNode, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with rpc:
        task_status.started()
        await trio.sleep_forever()


async def _open_dht(name, network, peers, client_mode, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with DHTNode.open(name, 4000, peers, network=network.host(name), client_mode=client_mode,
                            identity=Identity.from_seed(name.encode())) as node:
        task_status.started(node)
        await trio.sleep_forever()


async def newcomer(nursery, network: MemoryNetwork, name: str, helpers: list, *, announce=None):
    rpc = RPCNode(Identity.from_seed(name.encode()), network.host(name), announce=announce)
    await nursery.start(_enter, rpc)
    await rpc.listen(name, 4000)
    dht = await nursery.start(_open_dht, name, network, helpers, True)
    return rpc, dht


async def test_a_reachable_newcomer_is_public_and_becomes_a_server_in_the_helpers_table(autojump_clock):
    network = MemoryNetwork(seed=1)
    async with trio.open_nursery() as nursery:
        helpers = [await helper(nursery, network, name) for name in ("h1", "h2")]
        rpc, dht = await newcomer(nursery, network, "n", [("h1", 4000), ("h2", 4000)])
        result = await check_reachability(rpc, [("h1", 4000), ("h2", 4000)])
        assert (result.status, result.how, result.source) == ("public", "direct", "dial-back")
        assert (result.answered, result.tcp, result.udp, result.both) == (2, 2, 2, 2)
        assert "dialed back on TCP and UDP by 2 of 2 peers" in result.describe()
        assert rpc.peer_id not in {n.id for n in helpers[0][1]._table.nodes()}  # a client until now
        await dht.become_server()
        with trio.fail_after(30):
            while rpc.peer_id not in {n.id for n in helpers[0][1]._table.nodes()}:
                await trio.sleep(1)
        assert not dht.client_mode and dht.stats()["client_mode"] is False
        nursery.cancel_scope.cancel()


async def test_a_newcomer_nobody_can_dial_is_private_and_never_enters_a_routing_table(autojump_clock):
    network = MemoryNetwork(seed=2)
    async with trio.open_nursery() as nursery:
        helpers = [await helper(nursery, network, name) for name in ("h1", "h2", "h3", "h4")]
        peers = [(name, 4000) for name in ("h1", "h2", "h3", "h4")]
        rpc, dht = await newcomer(nursery, network, "n", peers, announce=("n", 4999))  # nothing there
        result = await check_reachability(rpc, peers)
        assert result.asked == 3  # up to 3 helpers are asked
        assert (result.status, result.how, result.answered, result.both) == ("private", "none", 3, 0)
        assert "not reachable from outside" in result.describe()
        await dht.get("some key")  # it keeps using the DHT as a client
        await trio.sleep(60)
        for _, helper_dht in helpers:
            assert rpc.peer_id not in {n.id for n in helper_dht._table.nodes()}
        nursery.cancel_scope.cancel()


async def test_a_dial_back_needs_an_announced_address_and_one_at_a_time(autojump_clock):
    network = MemoryNetwork(seed=3)
    async with trio.open_nursery() as nursery:
        await helper(nursery, network, "h1")
        client = RPCNode(Identity.generate(), network.host("c"))  # client mode: announces no address
        await nursery.start(_enter, client)
        with pytest.raises(DialBackRefused, match="no address announced"):
            await client.call(("h1", 4000), DIAL_BACK_METHOD, None, timeout=10)
        nursery.cancel_scope.cancel()


async def test_nobody_answering_is_public_unverified(autojump_clock):
    network = MemoryNetwork(seed=4)
    async with trio.open_nursery() as nursery:
        rpc, _ = await newcomer(nursery, network, "n", [])
        result = await check_reachability(rpc, [("nobody", 4000)], timeout=2.0)
        assert (result.status, result.source, result.asked, result.answered) == ("public", "unverified", 1, 0)
        nursery.cancel_scope.cancel()


async def _run_daemon(config: DaemonConfig, network: MemoryNetwork, host: str, *,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    daemon = Daemon(config, network=network.host(host))
    async with trio.open_nursery() as nursery:
        info = await nursery.start(daemon.run)
        task_status.started((daemon, info))


@pytest.mark.parametrize("announce, mode, expected", [
    (None, "auto", "public"),
    (("v", 4999), "auto", "private"),  # a NAT's effect on dial-backs (see the module docstring)
    (None, "private", "private"),
    (("v", 4999), "public", "public"),
])
async def test_a_daemon_shows_its_reachability_and_is_a_dht_client_when_private(autojump_clock, announce, mode,
                                                                               expected):
    network = MemoryNetwork(seed=5)
    async with trio.open_nursery() as nursery:
        first, _ = await nursery.start(_run_daemon, DaemonConfig(host="a", port=4000, hidden_dim=8,
                                                                 experts="ffn.[0:2]"), network, "a")
        daemon, info = await nursery.start(_run_daemon, DaemonConfig(
            host="v", port=4000, hidden_dim=8, experts="ffn.[2:4]", initial_peers=[("a", 4000)],
            announce=announce, reachability=mode), network, "v")
        assert info.reachability.startswith(expected), info.reachability
        status = daemon.status()
        assert status["reachability"]["status"] == expected
        assert daemon.dht.client_mode is (expected == "private")
        await trio.sleep(30)
        in_table = daemon.identity.peer_id in {n.id for n in first.dht._table.nodes()}
        assert in_table is (expected == "public")
        nursery.cancel_scope.cancel()
