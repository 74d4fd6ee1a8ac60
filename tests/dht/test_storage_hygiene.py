"""Issue 40's DHT findings against a storing node: 8 KiB junk entries from 10 identities under a training key do
not push out the small signed entries honest peers refresh, and expirations are clamped on the storer's clock."""

from __future__ import annotations

import random

from dht import records
from dht.records import Record
from dht.storage import Sender, Storage
from peer.p2p.identity import Identity

KEY = b"k" * 20
NOW = 1_000_000.0


def entry_of(identity: Identity, value: object, expiration: float) -> tuple[bytes, records.Entry]:
    subkey = bytes(identity.peer_id)
    return subkey, records.make_entry(KEY, subkey, value, expiration, identity)


def test_junk_from_ten_identities_does_not_evict_honest_entries_under_a_training_key():
    honest = [Identity.generate() for _ in range(8)]
    attackers = [Identity.generate() for _ in range(10)]
    stores: list[tuple[bytes, records.Entry]] = []
    for identity in honest:  # small progress-like entries, refreshed every few seconds
        stores.append(entry_of(identity, {"step": 12, "samples": 4096}, NOW + 30))
    for identity in attackers:  # 8 KiB junk, claiming to live for ten years
        stores.append(entry_of(identity, b"\0" * 8000, NOW + 10 * 365 * 86400))
    random.Random(3).shuffle(stores)
    storage = Storage(1000)
    for subkey, entry in stores:
        storage.store(KEY, Record(None, {subkey: entry}), NOW, NOW, Sender.remote("10.0.0.9", subkey))
    held = storage.get(KEY, NOW)
    assert held is not None
    owners = {entry.owner for entry in held.record.subkeys.values()}
    assert {identity.public_key for identity in honest} <= owners
    assert all(len(records.pack(entry.value)) < 100 for entry in held.record.subkeys.values())


def test_a_far_future_expiration_is_clamped_on_the_storers_clock():
    storage = Storage(1000, max_ttl=3600.0)
    attacker = Identity.generate()
    subkey, entry = entry_of(attacker, b"junk", NOW + 10 * 365 * 86400)
    assert storage.store(KEY, Record(None, {subkey: entry}), NOW, NOW) == "accepted"
    held = storage.get(KEY, NOW)
    assert held is not None and held.deadline == NOW + 3600.0
    assert storage.get(KEY, NOW + 3600.0) is None  # nobody stored it again within max_ttl: gone here
