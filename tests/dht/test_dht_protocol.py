"""The datagram protocol speaks rpcudp byte for byte, and no datagram can make it raise."""

from __future__ import annotations

import random

import pytest
import umsgpack

from dht import protocol as proto

NODE_ID = bytes(range(20))
KEY = bytes(range(100, 120))
MSG_ID = b"\x07" * 20


def rpcudp_request(msg_id: bytes, name: str, args: tuple) -> bytes:
    """What rpcudp's RPCProtocol.__getattr__ closure puts on the wire."""
    return b"\x00" + msg_id + umsgpack.packb([name, args])


def rpcudp_reply(msg_id: bytes, response) -> bytes:
    """What rpcudp's _accept_request sends back."""
    return b"\x01" + msg_id + umsgpack.packb(response)


@pytest.mark.parametrize(
    "name, args",
    [
        ("ping", (NODE_ID,)),
        ("store", (NODE_ID, KEY, "a str value")),
        ("store", (NODE_ID, KEY, b"\x00\xff" * 3000)),  # bin16
        ("store", (NODE_ID, KEY, 3.25)),
        ("store", (NODE_ID, KEY, -(2**40))),
        ("store", (NODE_ID, KEY, True)),
        ("store", (NODE_ID, KEY, "é" * 200)),  # str8 / str16
        ("find_node", (NODE_ID, KEY)),
        ("find_value", (NODE_ID, KEY)),
        ("stun", ()),
    ],
)
def test_requests_are_byte_identical_to_rpcudp(name, args):
    assert proto.encode_request(MSG_ID, name, list(args)) == rpcudp_request(MSG_ID, name, args)


@pytest.mark.parametrize(
    "response",
    [
        NODE_ID,  # ping
        True,  # store
        [(NODE_ID, "127.0.0.1", 8468), (KEY, "10.0.0.2", 1)],  # find_node: list(map(tuple, neighbors))
        {"value": b"bytes value"},  # find_value hit
        {"value": 12345678901},
        ("127.0.0.1", 40000),  # stun returns the sender tuple
        [],
    ],
)
def test_replies_are_byte_identical_to_rpcudp(response):
    assert proto.encode_reply(MSG_ID, response) == rpcudp_reply(MSG_ID, response)


def test_stock_requests_decode_to_request_events():
    protocol = proto.DatagramProtocol()
    event = protocol.receive(rpcudp_request(MSG_ID, "store", (NODE_ID, KEY, b"v")), ("127.0.0.1", 9))
    assert event == proto.Request(MSG_ID, "store", [NODE_ID, KEY, b"v"], ("127.0.0.1", 9))


def test_request_size_cap_matches_rpcudp_exactly():
    for size in range(8120, 8160):
        args = [NODE_ID, KEY, b"x" * size]
        rpcudp_sends_it = len(umsgpack.packb(["store", tuple(args)])) <= 8192
        try:
            proto.encode_request(MSG_ID, "store", args)
            we_send_it = True
        except proto.RequestTooLarge:
            we_send_it = False
        assert we_send_it == rpcudp_sends_it, size


def test_reply_accepted_only_from_the_address_asked():
    protocol = proto.DatagramProtocol()
    msg_id, _ = protocol.request(("10.0.0.1", 5000), "ping", [NODE_ID])
    forged = protocol.receive(proto.encode_reply(msg_id, KEY), ("10.0.0.66", 5000))
    assert forged == proto.Dropped("forged_reply", ("10.0.0.66", 5000))
    genuine = protocol.receive(proto.encode_reply(msg_id, NODE_ID), ("10.0.0.1", 5000))
    assert isinstance(genuine, proto.Reply) and genuine.result == NODE_ID and genuine.name == "ping"
    replayed = protocol.receive(proto.encode_reply(msg_id, NODE_ID), ("10.0.0.1", 5000))
    assert replayed.reason == "unsolicited_reply"


def test_forgotten_request_makes_late_reply_unsolicited():
    protocol = proto.DatagramProtocol()
    msg_id, _ = protocol.request(("h", 1), "ping", [NODE_ID])
    protocol.forget(msg_id)
    assert protocol.receive(proto.encode_reply(msg_id, NODE_ID), ("h", 1)).reason == "unsolicited_reply"
    assert protocol.outstanding == 0


