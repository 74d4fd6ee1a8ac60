"""Issue 36, "anyone can write the swarm's directory and ban list", as attacks: a hostile peer signs entries under
subkeys naming other PeerIDs (or floods a key with far-future subkeys of its own), and every storing node refuses
or bounds them. In-memory network, MockClock."""

from __future__ import annotations

import random

import pytest
import trio

from dht import DHTNode, InvalidValue, records
from dht.node import key_id_of
from dht.records import MAX_RECORD_BYTES, MAX_SUBKEYS_PER_OWNER, Entry, Record, make_entry
from moe.bans import BANS_KEY
from peer.directory import PeerDirectory, list_peers, shard_key
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.status import read_expert_bans
from tests.dht.dht_swarm import forge_store, start_swarm


def _identity(name: str) -> Identity:
    return Identity.from_seed(name.encode().ljust(32, b"."))


# -------------------------------------------------------------------------------------------- pure rule


def test_a_peer_id_subkey_accepts_only_its_own_signature():
    victim, attacker = _identity("victim"), _identity("attacker")
    key_id = key_id_of("swarmd.peers.0")
    for subkey in (bytes(victim.peer_id), victim.peer_id.hex()):
        own = make_entry(key_id, subkey, ["h", 1, {}], 100.0, victim)
        forged = make_entry(key_id, subkey, ["evil", 1, {}], 100.0, attacker)
        unsigned = make_entry(key_id, subkey, ["evil", 1, {}], 100.0)
        assert records.entry_authentic(key_id, subkey, own)
        assert not records.entry_authentic(key_id, subkey, forged)
        assert not records.entry_authentic(key_id, subkey, unsigned)
        # the same bytes from the wire: the storing node's decode drops the whole forged record
        wire = records.encode(Record(None, {subkey: forged}))
        assert records.decode(key_id, wire, 0.0) is None
        assert records.decode(key_id, records.encode(Record(None, {subkey: own})), 0.0) is not None
    # subkeys that name no PeerID keep first-come ownership as before
    assert records.entry_authentic(key_id, 3, make_entry(key_id, 3, "x", 100.0, attacker))
    assert records.entry_authentic(key_id, "run-1", make_entry(key_id, "run-1", "x", 100.0))
    assert records.subkey_peer_id(victim.peer_id.hex().upper()) is None  # only the lowercase hex form


def test_a_signature_checked_once_is_not_checked_again_and_a_replay_over_other_bytes_still_is(monkeypatch):
    signer = _identity("signer")
    key_id = key_id_of("swarmd.matchmaking.run")
    entry = make_entry(key_id, "group", ["a", 1], 100.0, signer)
    checks = []
    real = records.verify_signature
    monkeypatch.setattr(records, "verify_signature", lambda *a: checks.append(a) or real(*a))
    monkeypatch.setattr(records, "VERIFIED", records.VerifiedSignatures(size=2))
    for _ in range(3):  # a reader polling the same key
        assert records.entry_authentic(key_id, "group", entry)
    assert len(checks) == 1
    for replay in (Entry(["b", 1], 100.0, entry.owner, entry.signature),  # the good signature over other bytes
                   Entry(entry.value, 101.0, entry.owner, entry.signature),
                   Entry(entry.value, 100.0, _identity("other").public_key, entry.signature)):
        assert not records.entry_authentic(key_id, "group", replay)
    assert not records.entry_authentic("other key".encode().ljust(20, b"\0"), "group", entry)
    assert len(checks) == 5
    for index in range(2):  # the oldest good signature is forgotten past `size`, and then checked again
        assert records.entry_authentic(key_id, index, make_entry(key_id, index, "x", 100.0, signer))
    assert records.entry_authentic(key_id, "group", entry) and len(checks) == 8


def test_the_client_refuses_to_send_what_every_replica_would_refuse():
    me, other = _identity("me"), _identity("other")
    key_id = key_id_of("k")
    with pytest.raises(InvalidValue):
        records.record_for_store(key_id, 1, 100.0, bytes(other.peer_id), me)
    with pytest.raises(InvalidValue):
        records.record_for_store(key_id, 1, 100.0, bytes(me.peer_id), None)
    assert records.record_for_store(key_id, 1, 100.0, bytes(me.peer_id), me).subkeys


