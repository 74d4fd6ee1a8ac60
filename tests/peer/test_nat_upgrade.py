"""Circuits upgraded by hole punching (`RPCNode.upgrade_circuit`, `RelayReservations.answer_punch`,
`peer.relays.enable_punching`): a trainer behind one NAT calls a private daemon behind another through a relayed
address; behind two MASQUERADE routers the punch gives a direct connection that the RPC pool then uses (the
circuit closes), behind a symmetric NAT it fails and the calls go on through the relay. In-memory network with
NAT routers, MockClock: deterministic.
"""

from __future__ import annotations

import re

import trio

from dht.node import DHTNode
from moe.calls import info
from moe.declare import get_experts
from peer.daemon import DaemonConfig
from peer.p2p import relay
from peer.p2p.identity import Identity, PeerID
from peer.p2p.net import MemoryNetwork
from peer.p2p.rpc import RPCNode
from peer.relays import enable_punching
from peer.status import format_status, gather_status
from tests.peer.daemon_tasks import run_daemon


async def upgrade_scenario(trainer_nat: str, seed: int, circuits_left: int, after_idle: bool = False):
    """Relays `a` and `b`; a private daemon at `home1` behind a MASQUERADE router `r1`; a trainer at `home2`
    behind `r2` of kind `trainer_nat` calls the daemon's expert twice, then waits until the relays splice
    `circuits_left` circuits (an upgraded circuit closes a moment after the direct connection took over; the
    scenario's deadline fails the test if it never does). `after_idle`: then waits until no circuit is left (an
    idle one closes) and calls once more. Returns what both ends counted."""
    network = MemoryNetwork(latency=0.005, seed=seed)
    network.add_nat("r1", "masquerade")
    network.place_behind("home1", "r1")
    network.add_nat("r2", trainer_nat)
    network.place_behind("home2", "r2")
    outcome: dict[str, object] = {}
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            first, _ = await nursery.start(run_daemon, DaemonConfig(
                host="a", port=4000, experts="pub.[0:1]", hidden_dim=8, reachability="public"), network)
            second, _ = await nursery.start(run_daemon, DaemonConfig(
                host="b", port=4000, experts="pub.[1:2]", hidden_dim=8, reachability="public",
                initial_peers=[("a", 4000)]), network)
            private, _ = await nursery.start(run_daemon, DaemonConfig(
                host="home1", port=4000, experts="priv.[0:1]", hidden_dim=8, initial_peers=[("a", 4000)]),
                network)
            assert private.reachability.status == "private"  # the dial-backs were dropped by r1
            host = network.host("home2")
            async with RPCNode(Identity.generate(), host) as rpc:
                puncher = enable_punching(rpc)
                async with DHTNode.open("home2", 0, [("a", 4000)], network=host, client_mode=True) as dht:
                    while True:
                        location = (await get_experts(dht, ["priv.0"]))["priv.0"]
                        if location is not None and relay.is_relayed(location.address):
                            break
                        await trio.sleep(0.2)
                    peer = PeerID.from_hex(location.peer_id_hex)
                    for _ in range(2):
                        assert (await info(rpc, location.address, peer, "priv.0", timeout=10))["hidden_dim"] == 8
                    outcome["trainer"] = puncher.stats()
                    outcome["trainer_rpc"] = dict(rpc.stats)
                    # the relays' circuits: the upgraded one closes, the kept one is still spliced
                    def circuits() -> int:
                        return sum(d.relaying.service.core.circuits for d in (first, second))

                    while circuits() != circuits_left:
                        await trio.sleep(0.05)
                    outcome["circuits_open"] = circuits()
                    if after_idle:
                        idle_since = trio.current_time()
                        while circuits() != 0:
                            await trio.sleep(0.05)
                        outcome["idle_closed_after"] = trio.current_time() - idle_since
                        assert (await info(rpc, location.address, peer, "priv.0", timeout=10))["hidden_dim"] == 8
                        outcome["trainer_after_idle"] = puncher.stats()
                        outcome["skipped"] = puncher.skipped
                    outcome["private"] = private.status()["relay"]["connections"]
                    outcome["served"] = private.expert_server.stats()["requests_total"]
                    outcome["status"] = format_status(await gather_status(first.rpc, first.dht))
            nursery.cancel_scope.cancel()
    return outcome


async def test_between_two_masquerade_routers_the_circuit_is_upgraded_and_closes(autojump_clock):
    outcome = await upgrade_scenario("masquerade", seed=31, circuits_left=0)
    trainer, private = outcome["trainer"], outcome["private"]
    assert trainer["upgraded"] == 1 and trainer["relayed"] == 0 and trainer["punch_attempts"] == 1, trainer
    assert private["upgraded"] == 1 and private["relayed"] == 0, private
    assert outcome["trainer_rpc"]["circuits_dialed"] == 1  # the second call used the pooled direct connection
    assert outcome["circuits_open"] == 0  # the circuit closed once the direct connection took over
    assert outcome["served"] >= 2
    # `peer status` sums the peers' connections (its own call to the private daemon was upgraded too)
    assert re.search(r"connections: \d+ direct, [1-9]\d* upgraded by hole punching, 0 relayed \(1 private peer\)",
                     outcome["status"]), outcome["status"]


async def test_behind_a_symmetric_nat_the_punch_fails_and_the_calls_go_through_the_relay(autojump_clock):
    """... and once idle for `CIRCUIT_IDLE_TIMEOUT` the kept circuit closes (its relay slot is free again); the
    next call opens a fresh circuit without trying the punch that just failed."""
    from peer.p2p.rpc import CIRCUIT_IDLE_TIMEOUT

    outcome = await upgrade_scenario("symmetric", seed=32, circuits_left=1, after_idle=True)
    trainer, private = outcome["trainer"], outcome["private"]
    assert trainer["upgraded"] == 0 and trainer["relayed"] == 1 and trainer["punch_failures"] == 1, trainer
    assert private["upgraded"] == 0 and private["relayed"] == 1, private
    assert outcome["trainer_rpc"]["circuits_dialed"] == 1 and outcome["trainer_rpc"]["calls_failed"] == 0
    assert outcome["circuits_open"] == 1  # the circuit stays and carries the calls
    assert outcome["served"] >= 2
    assert CIRCUIT_IDLE_TIMEOUT - 1 <= outcome["idle_closed_after"] <= CIRCUIT_IDLE_TIMEOUT + 1
    later = outcome["trainer_after_idle"]
    assert later["punch_attempts"] == 1 and later["relayed"] == 2 and outcome["skipped"] == 1, later
