"""DHTNode behaviour a user relies on: joining errors, signed records, client mode, limits, hostile peers."""

from __future__ import annotations

import math
import random
from contextlib import asynccontextmanager

import pytest
import trio
import trio.lowlevel
import umsgpack
from dht_swarm import start_node, start_swarm

from dht import BootstrapFailed, DHTConfig, DHTNode, ValueTooLarge, key_id_of
from dht import protocol as proto
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork, RealNetwork

FAST = DHTConfig(initial_timeout=0.2, bootstrap_attempts=2)


async def test_bootstrap_failure_names_the_addresses_tried(autojump_clock):
    network = MemoryNetwork(latency=0.001)
    with pytest.raises(BootstrapFailed) as info:
        async with DHTNode.open("lonely", 0, [("ghost1", 4000), ("ghost2", 4001)], network=network.host("lonely"),
                                config=FAST):
            pass
    message = str(info.value)
    assert "ghost1:4000" in message and "ghost2:4001" in message
    assert info.value.addresses == [("ghost1", 4000), ("ghost2", 4001)]
    assert info.value.operation == "bootstrap"


async def test_bootstrap_failure_on_real_sockets_releases_the_port():
    network = RealNetwork()
    silent = await network.open_udp("127.0.0.1", 0)  # bound, never answers
    async with silent:
        with pytest.raises(BootstrapFailed, match=f"127.0.0.1:{silent.address[1]}"):
            async with DHTNode.open("127.0.0.1", 0, [silent.address], config=FAST):
                pass


async def test_node_without_initial_peers_is_a_new_dht_of_one():
    async with DHTNode.open("127.0.0.1", 0) as node:
        assert await node.store("k", "v", node.now() + 60)
        assert (await node.get("k")).value == "v"
        assert await node.get("missing") is None


async def test_user_exception_leaves_the_block_unwrapped():
    with pytest.raises(KeyError):
        async with DHTNode.open("127.0.0.1", 0):
            raise KeyError("mine")


@asynccontextmanager
async def _memory_swarm(count, seed=1, **kwargs):
    """`count` nodes (n0, n1, ...) on a fresh in-memory network, in a nursery cancelled when the block ends:
    (the nursery, the network, the nodes)."""
    network = MemoryNetwork(latency=0.002, seed=seed)
    hosts = [f"n{i}" for i in range(count)]
    async with trio.open_nursery() as nursery:
        yield nursery, network, await start_swarm(nursery, hosts, network.host, random.Random(seed), **kwargs)
        nursery.cancel_scope.cancel()


async def test_a_frugal_get_asks_only_the_replicas_its_quorum_lacks(autojump_clock):
    """Every node of a small swarm holds every key, the reader included. A quick get (quorum 3 by default, the
    reader's own copy counting as one) keeps alpha (3) queries active, so a dead replica costs it no time: it asks
    at least 3 peers for the 2 copies it lacks, whether or not it names its quorum. A frugal get asks only what
    its quorum lacks: 2 for the default quorum (matchmaking's view), 1 for `quorum=2`, none for `quorum=1`. Each
    merges what it read with the reader's own copy."""

    def served(swarm) -> int:
        return sum(r.node.stats()["requests_served"].get("find_value", 0) for r in swarm)

    async with _memory_swarm(6) as (nursery, _, swarm):
        reader = swarm[0].node
        assert await reader.store("k", "v", reader.now() + 60, subkey=b"a")
        assert await swarm[3].node.store("k", "w", reader.now() + 60, subkey=b"b")
        await trio.sleep(1)  # background read repairs and gifts settle
        for quorum, frugal, asked in ((None, False, None), (3, False, None), (None, True, 2), (3, True, 2),
                                      (2, True, 1), (1, True, 0)):
            before = served(swarm)
            record = await reader.get("k", quorum=quorum, frugal=frugal)
            await trio.sleep(1)  # a query still in flight when the quorum was met is served meanwhile
            assert {k: e.value for k, e in record.subkeys.items()} == {b"a": "v", b"b": "w"}
            if asked is None:
                assert served(swarm) - before >= 3, (quorum, frugal)
            else:
                assert served(swarm) - before == asked, (quorum, frugal)
        with pytest.raises(ValueError, match="at least 1"):
            await reader.get("k", quorum=0)
        with pytest.raises(ValueError, match="cannot be frugal"):
            await reader.get("k", latest=True, frugal=True)


