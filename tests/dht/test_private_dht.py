"""Private swarms in the DHT (dht/protocol.py MACs, driven by dht/node.py): properties of the codec, then real
UDP sockets on 127.0.0.1 between separate nodes.

Codec: every datagram of a keyed protocol carries a tag that a protocol holding the same key accepts; one holding
another key, or none, drops it as `bad_mac` before decoding, and so does a keyed protocol for any untagged or
mangled datagram (any single flipped bit); an open protocol's datagrams are exactly rpcudp's bytes.

Sockets: a private swarm stores and reads; a node without the key or with another key cannot join (bootstrap
fails), is in nobody's routing table, cannot store or read; a raw socket sending stock-format requests (a stock
`kademlia` node's bytes) gets not a single byte back, and every one of its datagrams is counted as `bad_mac`.
"""

from __future__ import annotations

import pytest
import trio
from dht_swarm import start_node
from hypothesis import given
from hypothesis import strategies as st

from dht import BootstrapFailed, DHTConfig
from dht import protocol as proto
from dht.errors import RequestTimeout
from dht.node import key_id_of
from peer.p2p.identity import SwarmKey
from peer.p2p.net import RealNetwork

KEY = SwarmKey(b"k" * 32)
OTHER_KEY = SwarmKey(b"K" * 32)
ADDRESS = ("10.0.0.1", 4000)
HOST = "127.0.0.1"
TEST_DEADLINE = 60.0
QUICK_FAIL = DHTConfig(bootstrap_attempts=1, initial_timeout=0.5, max_timeout=0.5)

ids = st.binary(min_size=20, max_size=20)
requests = st.one_of(
    st.tuples(st.just("ping"), st.tuples(ids)),
    st.tuples(st.just("find_node"), st.tuples(ids, ids)),
    st.tuples(st.just("find_value"), st.tuples(ids, ids)),
    st.tuples(st.just("store"), st.tuples(ids, ids, st.binary(max_size=200) | st.integers() | st.text(max_size=50))),
)


@given(requests)
def test_property_same_key_accepts_other_or_no_key_drops_before_decoding(request):
    name, args = request
    _msg_id, datagram = proto.DatagramProtocol(swarm_key=KEY).request(ADDRESS, name, list(args))
    received = proto.DatagramProtocol(swarm_key=KEY).receive(datagram, ADDRESS)
    assert isinstance(received, proto.Request) and received.name == name and received.args == list(args)
    assert proto.DatagramProtocol(swarm_key=OTHER_KEY).receive(datagram, ADDRESS) == proto.Dropped("bad_mac", ADDRESS)
    _msg_id, open_datagram = proto.DatagramProtocol().request(ADDRESS, name, list(args))
    assert proto.DatagramProtocol(swarm_key=KEY).receive(open_datagram, ADDRESS) == proto.Dropped("bad_mac", ADDRESS)
    assert len(datagram) == len(open_datagram) + proto.MAC_BYTES


