"""Experts are findable in the DHT by uid and through grid prefixes, stay findable while served, expire after."""

import random
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from dht import DHTNode
from moe.declare import declaration_items, find_free_uids, find_own_uids, get_experts, get_prefix_entries, get_prefixes
from moe.experts import make_expert
from moe.grid import InvalidUID
from moe.server import ExpertServer, choose_uids
from peer.p2p.net import MemoryNetwork, RealNetwork
from peer.p2p.rpc import RPCNode


@asynccontextmanager
async def memory_swarm(network, hosts):
    """DHT nodes on the in-memory network, on the trio clock (so MockClock drives expirations)."""
    async with trio.open_nursery() as nursery:
        nodes = []
        for index, host in enumerate(hosts):
            initial = [nodes[0].address] if nodes else []

            async def run(host=host, initial=initial, index=index, task_status=trio.TASK_STATUS_IGNORED):
                async with DHTNode.open(host, 4000, initial, network=network.host(host), clock=trio.current_time,
                                        seed=index) as node:
                    task_status.started(node)
                    await trio.sleep_forever()

            nodes.append(await nursery.start(run))
        yield nodes
        nursery.cancel_scope.cancel()


async def test_declared_experts_are_found_by_uid_and_prefix_over_real_sockets():
    network = RealNetwork()
    experts = [make_expert(uid, "ffn", 4, seed=0) for uid in ["ffn.0.1", "ffn.0.2", "ffn.3.4"]]
    server = ExpertServer(experts)
    async with trio.open_nursery() as nursery:
        async def dht_node(initial, task_status=trio.TASK_STATUS_IGNORED):
            async with DHTNode.open("127.0.0.1", 0, initial, network=network) as node:
                task_status.started(node)
                await trio.sleep_forever()

        first = await nursery.start(dht_node, [])
        reader = await nursery.start(dht_node, [first.address])
        async with RPCNode(first.identity, network) as rpc:  # one identity: it signs the declarations
            address = await rpc.listen("127.0.0.1", 0)
            await nursery.start(server.run, rpc, first)
            found = await get_experts(reader, ["ffn.0.1", "ffn.3.4", "ffn.9.9"])
            assert found["ffn.9.9"] is None
            for uid in ["ffn.0.1", "ffn.3.4"]:
                assert found[uid].address == address and found[uid].peer_id_hex == str(rpc.peer_id)
            top = await get_prefix_entries(reader, "ffn.")
            assert sorted(top) == [0, 3] and top[3][0] == "ffn.3.4"
            level = await get_prefixes(reader, ["ffn.0.", "ffn.3."])
            assert {c: uid for c, (uid, _) in level["ffn.0."].items()} == {1: "ffn.0.1", 2: "ffn.0.2"}
            assert level["ffn.3."][4][1].address == address
            # a client that found the expert in the DHT can call it at the declared address
            info = await rpc.call(found["ffn.3.4"].address, "moe.info", {"uid": "ffn.0.2"}, timeout=10)
            assert info["uid"] == "ffn.0.2"
            assert server.stats()["declarations"]["rounds"] == 1
            nursery.cancel_scope.cancel()


async def test_redeclared_while_served_and_expire_after_shutdown(autojump_clock):
    network = MemoryNetwork(latency=0.005, seed=3)
    server = ExpertServer([make_expert("ffn.5", "ffn", 4, seed=0)], declare_ttl=10.0, declare_interval=3.0)
    async with memory_swarm(network, ["d0", "d1", "d2"]) as nodes:
        async with RPCNode(nodes[0].identity, network.host("s0")) as rpc:
            await rpc.listen("s0", 5000)
            with trio.CancelScope() as serving:
                async with trio.open_nursery() as nursery:
                    await nursery.start(server.run, rpc, nodes[0])
                    await trio.sleep(35.0)  # far past one TTL: only re-declarations keep it alive
                    assert (await get_experts(nodes[2], ["ffn.5"]))["ffn.5"].address == ("s0", 5000)
                    assert server.stats()["declarations"]["rounds"] >= 10
                    serving.cancel()
        await trio.sleep(11.0)
        assert (await get_experts(nodes[2], ["ffn.5"]))["ffn.5"] is None
        assert await get_prefix_entries(nodes[2], "ffn.") == {}


