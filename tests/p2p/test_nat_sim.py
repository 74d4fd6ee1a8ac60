"""NAT in the simulator (peer/p2p/net.py, `MemoryNetwork.add_nat`): hosts behind a MASQUERADE-like router reach
out and nobody reaches in, except from an endpoint they sent to; a symmetric NAT maps every destination apart.
Then the product on top of it: the reachability check calls NATed daemons private and public ones public, a NATed
peer never enters a public peer's routing table and still reads and writes the DHT as a client.

All under MockClock on the in-memory network, so the runs are deterministic.
"""

from __future__ import annotations

import random
import time
from contextlib import asynccontextmanager

import pytest
import trio

from dht import DHTNode
from peer.daemon import Daemon, DaemonConfig
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.p2p.rpc import RPCNode
from peer.reachability import DialBackService, check_reachability


def nat_network(kind: str = "masquerade", seed: int = 0) -> MemoryNetwork:
    network = MemoryNetwork(latency=0.01, seed=seed)
    network.add_nat("r1", kind)
    network.place_behind("home1", "r1")
    network.place_behind("home2", "r1")
    return network


# --------------------------------------------------------------------------------------------- datagrams


async def test_datagrams_leave_through_a_mapping_and_only_its_remote_gets_back_in(autojump_clock):
    network = nat_network()
    inside = await network.host("home1").open_udp("home1", 4000)
    server = await network.host("pub").open_udp("pub", 5000)
    other_port = await network.host("pub").open_udp("pub", 5001)
    stranger = await network.host("stranger").open_udp("stranger", 5000)

    await inside.sendto(b"hello", ("pub", 5000))
    data, seen = await server.recvfrom()
    assert (data, seen) == (b"hello", ("r1", 4000))  # MASQUERADE keeps the port when it is free
    await server.sendto(b"reply", seen)
    assert await inside.recvfrom() == (b"reply", ("pub", 5000))

    dropped = network.nat("r1").counters["udp_inbound_dropped"]
    await other_port.sendto(b"other port", seen)  # same host, another port: endpoint-dependent filtering
    await stranger.sendto(b"unsolicited", seen)
    await stranger.sendto(b"private name", ("home1", 4000))  # a private name is not routed from outside
    with trio.move_on_after(5):
        await inside.recvfrom()
        pytest.fail("an unsolicited datagram got through the NAT")
    assert network.nat("r1").counters["udp_inbound_dropped"] == dropped + 2


async def test_hosts_behind_one_router_share_a_lan_and_a_second_one_gets_another_public_port(autojump_clock):
    network = nat_network()
    first = await network.host("home1").open_udp("home1", 4000)
    second = await network.host("home2").open_udp("home2", 4000)
    server = await network.host("pub").open_udp("pub", 5000)
    await second.sendto(b"lan", ("home1", 4000))
    assert await first.recvfrom() == (b"lan", ("home2", 4000))
    await first.sendto(b"a", ("pub", 5000))
    await second.sendto(b"b", ("pub", 5000))
    (_, one), (_, two) = await server.recvfrom(), await server.recvfrom()
    assert one == ("r1", 4000) and two[0] == "r1" and two[1] != 4000


async def test_a_symmetric_nat_maps_each_destination_to_its_own_port(autojump_clock):
    network = nat_network("symmetric")
    inside = await network.host("home1").open_udp("home1", 4000)
    a = await network.host("a").open_udp("a", 5000)
    b = await network.host("b").open_udp("b", 5000)
    await inside.sendto(b"x", ("a", 5000))
    await inside.sendto(b"x", ("b", 5000))
    (_, seen_by_a), (_, seen_by_b) = await a.recvfrom(), await b.recvfrom()
    assert seen_by_a[0] == seen_by_b[0] == "r1" and seen_by_a[1] != seen_by_b[1]
    await b.sendto(b"to a's mapping", seen_by_a)  # the address a observed is useless to b
    with trio.move_on_after(5):
        await inside.recvfrom()
        pytest.fail("a symmetric NAT let a third party in")