@given(requests, st.data())
def test_property_any_flipped_bit_or_truncation_is_dropped(request, data):
    name, args = request
    _msg_id, datagram = proto.DatagramProtocol(swarm_key=KEY).request(ADDRESS, name, list(args))
    bit = data.draw(st.integers(0, 8 * len(datagram) - 1))
    mangled = bytearray(datagram)
    mangled[bit // 8] ^= 1 << (bit % 8)
    receiver = proto.DatagramProtocol(swarm_key=KEY)
    assert receiver.receive(bytes(mangled), ADDRESS) == proto.Dropped("bad_mac", ADDRESS)
    cut = data.draw(st.integers(0, len(datagram) - 1))
    assert receiver.receive(datagram[:cut], ADDRESS) == proto.Dropped("bad_mac", ADDRESS)


@given(st.binary(max_size=300))
def test_property_arbitrary_bytes_never_reach_the_decoder(garbage):
    assert proto.DatagramProtocol(swarm_key=KEY).receive(garbage, ADDRESS) == proto.Dropped("bad_mac", ADDRESS)


@given(requests, st.binary(min_size=20, max_size=20))
def test_property_open_swarm_datagrams_are_rpcudp_bytes_and_replies_are_tagged_too(request, result):
    name, args = request
    fixed = b"\x01" * 20
    sender = proto.DatagramProtocol(random_bytes=lambda n: fixed[:n])
    msg_id, datagram = sender.request(ADDRESS, name, list(args))
    assert datagram == proto.encode_request(msg_id, name, list(args))  # no trailer without a key
    keyed_sender = proto.DatagramProtocol(swarm_key=KEY)
    msg_id, datagram = keyed_sender.request(ADDRESS, name, list(args))
    server = proto.DatagramProtocol(swarm_key=KEY)
    reply = server.reply(server.receive(datagram, ADDRESS), result)
    assert keyed_sender.receive(reply, ADDRESS) == proto.Reply(msg_id, name, result, ADDRESS)
    unkeyed_reply = proto.encode_reply(msg_id, result)
    assert keyed_sender.receive(unkeyed_reply, ADDRESS) == proto.Dropped("bad_mac", ADDRESS)


# --------------------------------------------------------------------------------------------- real sockets


async def _private_swarm(nursery, size: int, key: SwarmKey):
    network = RealNetwork()
    first = await start_node(nursery, HOST, network=network, swarm_key=key)
    nodes = [first]
    for _ in range(size - 1):
        nodes.append(await start_node(nursery, HOST, [first.node.address], network=network, swarm_key=key))
    return [running.node for running in nodes]


async def test_a_private_swarm_stores_and_reads_across_nodes():
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            nodes = await _private_swarm(nursery, 4, KEY)
            expiration = nodes[0].now() + 600
            for index, writer in enumerate(nodes):
                assert await writer.store(f"private:{index}", {"index": index}, expiration)
            for index in range(len(nodes)):
                reader = nodes[(index + 1) % len(nodes)]
                record = await reader.get(f"private:{index}")
                assert record is not None and record.value == {"index": index}
            assert all(node.stats()["private_swarm"] for node in nodes)
            assert all(node.stats()["dropped"].get("bad_mac", 0) == 0 for node in nodes)
            assert min(len(node.routing_table_ids()) for node in nodes) >= 1
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("outsider_key", [None, OTHER_KEY], ids=["no key", "another key"])
async def test_an_outsider_cannot_join_store_read_or_enter_a_routing_table(outsider_key):
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            nodes = await _private_swarm(nursery, 3, KEY)
            expiration = nodes[0].now() + 600
            assert await nodes[0].store("secret", b"members only", expiration)
            with pytest.raises(BootstrapFailed):
                await start_node(nursery, HOST, [nodes[0].address], network=RealNetwork(), swarm_key=outsider_key,
                                 config=QUICK_FAIL)
            # an outsider that starts its own DHT and talks to the swarm's nodes as if they were its peers
            outsider = (await start_node(nursery, HOST, network=RealNetwork(), swarm_key=outsider_key)).node
            await _probe_silently(outsider, nodes)
            for node in nodes:
                assert outsider.peer_id not in node.routing_table_ids()
                assert node.local_record("planted") is None
                assert node.stats()["dropped"].get("bad_mac", 0) > 0
            assert outsider.routing_table_ids() == []
            assert await outsider.get("secret") is None
            # the members still work together
            record = await nodes[2].get("secret")
            assert record is not None and record.value == b"members only"
            nursery.cancel_scope.cancel()


def proto_key(key: str) -> bytes:
    return key_id_of(key)


async def _probe_silently(outsider, nodes) -> None:
    """The outsider pings, stores and reads at each member directly; none of it may be answered (a member's
    silence is all it gets, so the wait is a bounded 0.5 s of nothing, not a race)."""

    for node in nodes:
        for name, args in (("ping", [outsider.peer_id]),
                           ("store", [outsider.peer_id, proto_key("planted"), b"by an outsider"]),
                           ("find_value", [outsider.peer_id, proto_key("secret")])):
            with pytest.raises(RequestTimeout):
                await outsider._request(node.address, name, args, timeout=0.5)


async def test_stock_format_datagrams_get_not_one_byte_back_and_are_counted():
    """A raw socket speaks rpcudp as a stock node does; then a member's tagged ping from the same socket: when its
    answer arrives every earlier datagram was handled, and the answer is the only thing that ever came back."""
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            (node,) = await _private_swarm(nursery, 1, KEY)
            endpoint = await RealNetwork().open_udp(HOST, 0)
            async with endpoint:
                stock = proto.DatagramProtocol()
                sent = 0
                for name, args in (("ping", [b"s" * 20]), ("find_node", [b"s" * 20, b"t" * 20]),
                                   ("store", [b"s" * 20, proto_key("x"), b"value"]), ("stun", [])):
                    await endpoint.sendto(stock.request(node.address, name, args)[1], node.address)
                    sent += 1
                await endpoint.sendto(b"\x00garbage", node.address)
                sent += 1
                member = proto.DatagramProtocol(swarm_key=KEY)
                msg_id, ping = member.request(node.address, "ping", [b"m" * 20])
                await endpoint.sendto(ping, node.address)
                data, _source = await endpoint.recvfrom()
                assert member.receive(data, node.address) == proto.Reply(msg_id, "ping", bytes(node.peer_id),
                                                                         node.address)
            assert node.stats()["dropped"]["bad_mac"] == sent
            assert node.local_record("x") is None
            assert node.routing_table_ids() == []  # the member's ping is answered, its bogus id checked first
            nursery.cancel_scope.cancel()


async def test_a_stock_kademlia_node_finds_nobody_in_a_private_swarm():
    from stock_node import StockNodes

    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, StockNodes.open(1, seed="private") as stock:
            nodes = await _private_swarm(nursery, 2, KEY)
            assert await stock.bootstrap(0, [nodes[0].address]) == []
            assert all(stock_id not in nodes[0].routing_table_ids() for stock_id in stock.ids)
            assert nodes[0].stats()["dropped"]["bad_mac"] >= 1
            nursery.cancel_scope.cancel()
