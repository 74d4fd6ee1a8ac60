"""Private swarms in the RPC handshake (peer/p2p/handshake.py) and the RPC node (peer/p2p/rpc.py).

Sans-I/O part (bytes only): two holders of one swarm key complete with session keys that differ from an open
swarm's; a holder and a non-holder, or holders of different keys, fail on BOTH sides with a typed one-line error,
whatever way the bytes are split; a private listener sends a stranger no byte at all (its HELLO waits for the
dialer's sealed HELLO to open), and a sealed HELLO shows none of its fields; a peer off the allow list is refused
before we sign anything, with an ERROR frame; an open swarm's HELLO is byte for byte what it was.

Socket part (real 127.0.0.1 TCP between separate RPC nodes): with the key a call works; with another key or none
both sides count a failed handshake and the caller gets a typed error (`NotInSwarm`, or a `HandshakeError` naming
`--swarm-key` when it holds no key); `--allow-peers` gives `NotAllowed`
on the listening side and a refusal on the caller's.
"""

from __future__ import annotations

import os

import msgpack
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from peer.p2p import framing
from peer.p2p.handshake import (
    PRIVATE,
    SEALED_HELLO,
    TAG_BYTES,
    Handshake,
    HandshakeFailed,
    HandshakeRefused,
    PeerNotAllowed,
    Role,
    SwarmKeyMismatch,
)
from peer.p2p.identity import SIGNATURE_BYTES, Identity, SwarmKey
from peer.p2p.net import RealNetwork
from peer.p2p.rpc import HandshakeError, NotInSwarm, RPCNode
from tests.p2p.handshake_peers import ALICE, BOB, nonces

KEY = SwarmKey(bytes(range(32)))
OTHER_KEY = SwarmKey(bytes(range(1, 33)))


def pair(alice_key: SwarmKey | None, bob_key: SwarmKey | None, **bob_options) -> tuple[Handshake, Handshake]:
    alice = Handshake(ALICE, Role.INITIATOR, swarm_key=alice_key, nonce_source=nonces(1))
    bob = Handshake(BOB, Role.RESPONDER, listen=("127.0.0.1", 4100), swarm_key=bob_key, nonce_source=nonces(2),
                    **bob_options)
    return alice, bob


def frames(data: bytes) -> list[framing.Frame]:
    return framing.FrameParser(1 << 20).receive(data)


def exchange(alice: Handshake, bob: Handshake, split: int | None = None) -> dict[str, object]:
    """Run both sides to the end as two drivers do (each sends whatever its side queued, also after a failure);
    returns each side's outcome: a HandshakeComplete or the failure raised. `split` cuts each input in two."""
    outcome: dict[str, object] = {}
    inbox = {"alice": bob.data_to_send(), "bob": alice.data_to_send()}
    sides = {"alice": (alice, "bob"), "bob": (bob, "alice")}
    for _ in range(4):
        progressed = False
        for name, (side, other) in sides.items():
            data, inbox[name] = inbox[name], b""
            if not data or name in outcome:
                continue
            progressed = True
            pieces = [data] if split is None else [data[:split], data[split:]]
            try:
                for piece in pieces:
                    if piece:
                        events = side.receive_data(piece)
                        if events:
                            outcome[name] = events[0]
                            break
            except (SwarmKeyMismatch, PeerNotAllowed, HandshakeRefused) as error:
                outcome[name] = error
            inbox[other] += side.data_to_send()
        if not progressed:
            break
    for name, (side, other) in sides.items():  # a side whose remote failed sees the connection close
        if name not in outcome and isinstance(outcome.get(other), Exception):
            outcome[name] = side.connection_closed()
    return outcome


def test_two_holders_complete_with_keys_of_their_own():
    done = exchange(*pair(KEY, KEY))
    alice_done, bob_done = done["alice"], done["bob"]
    assert alice_done.peer_id == BOB.peer_id and bob_done.peer_id == ALICE.peer_id
    assert alice_done.keys.send == bob_done.keys.receive and alice_done.keys.receive == bob_done.keys.send
    open_done = exchange(*pair(None, None))
    # same nonces and ephemeral keys: only the swarm key differs, and it changes the session keys
    assert open_done["alice"].keys.send != alice_done.keys.send