async def test_free_uids_avoid_experts_declared_by_others(autojump_clock):
    network = MemoryNetwork(latency=0.005, seed=4)
    async with memory_swarm(network, ["d0", "d1"]) as nodes:
        items = declaration_items(["ffn.0.0", "ffn.0.1", "ffn.1.0"], ("other", 1), "ab" * 20, nodes[0].now() + 60)
        assert all(await nodes[0].store_many(items))
        rng = random.Random(5)
        assert await find_free_uids(nodes[1], "ffn.[0:2].[0:2]", 1, rng=rng) == ["ffn.1.1"]
        uids = await choose_uids("ffn.[0:2].[0:2]", 1, dht=nodes[1], rng=rng)
        assert uids == ["ffn.1.1"]


async def test_uids_declared_by_our_own_peer_id_are_ours(autojump_clock, tmp_path):
    """A server restarted with the same identity (no checkpoints) takes back what its PeerID still declares."""
    network = MemoryNetwork(latency=0.005, seed=7)
    async with memory_swarm(network, ["d0", "d1"]) as nodes:
        me, other = "ab" * 20, "cd" * 20
        expiration = nodes[0].now() + 60
        assert all(await nodes[0].store_many(declaration_items(["ffn.0", "ffn.1"], ("old", 1), me, expiration)))
        assert all(await nodes[0].store_many(declaration_items(["ffn.2"], ("x", 1), other, expiration)))
        with pytest.raises(InvalidUID, match="0 free uids, 2 requested"):  # without the rule we block ourselves
            await choose_uids("ffn.[0:3]", 2, dht=nodes[1])
        assert await find_own_uids(nodes[1], "ffn.[0:3]", bytes.fromhex(me)) == ["ffn.0", "ffn.1"]
        assert await choose_uids("ffn.[0:3]", 2, dht=nodes[1], peer_id=bytes.fromhex(me)) == ["ffn.0", "ffn.1"]
        # our own first, then free ones, never someone else's
        assert await choose_uids("ffn.[0:4]", 3, dht=nodes[1], peer_id=me) == ["ffn.0", "ffn.1", "ffn.3"]
        assert sorted(await find_free_uids(nodes[1], "ffn.[0:4]", 3, peer_id=me)) == ["ffn.0", "ffn.1", "ffn.3"]
        with pytest.raises(InvalidUID, match="3 requested"):
            await find_free_uids(nodes[1], "ffn.[0:4]", 3, peer_id=other)
        # checkpoints still come before our declarations
        (tmp_path / "ffn.3.pt").write_bytes(b"")
        assert await choose_uids("ffn.[0:4]", 2, dht=nodes[1], checkpoint_dir=tmp_path, peer_id=me) == [
            "ffn.3", "ffn.0"]


async def test_malformed_records_are_ignored(autojump_clock):
    network = MemoryNetwork(latency=0.005, seed=5)
    async with memory_swarm(network, ["d0", "d1"]) as nodes:
        expiration = nodes[0].now() + 60
        good = ["ffn.2", "h", 7, "cd" * 20]
        await nodes[0].store_many([
            ("ffn.1", ["h", "not a port", "ab" * 20], expiration, None),
            ("ffn.", good, expiration, 2),
            ("ffn.", ["other.3", "h", 7, "cd" * 20], expiration, 3),  # uid not below the prefix
            ("ffn.", ["ffn.4", "h", 7, "not hex"], expiration, 4),
            ("ffn.", "garbage", expiration, 5),
            ("ffn.", good, expiration, "six"),
        ])
        assert (await get_experts(nodes[1], ["ffn.1"]))["ffn.1"] is None
        entries = await get_prefix_entries(nodes[1], "ffn.")
        assert list(entries) == [2] and entries[2][1].address == ("h", 7)


async def test_wildcard_listen_address_needs_an_announced_one(autojump_clock):
    import pytest

    network = MemoryNetwork(latency=0.005, seed=6)
    server = ExpertServer([make_expert("ffn.1", "ffn", 4, seed=0)])
    async with memory_swarm(network, ["d0"]) as nodes:
        async with RPCNode(nodes[0].identity, network.host("s0")) as rpc:
            with pytest.raises(ValueError, match="wildcard"):
                await server.run(rpc, nodes[0], announce=("0.0.0.0", 5000))
            await rpc.listen("s0", 5000)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run, rpc, nodes[0])
                assert (await get_experts(nodes[0], ["ffn.1"]))["ffn.1"].address == ("s0", 5000)
                nursery.cancel_scope.cancel()
