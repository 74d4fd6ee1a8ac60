"""Storage: deadlines for every record (stock values included), per-IP and per-prefix shares, fair eviction,
the byte bound, and the cost of each operation counted structurally (heap entries touched, full scans of the
records made impossible to miss), never timed."""

from __future__ import annotations

import hashlib
import math
import random

import pytest
import trio

from dht import records
from dht.storage import LOCAL, RECORD_OVERHEAD, Sender, Storage


def key(name: object) -> bytes:
    return hashlib.sha1(repr(name).encode()).digest()


def stock(value: object) -> records.Record:
    """A plain value as a stock kademlia node stores it (never expires on the wire)."""
    return records.decode(b"\x00" * 20, value, 0.0)


def expiring(key_id: bytes, value: object, expiration: float) -> records.Record:
    return records.record_for_store(key_id, value, expiration)


def sender(ip: str, prefix: int = 0, rest: bytes = b"\x11" * 19) -> Sender:
    return Sender.remote(ip, bytes([prefix]) + rest)


class ScanDetector(dict):
    """The records dict, failing the test if anything iterates over it (a full scan)."""

    def __iter__(self):
        raise AssertionError("a storage operation scanned every record")

    def keys(self):
        raise AssertionError("a storage operation scanned every record")

    def values(self):
        raise AssertionError("a storage operation scanned every record")

    def items(self):
        raise AssertionError("a storage operation scanned every record")


def no_scans(storage: Storage) -> Storage:
    storage._items = ScanDetector(storage._items)
    return storage


def fill_from(storage: Storage, who: Sender, count: int, now: float = 0.0, tag: str = "flood") -> list[bytes]:
    keys = []
    for i in range(count):
        key_id = key((tag, i))
        assert storage.store(key_id, stock(i), now, now, who) == "accepted"
        keys.append(key_id)
    return keys


# ------------------------------------------------------------------------------------------------ deadlines


def test_stock_value_gets_the_default_ttl_and_each_store_renews_it():
    storage = Storage(100, stock_ttl=100.0)
    k = key("stock")
    assert storage.store(k, stock("v1"), 0.0, 0.0, sender("10.0.0.1")) == "accepted"
    assert storage.get(k, 99.0).record.value == "v1"
    assert storage.store(k, stock("v2"), 50.0, 50.0, sender("10.0.0.2")) == "accepted"  # stock republish
    assert storage.get(k, 149.0).record.value == "v2"
    assert storage.expire(149.0) == 0
    assert storage.expire(150.0) == 1
    assert storage.get(k, 150.0) is None and len(storage) == 0


def test_an_expiring_record_keeps_its_own_deadline_and_a_later_one_moves_it():
    storage = Storage(100, stock_ttl=1e9)
    k = key("swarmd")
    assert storage.store(k, expiring(k, "a", 30.0), 0.0, 0.0) == "accepted"
    assert storage.store(k, expiring(k, "b", 60.0), 10.0, 10.0) == "accepted"
    assert storage.expire(59.0) == 0 and storage.get(k, 59.0).record.value == "b"
    assert storage.expire(60.0) == 1 and len(storage) == 0


def test_a_swarmd_record_replacing_a_stock_value_brings_its_earlier_deadline():
    storage = Storage(100, stock_ttl=1000.0)
    k = key("mixed")
    storage.store(k, stock("plain"), 0.0, 0.0)
    assert storage.store(k, expiring(k, "record", 20.0), 1.0, 1.0) == "accepted"  # the swarmd record wins
    assert storage.expire(20.0) == 1  # not kept until 1000 s
    assert len(storage) == 0


def test_expire_touches_only_what_is_due():
    storage = no_scans(Storage(10_000))
    for i in range(5000):
        k = key(i)
        storage.store(k, expiring(k, i, 100.0 + i), 0.0, 0.0)
    work = storage.work
    assert storage.expire(110.0) == 11
    assert storage.work - work <= 12  # the 11 due entries and one look at the next: not 5000