async def test_an_idle_udp_mapping_expires(autojump_clock):
    network = MemoryNetwork(seed=1)
    network.add_nat("r1", timeout=30.0)
    inside = await network.host("home1", behind="r1").open_udp("home1", 4000)
    server = await network.host("pub").open_udp("pub", 5000)
    await inside.sendto(b"x", ("pub", 5000))
    _, seen = await server.recvfrom()
    await trio.sleep(31)
    await server.sendto(b"late", seen)
    with trio.move_on_after(5):
        await inside.recvfrom()
        pytest.fail("an expired mapping still forwarded")


# --------------------------------------------------------------------------------------------- streams


async def _echo_server(network: MemoryNetwork, host: str, port: int, nursery: trio.Nursery) -> list:
    seen: list = []

    async def handler(stream) -> None:
        seen.append(stream.remote_address)
        async for data in stream:
            await stream.send_all(data)

    await nursery.start(network.host(host).serve_tcp, handler, host, port)
    return seen


async def test_streams_go_out_through_the_nat_and_unsolicited_connects_hang(autojump_clock):
    network = nat_network()
    async with trio.open_nursery() as nursery:
        seen = await _echo_server(network, "pub", 7000, nursery)
        await _echo_server(network, "home1", 7000, nursery)
        stream = await network.host("home1").connect_tcp(("pub", 7000))
        await stream.send_all(b"ping")
        assert await stream.receive_some(10) == b"ping"
        assert seen[0][0] == "r1" and stream.remote_address == ("pub", 7000)
        assert stream.local_address[0] == "home1"

        for target in (("r1", 7000), ("r1", seen[0][1]), ("home1", 7000)):  # nothing gets in, not even a reset
            with trio.move_on_after(10) as scope:
                await network.host("stranger").connect_tcp(target)
            assert scope.cancelled_caught, target
        assert network.nat("r1").counters["tcp_inbound_dropped"] >= 2
        # the LAN neighbour reaches the inside listener by name
        lan = await network.host("home2").connect_tcp(("home1", 7000))
        await lan.send_all(b"lan")
        assert await lan.receive_some(10) == b"lan"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind, punched", [("masquerade", True), ("symmetric", False)])
async def test_a_simultaneous_open_between_two_nats(autojump_clock, kind, punched):
    """Both ends hold a connection to a public rendezvous from one local port, learn each other's mapping
    from it, and connect to that mapping from the same port at about the same time."""
    network = MemoryNetwork(latency=0.02, seed=2)
    network.add_nat("ra", "masquerade")
    network.add_nat("rb", kind)
    async with trio.open_nursery() as nursery:
        seen = await _echo_server(network, "rendezvous", 7000, nursery)
        a, b = network.host("a", behind="ra"), network.host("b", behind="rb")
        await a.connect_tcp_from(("rendezvous", 7000), 5000)
        await b.connect_tcp_from(("rendezvous", 7000), 6000)
        mapping_a, mapping_b = seen
        results: dict = {}

        async def punch(host, local_port, target, name) -> None:
            with trio.move_on_after(10):
                results[name] = await host.connect_tcp_from(target, local_port)

        async with trio.open_nursery() as punching:
            punching.start_soon(punch, a, 5000, mapping_b, "a")
            await trio.sleep(0.015)  # b starts a little later, as a side channel's message would make it
            punching.start_soon(punch, b, 6000, mapping_a, "b")
        if not punched:
            assert results == {}
        else:
            assert set(results) == {"a", "b"}
            await results["a"].send_all(b"direct")
            assert await results["b"].receive_some(10) == b"direct"
            assert results["a"].remote_address == mapping_b and results["b"].remote_address == mapping_a
        nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------------------------- the product on it