async def test_signed_record_survives_its_owner_leaving(autojump_clock):
    async with _memory_swarm(12) as (nursery, network, swarm):
        owner = swarm[3]
        assert await owner.node.store("my-key", "owner's value", owner.node.now() + 300, signed=True)
        assert await owner.node.store("group", "owner's entry", owner.node.now() + 300, subkey="slot", signed=True)
        network.crash("n3")
        owner.kill()
        intruder = swarm[7].node
        assert not await intruder.store("my-key", "hijacked", intruder.now() + 3000)
        assert not await intruder.store("my-key", "hijacked", intruder.now() + 3000, signed=True)
        assert not await intruder.store("group", "hijacked", intruder.now() + 3000, subkey="slot")
        assert await intruder.store("group", "intruder's own", intruder.now() + 3000, subkey="other")
        reader = swarm[9].node
        record = await reader.get("my-key", latest=True)
        assert record.value == "owner's value"
        assert record.owner == owner.node.identity.public_key
        group = await reader.get("group", latest=True)
        assert group.subkeys["slot"].value == "owner's entry"
        assert group.subkeys["other"].value == "intruder's own"


async def test_newer_value_wins_and_expired_value_disappears(autojump_clock):
    async with _memory_swarm(10) as (nursery, _, swarm):
        a, b, c = swarm[1].node, swarm[4].node, swarm[8].node
        now = a.now()
        assert await a.store("k", "first", now + 100)
        assert await b.store("k", "second", now + 200)
        assert not await a.store("k", "stale", now + 150)  # every replica holds a newer value
        assert (await c.get("k", latest=True)).value == "second"
        assert not await a.store("gone", "x", now - 1)


async def test_expiration_uses_the_dht_clock():
    fake_now = [1_000.0]
    network = MemoryNetwork()
    async with DHTNode.open("a", 0, network=network.host("a"), clock=lambda: fake_now[0]) as a:
        async with DHTNode.open("b", 0, [a.address], network=network.host("b"), clock=lambda: fake_now[0]) as b:
            assert await a.store("k", "v", 1_010.0)
            assert (await b.get("k")).expiration_time == 1_010.0
            fake_now[0] = 1_011.0
            assert await b.get("k") is None


async def test_plain_values_round_trip_as_stock_values(autojump_clock):
    async with _memory_swarm(6) as (nursery, _, swarm):
        writer, reader = swarm[0].node, swarm[5].node
        assert await writer.store("plain", 42, math.inf)
        record = await reader.get("plain")
        assert record.value == 42 and record.expiration_time == math.inf


async def test_value_too_large_is_refused_before_sending():
    async with DHTNode.open("127.0.0.1", 0) as node:
        with pytest.raises(ValueTooLarge):
            await node.store("k", b"x" * 9000, node.now() + 10)


async def test_get_many_and_store_many_use_one_request_per_swarmd_peer(autojump_clock):
    async with _memory_swarm(8) as (nursery, _, swarm):
        writer, reader = swarm[2].node, swarm[6].node
        keys = [f"batch-{i}" for i in range(30)]
        assert all(await writer.store_many([(key, i, writer.now() + 60) for i, key in enumerate(keys)]))
        found = await reader.get_many(keys + ["absent"])
        assert {key: r.value for key, r in found.items() if r is not None} == {k: i for i, k in enumerate(keys)}
        assert found["absent"] is None
        served = [r.node.stats()["requests_served"] for r in swarm]
        assert sum(s.get("swarmd_store_find", 0) + s.get("swarmd_store_many", 0) for s in served) > 0
        assert sum(s.get("store", 0) for s in served) == 0  # every peer speaks swarmd: no per-key stores
        assert sum(s.get("swarmd_find_many", 0) for s in served) > 0
        # with 8 nodes and k=20 every node is a replica of every key: batching means far fewer than
        # 31 keys x 7 peers single requests
        assert sum(s.get("find_value", 0) for s in served) < 31


async def test_client_mode_node_reads_and_writes_but_is_never_routed_to(autojump_clock):
    async with _memory_swarm(8) as (nursery, network, swarm):
        client = await start_node(nursery, "client", [swarm[0].node.address], network=network.host("client"),
                                  client_mode=True)
        assert await client.node.store("from-client", "hello", client.node.now() + 60)
        assert (await swarm[5].node.get("from-client")).value == "hello"
        assert await swarm[5].node.store("to-client", "hi", client.node.now() + 60)
        assert (await client.node.get("to-client")).value == "hi"
        await trio.sleep(5)  # virtual: let every verification of the client finish
        for running in swarm:
            assert client.node.peer_id not in running.node.routing_table_ids()
        assert client.node.stats()["records_held"] == 0