# ------------------------------------------------------------------------------------------------ work per request


@pytest.mark.parametrize("held", [500, 8000])
def test_store_at_capacity_is_amortized_constant_heap_work_without_scans(held):
    """A flooder fills the store; then honest new keys (each evicting one flooder record) and more flood (each
    refused) arrive. The heap work per store stays the same whatever the store holds."""
    storage = Storage(held, 10**12)
    flooder = sender("10.0.0.66", 0x42)
    fill_from(storage, flooder, held)
    no_scans(storage)
    work = storage.work
    for i in range(1000):
        assert storage.store(key(("more", i)), stock(i), 0.5, 0.5, flooder) == "full"
    assert storage.work == work  # a refused flood datagram costs no heap work at all
    rng = random.Random(held)
    stores = 3 * held  # enough evictions for the heap rebuilds to have happened and be paid for
    for i in range(stores):
        honest = sender(f"10.1.{i % 250}.{i // 250 % 250}", rng.randrange(256), rng.randbytes(19))
        assert storage.store(key(("honest", i)), stock(i), 1.0, 1.0, honest) == "accepted"
    per_store = (storage.work - work) / stores
    assert per_store <= 12, per_store
    work = storage.work
    for i in range(1000):
        storage.get(key(("honest", stores - 1 - i)), 3.0)
    assert storage.work == work
    assert len(storage) == held


def test_heaps_stay_bounded_by_the_live_records_under_churn():
    storage = Storage(200, 10**12, stock_ttl=5.0)
    for i in range(20_000):
        now = i * 0.01
        storage.store(key(i % 700), stock(i), now, now, sender(f"10.0.{i % 7}.1", i % 256))
    assert len(storage._heap) <= 2 * len(storage) + 64
    for account in storage._accounts.values():
        assert account.records > 0 and len(account.heap) <= 2 * account.records + 64


# ------------------------------------------------------------------------------------------------ shares


def test_per_ip_share_lets_honest_new_keys_in_past_a_flooder_that_filled_the_store():
    storage = Storage(100, 10**12)
    flooder_ip = "10.0.0.66"
    for i in range(100):  # many ports and ids from one IP: still one account (Sender.remote sees the host only)
        storage.store(key(("flood", i)), stock(i), 0.0, 0.0, sender(flooder_ip, i % 256, bytes([i]) * 19))
    assert len(storage) == 100
    assert storage.store(key("flood-more"), stock(0), 0.0, 0.0, sender(flooder_ip, 7)) == "full"
    honest = sender("10.0.0.2", 0x99)
    for i in range(8):
        assert storage.store(key(("honest", i)), stock(i), 1.0, 1.0, honest) == "accepted"
    assert len(storage) == 100
    assert storage.account_usage(sender(flooder_ip))[0][0] == 92
    assert storage.account_usage(honest)[0][0] == 8
    # ten honest hosts taking their share each push the flooder down to about its own share
    for host in range(10):
        for i in range(10):
            assert storage.store(key(("h", host, i)), stock(i), 2.0, 2.0, sender(f"10.2.0.{host}", 0x80 + host)) \
                == "accepted"
    assert storage.account_usage(sender(flooder_ip))[0][0] <= 10
    for i in range(50):  # back at its share, the flooder's new keys only take the room of its own old ones
        storage.store(key(("flood-again", i)), stock(i), 3.0, 3.0, sender(flooder_ip, 9))
        assert storage.account_usage(sender(flooder_ip))[0][0] <= 10
    honest_records = sum(storage.get(key(("h", host, i)), 3.0) is not None for host in range(10) for i in range(10))
    assert honest_records + storage.account_usage(sender(flooder_ip))[0][0] >= 98


