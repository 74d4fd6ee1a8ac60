"""The DHT's sans-I/O cores (dht/server.py, dht/policy.py) driven directly: requests in, replies and plans out,
no trio, no sockets, time passed as numbers. Seeded randomness throughout."""

from __future__ import annotations

import random
from collections import Counter

from kademlia.node import Node

from dht import protocol as proto
from dht import records
from dht.lookup import State, Target
from dht.peers import PeerBook
from dht.policy import WELCOME_PER_PASS, Contacts, IPRequestLimit, WelcomeQueue, repair_gifts, welcome_gifts
from dht.routing import RoutingTable
from dht.server import MAX_REPLY_BYTES, NO_REPLY, Server
from dht.storage import LOCAL, Storage

K = 20
SELF_ID = bytes(20)  # the node under test sits at id 0: distances to it are the ids themselves


def make_server(*, client_mode: bool = False, max_verifications: int = 256, peer_id: bytes = SELF_ID,
                max_records: int = 1000) -> Server:
    table = RoutingTable(peer_id, K, 0.0)
    peers = PeerBook(min_timeout=0.01, max_timeout=2.0, initial_timeout=1.0, rate=500, burst=1000)
    storage = Storage(max_records)
    dropped: Counter[str] = Counter()
    contacts = Contacts(peer_id, table, peers, client_mode=client_mode, head_check_after=60.0,
                        max_verifications=max_verifications, verify_backoff=6.0, dropped=dropped)
    return Server(peer_id, client_mode=client_mode, k=K, table=table, peers=peers, storage=storage,
                  contacts=contacts, dropped=dropped)


def request(name: str, args: list, address: tuple[str, int], flags: int | None = 0,
            rng: random.Random | None = None) -> proto.Request:
    rng = rng or random.Random(0)
    msg_id = proto.new_msg_id(lambda n: rng.randbytes(n), flags)
    return proto.Request(msg_id, name, args, address)


def node_id(n: int) -> bytes:
    return n.to_bytes(20, "big")


def test_a_new_sender_is_answered_and_pinged_back_but_enters_the_table_only_once_it_answers():
    server = make_server()
    sender, address = node_id(5), ("10.0.0.5", 4000)
    outcome = server.handle(request("ping", [sender], address), now=100.0, local_now=1.0)
    assert outcome.reply == SELF_ID
    assert outcome.verify == address
    assert sender not in server.table
    admission = server.contacts.answered(sender, address, 1.1)  # the ping back came from there, naming it
    server.contacts.verification_done(address, True, 1.1)
    assert sender in server.table
    assert admission.welcome is not None and admission.welcome.id == sender
    again = server.handle(request("ping", [sender], address), now=100.0, local_now=2.0)
    assert again.verify is None  # a contact the table holds at that address is only refreshed


def test_a_flood_of_made_up_ids_never_reaches_the_table_or_find_node_replies():
    server = make_server(max_records=10_000)
    rng = random.Random(7)
    honest, honest_address = node_id(1 << 150), ("10.0.0.9", 5000)
    server.handle(request("ping", [honest], honest_address), 100.0, 0.0)
    server.contacts.answered(honest, honest_address, 0.0)
    server.contacts.verification_done(honest_address, True, 0.0)
    verifications: list[tuple[str, int]] = []
    for i in range(5000):
        address = ("127.0.0.1", 40000 + i % 64)
        fake = rng.randbytes(20)
        outcome = server.handle(request("store", [fake, rng.randbytes(20), i], address, flags=None, rng=rng),
                                100.0, 1.0 + i / 2500)
        assert outcome.reply is True
        if outcome.verify is not None:
            verifications.append(outcome.verify)
    # one ping back per flooding address while it is pending (capped per IP), nothing more
    assert len(verifications) == len(set(verifications)) <= server.contacts.max_verifications_per_ip
    assert server.table.nodes() == [server.table.get(honest)]
    reply = server.handle(request("find_node", [node_id(77), rng.randbytes(20)], ("10.0.0.10", 1)), 100.0, 3.0)
    assert reply.reply == [[honest, "10.0.0.9", 5000]]  # never a made-up contact
    # nobody answered the pings: those addresses are left alone for a while, whatever they send
    for address in verifications:
        server.contacts.verification_done(address, False, 3.0)
    retried = server.handle(request("ping", [rng.randbytes(20)], verifications[0]), 100.0, 4.0)
    assert retried.verify is None
    later = server.handle(request("ping", [rng.randbytes(20)], verifications[0]), 100.0, 3.0 + 6.1)
    assert later.verify == verifications[0]


def test_verifications_are_capped_in_all_and_per_ip():
    server = make_server(max_verifications=8)
    planned = [server.handle(request("ping", [node_id(i + 1)], (f"10.0.{i % 4}.1", 1000 + i)), 0.0, 0.0).verify
               for i in range(40)]
    started = [address for address in planned if address is not None]
    assert len(started) == 8
    assert max(Counter(ip for ip, _ in started).values()) <= 2
    assert server.dropped["verification_skipped"] == 32