def test_an_open_swarm_hello_is_unchanged_and_a_private_one_says_so():
    open_hello = msgpack.unpackb(frames(Handshake(ALICE, Role.INITIATOR).data_to_send())[0].payload)
    assert PRIVATE not in open_hello and set(open_hello) == {"v", "pk", "eph", "nonce", "listen", "transport"}
    sealed = frames(Handshake(ALICE, Role.INITIATOR, swarm_key=KEY).data_to_send())[0].payload
    assert sealed[0] == SEALED_HELLO and ALICE.public_key not in sealed and PRIVATE.encode() not in sealed
    assert Handshake(BOB, Role.RESPONDER, swarm_key=KEY).data_to_send() == b""  # a private listener waits
    bob = Handshake(BOB, Role.RESPONDER, swarm_key=KEY)
    with pytest.raises(SwarmKeyMismatch):  # a stranger's open HELLO: bob fails and still has nothing to send
        bob.receive_data(Handshake(ALICE, Role.INITIATOR).data_to_send())
    assert bob.data_to_send() == b""
    bob = Handshake(BOB, Role.RESPONDER, swarm_key=KEY)
    with pytest.raises(SwarmKeyMismatch):  # a sealed HELLO under another key does not open
        bob.receive_data(Handshake(ALICE, Role.INITIATOR, swarm_key=OTHER_KEY).data_to_send())
    assert bob.data_to_send() == b""


@pytest.mark.parametrize("alice_key, bob_key", [(KEY, None), (None, KEY)])
def test_a_holder_and_a_non_holder_fail_on_both_sides_at_the_hello(alice_key, bob_key):
    alice, bob = pair(alice_key, bob_key)
    done = exchange(alice, bob)
    for name in ("alice", "bob"):
        error = done[name]
        assert isinstance(error, HandshakeFailed), (name, error)
        assert "\n" not in str(error) and "swarm" in str(error)
    private_side = done["alice"] if alice_key else done["bob"]
    assert isinstance(private_side, SwarmKeyMismatch) and "not part of this private swarm" in str(private_side)
    open_side = done["bob"] if alice_key else done["alice"]
    assert "--swarm-key" in str(open_side)
    # the open side that dialed a private listener got no byte: it only saw the connection close
    assert isinstance(open_side, SwarmKeyMismatch) == bool(alice_key)


@pytest.mark.parametrize("split", [None, 1, 7, 60, 150, 200])
def test_different_keys_fail_on_both_sides_at_the_hello_however_the_bytes_are_split(split):
    done = exchange(*pair(KEY, OTHER_KEY), split=split)
    for name in ("alice", "bob"):
        assert isinstance(done[name], SwarmKeyMismatch), (name, done[name])
        assert "different swarm key" in str(done[name])


@pytest.mark.parametrize("mangle", ["signature only", "tag flipped", "tag of the other role"])
def test_the_proof_without_the_right_tag_fails_even_with_a_valid_signature(mangle):
    alice, bob = pair(KEY, KEY)
    to_bob, to_alice = alice.data_to_send(), bob.data_to_send()
    bob.receive_data(to_bob)
    to_alice = bob.data_to_send()  # the private responder's HELLO comes with its PROOF
    hello_frame, proof_frame = frames(to_alice)
    proof = proof_frame.payload
    to_alice = framing.control_frame(framing.HELLO, hello_frame.payload)
    assert len(proof) == TAG_BYTES + SIGNATURE_BYTES
    alice.receive_data(to_alice)
    own_proof = frames(alice.data_to_send())[0].payload  # alice's, as initiator
    forged = {"signature only": proof[TAG_BYTES:],
              "tag flipped": bytes([proof[0] ^ 1]) + proof[1:],
              "tag of the other role": own_proof[:TAG_BYTES] + proof[TAG_BYTES:]}[mangle]
    with pytest.raises(SwarmKeyMismatch):
        alice.receive_data(framing.control_frame(framing.PROOF, forged))


@given(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32), st.integers(0, 2**32))
def test_property_sealed_hellos_show_nothing_and_only_the_same_key_completes(key_a, key_b, seed):
    """A sealed HELLO carries none of its fields in clear, a private listener answers another key with nothing,
    and only the same key completes."""
    first = Handshake(ALICE, Role.INITIATOR, swarm_key=SwarmKey(key_a), nonce_source=nonces(seed))
    sealed = first.data_to_send()
    assert ALICE.public_key not in sealed and first._nonce not in sealed
    listener = Handshake(BOB, Role.RESPONDER, swarm_key=SwarmKey(key_b), nonce_source=nonces(seed + 1))
    if key_a != key_b:
        with pytest.raises(SwarmKeyMismatch):
            listener.receive_data(sealed)
        assert listener.data_to_send() == b""
    alice = Handshake(ALICE, Role.INITIATOR, swarm_key=SwarmKey(key_a), nonce_source=nonces(seed))
    bob = Handshake(BOB, Role.RESPONDER, swarm_key=SwarmKey(key_b), nonce_source=nonces(seed + 1))
    done = exchange(alice, bob)
    if key_a == key_b:
        assert not isinstance(done["alice"], Exception) and not isinstance(done["bob"], Exception)
    else:
        assert isinstance(done["alice"], SwarmKeyMismatch) and isinstance(done["bob"], SwarmKeyMismatch)