def test_one_owner_cannot_push_other_owners_out_of_a_key():
    """Far-future subkeys of one identity used to win `fit` (soonest-expiring dropped first): now each owner
    keeps at most MAX_SUBKEYS_PER_OWNER, and when the record is still too big the largest owner gives way."""
    key_id = key_id_of("ffn.")
    honest = [_identity(f"honest{i}") for i in range(3)]
    attacker = _identity("attacker")
    subkeys = {}
    for i, identity in enumerate(honest):
        for coord in range(4 * i, 4 * i + 4):
            subkeys[coord] = make_entry(key_id, coord, ["ffn.%d" % coord, "h", 1, "00" * 20], 100.0, identity)
    for coord in range(100, 400):  # junk coordinates expiring far later than any honest entry
        subkeys[coord] = make_entry(key_id, coord, ["ffn.%d" % coord, "h", 9, "00" * 20], 1e12, attacker)
    kept = records.fit(Record(None, subkeys))
    assert records.encoded_size(records.encode(kept)) <= MAX_RECORD_BYTES
    assert all(coord in kept.subkeys for coord in range(12))  # every honest entry stays
    owned = sum(1 for entry in kept.subkeys.values() if entry.owner == attacker.public_key)
    assert owned <= MAX_SUBKEYS_PER_OWNER
    # several identities each get an equal share: the honest owners, holding the fewest subkeys, are trimmed last
    for sybils, honest_kept in ((6, 4), (12, 3)):
        many = dict((coord, subkeys[coord]) for coord in range(12))
        for n in range(sybils):
            sybil = _identity(f"sybil{n}")
            for coord in range(1000 + 40 * n, 1040 + 40 * n):
                many[coord] = make_entry(key_id, coord, ["ffn.%d" % coord, "h", 9, "00" * 20], 1e12, sybil)
        kept = records.fit(Record(None, many))
        counts: dict[bytes | None, int] = {}
        for entry in kept.subkeys.values():
            counts[entry.owner] = counts.get(entry.owner, 0) + 1
        for identity in honest:  # with 12 Sybils the room (about 50 signed entries) is split 15 ways
            assert counts[identity.public_key] >= honest_kept
        trimmed = [count for owner, count in counts.items() if owner not in {i.public_key for i in honest}]
        assert max(trimmed) - min(trimmed) <= 1  # the trimmed owners share the room equally
        # every holder keeps the same entries, whatever order they were merged in
        shuffled = list(many.items())
        random.Random(1).shuffle(shuffled)
        assert records.fit(Record(None, dict(shuffled))).subkeys.keys() == kept.subkeys.keys()


# ---------------------------------------------------------------------------------------- over the network


async def _swarm(nursery, network, count=6):
    return [r.node for r in await start_swarm(nursery, [f"n{i}" for i in range(count)], network.host,
                                              random.Random(5), clock=trio.current_time)]


async def test_forged_directory_and_ban_records_are_refused_by_every_storing_node(autojump_clock):
    network = MemoryNetwork(latency=0.002, seed=3)
    async with trio.open_nursery() as nursery:
        nodes = await _swarm(nursery, network)
        honest, reader = nodes[1], nodes[2]
        attacker_identity = _identity("attacker")
        attacker = await nursery.start(_client, network, [nodes[0].address], attacker_identity)
        # the honest peer's directory entry and bans, written the ordinary way
        directory = PeerDirectory(honest, ttl=30.0)
        assert await directory.declare(("10.0.0.1", 4000), honest.peer_id, {"grid": "ffn.[0:12]"})
        assert await honest.store(BANS_KEY, {"ffn.1": "wrong outputs"}, honest.now() + 60,
                                  subkey=bytes(honest.peer_id), signed=True)
        # the attack: entries under the honest peer's subkey and under made-up PeerIDs, signed by the attacker
        # or not at all; an evil directory summary would make `peer join` serve `evil.*`
        victim = _identity("victim")
        evil = ["127.0.0.1", 9, {"grid": "evil.[0:99]", "experts": 99}]
        forged = [
            (shard_key(honest.peer_id), honest.peer_id.hex(), evil, attacker_identity),
            (shard_key(victim.peer_id), victim.peer_id.hex(), evil, attacker_identity),
            (shard_key(victim.peer_id), victim.peer_id.hex(), evil, None),
            (BANS_KEY, bytes(honest.peer_id), {"ffn.0": "forged"}, attacker_identity),
            (BANS_KEY, bytes(victim.peer_id), {"ffn.2": "forged"}, attacker_identity),
        ]
        for key, subkey, value, signer in forged:
            assert not await forge_store(attacker, key, value, attacker.now() + 600, subkey, signer)
        # every storing node holds only the honest entries
        for node in nodes:
            for key in {shard_key(honest.peer_id), shard_key(victim.peer_id), BANS_KEY}:
                held = node.local_record(key)
                for subkey, entry in (held.subkeys if held is not None else {}).items():
                    assert records.signed_by_subkey(subkey, entry)
                    assert entry.owner == honest.identity.public_key
        # and what `peer status`, `peer join` (discover) and `peer train` read is the honest swarm
        peers = await list_peers(reader)
        assert [(p.peer_id, p.address) for p in peers] == [(honest.peer_id.hex(), ("10.0.0.1", 4000))]
        assert await read_expert_bans(reader) == {"ffn.1": {honest.peer_id.hex(): "wrong outputs"}}
        # the attacker may still write its own entry, under its own PeerID: that is what the rule allows
        assert await attacker.store(BANS_KEY, {"ffn.3": "mine"}, attacker.now() + 60,
                                    subkey=bytes(attacker.peer_id), signed=True)
        assert set(await read_expert_bans(reader)) == {"ffn.1", "ffn.3"}
        nursery.cancel_scope.cancel()


async def _client(network, peers, identity, *, task_status=trio.TASK_STATUS_IGNORED):
    async with DHTNode.open("attacker", 0, peers, network=network.host("attacker"), client_mode=True,
                            identity=identity, clock=trio.current_time, seed=99) as node:
        task_status.started(node)
        await trio.sleep_forever()
