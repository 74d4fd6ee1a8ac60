"""Private daemons served through relays: in-process daemons on 127.0.0.1 (separate peers, real sockets) and on
the in-memory network (virtual time). A daemon forced `--reachability private` is dialed by nobody directly: it
announces and declares only relayed addresses, and its RPC listener accepts no connection."""

from __future__ import annotations

import torch
import trio
import trio.testing

from dht.node import DHTNode
from moe.calls import forward, info
from moe.declare import get_experts
from peer.daemon import DaemonConfig
from peer.p2p import relay
from peer.p2p.identity import Identity, PeerID
from peer.p2p.net import MemoryNetwork, RealNetwork
from peer.p2p.rpc import RPCNode
from tests.peer.daemon_tasks import average_together, run_daemon


async def use_expert(network, bootstrap, uid: str, *, host: str = "127.0.0.1",
                     avoid: PeerID | None = None) -> relay.RelayedAddress:
    """A trainer's view: find `uid` in the DHT (declared through a relay, and not through `avoid` first), call its
    forward (on the memory network its `moe.info`: the forward's compute runs in a worker thread, which virtual
    time does not wait for); returns the relayed address it went through."""
    async with RPCNode(Identity.generate(), network) as rpc:
        async with DHTNode.open(host, 0, [bootstrap], network=network, client_mode=True) as dht:
            while True:
                location = (await get_experts(dht, [uid]))[uid]
                if location is not None and relay.is_relayed(location.address):
                    relayed = relay.parse_relayed(location.address)
                    if relayed.relays[0][0] != avoid:
                        break
                await trio.sleep(0.2)
            peer = PeerID.from_hex(location.peer_id_hex)
            if isinstance(network, RealNetwork):
                outputs = await forward(rpc, location.address, peer, uid, [torch.ones(3, 8)], timeout=10)
                assert outputs[0].shape == (3, 8)
            else:
                assert (await info(rpc, location.address, peer, uid, timeout=10))["hidden_dim"] == 8
            assert rpc.stats["circuits_dialed"] == 1
            return relayed


async def private_swarm(nursery, network=None, hosts=("127.0.0.1",) * 3):
    public = [await nursery.start(run_daemon, DaemonConfig(host=hosts[0], port=4000 if network else 0,
                                                           experts="pub.[0:1]", hidden_dim=8,
                                                           reachability="public"), network)]
    bootstrap = public[0][0].rpc.address
    public.append(await nursery.start(run_daemon, DaemonConfig(
        host=hosts[1], port=4000 if network else 0, experts="pub.[1:2]", hidden_dim=8, reachability="public",
        initial_peers=[bootstrap]), network))
    private, _ = await nursery.start(run_daemon, DaemonConfig(
        host=hosts[2], port=4000 if network else 0, experts="priv.[0:2]", hidden_dim=8, reachability="private",
        initial_peers=[bootstrap], declare_ttl=3.0), network)
    return public, private, bootstrap


async def check_private_daemon_through_relays(network, trainer_host, public, private, bootstrap):
    with trio.fail_after(60):
        while len(private.relaying.reservations.relays) < 2:
            await trio.sleep(0.1)
        used = await use_expert(network, bootstrap, "priv.0", host=trainer_host)
    assert used.target == private.identity.peer_id
    assert private.expert_server.stats()["requests_total"] >= 1
    assert private.rpc.stats["connections_accepted"] == 0  # nothing came in but through a relay
    assert private.rpc.stats["circuits_accepted"] >= 1
    status = private.status()
    assert status["reachability"]["how"] == "relay" and status["relay"]["role"] == "relayed"
    assert public[0][0].status()["relay"]["role"] == "relay"

    # the relay the trainer went through dies: the private peer keeps the other, declares it first, and a
    # trainer uses its experts through that one
    victim = used.relays[0][0]
    for daemon, scope in public:
        if daemon.identity.peer_id == victim:
            scope.cancel()
    with trio.fail_after(60):
        while victim in private.relaying.reservations.relays:
            await trio.sleep(0.1)
        assert victim.hex() not in private.rpc.announced_address[0]
        survivor = next(daemon for daemon, _ in public if daemon.identity.peer_id != victim)
        again = await use_expert(network, survivor.rpc.address, "priv.1", host=trainer_host, avoid=victim)
    assert again.relays[0][0] == survivor.identity.peer_id
    assert private.relaying.reservations.stats["relay_failures"] == 1