@pytest.mark.parametrize(
    "datagram, reason",
    [
        (b"", "too_short"),
        (b"\x00" * 21, "too_short"),
        (b"\x02" + MSG_ID + umsgpack.packb(["ping", [NODE_ID]]), "unknown_type"),
        (b"\x00" + MSG_ID + b"\xc1", "bad_msgpack"),
        (b"\x00" + MSG_ID + umsgpack.packb(["ping", [NODE_ID]]) + b"extra", "bad_msgpack"),
        (b"\x00" + MSG_ID + b"\x91" * 5000 + b"\xc0", "bad_msgpack"),  # absurd nesting
        (b"\x00" + MSG_ID + umsgpack.packb({"ping": 1}), "malformed_request"),
        (b"\x00" + MSG_ID + umsgpack.packb(["ping", NODE_ID]), "malformed_request"),
        (b"\x00" + MSG_ID + umsgpack.packb(["rpc_evil", [NODE_ID]]), "unknown_method"),
        (b"\x00" + MSG_ID + umsgpack.packb(["ping", [b"short"]]), "bad_arguments"),
        (b"\x00" + MSG_ID + umsgpack.packb(["store", [NODE_ID, KEY, [1, 2]]]), "bad_arguments"),  # unhashable
        (b"\x00" + MSG_ID + umsgpack.packb(["store", [NODE_ID, KEY, None]]), "bad_arguments"),
        (b"\x00" + MSG_ID + umsgpack.packb(["find_node", [NODE_ID, b"k"]]), "bad_arguments"),
        (b"\x00" + MSG_ID + umsgpack.packb(["stun", [NODE_ID]]), "bad_arguments"),
    ],
)
def test_hostile_datagrams_are_dropped_with_a_reason(datagram, reason):
    event = proto.DatagramProtocol().receive(datagram, ("h", 1))
    assert event == proto.Dropped(reason, ("h", 1))


def test_random_bytes_never_raise():
    rng = random.Random(3)
    protocol = proto.DatagramProtocol()
    protocol.request(("h", 1), "ping", [NODE_ID])
    for _ in range(3000):
        length = rng.choice([0, 1, 21, 22, 30, 200, 2000])
        data = bytes(rng.getrandbits(8) for _ in range(length))
        if data and rng.random() < 0.5:
            data = bytes([rng.choice([0, 1])]) + data[1:]
        event = protocol.receive(data, ("h", 1))
        assert isinstance(event, (proto.Request, proto.Reply, proto.Dropped))


def test_huge_find_node_answers_are_cut_to_k_and_bad_entries_skipped():
    contacts = [[bytes([i % 256]) * 20, "127.0.0.1", 1000 + i] for i in range(5000)]
    contacts.insert(0, [b"bad", "127.0.0.1", 1])
    contacts.insert(1, [NODE_ID, "127.0.0.1", 70000])
    contacts.insert(2, ["not bytes", 1, 2])
    parsed = proto.parse_contacts(proto.unpack(proto.pack(contacts)), limit=20)
    assert len(parsed) == 20
    assert parsed[0] == (b"\x00" * 20, "127.0.0.1", 1000)
    assert proto.parse_contacts({"value": 1}, limit=20) is None


def test_our_msg_ids_tell_swarmd_senders_and_clients_apart_and_stock_ids_do_not():
    server = proto.DatagramProtocol(flags=0)
    client = proto.DatagramProtocol(flags=proto.FLAG_CLIENT)
    stock = proto.DatagramProtocol()  # plain rpcudp ids: sha1 of random bytes
    server_id, _ = server.request(("h", 1), "ping", [NODE_ID])
    client_id, _ = client.request(("h", 1), "ping", [NODE_ID])
    assert proto.swarmd_flags(server_id) == 0
    assert proto.swarmd_flags(client_id) == proto.FLAG_CLIENT
    assert all(proto.swarmd_flags(stock.request(("h", 1), "ping", [NODE_ID])[0]) is None for _ in range(1000))
    assert len({server.request(("h", 1), "ping", [NODE_ID])[0] for _ in range(1000)}) == 1000


def test_batches_fit_the_request_cap_and_set_aside_what_cannot():
    items = [(bytes([i]) * 20, b"v" * 3000) for i in range(5)] + [(b"\xff" * 20, b"w" * 8150)]
    groups, oversized = proto.batches("swarmd_store_find", items)
    assert oversized == [b"\xff" * 20]
    assert sum(len(g) for g in groups) == 5
    for group in groups:
        proto.encode_request(MSG_ID, "swarmd_store_find", [NODE_ID, group])  # never RequestTooLarge


def test_store_items_accept_only_the_offer_mark_as_third_element():
    assert proto.check_request_args("swarmd_store_many", [NODE_ID, [[KEY, b"v"], [KEY, 1, proto.OFFER]]])
    assert not proto.check_request_args("swarmd_store_many", [NODE_ID, [[KEY, b"v", "overwrite"]]])
    assert not proto.check_request_args("swarmd_store_find", [NODE_ID, [[KEY, [1]]]])
    assert not proto.check_request_args("swarmd_store_find", [NODE_ID, [[KEY, 1]] * (proto.MAX_BATCH_KEYS + 1)])