class _StockLikePeer:
    """A minimal stock node: answers the stock RPCs, stays silent on swarmd_* (as rpcudp does)."""

    def __init__(self, endpoint):
        self.endpoint = endpoint
        self.node_id = key_id_of("stock-like")
        self.storage = {}
        self.requests = []

    async def serve(self):
        protocol = proto.DatagramProtocol()
        while True:
            data, address = await self.endpoint.recvfrom()
            event = protocol.receive(data, address)
            if not isinstance(event, proto.Request):
                continue
            self.requests.append(event.name)
            if event.name == "ping":
                reply = self.node_id
            elif event.name == "store":
                self.storage[event.args[1]] = event.args[2]
                reply = True
            elif event.name in ("find_node", "find_value"):
                key = event.args[1]
                reply = {"value": self.storage[key]} if event.name == "find_value" and key in self.storage else []
            else:
                continue
            await self.endpoint.sendto(b"\x01" + event.msg_id + umsgpack.packb(reply), address)


async def test_stock_peer_is_probed_once_and_then_served_with_stock_rpcs(autojump_clock):
    network = MemoryNetwork(latency=0.002)
    endpoint = await network.host("stock").open_udp("stock", 0)
    stock = _StockLikePeer(endpoint)
    async with endpoint, trio.open_nursery() as nursery:
        nursery.start_soon(stock.serve)
        async with DHTNode.open("ours", 0, [endpoint.address], network=network.host("ours")) as node:
            for round_ in range(3):
                items = [(f"k{round_}-{i}", i, node.now() + 60) for i in range(5)]
                assert all(await node.store_many(items))
            assert stock.requests.count("swarmd_hello") == 1
            assert stock.requests.count("store") == 15
            found = await node.get_many([f"k2-{i}" for i in range(5)])
            assert [r.value for r in found.values()] == list(range(5))
        nursery.cancel_scope.cancel()


async def test_hostile_datagrams_are_counted_and_the_node_keeps_serving():
    network = RealNetwork()
    async with DHTNode.open("127.0.0.1", 0) as node, await network.open_udp("127.0.0.1", 0) as attacker:
        fake_id = b"\xee" * 20
        key = key_id_of("k")
        hostile = [
            b"",
            b"\x00" * 10,
            b"\x05" + b"\x00" * 40,
            b"\x00" + b"\x01" * 20 + b"\xc1\xc1",
            b"\x00" + b"\x01" * 20 + umsgpack.packb(["store", [fake_id, key, [1, 2, 3]]]),  # unhashable value
            b"\x00" + b"\x01" * 20 + umsgpack.packb(["store", [fake_id, key, b"\xc1swarmd\x01garbage"]]),
            b"\x00" + b"\x01" * 20 + umsgpack.packb(["rpc_shutdown", []]),
            b"\x01" + b"\x02" * 20 + umsgpack.packb(fake_id),  # reply nobody asked for
        ]
        for datagram in hostile:
            await attacker.sendto(datagram, node.address)
        msg_id = b"\x09" * 20
        await attacker.sendto(b"\x00" + msg_id + umsgpack.packb(["ping", [fake_id]]), node.address)
        with trio.fail_after(5):
            data = b""
            while not data.startswith(b"\x01" + msg_id):  # the refused stores are answered False first
                data, _ = await attacker.recvfrom()
        assert data == b"\x01" + msg_id + umsgpack.packb(bytes(node.peer_id))
        dropped = node.stats()["dropped"]
        for reason in ("too_short", "unknown_type", "bad_msgpack", "bad_arguments", "invalid_record",
                       "unknown_method", "unsolicited_reply"):
            assert dropped.get(reason, 0) >= 1, reason
        assert node.local_record("k") is None  # the unhashable and the forged envelope were both refused