async def test_a_private_daemon_serves_experts_through_relays_and_survives_losing_one():
    async with trio.open_nursery() as nursery:
        public, private, bootstrap = await private_swarm(nursery)
        await check_private_daemon_through_relays(RealNetwork(), "127.0.0.1", public, private, bootstrap)
        nursery.cancel_scope.cancel()


async def test_on_the_memory_network_the_private_daemon_moves_within_10_virtual_seconds(autojump_clock):
    memory = MemoryNetwork(latency=0.001, seed=8)
    async with trio.open_nursery() as nursery:
        public, private, bootstrap = await private_swarm(nursery, memory, hosts=("a", "b", "p"))
        with trio.fail_after(60):
            while len(private.relaying.reservations.relays) < 2:
                await trio.sleep(0.1)
        victim, scope = public[1]
        killed_at = trio.current_time()
        scope.cancel()
        while victim.identity.peer_id in private.relaying.reservations.relays:
            await trio.sleep(0.05)
        assert trio.current_time() - killed_at < 10
        with trio.fail_after(60):
            used = await use_expert(memory.host("t"), bootstrap, "priv.0", host="t", avoid=victim.identity.peer_id)
        assert used.relays[0][0] == public[0][0].identity.peer_id
        assert private.rpc.stats["connections_accepted"] == 0
        nursery.cancel_scope.cancel()


async def test_a_no_relay_peer_offers_nothing_and_a_private_peer_then_stays_unreached(autojump_clock):
    memory = MemoryNetwork(latency=0.001, seed=9)
    async with trio.open_nursery() as nursery:
        public, _ = await nursery.start(run_daemon, DaemonConfig(
            host="a", port=4000, experts="pub.[0:1]", hidden_dim=8, reachability="public", no_relay=True), memory)
        private, _ = await nursery.start(run_daemon, DaemonConfig(
            host="p", port=4000, experts="priv.[0:1]", hidden_dim=8, reachability="private",
            initial_peers=[("a", 4000)]), memory)
        assert public.status()["relay"]["role"] == "none" and "relay" not in public._summary()
        assert private.relaying.reservations.relays == {}
        assert private.status()["reachability"]["how"] == "none"
        assert not relay.is_relayed(private.rpc.announced_address)
        nursery.cancel_scope.cancel()


async def test_a_private_replica_averages_and_answers_status_through_a_relay():
    """Above RPC nothing changes: the replica all-reduce (its matchmaking and parts) and `peer status` reach the
    private daemon at the relayed address it declared. Real time on the memory network: each replica's snapshot
    copies its weights in a worker thread, which virtual time does not wait for, so under an autojump clock one
    peer's matchmaking window could close while the other's copy was still running."""
    from peer.status import gather_status

    memory = MemoryNetwork(latency=0.001, seed=10)
    async with trio.open_nursery() as nursery:
        public, _ = await nursery.start(run_daemon, DaemonConfig(
            host="a", port=4000, experts="ffn.[0:2]", hidden_dim=8, reachability="public", replicate=True,
            average_every=1000, seed=0), memory)
        private, _ = await nursery.start(run_daemon, DaemonConfig(
            host="p", port=4000, experts="ffn.[0:2]", hidden_dim=8, reachability="private", replicate=True,
            average_every=1000, seed=100, initial_peers=[("a", 4000)]), memory)
        assert relay.is_relayed(private.rpc.announced_address)
        before = [[p.detach().clone() for p in daemon.expert_server.experts["ffn.0"].module.parameters()]
                  for daemon in (public, private)]
        results = await average_together([public, private], timeout=60)
        assert all(result is not None and result.finished and result.group_size == 2 for result in results), results
        after = [p.detach() for p in private.expert_server.experts["ffn.0"].module.parameters()]
        for index, value in enumerate(after):
            assert torch.allclose(value, (before[0][index] + before[1][index]) / 2, atol=1e-6)
        assert private.rpc.stats["connections_accepted"] == 0
        status = await gather_status(public.rpc, public.dht)
        assert status["peers_reachable"] == 2
        nursery.cancel_scope.cancel()
