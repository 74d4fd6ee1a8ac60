"""The sans-I/O handshake (peer/p2p/handshake.py), driven with bytes only: no trio, no sockets, no clock.

Covers: both roles completing with matching per-direction session keys, byte-by-byte feeding and every split
boundary, bytes behind the PROOF handed on as leftover, the exact version-2 wire bytes (what peers of this version
send), every HELLO field wrong, frames out of order, a forged proof, a proof for another transcript (a swapped
ephemeral key, a replayed or reflected proof), an ERROR refusal, an unexpected peer (refused before we sign),
the insecure/secure transport mismatch, and misuse raising LocalProtocolError.
"""

from __future__ import annotations

import msgpack
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from peer.p2p import framing
from peer.p2p.handshake import (
    PLAINTEXT,
    PROTOCOL_VERSION,
    SEALED,
    BadProof,
    Handshake,
    HandshakeComplete,
    HandshakeFailed,
    HandshakeRefused,
    NotAPeer,
    Role,
    TransportMismatch,
    UnexpectedPeer,
    VersionMismatch,
    parse_hello,
    proof_message,
    transcript_hash,
)
from peer.p2p.identity import Identity
from peer.p2p.rpc_protocol import LocalProtocolError, RemoteProtocolError
from tests.p2p.handshake_peers import ALICE, BOB, nonces

MALLORY = Identity.from_seed(b"mallory")


