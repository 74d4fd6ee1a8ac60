"""Record merge rules: newer wins, expiry, subkeys, owners; and the envelope survives hostile bytes."""

from __future__ import annotations

import math

import pytest

from dht import records
from dht.errors import ValueTooLarge
from dht.records import MAGIC, Entry, Record, choose, decode, encode, merge, record_for_store
from peer.p2p.identity import Identity

KEY = b"\x11" * 20
OTHER_KEY = b"\x22" * 20
NOW = 1000.0
OWNER = Identity.from_seed(b"owner")
INTRUDER = Identity.from_seed(b"intruder")


def stored(key_id, value, expiration, subkey=None, identity=None):
    """The record as a replica sees it after the wire round trip."""
    return decode(key_id, encode(record_for_store(key_id, value, expiration, subkey, identity)), NOW)


def test_later_expiration_wins_in_either_order():
    old, new = stored(KEY, "old", NOW + 10), stored(KEY, "new", NOW + 20)
    assert merge(old, new, NOW).value == "new"
    assert merge(new, old, NOW).value == "new"


def test_expired_entries_vanish():
    record = stored(KEY, "v", NOW + 5)
    assert merge(record, None, NOW + 5) is None
    assert decode(KEY, encode(record), NOW + 6) is None
    live = merge(record, stored(KEY, "w", NOW + 50, subkey="a"), NOW + 10)
    assert live.value is None and list(live.subkeys) == ["a"]


def test_subkeys_merge_independently():
    a = stored(KEY, 1, NOW + 10, subkey="a")
    b = stored(KEY, 2, NOW + 20, subkey=7)
    a_newer = stored(KEY, 3, NOW + 30, subkey="a")
    merged = merge(merge(a, b, NOW), a_newer, NOW)
    assert {k: e.value for k, e in merged.subkeys.items()} == {"a": 3, 7: 2}
    assert merged.value is None
    assert merged.expiration_time == NOW + 30
    round_trip = decode(KEY, encode(merged), NOW)
    assert round_trip == merged


def test_non_owner_cannot_overwrite_signed_entry_even_with_later_expiration():
    owned = stored(KEY, "mine", NOW + 10, identity=OWNER)
    unsigned_attack = stored(KEY, "yours", NOW + 1000)
    signed_attack = stored(KEY, "yours", NOW + 1000, identity=INTRUDER)
    assert merge(owned, unsigned_attack, NOW).value == "mine"
    assert merge(owned, signed_attack, NOW).value == "mine"
    assert merge(owned, stored(KEY, "mine v2", NOW + 20, identity=OWNER), NOW).value == "mine v2"


def test_owned_subkey_is_protected_while_other_subkeys_stay_open():
    owned = stored(KEY, "expert@host1", NOW + 60, subkey="17", identity=OWNER)
    attack = stored(KEY, "expert@evil", NOW + 600, subkey="17")
    neighbour = stored(KEY, "expert@host2", NOW + 60, subkey="18")
    merged = merge(merge(owned, attack, NOW), neighbour, NOW)
    assert merged.subkeys["17"].value == "expert@host1"
    assert merged.subkeys["17"].owner == OWNER.public_key
    assert merged.subkeys["18"].value == "expert@host2"


def test_signature_binds_key_subkey_value_and_expiration():
    record = record_for_store(KEY, "v", NOW + 10, "sub", OWNER)
    entry = record.subkeys["sub"]
    for key_id, subkey, forged in [
        (OTHER_KEY, "sub", entry),  # replayed under another key
        (KEY, "other", entry),  # under another subkey
        (KEY, "sub", Entry("w", entry.expiration_time, entry.owner, entry.signature)),  # value changed
        (KEY, "sub", Entry("v", NOW + 99, entry.owner, entry.signature)),  # kept alive longer
    ]:
        assert decode(key_id, encode(Record(None, {subkey: forged})), NOW) is None
    assert decode(KEY, encode(record), NOW) == record


def test_signed_entry_can_expire_and_then_be_claimed():
    owned = stored(KEY, "mine", NOW + 10, identity=OWNER)
    later = stored(KEY, "next", NOW + 100)
    assert merge(owned, later, NOW + 11).value == "next"


def test_equal_expiration_incoming_wins():
    assert choose(Entry("a", NOW + 1), Entry("b", NOW + 1), NOW).value == "b"


@pytest.mark.parametrize("value", [7, 2.5, True, "text", b"raw bytes"])
def test_plain_stock_values_read_as_never_expiring_records(value):
    record = decode(KEY, value, NOW)
    assert record.value == value and record.expiration_time == math.inf and record.subkeys == {}
    assert encode(record) == value  # and written back unchanged, so stock readers see their value


def test_infinite_unsigned_store_is_a_plain_value():
    assert encode(record_for_store(KEY, "hello", math.inf)) == "hello"
    assert isinstance(encode(record_for_store(KEY, "hello", NOW + 1)), bytes)
    assert encode(record_for_store(KEY, "hello", NOW + 1)).startswith(MAGIC)
    # bytes that look like an envelope are wrapped, never stored bare (they would be misread)
    tricky = record_for_store(KEY, MAGIC + b"junk", math.inf)
    assert decode(KEY, encode(tricky), NOW).value == MAGIC + b"junk"


@pytest.mark.parametrize(
    "stored_value",
    [
        [1, 2, 3],  # unhashable, from a stock peer
        {"a": 1},
        None,
        MAGIC,
        MAGIC + b"\xc1",
        MAGIC + records.pack([None]),
        MAGIC + records.pack([["v", "not a time", None, None], {}]),
        MAGIC + records.pack([["v", float("nan"), None, None], {}]),
        MAGIC + records.pack([None, {True: ["v", NOW + 1, None, None]}]),
        MAGIC + records.pack([None, {"s": ["v", NOW + 1, b"short", b"sig"]}]),
        MAGIC + records.pack([["v", NOW + 1, OWNER.public_key, None], {}]),  # owner without signature
        MAGIC + records.pack([None, {}]),  # nothing in it
    ],
)
def test_hostile_or_empty_values_decode_to_none(stored_value):
    assert decode(KEY, stored_value, NOW) is None


def test_value_size_limit():
    record_for_store(KEY, b"x" * 8000, NOW + 1)
    with pytest.raises(ValueTooLarge) as info:
        record_for_store(KEY, b"x" * 8200, NOW + 1)
    assert info.value.operation == "store" and info.value.limit == records.MAX_RECORD_BYTES


def test_record_that_outgrows_a_datagram_keeps_its_freshest_subkeys():
    record = None
    for index in range(100):
        record = merge(record, stored(KEY, b"y" * 200, NOW + index, subkey=index), NOW)
    fitted = records.fit(record)
    assert records.encoded_size(encode(fitted)) <= records.MAX_RECORD_BYTES
    kept = sorted(fitted.subkeys)
    assert 10 < len(kept) < 100
    assert kept == list(range(100 - len(kept), 100))  # the soonest-expiring ones were dropped


def test_swarmd_record_beats_a_bare_stock_value_in_either_order():
    ours = stored(KEY, "ours", NOW + 10)
    bare = decode(KEY, b"a stock write or a lie", NOW)
    assert bare.stock
    assert merge(ours, bare, NOW).value == "ours"
    assert merge(bare, ours, NOW).value == "ours"
    assert merge(bare, decode(KEY, "newer stock write", NOW), NOW).value == "newer stock write"
    ours_plain = record_for_store(KEY, 5, math.inf)
    assert ours_plain.stock and merge(None, ours_plain, NOW).stock