async def test_request_flood_from_one_address_is_rate_limited(autojump_clock):
    network = MemoryNetwork()
    config = DHTConfig(requests_per_second=10, request_burst=20)
    async with DHTNode.open("victim", 0, network=network.host("victim"), config=config) as node:
        flooder = await network.host("flooder").open_udp("flooder", 0)
        async with flooder:
            for i in range(100):
                await flooder.sendto(b"\x00" + i.to_bytes(20, "big") + umsgpack.packb(["ping", [b"\xaa" * 20]]),
                                     node.address)
            answers = 0
            with trio.move_on_after(1):
                while True:
                    await flooder.recvfrom()
                    answers += 1
        assert 20 <= answers <= 40
        assert node.stats()["dropped"]["rate_limited"] >= 60


async def test_request_flood_from_one_ip_is_refused_before_decoding_while_other_ips_are_served(mock_clock):
    """Many ports of one IP (each under the per-address limit) exceed the per-IP budget: the excess is dropped
    on its first byte (not decoded: garbage past the budget never counts as bad msgpack); another IP is served.
    Virtual time stands still here, so no budget refills meanwhile."""
    network = MemoryNetwork()
    config = DHTConfig(ip_requests_per_second=100, ip_request_burst=200)
    async with DHTNode.open("victim", 0, network=network.host("victim"), config=config) as node:
        flooders = [await network.host("flooder").open_udp("flooder", 0) for _ in range(8)]
        for i in range(1000):
            await flooders[i % 8].sendto(b"\x00" + i.to_bytes(20, "big") + b"\xc1garbage", node.address)
        while sum(node.stats()["dropped"].get(reason, 0) for reason in ("ip_rate_limited", "bad_msgpack")) < 1000:
            await trio.lowlevel.checkpoint()  # the receive loop is still working through the datagrams
        dropped = node.stats()["dropped"]
        assert dropped["ip_rate_limited"] == 800
        assert dropped["bad_msgpack"] == 200
        honest = await network.host("honest").open_udp("honest", 0)
        async with honest:
            await honest.sendto(b"\x00" + b"\x01" * 20 + umsgpack.packb(["ping", [b"\xbb" * 20]]), node.address)
            with trio.fail_after(5):
                data, _ = await honest.recvfrom()
        assert umsgpack.unpackb(data[21:]) == bytes(node.peer_id)
        for flooder in flooders:
            flooder.close()


async def test_records_per_node_cap():
    config = DHTConfig(max_records=5)
    async with DHTNode.open("127.0.0.1", 0, config=config) as node:
        results = [await node.store(f"k{i}", i, node.now() + 60) for i in range(8)]
        assert results == [True] * 5 + [False] * 3
        assert node.stats()["records_held"] == 5
        assert node.stats()["dropped"]["storage_full"] == 3


async def test_four_nodes_with_the_same_initial_peer_form_one_dht(autojump_clock):
    network = MemoryNetwork(latency=0.003)
    async with trio.open_nursery() as nursery:
        seed = await start_node(nursery, "seed", network=network.host("seed"))
        others = [await start_node(nursery, f"p{i}", [seed.node.address], network=network.host(f"p{i}"))
                  for i in range(4)]
        ids = {bytes(r.node.peer_id) for r in [seed, *others]}
        for running in others:
            assert set(running.node.routing_table_ids()) == ids - {bytes(running.node.peer_id)}
        nursery.cancel_scope.cancel()


async def test_newcomer_closest_to_a_key_is_handed_its_record(autojump_clock):
    config = DHTConfig(k=3)
    async with _memory_swarm(10, config=config) as (nursery, network, swarm):
        assert await swarm[0].node.store("wanted", "payload", swarm[0].node.now() + 600)
        key = int.from_bytes(key_id_of("wanted"), "big")
        closest_existing = min(int.from_bytes(r.node.peer_id, "big") ^ key for r in swarm)
        identity = min((Identity.from_seed(i.to_bytes(4, "big")) for i in range(3000)),
                       key=lambda ident: int.from_bytes(ident.peer_id, "big") ^ key)
        assert int.from_bytes(identity.peer_id, "big") ^ key < closest_existing
        newcomer = await start_node(nursery, "newcomer", [swarm[5].node.address], network=network.host("newcomer"),
                                    identity=identity, config=config)
        with trio.fail_after(10):  # virtual time: welcome stores are sent in the background, passes are spaced
            while newcomer.node.local_record("wanted") is None:
                await trio.sleep(0.05)
        assert newcomer.node.local_record("wanted").value == "payload"