def ephemeral_public(private: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


EPHEMERAL = ephemeral_public(b"\x07" * 32)


def pair(**bob_options) -> tuple[Handshake, Handshake]:
    alice = Handshake(ALICE, Role.INITIATOR, nonce_source=nonces(1))
    bob = Handshake(BOB, Role.RESPONDER, listen=("10.0.0.2", 4100), nonce_source=nonces(2), **bob_options)
    return alice, bob


def hello_payload(identity: Identity, nonce: bytes, listen=None, changes: dict | None = None,
                  ephemeral: bytes = EPHEMERAL) -> bytes:
    """A version-2 HELLO payload as peers of this version build it, with `changes` to its fields."""
    hello = {"v": PROTOCOL_VERSION, "pk": identity.public_key, "eph": ephemeral, "nonce": nonce,
             "listen": listen, "transport": SEALED}
    hello.update(changes or {})
    return msgpack.packb(hello, use_bin_type=True)


def hello_frame(identity: Identity, nonce: bytes, listen=None, changes: dict | None = None) -> bytes:
    return framing.control_frame(framing.HELLO, hello_payload(identity, nonce, listen, changes))


def their_hello(handshake_output: bytes) -> bytes:
    hello = framing.FrameParser(1 << 20).receive(handshake_output)[0]
    assert hello.kind == framing.HELLO
    return hello.payload


def bob_transcript_with(alice_hello: bytes) -> bytes:
    """The transcript a fresh `bob_fed` Bob computes after Alice's HELLO `alice_hello` (payload)."""
    bob = Handshake(BOB, Role.RESPONDER, nonce_source=nonces(2))
    return transcript_hash(alice_hello, their_hello(bob.data_to_send()))


def run(alice: Handshake, bob: Handshake) -> tuple[HandshakeComplete, HandshakeComplete]:
    """Both HELLOs cross, then both PROOFs: how two drivers exchange them."""
    to_bob, to_alice = alice.data_to_send(), bob.data_to_send()
    assert alice.receive_data(to_alice) == [] and bob.receive_data(to_bob) == []
    (alice_done,) = alice.receive_data(bob.data_to_send())
    (bob_done,) = bob.receive_data(alice.data_to_send())
    return alice_done, bob_done


def test_both_sides_learn_the_proven_peer_and_its_listen_address():
    alice, bob = pair()
    alice_done, bob_done = run(alice, bob)
    keys_a, keys_b = alice_done.keys, bob_done.keys
    assert keys_a is not None and keys_b is not None
    assert keys_a.send == keys_b.receive and keys_a.receive == keys_b.send and keys_a.send != keys_a.receive
    assert alice_done == HandshakeComplete(BOB.peer_id, BOB.public_key, ("10.0.0.2", 4100), Role.INITIATOR,
                                           PROTOCOL_VERSION, b"", keys_a)
    assert bob_done == HandshakeComplete(ALICE.peer_id, ALICE.public_key, None, Role.RESPONDER, PROTOCOL_VERSION,
                                         b"", keys_b)
    assert alice.complete and bob.complete and alice.data_to_send() == b"" == bob.data_to_send()


def test_every_handshake_agrees_on_fresh_keys():
    """Random nonces and ephemeral keys: two runs between the same peers share no key (no replay of a session)."""
    first = run(Handshake(ALICE, Role.INITIATOR), Handshake(BOB, Role.RESPONDER))[0].keys
    second = run(Handshake(ALICE, Role.INITIATOR), Handshake(BOB, Role.RESPONDER))[0].keys
    assert first is not None and second is not None
    assert {first.send, first.receive}.isdisjoint({second.send, second.receive})


def test_the_wire_bytes_are_version_two_exactly():
    """What a peer of this version sends, built by hand: HELLO at once (nonce, then ephemeral key from the
    source), PROOF = sign(DOMAIN + role + transcript of both HELLOs, the initiator's first)."""
    alice, bob = pair()
    alice_source, bob_source = nonces(1), nonces(2)
    alice_nonce, alice_eph = alice_source(32), ephemeral_public(alice_source(32))
    bob_nonce, bob_eph = bob_source(32), ephemeral_public(bob_source(32))
    hello = alice.data_to_send()
    alice_payload = hello_payload(ALICE, alice_nonce, ephemeral=alice_eph)
    bob_payload = hello_payload(BOB, bob_nonce, ["10.0.0.2", 4100], ephemeral=bob_eph)
    assert hello == framing.control_frame(framing.HELLO, alice_payload)
    assert bob.data_to_send() == framing.control_frame(framing.HELLO, bob_payload)
    bob.receive_data(hello)
    signed = proof_message(Role.RESPONDER, transcript_hash(alice_payload, bob_payload))
    assert bob.data_to_send() == framing.control_frame(framing.PROOF, BOB.sign(signed))


def test_a_hand_rolled_version_two_peer_interoperates():
    bob = Handshake(BOB, Role.RESPONDER, nonce_source=nonces(2))
    mine = hello_payload(ALICE, bytes(range(32)))
    bob.receive_data(framing.control_frame(framing.HELLO, mine))
    transcript = transcript_hash(mine, their_hello(bob.data_to_send()))
    (done,) = bob.receive_data(framing.control_frame(framing.PROOF,
                                                     ALICE.sign(proof_message(Role.INITIATOR, transcript))))
    assert done.peer_id == ALICE.peer_id and done.keys is not None


def alice_stream_to_bob(trailing: bytes) -> tuple[Handshake, bytes]:
    """Alice's whole side of the handshake as one byte string (HELLO, PROOF, then `trailing`), and a fresh Bob
    whose HELLO she answered."""
    alice, bob = pair()
    hello = alice.data_to_send()
    alice.receive_data(bob.data_to_send())
    return bob, hello + alice.data_to_send() + trailing


TRAILING = framing.HEADER.pack(framing.HEADER.size - 4 + 8 + 5, framing.FIRST | framing.LAST, 1) \
    + framing.TOTAL.pack(5) + b"hello"


def test_byte_by_byte_completes_on_the_last_byte_of_the_proof_and_hands_on_the_rest():
    bob, stream = alice_stream_to_bob(TRAILING)
    proof_end = len(stream) - len(TRAILING)
    for index in range(proof_end - 1):
        assert bob.receive_data(stream[index:index + 1]) == []
    (done,) = bob.receive_data(stream[proof_end - 1:])
    assert done.peer_id == ALICE.peer_id and done.leftover == TRAILING


@pytest.mark.parametrize("trailing", [b"", TRAILING])
def test_every_split_boundary_gives_the_same_result(trailing):
    _, stream = alice_stream_to_bob(trailing)
    proof_end = len(stream) - len(trailing)
    for cut in range(len(stream) + 1):
        bob, _ = alice_stream_to_bob(b"")
        events = bob.receive_data(stream[:cut])
        after = b""
        if events:  # complete in the first piece: the rest belongs to the connection, not the handshake
            assert cut >= proof_end
            after = stream[cut:]
        else:
            assert cut < proof_end
            events = bob.receive_data(stream[cut:])
        (done,) = events
        assert done.peer_id == ALICE.peer_id and done.leftover + after == trailing


def test_hello_and_proof_in_one_read_complete_and_queue_our_proof():
    """A fast responder's HELLO and PROOF often arrive together: the initiator must still send its PROOF."""
    alice, bob = pair()
    bob.receive_data(alice.data_to_send())
    (done,) = alice.receive_data(bob.data_to_send())
    assert done.peer_id == BOB.peer_id
    (bob_done,) = bob.receive_data(alice.data_to_send())
    assert bob_done.peer_id == ALICE.peer_id


# ------------------------------------------------------------------------------------------------- failures


def bob_fed(data: bytes) -> Handshake:
    bob = Handshake(BOB, Role.RESPONDER, nonce_source=nonces(2))
    bob.data_to_send()
    bob.receive_data(data)
    return bob


@pytest.mark.parametrize("field, value, error", [
    ("v", 1, VersionMismatch),  # the unsealed version-1 protocol
    ("v", 3, VersionMismatch),
    ("v", True, VersionMismatch),  # a bool is no version number
    ("v", 2.0, VersionMismatch),
    ("eph", b"\x03" * 31, NotAPeer),
    ("eph", None, NotAPeer),
    ("eph", b"\x00" * 32, NotAPeer),  # a low-order point: the shared secret would be all zeros
    ("transport", "rot13", NotAPeer),
    ("transport", None, NotAPeer),
    ("pk", b"\x01" * 31, NotAPeer),
    ("pk", "x" * 32, NotAPeer),
    ("nonce", b"\x02" * 33, NotAPeer),
    ("nonce", None, NotAPeer),
    ("listen", ["host", 0], NotAPeer),
    ("listen", ["host", True], NotAPeer),
    ("listen", ["host", 70000], NotAPeer),
    ("listen", [b"host", 1], NotAPeer),
    ("listen", "host:1", NotAPeer),
])
def test_one_wrong_hello_field_fails_the_handshake(field, value, error):
    with pytest.raises(error) as caught:
        bob_fed(hello_frame(ALICE, b"\x00" * 32, changes={field: value}))
    assert isinstance(caught.value, RemoteProtocolError)


def test_unknown_hello_fields_are_ignored_for_later_versions_to_add():
    bob = bob_fed(hello_frame(ALICE, b"\x00" * 32, changes={"swarm": "key id"}))
    assert bob.state == "waiting for the remote's proof"


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb({"v": 1}) + b"x"])
def test_unreadable_hellos_are_not_a_peer(payload):
    with pytest.raises(NotAPeer):
        parse_hello(payload)


