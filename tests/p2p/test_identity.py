import os
import stat

import pytest

from peer.p2p.identity import Identity, IdentityError, PeerID, verify_signature


def test_peer_id_is_sha1_of_public_key():
    import hashlib

    identity = Identity.generate()
    assert identity.peer_id == hashlib.sha1(identity.public_key).digest()
    assert len(identity.peer_id) == 20
    assert PeerID.from_hex(str(identity.peer_id)) == identity.peer_id


def test_sign_and_verify_rejects_other_key_and_tampering():
    alice, bob = Identity.generate(), Identity.generate()
    signature = alice.sign(b"hello")
    assert verify_signature(alice.public_key, signature, b"hello")
    assert not verify_signature(bob.public_key, signature, b"hello")
    assert not verify_signature(alice.public_key, signature, b"hellO")
    assert not verify_signature(alice.public_key, b"short", b"hello")


def test_key_file_roundtrip_with_owner_only_permissions(tmp_path):
    path = tmp_path / "keys" / "identity.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id


def test_corrupt_and_foreign_key_files_give_clear_errors(tmp_path):
    foreign = tmp_path / "id_rsa"
    foreign.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    with pytest.raises(IdentityError, match="not a swarmd identity"):
        Identity.load(foreign)
    path = tmp_path / "identity.key"
    Identity.generate().save(path)
    path.write_bytes(path.read_bytes()[:-10] + b"zz\n")
    with pytest.raises(IdentityError, match="corrupt"):
        Identity.load(path)
    with pytest.raises(IdentityError, match="cannot read"):
        Identity.load(tmp_path / "missing.key")


def test_seeded_identities_are_reproducible():
    assert Identity.from_seed(b"7").peer_id == Identity.from_seed(b"7").peer_id
    assert Identity.from_seed(b"7").peer_id != Identity.from_seed(b"8").peer_id
