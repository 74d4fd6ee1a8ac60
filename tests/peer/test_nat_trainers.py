"""Private trainers (peer.relays.serve_reachable, `Swarm(reachability=...)`): a trainer behind a NAT is found
private by the dial-backs, takes relay reservations like a private daemon, announces its relayed address, and two
such trainers average with each other (a group of both, every byte through the relays).

On the in-memory network with NAT routers under MockClock (deterministic), and with `Swarm` on 127.0.0.1.
"""

from __future__ import annotations

import threading

import torch
import trio

from averaging.averager import Averager
from peer.client import Swarm, open_client_peer
from peer.daemon import DaemonConfig
from peer.p2p import relay
from peer.p2p.net import MemoryNetwork
from peer.relays import Reached, serve_reachable
from tests.peer.daemon_tasks import run_daemon


def two_homes(seed: int) -> MemoryNetwork:
    network = MemoryNetwork(latency=0.005, seed=seed)
    for router, host in (("r1", "home1"), ("r2", "home2")):
        network.add_nat(router)
        network.place_behind(host, router)
    return network


async def public_relays(nursery: trio.Nursery, network: MemoryNetwork) -> list[tuple[str, int]]:
    """Two public daemons offering relays (the bootstrap `a` and `b`); returns their addresses."""
    first, _ = await nursery.start(run_daemon, DaemonConfig(
        host="a", port=4000, experts="pub.[0:1]", hidden_dim=8, reachability="public"), network)
    await nursery.start(run_daemon, DaemonConfig(
        host="b", port=4000, experts="pub.[1:2]", hidden_dim=8, reachability="public",
        initial_peers=[("a", 4000)]), network)
    return [("a", 4000), ("b", 4000)]


async def private_trainer(network: MemoryNetwork, host: str, peers: list[tuple[str, int]], value: float,
                          results: dict[str, object], done: trio.Event, mode: str = "auto") -> None:
    """One trainer's averaging: reachable through `serve_reachable`, then one averaging step of its tensor."""
    async with open_client_peer(peers, network=network.host(host), host=host) as (rpc, dht):
        async with trio.open_nursery() as nursery:
            reached: Reached = await nursery.start(serve_reachable, rpc, dht, host, peers, mode)
            results[f"{host}.reached"] = reached
            results[f"{host}.announced"] = rpc.announced_address
            tensor = torch.full((64,), value)
            averager = Averager(rpc, dht, [tensor], prefix="run.grads", target_group_size=2, min_group_size=2,
                                matchmaking_time=3.0, allreduce_timeout=30.0, lock=threading.Lock())
            await nursery.start(averager.serve)
            for _ in range(10):  # a round may find nobody while the other trainer is still starting
                result = await averager.step()
                if result.finished:
                    break
            results[f"{host}.result"] = result
            results[f"{host}.tensor"] = tensor.clone()
            results[f"{host}.stats"] = dict(rpc.stats)
            done.set()
            await results["all_done"].wait()  # type: ignore[attr-defined]  # serve the other's last calls
            nursery.cancel_scope.cancel()


async def test_two_trainers_behind_nats_are_private_take_relays_and_average_with_each_other(autojump_clock):
    network = two_homes(seed=21)
    results: dict[str, object] = {"all_done": trio.Event()}
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            peers = await public_relays(nursery, network)
            done = [trio.Event(), trio.Event()]
            async with trio.open_nursery() as trainers:
                trainers.start_soon(private_trainer, network, "home1", peers, 1.0, results, done[0])
                trainers.start_soon(private_trainer, network, "home2", peers, 3.0, results, done[1])
                for event in done:
                    await event.wait()
                results["all_done"].set()  # type: ignore[attr-defined]
            nursery.cancel_scope.cancel()
    for host in ("home1", "home2"):
        reached = results[f"{host}.reached"]
        assert isinstance(reached, Reached)
        assert reached.reachability.status == "private" and reached.reachability.source == "dial-back"
        assert reached.reachability.answered >= 1 and reached.reachability.both == 0  # no dial-back got in
        assert reached.reachability.how == "relay" and len(reached.relaying.reservations.relays) == 2
        announced = results[f"{host}.announced"]
        assert relay.is_relayed(announced) and relay.parse_relayed(announced).target is not None
        result = results[f"{host}.result"]
        assert result.finished and result.group.size == 2, result  # a group of both private trainers
        assert torch.allclose(results[f"{host}.tensor"], torch.full((64,), 2.0))
        stats = results[f"{host}.stats"]
        assert stats["connections_accepted"] == 0 and stats["circuits_accepted"] >= 1  # nothing came in directly
        # the trainers' circuit to each other was upgraded by a hole punch (both routers MASQUERADE)
        assert reached.relaying.stats()["connections"]["upgraded"] >= 1


def test_swarm_with_reachability_private_announces_a_relayed_address_on_loopback():
    """The product path: `Swarm(reachability="private")` (what `peer train --reachability private` builds)
    listens, holds reservations with the swarm's two relays and announces the relayed address."""
    from peer.daemon import Daemon
    from peer.p2p.bridge import Bridge

    bridge = Bridge.start()
    try:
        async def start_public(task_status=trio.TASK_STATUS_IGNORED):
            async with trio.open_nursery() as nursery:
                first, _ = await nursery.start(run_daemon, DaemonConfig(
                    host="127.0.0.1", port=0, experts="pub.[0:1]", hidden_dim=8, reachability="public"))
                await nursery.start(run_daemon, DaemonConfig(
                    host="127.0.0.1", port=0, experts="pub.[1:2]", hidden_dim=8, reachability="public",
                    initial_peers=[first.rpc.address]))
                task_status.started(first.rpc.address)
                await trio.sleep_forever()

        assert Daemon  # the daemons above are peer.daemon.Daemon instances (run_daemon)
        bootstrap = bridge.start_and_wait(start_public)
        with Swarm([bootstrap], host="127.0.0.1", reachability="private") as swarm:
            reached = swarm.reached
            assert reached is not None and reached.reachability.status == "private"
            assert reached.reachability.how == "relay"
            announced = swarm.run(_announced, swarm)
            assert relay.is_relayed(announced)
            assert relay.parse_relayed(announced).target == swarm.peer_id
            assert len(relay.parse_relayed(announced).relays) == 2
    finally:
        bridge.close()


async def _announced(swarm: Swarm):
    return swarm.rpc.announced_address