def test_a_restarted_node_at_a_known_address_replaces_its_old_id_only_after_answering():
    server = make_server()
    address = ("10.0.0.3", 7000)
    server.handle(request("ping", [node_id(3)], address), 0.0, 0.0)
    server.contacts.answered(node_id(3), address, 0.0)
    server.contacts.verification_done(address, True, 0.0)
    claimed = server.handle(request("ping", [node_id(4)], address), 0.0, 1.0)
    assert claimed.verify == address and node_id(3) in server.table  # a claim alone removes nobody
    server.contacts.answered(node_id(4), address, 1.1)
    assert node_id(4) in server.table and node_id(3) not in server.table


def test_a_full_bucket_asks_for_a_check_of_its_silent_head():
    server = make_server(peer_id=node_id(1))
    far = [(1 << 159) + i for i in range(K + 1)]  # all in the bucket that does not hold our id
    for i, long_id in enumerate(far[:K]):
        assert server.contacts.answered(node_id(long_id), ("10.1.0.1", 2000 + i), 0.0).check_head is None
    server.table.add(Node(node_id(1 << 100), "10.2.0.1", 1), 0.0)  # split until the far bucket is full
    admission = server.contacts.answered(node_id(far[K]), ("10.1.0.1", 9999), 100.0)
    if admission.check_head is None:  # the far half may have split once more; then it had room
        assert node_id(far[K]) in server.table
    else:
        assert admission.check_head.id in {node_id(long_id) for long_id in far[:K]}
        again = server.contacts.answered(node_id(far[K]), ("10.1.0.1", 9999), 100.0)
        assert again.check_head is None  # one check per head at a time
        server.contacts.head_check_done(admission.check_head.id)


def test_clients_are_never_pinged_back_and_a_client_node_answers_only_hello_and_stun():
    server = make_server()
    outcome = server.handle(request("ping", [node_id(9)], ("10.0.0.2", 1), flags=proto.FLAG_CLIENT), 0.0, 0.0)
    assert outcome.reply == SELF_ID and outcome.verify is None
    client = make_server(client_mode=True)
    assert client.handle(request("ping", [node_id(9)], ("10.0.0.2", 1)), 0.0, 0.0).reply is NO_REPLY
    assert client.dropped["client_mode"] == 1
    hello = client.handle(request("swarmd_hello", [node_id(9), {"client": False}], ("10.0.0.2", 1)), 0.0, 0.0)
    assert hello.reply == {"id": SELF_ID, "client": True, "version": 1} and hello.verify is None
    assert client.handle(request("stun", [], ("10.0.0.2", 1)), 0.0, 0.0).reply == ["10.0.0.2", 1]


def test_store_then_find_value_and_offers_only_fill_gaps():
    server = make_server()
    sender, address, key = node_id(2), ("10.0.0.2", 1), node_id(99)
    stored = server.handle(request("store", [sender, key, "v1"], address, flags=None), 50.0, 0.0)
    assert stored.reply is True and stored.stored == [key]
    assert server.handle(request("find_value", [sender, key], address), 50.0, 0.0).reply == {"value": "v1"}
    offered = server.handle(request("swarmd_store_many", [sender, [[key, "old", proto.OFFER]]], address),
                            50.0, 0.0)
    assert offered.reply == [True] and offered.stored == []
    assert server.handle(request("find_value", [sender, key], address), 50.0, 0.0).reply == {"value": "v1"}
    missing = server.handle(request("find_value", [sender, node_id(98)], address), 50.0, 0.0)
    assert isinstance(missing.reply, list)  # contacts instead of a value


def test_find_many_leaves_out_answers_that_would_overflow_one_datagram():
    server = make_server()
    sender, address = node_id(2), ("10.0.0.2", 1)
    big = b"x" * 7000
    keys = [node_id(1000 + i) for i in range(12)]
    for key in keys:
        server.storage.store(key, records.decode(key, big, 0.0), 0.0, 0.0, LOCAL)
    reply = server.handle(request("swarmd_find_many", [sender, keys], address), 0.0, 0.0).reply
    assert len(reply) == len(keys)
    assert sum(len(proto.pack(answer)) for answer in reply if answer is not None) <= MAX_REPLY_BYTES
    assert reply[0] == {"value": big} and reply[-1] is None


def test_welcome_queue_batches_paces_and_bounds_newcomers():
    queue = WelcomeQueue(batch_delay=0.05, min_interval=1.0, per_pass=2, limit=3)
    nodes = [Node(node_id(i + 1), "10.0.0.1", i + 1) for i in range(4)]
    assert queue.add(nodes[0], 0.0) == "schedule"
    assert queue.add(nodes[1], 0.0) == "queued"
    assert queue.add(nodes[2], 0.0) == "queued"
    assert queue.add(nodes[3], 0.0) == "skipped"
    assert queue.pass_at(0.0) == 0.05
    batch, more = queue.take(0.05)
    assert [node.id for node, _ in batch] == [nodes[0].id, nodes[1].id] and more
    assert queue.pass_at(0.06) == 1.05  # at least min_interval after the last pass
    batch, more = queue.take(1.05)
    assert [node.id for node, _ in batch] == [nodes[2].id] and not more
    assert queue.add(nodes[3], 2.0) == "schedule"
    assert WELCOME_PER_PASS >= 1


