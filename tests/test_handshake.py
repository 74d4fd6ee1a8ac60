"""The sans-I/O handshake (peer/p2p/handshake.py), driven with bytes only: no trio, no sockets, no clock.

Covers: both roles completing, byte-by-byte feeding and every split boundary, bytes behind the PROOF handed on as
leftover, the exact version-1 wire bytes (what peers of this version send), every HELLO field wrong, frames out
of order, a forged proof, an ERROR refusal, an unexpected peer (refused before we sign), and misuse raising
LocalProtocolError.
"""

from __future__ import annotations

import random

import msgpack
import pytest

from peer.p2p import framing
from peer.p2p.handshake import (
    DOMAIN,
    PROTOCOL_VERSION,
    BadProof,
    Handshake,
    HandshakeComplete,
    HandshakeFailed,
    HandshakeRefused,
    NotAPeer,
    Role,
    UnexpectedPeer,
    VersionMismatch,
    parse_hello,
)
from peer.p2p.identity import Identity
from peer.p2p.rpc_protocol import LocalProtocolError, RemoteProtocolError

ALICE = Identity.from_seed(b"alice")
BOB = Identity.from_seed(b"bob")
MALLORY = Identity.from_seed(b"mallory")


def nonces(seed: int):
    rng = random.Random(seed)
    return lambda n: bytes(rng.getrandbits(8) for _ in range(n))


def pair(**bob_options) -> tuple[Handshake, Handshake]:
    alice = Handshake(ALICE, Role.INITIATOR, nonce_source=nonces(1))
    bob = Handshake(BOB, Role.RESPONDER, listen=("10.0.0.2", 4100), nonce_source=nonces(2), **bob_options)
    return alice, bob


def hello_frame(identity: Identity, nonce: bytes, listen=None, changes: dict | None = None) -> bytes:
    """A version-1 HELLO as peers of this version build it, with `changes` to its fields."""
    hello = {"v": PROTOCOL_VERSION, "pk": identity.public_key, "nonce": nonce, "listen": listen}
    hello.update(changes or {})
    return framing.control_frame(framing.HELLO, msgpack.packb(hello, use_bin_type=True))


def their_nonce(handshake_output: bytes) -> bytes:
    hello = framing.FrameParser(1 << 20).receive(handshake_output)[0]
    assert hello.kind == framing.HELLO
    return msgpack.unpackb(hello.payload)["nonce"]


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
    assert alice_done == HandshakeComplete(BOB.peer_id, BOB.public_key, ("10.0.0.2", 4100), Role.INITIATOR,
                                           PROTOCOL_VERSION, b"")
    assert bob_done == HandshakeComplete(ALICE.peer_id, ALICE.public_key, None, Role.RESPONDER, PROTOCOL_VERSION,
                                         b"")
    assert alice.complete and bob.complete and alice.data_to_send() == b"" == bob.data_to_send()


def test_the_wire_bytes_are_version_one_exactly():
    """What a peer of this version sends, built by hand: HELLO at once, PROOF = sign(DOMAIN + theirs + ours)."""
    alice, bob = pair()
    alice_nonce, bob_nonce = nonces(1)(32), nonces(2)(32)
    hello = alice.data_to_send()
    assert hello == hello_frame(ALICE, alice_nonce)
    assert bob.data_to_send() == hello_frame(BOB, bob_nonce, ["10.0.0.2", 4100])
    bob.receive_data(hello)
    assert bob.data_to_send() == framing.control_frame(framing.PROOF, BOB.sign(DOMAIN + alice_nonce + bob_nonce))


def test_a_hand_rolled_version_one_peer_interoperates():
    bob = Handshake(BOB, Role.RESPONDER, nonce_source=nonces(2))
    nonce = bytes(range(32))
    bob.receive_data(hello_frame(ALICE, nonce))
    bob_nonce = their_nonce(bob.data_to_send())
    (done,) = bob.receive_data(framing.control_frame(framing.PROOF, ALICE.sign(DOMAIN + bob_nonce + nonce)))
    assert done.peer_id == ALICE.peer_id


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
    ("v", 2, VersionMismatch),
    ("v", True, VersionMismatch),  # True == 1 in Python, but it is no version number
    ("v", 1.0, VersionMismatch),
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
    payload = msgpack.packb({"v": 1, "pk": b"k" * 32, "nonce": b"n" * 32, "listen": ["h", 9]}, use_bin_type=True)
    assert parse_hello(payload) == (b"k" * 32, b"n" * 32, ("h", 9))


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


def test_a_proof_by_another_key_or_over_other_bytes_fails():
    for signer, signed in ((MALLORY, None), (ALICE, b"other bytes")):
        bob = bob_fed(hello_frame(ALICE, b"\x00" * 32))
        bob_nonce = nonces(2)(32)
        proof = signer.sign(signed or DOMAIN + bob_nonce + b"\x00" * 32)
        with pytest.raises(BadProof) as caught:
            bob.receive_data(framing.control_frame(framing.PROOF, proof))
        assert caught.value.peer_id == ALICE.peer_id


def test_a_truncated_proof_waits_and_a_short_one_fails():
    bob = bob_fed(hello_frame(ALICE, b"\x00" * 32))
    proof = framing.control_frame(framing.PROOF, ALICE.sign(DOMAIN + nonces(2)(32) + b"\x00" * 32))
    assert bob.receive_data(proof[:-1]) == []  # not all there yet
    short = framing.control_frame(framing.PROOF, ALICE.sign(DOMAIN + nonces(2)(32) + b"\x00" * 32)[:-1])
    bob = bob_fed(hello_frame(ALICE, b"\x00" * 32))
    with pytest.raises(BadProof):
        bob.receive_data(short)


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