def test_parse_hello_returns_the_fields():
    payload = msgpack.packb({"v": 2, "pk": b"k" * 32, "nonce": b"n" * 32, "listen": ["h", 9], "eph": b"e" * 32,
                             "transport": PLAINTEXT}, use_bin_type=True)
    assert parse_hello(payload) == (b"k" * 32, b"n" * 32, ("h", 9), b"e" * 32, PLAINTEXT, False)  # not private


@pytest.mark.parametrize("frame, reason", [
    (framing.control_frame(framing.PROOF, b"s" * 64), "proof before hello"),
    (framing.HEADER.pack(framing.HEADER.size - 4 + 8 + 1, framing.FIRST | framing.LAST, 1) + framing.TOTAL.pack(1)
     + b"x", "unexpected frame kind 0x3"),
    (framing.HEADER.pack(framing.HEADER.size - 4, framing.CANCEL, 1), "unexpected frame kind 0x10"),
    (framing.HEADER.pack(framing.HEADER.size - 4, 0x7F, 0), "unexpected frame kind 0x7f"),
    (framing.HEADER.pack(3, framing.HELLO, 0), "outside the allowed"),
    (framing.HEADER.pack(10**9, framing.HELLO, 0), "outside the allowed"),
    (framing.HEADER.pack(framing.HEADER.size - 4 + framing.MAX_CONTROL_BYTES + 1, framing.HELLO, 0),
     "control frame too large"),
])
def test_frames_out_of_place_are_not_a_peer(frame, reason):
    with pytest.raises(NotAPeer, match=reason):
        bob_fed(frame)


def test_a_second_hello_instead_of_the_proof_fails():
    bob = bob_fed(hello_frame(ALICE, b"\x00" * 32))
    with pytest.raises(NotAPeer, match="second hello"):
        bob.receive_data(hello_frame(ALICE, b"\x00" * 32))


ALICE_HELLO = hello_payload(ALICE, b"\x00" * 32)


def test_a_proof_by_another_key_or_over_another_transcript_fails():
    transcript = bob_transcript_with(ALICE_HELLO)
    other_hello = hello_payload(ALICE, b"\x00" * 32, ephemeral=ephemeral_public(b"\x09" * 32))
    for signer, signed in (
        (MALLORY, proof_message(Role.INITIATOR, transcript)),  # not Alice's key
        (ALICE, b"other bytes"),
        (ALICE, proof_message(Role.RESPONDER, transcript)),  # Bob's own proof reflected: the wrong role
        # a man in the middle swapped the ephemeral key: Alice signed the transcript she saw, not Bob's
        (ALICE, proof_message(Role.INITIATOR, bob_transcript_with(other_hello))),
        # replayed from an earlier handshake with other nonces
        (ALICE, proof_message(Role.INITIATOR, transcript_hash(ALICE_HELLO, hello_payload(BOB, b"\x05" * 32)))),
    ):
        bob = bob_fed(framing.control_frame(framing.HELLO, ALICE_HELLO))
        with pytest.raises(BadProof) as caught:
            bob.receive_data(framing.control_frame(framing.PROOF, ALICE.sign(signed) if signer is ALICE
                                                   else signer.sign(signed)))
        assert caught.value.peer_id == ALICE.peer_id