def test_welcome_gifts_go_to_newcomers_closer_than_our_kth_contact_for_records_older_than_them():
    server = make_server()
    key = node_id(0b1000)
    old_key, new_key = key, node_id(0b1001)
    server.storage.store(old_key, records.decode(old_key, "old", 0.0), 0.0, 1.0, LOCAL)  # stored at t=1
    server.storage.store(new_key, records.decode(new_key, "new", 0.0), 0.0, 9.0, LOCAL)  # after the newcomer
    newcomer = Node(node_id(0b1010), "10.0.0.7", 7)
    server.table.add(newcomer, 5.0)
    far = Node(node_id(1 << 159), "10.0.0.8", 8)
    server.table.add(far, 5.0)
    gifts = welcome_gifts([(newcomer, 5.0)], server.storage, server.table, SELF_ID, K, 0.0)
    assert gifts.items == {(newcomer.id, ("10.0.0.7", 7)): [(old_key, "old")]}
    assert gifts.offers == {old_key}  # a plain value: it only fills a gap at the newcomer
    # a closer holder than us exists: it does the welcoming, not us
    elsewhere = make_server(peer_id=node_id(1 << 158))
    elsewhere.storage.store(old_key, records.decode(old_key, "old", 0.0), 0.0, 1.0, LOCAL)
    elsewhere.table.add(newcomer, 5.0)
    elsewhere.table.add(Node(node_id(0b1000 ^ 1), "10.0.0.9", 9), 5.0)
    assert not welcome_gifts([(newcomer, 5.0)], elsewhere.storage, elsewhere.table, node_id(1 << 158), K, 0.0)


def test_read_repair_sends_the_merged_record_to_close_replicas_that_lacked_it():
    key = node_id(42)
    target = Target(key, k=3, alpha=3, want_value=True)
    for n in (40, 41, 43, 44, 1 << 100):
        target.add(node_id(n), ("10.0.0.1", n % 60000 + 1))
    for n in (40, 41, 1 << 100):
        target.on_answer(node_id(n), [], None, False, SELF_ID)  # answered without the value
    target.on_answer(node_id(43), [], records.decode(key, "v", 0.0), True, SELF_ID)
    assert target.candidates[node_id(44)].state is State.NEW
    record = records.decode(key, "v", 0.0)
    gifts = repair_gifts({key: target}, [(key, record)], k=3, per_key=2)
    assert sorted(node for node, _ in gifts.items) == [node_id(40), node_id(41)]
    assert all(items == [(key, "v")] for items in gifts.items.values()) and gifts.offers == {key}
    assert not repair_gifts({key: target}, [(key, None)], k=3)


def test_read_repair_trims_a_merged_dictionary_that_outgrew_one_datagram():
    """64 peers' subkeys, merged from many replicas, exceed one store request: the gift is the trimmed record,
    so the background sender never meets a request it cannot encode (a CI failure with 64 averagers)."""
    key = node_id(42)
    target = Target(key, k=3, alpha=3, want_value=True)
    target.add(node_id(40), ("10.0.0.1", 40))
    target.on_answer(node_id(40), [], None, False, SELF_ID)
    big = records.Record(None, {f"peer{i}": records.Entry(b"x" * 200, 100.0) for i in range(64)})
    assert records.encoded_size(records.encode(big)) > records.MAX_RECORD_BYTES
    gifts = repair_gifts({key: target}, [(key, big)], k=3)
    [(_, wire)] = gifts.items[(node_id(40), ("10.0.0.1", 40))]
    assert records.encoded_size(wire) <= records.MAX_RECORD_BYTES
    proto.encode_request(b"\x00" * 20, "store", [SELF_ID, key, wire])  # fits: no RequestTooLarge


def test_ip_limit_refuses_one_ips_excess_and_refills_with_time():
    limit = IPRequestLimit(rate=100.0, burst=10.0, max_ips=2)
    assert all(limit.allow("10.0.0.1", 0.0) for _ in range(10))
    assert not limit.allow("10.0.0.1", 0.0)
    assert limit.allow("10.0.0.2", 0.0)  # another IP has its own budget
    assert limit.allow("10.0.0.1", 0.011)  # 1.1 tokens back after 11 ms
    assert not limit.allow("10.0.0.1", 0.011)
    assert limit.allow("10.0.0.3", 0.02) and len(limit) == 2  # bounded: the least recent IP is forgotten


def test_ip_limit_counts_an_ipv6_sender_per_64():
    limit = IPRequestLimit(rate=0.0, burst=2.0)
    assert limit.allow("2001:db8::1", 0.0) and limit.allow("2001:db8::2", 0.0)
    assert not limit.allow("2001:db8::ffff", 0.0)  # the same /64: one budget
    assert limit.allow("2001:db8:0:1::1", 0.0)