def test_per_prefix_share_bounds_a_flooder_that_varies_its_address():
    storage = Storage(100, 10**12)
    for i in range(100):  # a new source IP for every store, the same id
        storage.store(key(("flood", i)), stock(i), 0.0, 0.0, sender(f"10.9.{i}.1", 0xAB))
    prefix_usage = storage.account_usage(sender("10.9.0.1", 0xAB))[1]
    # another new address with that id: the prefix is at its share, so the key replaces the prefix's
    # soonest-expiring record (a prefix is never refused: 1/256 of honest peers share it) and cannot grow it
    assert storage.store(key("x"), stock(0), 1.0, 1.0, sender("10.9.200.1", 0xAB)) == "accepted"
    assert key(("flood", 0)) not in storage._items
    assert storage.account_usage(sender("10.9.0.1", 0xAB))[1] == prefix_usage
    honest = sender("10.0.0.2", 0x01)
    assert storage.store(key("honest"), stock(1), 1.0, 1.0, honest) == "accepted"
    assert storage.account_usage(sender("10.9.0.1", 0xAB))[1][0] == 99
    assert storage.account_usage(honest)[1][0] == 1


def test_ipv6_hosts_share_one_account_per_64_block():
    a = Sender.remote("2001:db8:1:2::1", b"\x01" * 20)
    b = Sender.remote("2001:db8:1:2:ffff::9", b"\x01" * 20)
    c = Sender.remote("2001:db8:1:3::1", b"\x01" * 20)
    assert a.accounts[0] == b.accounts[0] != c.accounts[0]
    assert Sender.remote("::ffff:10.0.0.1", b"\x01" * 20).accounts[0] == ("ip", "10.0.0.1")


def test_local_stores_count_but_an_honest_sender_under_its_share_still_gets_in():
    storage = Storage(50, 10**12)
    fill_from(storage, LOCAL, 50, tag="mine")
    assert storage.store(key("mine-more"), stock(0), 0.0, 0.0, LOCAL) == "full"
    assert storage.store(key("theirs"), stock(0), 0.0, 0.0, sender("10.0.0.2", 3)) == "accepted"
    assert storage.account_usage(LOCAL) == [(49, 49 * storage._items[key("theirs")].size)]


def test_updates_of_held_keys_are_not_refused_at_the_cap():
    storage = Storage(10, 10**12)
    flooder = sender("10.0.0.66")
    keys = fill_from(storage, flooder, 10)
    assert storage.store(keys[0], stock("new value"), 1.0, 1.0, flooder) == "accepted"
    assert storage.get(keys[0], 1.0).record.value == "new value"


# ------------------------------------------------------------------------------------------------ eviction order


def test_eviction_takes_the_soonest_expiring_record_of_the_account_furthest_over_its_share():
    storage = Storage(20, 10**12, ip_share=0.25, prefix_share=1.0)
    big, small = sender("10.0.0.1", 1), sender("10.0.0.2", 2)
    big_keys = [key(("big", i)) for i in range(12)]
    expirations = [500.0 + 37 * i % 120 for i in range(12)]  # shuffled deadlines
    for k, expiration in zip(big_keys, expirations):
        storage.store(k, expiring(k, "b", expiration), 0.0, 0.0, big)
    small_keys = [key(("small", i)) for i in range(8)]  # over its share of 5, but less so than `big`
    for i, k in enumerate(small_keys):
        storage.store(k, expiring(k, "s", 100.0 + i), 0.0, 0.0, small)
    honest = sender("10.0.0.3", 3)
    evicted = []
    for i in range(7):
        storage.store(key(("honest", i)), stock(i), 1.0, 1.0, honest)
        evicted.extend(k for k in big_keys + small_keys if k not in storage._items and k not in evicted)
    by_deadline = sorted(zip(expirations, big_keys))
    # `big` (12 of 20, share 5) loses its soonest-expiring records until it is no further over than `small`
    # (8 of 20); from then on the one further over loses one, soonest first (`small`'s deadlines are earlier)
    assert evicted[:4] == [k for _, k in by_deadline[:4]]
    assert set(evicted[4:]) <= {k for _, k in by_deadline[4:6]} | set(small_keys[:3])
    assert storage.account_usage(big)[0][0] <= 8 and storage.account_usage(small)[0][0] <= 8