async def _run_daemon(config: DaemonConfig, network: MemoryNetwork, host: str, behind: str | None = None, *,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    daemon = Daemon(config, network=network.host(host, behind=behind), identity=Identity.from_seed(host.encode()))
    async with trio.open_nursery() as nursery:
        info = await nursery.start(daemon.run)
        task_status.started((daemon, info))


async def test_daemons_behind_a_nat_find_themselves_private_and_public_ones_public(autojump_clock):
    """`--reachability auto` with the default listen host (all interfaces): the NATed daemon announces what the
    bootstrap observes (its router's mapping), nobody can dial that back, so it is private and a DHT client."""
    network = MemoryNetwork(latency=0.005, seed=5)
    network.add_nat("router")
    async with trio.open_nursery() as nursery:
        boot, _ = await nursery.start(_run_daemon, DaemonConfig(host="boot", port=4000, hidden_dim=8,
                                                                experts="ffn.[0:2]"), network, "boot")
        public, public_info = await nursery.start(_run_daemon, DaemonConfig(
            host="0.0.0.0", port=4000, hidden_dim=8, experts="ffn.[2:4]", initial_peers=[("boot", 4000)]),
            network, "pub")
        natted, natted_info = await nursery.start(_run_daemon, DaemonConfig(
            host="0.0.0.0", port=4000, hidden_dim=8, experts="ffn.[4:6]", initial_peers=[("boot", 4000)]),
            network, "home", "router")
        assert public_info.reachability.startswith("public"), public_info.reachability
        assert natted_info.reachability.startswith("private"), natted_info.reachability
        assert natted_info.address == ("router", 4000)  # what the bootstrap observed
        assert natted.dht.client_mode and not public.dht.client_mode
        assert network.nat("router").counters["tcp_inbound_dropped"] >= 1  # the TCP dial-back
        assert network.nat("router").counters["udp_inbound_dropped"] >= 1  # the UDP one, from a fresh port
        await trio.sleep(60)
        for daemon in (boot, public):
            table = {n.id for n in daemon.dht._table.nodes()}
            assert natted.identity.peer_id not in table
        assert public.identity.peer_id in {n.id for n in boot.dht._table.nodes()}
        # the private peer still reads and writes the DHT as a client
        assert await natted.dht.store("from behind a nat", b"value", time.time() + 600)
        found = await public.dht.get("from behind a nat")
        assert found is not None and found.value == b"value"
        nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------------------------- a swarm


@asynccontextmanager
async def _network_core(network: MemoryNetwork, name: str, behind: str | None, bootstrap: list, **rpc_options):
    """A daemon's network core: RPC and DHT on one port of all interfaces, the dial-back service, the
    reachability check through its bootstrap peers (None for the first peer). Yields (rpc, dht, result)."""
    host = network.host(name, behind=behind)
    identity = Identity.from_seed(name.encode())
    async with RPCNode(identity, host, **rpc_options) as rpc:
        address = await rpc.listen("0.0.0.0", 4000)
        async with DHTNode.open("0.0.0.0", address[1], bootstrap, identity=identity, network=host,
                                client_mode=bool(bootstrap), clock=trio.current_time,
                                seed=sum(name.encode())) as dht:
            observed = await dht.observed_address(bootstrap) if bootstrap else None
            rpc.announce = (observed[0], 4000) if observed else (name, 4000)
            DialBackService(rpc, dht).register()
            yield rpc, dht, await check_reachability(rpc, bootstrap) if bootstrap else None


async def _sim_peer(network: MemoryNetwork, name: str, behind: str | None, bootstrap: list, peers: dict,
                    *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """`_network_core`, a server only once found public."""
    async with _network_core(network, name, behind, bootstrap) as (rpc, dht, result):
        if result is None or result.status == "public":
            await dht.become_server()
        peers[name] = (dht, result)
        task_status.started()
        await trio.sleep_forever()


class _Churn:
    """The swarm tests' bookkeeping: each peer runs in its own cancel scope, bootstrapping from up to 3 public
    peers up now; `stop` crashes one; `watch` looks into every public routing table once a virtual second and
    records any private peer found there. `run(name, behind, bootstrap, task_status=...)` runs one peer and
    puts it in `peers` (its DHT node first) once it has joined."""

    def __init__(self, network: MemoryNetwork, rng: random.Random, routers: list[str], run):
        self.network, self.rng, self.routers, self.run = network, rng, routers, run
        self.peers: dict[str, tuple] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.private_ids: set = set()
        self.violations: list = []

    async def start(self, nursery: trio.Nursery, name: str, private: bool) -> None:
        public_now = [(n, 4000) for n, entry in self.peers.items() if not entry[0].client_mode]
        bootstrap = self.rng.sample(public_now, min(3, len(public_now)))
        if private:
            self.private_ids.add(Identity.from_seed(name.encode()).peer_id)
        scope = self.scopes[name] = trio.CancelScope()
        behind = self.rng.choice(self.routers) if private else None

        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await self.run(name, behind, bootstrap, task_status=task_status)

        await nursery.start(run)

    def stop(self, name: str) -> None:
        self.network.crash(name)
        self.scopes.pop(name).cancel()
        self.peers.pop(name)

    async def watch(self, every_second=lambda: None) -> None:
        while True:
            for name, entry in list(self.peers.items()):
                if not entry[0].client_mode:
                    leaked = self.private_ids & {n.id for n in entry[0]._table.nodes()}
                    if leaked:
                        self.violations.append((trio.current_time(), name, len(leaked)))
            every_second()
            await trio.sleep(1)


@pytest.mark.slow
async def test_a_hundred_peers_seventy_percent_private_with_churn(autojump_clock):
    """120 peers, 84 of them behind 12 MASQUERADE routers; a fifth of them leave and others join while a
    watcher looks into every public routing table once a virtual second: never a private peer there."""
    rng = random.Random(12)
    network = MemoryNetwork(latency=0.01, seed=12)
    routers = [f"r{i}" for i in range(12)]
    for router in routers:
        network.add_nat(router)
    churn = _Churn(network, rng, routers,
                   lambda name, behind, bootstrap, **kw: _sim_peer(network, name, behind, bootstrap, peers, **kw))
    peers, start, stop, watch = churn.peers, churn.start, churn.stop, churn.watch

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        kinds = [True] * 84 + [False] * 36
        rng.shuffle(kinds)
        kinds[:6] = [False] * 6  # the swarm's first peers are public (somebody must be)
        for index, private in enumerate(kinds):
            await start(nursery, f"p{index}", private)
        for name, (dht, result) in peers.items():
            expected_private = network.behind(name) is not None
            assert dht.client_mode is expected_private, (name, result)
        for round_ in range(4):  # churn: 6 leave, 6 new ones (70 % private) join, then time passes
            for name in rng.sample(sorted(n for n in peers if n not in ("p0", "p1", "p2")), 6):
                stop(name)
            for index in range(6):
                await start(nursery, f"c{round_}-{index}", rng.random() < 0.7)
            await trio.sleep(30)
        for name, (dht, _) in peers.items():
            assert dht.client_mode is (network.behind(name) is not None), name
        public_tables = [len(dht._table) for n, (dht, _) in peers.items() if network.behind(n) is None]
        assert min(public_tables) > 0 and sum(public_tables) >= 5 * len(public_tables)  # the watch saw real tables
        # a private peer still reads what a public one stores, and the other way round
        writer = next(dht for n, (dht, _) in peers.items() if network.behind(n) is not None)
        reader = next(dht for n, (dht, _) in peers.items() if network.behind(n) is None and n != "p0")
        assert await writer.store("nat swarm key", b"v", trio.current_time() + 600)
        found = await reader.get("nat swarm key")
        assert found is not None and found.value == b"v"
        nursery.cancel_scope.cancel()
    assert churn.violations == []


# --------------------------------------------------------------------------------------------- reached


PING = "sim.ping"
REACHED_WITHIN = 15.0  # virtual seconds after joining by which every other peer has reached a private peer
CALLS_FROM, CALLS_UNTIL = 2.0, 12.0  # the other peers' calls start spread over this span after the joining


async def _reachable_peer(network: MemoryNetwork, name: str, behind: str | None, bootstrap: list, peers: dict,
                          relays: dict, services: dict, rng: random.Random, *,
                          task_status=trio.TASK_STATUS_IGNORED) -> None:
    """`_sim_peer` plus what makes a private peer reachable: a public one relays (`RelayService`), a private
    one keeps reservations with 2 of the public peers up now (`RelayReservations`, as a daemon does from the
    directory) and announces the relayed address; every circuit is offered a hole punch (`enable_punching`)."""
    from peer.p2p.relay_service import RelayReservations, RelayService
    from peer.relays import enable_punching

    # each pair calls once: direct connections idle for the product's 300 s would only hold the simulator's memory
    async with _network_core(network, name, behind, bootstrap, idle_timeout=30.0) as (rpc, dht, result):
        rpc.register(PING, lambda context, args: _pong(name))
        puncher = enable_punching(rpc)
        async with trio.open_nursery() as nursery:
            if result is None or result.status == "public":
                await dht.become_server()
                service = RelayService(rpc, limit=64)  # the daemon's default --relay-limit
                await nursery.start(service.run)
                relays[name] = (rpc.peer_id, rpc.announced_address)
                services[name] = service
            else:
                async def candidates() -> list:
                    live = sorted(relays.values())
                    return rng.sample(live, min(6, len(live)))

                direct = rpc.announced_address

                def changed(relayed) -> None:
                    rpc.announce = relayed if relayed is not None else direct

                reservations = RelayReservations(rpc, candidates, on_change=changed)
                reservations.answer_punch = puncher.answer
                rpc.close_connections("private: reached through relays from now on")
                nursery.start_soon(reservations.run)
            peers[name] = (dht, result, rpc, trio.current_time(), puncher)
            task_status.started()
            await trio.sleep_forever()


async def _pong(name: str) -> str:
    return name


@pytest.mark.slow
async def test_200_peers_70_percent_private_with_churn_every_private_peer_is_reached_within_15_s(autojump_clock):
    """200 peers, 140 behind 20 MASQUERADE routers (and 2 symmetric ones), joining one by one, then churn: every
    other peer up calls each private peer still up at its relayed address (a circuit, upgraded by a punch where
    the NATs allow), the calls starting spread over 2 to 12 virtual seconds after it joined, and every call is
    answered by 15 s after the joining -- all pairs, through relays at the daemon's default `--relay-limit` (64
    circuits): punched circuits close at once, idle ones after `CIRCUIT_IDLE_TIMEOUT`, and a caller a full relay
    refuses goes on to the target's other one. No private peer ever enters a public routing table."""
    from peer.p2p.rpc import CIRCUIT_IDLE_TIMEOUT

    rng = random.Random(20)
    network = MemoryNetwork(latency=0.01, seed=20)
    routers = [f"r{i}" for i in range(20)]
    for router in routers:
        network.add_nat(router)
    for router in ("s0", "s1"):
        network.add_nat(router, "symmetric")
    routers += ["s0", "s1"]
    relays: dict[str, tuple] = {}
    services: dict[str, object] = {}
    churn = _Churn(network, rng, routers, lambda name, behind, bootstrap, **kw: _reachable_peer(
        network, name, behind, bootstrap, peers, relays, services, rng, **kw))
    peers = churn.peers
    unreached: list = []
    checked: list = []
    calls = {"issued": 0, "answered": 0, "skipped": 0, "latest": 0.0}
    busiest = {"circuits": 0}

    async def check(name: str, joined: float) -> None:
        """Every other peer up calls `name` once, the calls starting spread over CALLS_FROM..CALLS_UNTIL after
        it joined; each must be answered by REACHED_WITHIN after the joining."""
        await trio.sleep_until(joined + CALLS_FROM)
        if name not in peers:
            return  # churned away meanwhile
        target = peers[name][2]
        address, peer_id = target.announced_address, target.peer_id
        others = sorted(n for n in peers if n != name)
        rng.shuffle(others)
        step = (CALLS_UNTIL - CALLS_FROM) / max(len(others), 1)

        async def call(other: str, at: float) -> None:
            await trio.sleep_until(at)
            entry = peers.get(other)
            if entry is None or name not in peers:
                calls["skipped"] += 1  # one of the two left before the call (or during it, below)
                return
            try:
                reply = await entry[2].call(address, PING, None, timeout=joined + REACHED_WITHIN - at,
                                            peer_id=peer_id)
                assert reply == name
                calls["answered"] += 1
                calls["latest"] = max(calls["latest"], trio.current_time() - joined)
            except Exception as error:  # noqa: BLE001 - recorded, the test asserts on the list
                if name in peers and other in peers:  # neither left during the call
                    unreached.append((name, network.behind(name), other, network.behind(other), repr(error)))
                else:
                    calls["skipped"] += 1

        calls["issued"] += len(others)
        async with trio.open_nursery() as callers:
            for index, other in enumerate(others):
                callers.start_soon(call, other, joined + CALLS_FROM + index * step)
        checked.append(name)

    async def start(nursery: trio.Nursery, name: str, private: bool) -> None:
        await churn.start(nursery, name, private)
        if private:
            nursery.start_soon(check, name, trio.current_time())

    def stop(name: str) -> None:
        churn.stop(name)
        relays.pop(name, None)
        services.pop(name, None)

    def note_busiest() -> None:
        busiest["circuits"] = max([busiest["circuits"], *(s.core.circuits for s in services.values())])

    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(churn.watch, note_busiest)
        kinds = [True] * 140 + [False] * 60
        rng.shuffle(kinds)
        kinds[:6] = [False] * 6  # the swarm's first peers are public (somebody must be)
        for index, private in enumerate(kinds):
            await start(nursery, f"p{index}", private)
        for round_ in range(3):  # churn: 8 leave (relays among them), 8 new ones (70 % private) join
            for name in rng.sample(sorted(n for n in peers if n not in ("p0", "p1", "p2")), 8):
                stop(name)
            for index in range(8):
                await start(nursery, f"c{round_}-{index}", rng.random() < 0.7)
            await trio.sleep(20)
        await trio.sleep(REACHED_WITHIN + 1)  # the last joiners' checks
        punchers = [entry[4] for entry in peers.values()]
        counts = {key: sum(p.counters[key] for p in punchers) for key in ("upgraded", "relayed", "punch_failures")}
        # every circuit the punches upgraded closed at its relay; the rest close once idle
        await trio.sleep(CIRCUIT_IDLE_TIMEOUT + 2)
        open_at_end = sum(s.core.circuits for s in services.values())
        refused = sum(s.core.stats["circuits_refused"] for s in services.values())
        nursery.cancel_scope.cancel()
    print(f"200-peer run: {time.monotonic() - started:.1f} s wall, {len(checked)} private peers checked, "
          f"{calls['issued']} calls, {calls['answered']} answered (latest {calls['latest']:.2f} s after the joining), "
          f"{calls['skipped']} skipped (churn), busiest relay {busiest['circuits']} circuits, {refused} circuit "
          f"requests refused by the relays still up (and retried), {counts}, "
          f"{open_at_end} circuits open at the end")
    assert churn.violations == []
    assert unreached == [], (len(unreached), unreached[:5])
    assert len(checked) >= 130  # nearly every private peer was checked (a few left before their calls)
    assert calls["answered"] + calls["skipped"] == calls["issued"] > 15_000  # all pairs: every other peer up
    assert counts["upgraded"] > 0 and counts["relayed"] > 0  # both kinds of connection were exercised
    assert busiest["circuits"] <= 64 and open_at_end == 0