def test_a_truncated_proof_waits_and_a_short_one_fails():
    signature = ALICE.sign(proof_message(Role.INITIATOR, bob_transcript_with(ALICE_HELLO)))
    bob = bob_fed(framing.control_frame(framing.HELLO, ALICE_HELLO))
    proof = framing.control_frame(framing.PROOF, signature)
    assert bob.receive_data(proof[:-1]) == []  # not all there yet
    (done,) = bob.receive_data(proof[-1:])
    assert done.peer_id == ALICE.peer_id
    bob = bob_fed(framing.control_frame(framing.HELLO, ALICE_HELLO))
    with pytest.raises(BadProof):
        bob.receive_data(framing.control_frame(framing.PROOF, signature[:-1]))


@pytest.mark.parametrize("alice_secure, bob_secure", [(False, True), (True, False)])
def test_an_insecure_and_a_secure_peer_refuse_each_other_both_ways(alice_secure, bob_secure):
    alice = Handshake(ALICE, Role.INITIATOR, secure=alice_secure)
    bob = Handshake(BOB, Role.RESPONDER, secure=bob_secure)
    to_bob, to_alice = alice.data_to_send(), bob.data_to_send()
    for side, data in ((alice, to_alice), (bob, to_bob)):
        with pytest.raises(TransportMismatch, match="--insecure-transport.*both sides must agree") as caught:
            side.receive_data(data)
        assert "\n" not in str(caught.value)
        assert side.data_to_send() == b""  # nothing signed for a peer we refuse


def test_two_insecure_peers_agree_and_get_no_keys():
    alice_done, bob_done = run(Handshake(ALICE, Role.INITIATOR, secure=False),
                               Handshake(BOB, Role.RESPONDER, secure=False))
    assert alice_done.keys is None and bob_done.keys is None and bob_done.peer_id == ALICE.peer_id


def test_an_error_frame_is_the_remote_refusing():
    with pytest.raises(HandshakeRefused, match="peer refused: go away"):
        bob_fed(framing.control_frame(framing.ERROR, b"go away"))


def test_an_unexpected_peer_is_refused_before_we_sign_anything():
    alice = Handshake(ALICE, Role.INITIATOR, expected_peer=MALLORY.peer_id, nonce_source=nonces(1))
    alice.data_to_send()
    with pytest.raises(UnexpectedPeer) as caught:
        alice.receive_data(hello_frame(BOB, b"\x00" * 32))
    assert caught.value.peer_id == BOB.peer_id
    assert alice.data_to_send() == b""  # no PROOF: we never signed for the wrong peer
    expected = Handshake(ALICE, Role.INITIATOR, expected_peer=BOB.peer_id, nonce_source=nonces(1))
    expected.receive_data(hello_frame(BOB, b"\x00" * 32))
    assert expected.state == "waiting for the remote's proof"


def test_closing_early_is_a_failure_and_input_after_the_end_is_our_bug():
    bob = bob_fed(hello_frame(ALICE, b"\x00" * 32))
    failure = bob.connection_closed()
    assert isinstance(failure, HandshakeFailed) and failure.peer_id == ALICE.peer_id
    assert "after its hello" in str(failure)
    with pytest.raises(LocalProtocolError):
        bob.receive_data(b"x")
    failed = Handshake(BOB, Role.RESPONDER)
    with pytest.raises(NotAPeer):
        failed.receive_data(framing.HEADER.pack(3, 0, 0))
    with pytest.raises(LocalProtocolError):
        failed.receive_data(b"more")
    alice, bob = pair()
    run(alice, bob)
    with pytest.raises(LocalProtocolError, match="connection owns the bytes"):
        alice.receive_data(TRAILING)


def test_misconfigured_handshakes_are_our_bug():
    with pytest.raises(LocalProtocolError, match="version"):
        Handshake(ALICE, Role.INITIATOR, version=PROTOCOL_VERSION + 1)
    with pytest.raises(LocalProtocolError, match="nonce"):
        Handshake(ALICE, Role.INITIATOR, nonce_source=lambda n: b"short")