def test_a_peer_off_the_allow_list_is_refused_before_we_sign_with_an_error_frame():
    alice, bob = pair(KEY, KEY, allowed_peers=frozenset({BOB.peer_id}))
    done = exchange(alice, bob)
    assert isinstance(done["bob"], PeerNotAllowed) and ALICE.peer_id.short() in str(done["bob"])
    assert isinstance(done["alice"], HandshakeRefused) and "allow list" in str(done["alice"])
    alice, bob = pair(KEY, KEY, allowed_peers=frozenset({ALICE.peer_id}))
    done = exchange(alice, bob)
    assert done["bob"].peer_id == ALICE.peer_id


def test_a_refused_peer_gets_no_proof_from_us():
    alice, bob = pair(None, None, allowed_peers=frozenset())
    bob.data_to_send()
    with pytest.raises(PeerNotAllowed):
        bob.receive_data(alice.data_to_send())
    assert [frame.kind for frame in frames(bob.data_to_send())] == [framing.ERROR]


# --------------------------------------------------------------------------------------------- real sockets


async def _serve_and_call(server_key, client_key, *, allowed=None):
    """One listening node and one calling node on 127.0.0.1; returns (result or error, both nodes' stats)."""
    network = RealNetwork()
    async with RPCNode(Identity.generate(), network, swarm_key=server_key, allowed_peers=allowed,
                       handshake_timeout=30) as server:

        async def echo(context, args):
            return args

        server.register("echo", echo)
        address = await server.listen("127.0.0.1", 0)
        async with RPCNode(Identity.generate(), network, swarm_key=client_key, handshake_timeout=30) as client:
            try:
                result: object = await client.call(address, "echo", b"hi", timeout=30)
            except HandshakeError as error:
                result = error
            with trio.fail_after(30):  # the server's verdict is reached on its own task: wait for it
                while result != b"hi" and not server.stats["handshake_failures"]:
                    await trio.sleep(0.01)
            return result, server.stats, client.stats


async def test_holders_call_each_other_over_real_sockets():
    result, server_stats, _ = await _serve_and_call(KEY, KEY)
    assert result == b"hi" and server_stats["handshake_failures"] == 0


@pytest.mark.parametrize("server_key, client_key, words, kind", [
    (KEY, OTHER_KEY, "different swarm key", NotInSwarm),
    (KEY, None, "private swarm, pass its --swarm-key", HandshakeError),  # it got no byte: it cannot be sure
    (None, KEY, "not part of this private swarm", NotInSwarm),
])
async def test_a_wrong_or_missing_key_fails_typed_on_both_sides(server_key, client_key, words, kind):
    result, server_stats, client_stats = await _serve_and_call(server_key, client_key)
    assert isinstance(result, kind), result
    assert words in str(result) and "\n" not in str(result)
    assert server_stats["handshake_failures"] == 1 and client_stats["handshake_failures"] == 1
    assert server_stats["handshakes_not_in_swarm"] == 1  # the listening side's failure is a NotInSwarm too
    assert server_stats["calls_received"] == 0


async def test_the_allow_list_refuses_others_and_admits_listed_peers():
    result, server_stats, _ = await _serve_and_call(KEY, KEY, allowed=frozenset())
    assert isinstance(result, HandshakeError) and "allow list" in str(result)
    assert server_stats["handshake_failures"] == 1  # the server's side of it is a NotAllowed (logged at debug)
    network = RealNetwork()
    listed = Identity.generate()
    async with RPCNode(Identity.generate(), network, allowed_peers=frozenset({listed.peer_id})) as server:
        server.register("echo", _echo)
        address = await server.listen("127.0.0.1", 0)
        async with RPCNode(listed, network) as client:
            assert await client.call(address, "echo", 5, timeout=30) == 5


async def _echo(context, args):
    return args


def test_swarm_key_files_are_0600_never_overwritten_by_accident_and_round_trip(tmp_path):
    from peer.p2p.identity import SwarmKeyError

    path = tmp_path / "swarm.key"
    key = SwarmKey.generate()
    key.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert SwarmKey.load(path).derive(b"x") == key.derive(b"x")
    with pytest.raises(SwarmKeyError, match="--force"):
        SwarmKey.generate().save(path)
    SwarmKey.generate().save(path, overwrite=True)
    assert SwarmKey.load(path).derive(b"x") != key.derive(b"x")
    os.chmod(path, 0o644)
    with pytest.raises(SwarmKeyError, match="chmod 600"):
        SwarmKey.load(path)
    (tmp_path / "bad.key").write_text("hello\n")
    with pytest.raises(SwarmKeyError, match="not a swarmd swarm key"):
        SwarmKey.load(tmp_path / "bad.key")
    assert "SwarmKey(…)" == repr(key) and key.derive(b"a") != key.derive(b"b")