async def test_get_latest_finds_the_newest_value_even_when_most_replicas_are_stale(autojump_clock):
    async with _memory_swarm(12) as (nursery, network, swarm):
        hosts = [r.node.address[0] for r in swarm]
        writer, reader = swarm[0].node, swarm[11].node
        assert await writer.store("k", "old", writer.now() + 100)
        network.partition(hosts[:3], hosts[3:])  # the writer reaches only two other replicas
        assert await writer.store("k", "new", writer.now() + 200)
        network.heal()
        assert (await reader.get("k", latest=True)).value == "new"


async def test_a_restarted_peer_with_a_new_identity_replaces_its_old_contact(autojump_clock):
    network = MemoryNetwork(latency=0.002)
    async with trio.open_nursery() as nursery:
        first = await start_node(nursery, "a", network=network.host("a"))
        old = await start_node(nursery, "b", [first.node.address], network=network.host("b"))
        port = old.node.address[1]
        old_id = bytes(old.node.peer_id)
        assert old_id in first.node.routing_table_ids()
        network.crash("b")
        old.kill()
        new = await nursery.start(_run_on_port, network, "b", port, first.node.address)
        assert bytes(new.peer_id) in first.node.routing_table_ids()
        assert old_id not in first.node.routing_table_ids()
        nursery.cancel_scope.cancel()


async def _run_on_port(network, host, port, initial, *, task_status):
    async with DHTNode.open(host, port, [initial], network=network.host(host)) as node:
        task_status.started(node)
        await trio.sleep_forever()


async def test_many_keys_in_one_call(autojump_clock):
    async with _memory_swarm(6) as (nursery, _, swarm):
        writer, reader = swarm[1].node, swarm[4].node
        keys = [f"bulk-{i}" for i in range(300)]
        assert all(await writer.store_many([(key, i, writer.now() + 60, "sub") for i, key in enumerate(keys)]))
        found = await reader.get_many(keys)
        assert [found[key].subkeys["sub"].value for key in keys] == list(range(300))


async def test_reading_a_key_refills_its_thinned_replica_set(autojump_clock):
    config = DHTConfig(k=3)
    async with _memory_swarm(12, config=config) as (nursery, network, swarm):
        assert await swarm[0].node.store("thin", "v", swarm[0].node.now() + 600)
        holders = [r for r in swarm if r.node.local_record("thin") is not None]
        assert len(holders) >= 3
        for running in holders[1:]:
            network.crash(running.node.address[0])
            running.kill()
        alive = [r for r in swarm if r not in holders[1:]]
        reader = next(r.node for r in alive if r is not holders[0])
        assert (await reader.get("thin", latest=True)).value == "v"
        await trio.sleep(1)  # virtual: repairs are sent in the background
        assert sum(r.node.local_record("thin") is not None for r in alive) >= 3


async def test_forged_reply_from_another_address_is_dropped_and_the_real_one_accepted(autojump_clock):
    network = MemoryNetwork(latency=0.002)
    real_id, forged_id = key_id_of("real peer"), key_id_of("forged peer")
    async with await network.host("s").open_udp("s", 0) as honest, await network.host("m").open_udp("m", 0) as mallory:

        async def answer_after_forgery(*, task_status=trio.TASK_STATUS_IGNORED):
            task_status.started()
            data, sender = await honest.recvfrom()
            msg_id = data[1:21]
            # an observer who saw the msg id answers first, from its own address
            await mallory.sendto(b"\x01" + msg_id + umsgpack.packb(forged_id), sender)
            await trio.sleep(0.01)
            await honest.sendto(b"\x01" + msg_id + umsgpack.packb(real_id), sender)
            while True:  # then behave like a quiet stock node: answer lookups with no contacts
                data, sender = await honest.recvfrom()
                event = proto.DatagramProtocol().receive(data, sender)
                if isinstance(event, proto.Request) and event.name == "find_node":
                    await honest.sendto(proto.encode_reply(event.msg_id, []), sender)

        async with trio.open_nursery() as nursery:
            await nursery.start(answer_after_forgery)
            async with DHTNode.open("ours", 0, [honest.address], network=network.host("ours")) as node:
                assert node.routing_table_ids() == [real_id]
                assert node.stats()["dropped"]["forged_reply"] == 1
            nursery.cancel_scope.cancel()