def test_when_nobody_is_over_its_share_the_soonest_expiring_record_goes():
    storage = Storage(10, 10**12, ip_share=1.0, prefix_share=1.0)
    for i in range(10):
        k = key(i)
        storage.store(k, expiring(k, i, 1000.0 - i), 0.0, 0.0, sender(f"10.0.0.{i}", i))
    assert storage.store(key("new"), stock("n"), 1.0, 1.0, sender("10.0.1.1", 99)) == "accepted"
    assert key(9) not in storage._items  # expiring at 991, the soonest
    assert all(key(i) in storage._items for i in range(9))


def test_expired_records_make_room_before_anyone_is_evicted():
    storage = Storage(10, 10**12)
    flooder = sender("10.0.0.66")
    for i in range(10):
        k = key(i)
        storage.store(k, expiring(k, i, 10.0 if i < 3 else 1e6), 0.0, 0.0, flooder)
    honest = sender("10.0.0.2")
    for i in range(3):
        assert storage.store(key(("h", i)), stock(i), 11.0, 11.0, honest) == "accepted"
    assert storage.evicted == 0 and storage.expired == 3


# ------------------------------------------------------------------------------------------------ bytes


def test_bytes_are_bounded_and_a_flooder_of_big_values_cannot_keep_honest_keys_out():
    max_bytes = 200_000
    storage = Storage(10_000, max_bytes)
    flooder = sender("10.0.0.66")
    big = b"x" * 8000
    refused = 0
    for i in range(100):
        outcome = storage.store(key(("big", i)), stock(big + bytes([i])), 0.0, 0.0, flooder)
        refused += outcome == "full"
        assert storage.bytes <= max_bytes
    assert refused > 70 and storage.stats()["bytes_held"] == storage.bytes
    for i in range(40):  # 4 hosts, each well under its share of 20,000 bytes
        honest = sender(f"10.0.1.{i % 4}", i % 4)
        assert storage.store(key(("small", i)), stock(i), 1.0, 1.0, honest) == "accepted"
        assert storage.bytes <= max_bytes
    assert len(storage) >= 40
    size = storage._items[key(("small", 0))].size
    assert size >= RECORD_OVERHEAD + 20


def test_a_growing_record_is_charged_its_new_size():
    storage = Storage(100, 10**12)
    k = key("grid")
    storage.store(k, records.record_for_store(k, "a", 100.0, subkey="s1"), 0.0, 0.0)
    before = storage.bytes
    storage.store(k, records.record_for_store(k, "b" * 1000, 100.0, subkey="s2"), 0.0, 0.0)
    assert storage.bytes - before >= 1000
    assert storage.bytes == sum(item.size for item in dict.values(storage._items))
    storage.get(k, 0.0)
    assert math.isclose(storage.account_usage(LOCAL)[0][1], storage.bytes)


# ------------------------------------------------------------------------------------------------ in a node


async def test_a_node_renews_a_stock_ttl_on_stores_but_not_on_its_own_republishing(autojump_clock):
    from dht import DHTConfig, DHTNode
    from peer.p2p.net import MemoryNetwork

    network = MemoryNetwork(latency=0.001)
    config = DHTConfig(stock_ttl=100.0)
    async with DHTNode.open("solo", 0, network=network.host("solo"), clock=trio.current_time, config=config) as node:
        start = node.now()
        assert await node.store("kept", "v", math.inf) and await node.store("dropped", "v", math.inf)
        await trio.sleep(60)
        assert await node.republish(force=True) == 2  # re-offers both: renews neither
        assert await node.store("kept", "v2", math.inf)  # a store does renew
        await trio.sleep(start + 101 - node.now())
        assert node.local_record("dropped") is None
        assert node.local_record("kept").value == "v2"
        await trio.sleep(start + 161 - node.now())
        assert node.local_record("kept") is None
        assert node.stats()["storage"]["records_held"] == 0