async def test_largest_records_travel_through_batched_and_stock_paths(autojump_clock):
    async with _memory_swarm(6) as (nursery, _, swarm):
        writer, reader = swarm[1].node, swarm[3].node
        expiration = writer.now() + 60
        biggest = b"x" * 8109  # the largest bytes value whose record fits a stock store request
        assert await writer.store("big", biggest, expiration)
        assert all(await writer.store_many([("big1", biggest, expiration), ("big2", biggest, expiration)]))
        found = await reader.get_many(["big", "big1", "big2"])
        assert all(record.value == biggest for record in found.values())
        with pytest.raises(ValueTooLarge):
            await writer.store("too-big", biggest + b"x", expiration)


def _junk(rng: random.Random, depth: int = 0):
    """Random msgpack-able objects of every shape a hostile peer could send back."""
    choice = rng.randrange(9 if depth < 3 else 6)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False, 0, -1, 2**63 - 1, 1.5, float("inf")])
    if choice == 2:
        return rng.randbytes(rng.choice([0, 5, 20, 32, 64]))
    if choice == 3:
        return rng.choice(["", "value", "127.0.0.1", "x" * 300])
    if choice == 4:
        return [rng.randbytes(20), rng.choice(["127.0.0.1", "h", ""]), rng.choice([0, 1, 65535, 70000, -5])]
    if choice == 5:
        return {"value": rng.randbytes(10)}
    if choice == 6:
        return [_junk(rng, depth + 1) for _ in range(rng.choice([0, 3, 25, 120]))]
    if choice == 7:
        return {rng.choice(["value", b"value", 7, "id"]): _junk(rng, depth + 1) for _ in range(3)}
    return [[_junk(rng, depth + 1), _junk(rng, depth + 1)] for _ in range(rng.choice([1, 30]))]


async def test_a_peer_answering_garbage_never_breaks_our_node(autojump_clock):
    rng = random.Random(99)
    network = MemoryNetwork(latency=0.002, seed=3)
    async with trio.open_nursery() as nursery:
        good = await start_node(nursery, "good", network=network.host("good"))
        liar = await network.host("liar").open_udp("liar", 0)

        async def lie():
            protocol = proto.DatagramProtocol()
            while True:
                data, sender = await liar.recvfrom()
                event = protocol.receive(data, sender)
                if isinstance(event, proto.Request):
                    reply = key_id_of("liar") if event.name == "ping" else _junk(rng)
                    try:
                        await liar.sendto(proto.encode_reply(event.msg_id, reply), sender)
                    except Exception:
                        continue  # an unencodable junk object: just stay silent this time

        nursery.start_soon(lie)
        async with DHTNode.open("ours", 0, [liar.address, good.node.address], network=network.host("ours")) as node:
            for round_ in range(8):
                assert await node.store(f"k{round_}", round_, node.now() + 60)
                assert (await node.get(f"k{round_}")).value == round_
                await node.get_many([f"k{round_}", "missing"])
                await node.store_many([(f"m{round_}", 1, node.now() + 60), (f"n{round_}", 2, node.now() + 60)])
            dropped = node.stats()["dropped"]
            assert not any(reason.startswith("internal_error") for reason in dropped), dropped
            assert dropped.get("handler_error", 0) == 0
            assert dropped["bad_reply"] > 0  # the liar was consulted, and its answers were refused
        nursery.cancel_scope.cancel()
    liar.close()


async def test_store_reports_failure_when_no_replica_answers(autojump_clock):
    network = MemoryNetwork(latency=0.002)
    async with trio.open_nursery() as nursery:
        server = await start_node(nursery, "server", network=network.host("server"))
        client = await start_node(nursery, "client", [server.node.address], network=network.host("client"),
                                  client_mode=True)
        assert await client.node.store("k", "v", client.node.now() + 60)
        network.crash("server")
        server.kill()
        with trio.fail_after(5):
            assert not await client.node.store("k2", "v", client.node.now() + 60)
            assert await client.node.get("k") is None
        nursery.cancel_scope.cancel()


async def test_republishing_a_stale_plain_value_does_not_undo_a_newer_write(autojump_clock):
    async with _memory_swarm(8) as (nursery, network, swarm):
        stale_holder = swarm[7]
        assert await swarm[0].node.store("plain", "v1", math.inf)
        network.isolate(stale_holder.node.address[0])
        assert await swarm[1].node.store("plain", "v2", math.inf)
        network.heal()
        assert stale_holder.node.local_record("plain").value == "v1"
        assert await stale_holder.node.republish(force=True) >= 1
        await trio.sleep(1)  # virtual
        others = [r.node for r in swarm[:7]]
        assert all(node.local_record("plain").value == "v2" for node in others)
