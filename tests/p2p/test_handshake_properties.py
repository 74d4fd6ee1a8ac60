"""Property tests of the RPC handshake and error frames (peer/p2p/rpc.py), driven over in-memory streams.

The handshake only exists on trio streams, so each example runs its own `trio.run` under
`trio.testing.MockClock(autojump_threshold=0)` (virtual time: timeouts cost nothing) over
`MemoryNetwork().stream_pair(...)` or a listening node on a `MemoryNetwork`. A hand-rolled peer speaks the
protocol with exactly one thing wrong -- one HELLO field (version, public key, ephemeral key, nonce, listen address,
transport), the frame kind or size, or the PROOF (signed by another key, for the other role, over another
transcript, truncated) -- and the node must refuse it with
a `HandshakeError` and keep serving others. Valid handshakes must succeed, so the properties cannot pass by
refusing everything. Error replies ([1, code, text]) must arrive as the registered `RemoteError` subclass, and
malformed response envelopes as `ResponseRejected`.

Hypothesis runs under the `ci` profile registered in tests/conftest.py (derandomized, a modest number of
examples, no deadline); `HYPOTHESIS_PROFILE=thorough` runs many more.
"""

from __future__ import annotations

import os

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from peer.p2p import framing, rpc, wire
from peer.p2p.handshake import (
    DOMAIN,
    PLAINTEXT,
    SEALED,
    HandshakeFailed,
    Role,
    parse_hello,
    proof_message,
    transcript_hash,
)
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.p2p.rpc import HandshakeError, RemoteError, ResponseRejected, RPCNode
from peer.p2p.rpc_protocol import CallCompleted, CallFailed, RPCConnection
from peer.testing import hand_rolled

EPHEMERAL = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")  # RFC 7748, 6.1
SERVER = Identity.from_seed(b"server")
CLIENT = Identity.from_seed(b"client")
OTHER = Identity.from_seed(b"other")


def run_trio(async_fn, *args):
    return trio.run(async_fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


# ------------------------------------------------------------------------------------------------- strategies


def valid_hello(identity: Identity, nonce: bytes, listen=None) -> dict:
    return {"v": rpc.PROTOCOL_VERSION, "pk": identity.public_key, "eph": EPHEMERAL, "nonce": nonce,
            "listen": listen, "transport": SEALED}


junk = st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats() | st.text(max_size=40) \
    | st.binary(max_size=40) | st.lists(st.integers(0, 3), max_size=3)
listens = st.none() | st.tuples(st.text(min_size=1, max_size=30), st.integers(1, 65535)).map(list)


@st.composite
def hello_mutations(draw):
    """(field, new value or MISSING): one HELLO field made wrong."""
    field = draw(st.sampled_from(["v", "pk", "eph", "nonce", "listen", "transport"]))
    if field == "transport":
        return field, draw(junk.filter(lambda v: v not in (SEALED, PLAINTEXT)) | st.just(MISSING))
    if draw(st.integers(0, 5)) == 0:
        return field, MISSING if field != "listen" else draw(junk.filter(lambda v: v is not None))
    if field == "v":
        return field, draw(junk.filter(lambda v: not (type(v) is int and v == rpc.PROTOCOL_VERSION)))
    if field in ("pk", "eph", "nonce"):
        return field, draw(st.binary(max_size=31) | st.binary(min_size=33, max_size=64)
                           | st.text(min_size=32, max_size=32) | junk.filter(lambda v: not isinstance(v, bytes)))
    return field, draw(
        st.tuples(st.text(max_size=5), st.integers(65536, 2**40) | st.integers(-(2**40), 0) | st.booleans()
                  | st.floats() | st.text(max_size=3)).map(list)
        | st.tuples(st.binary(max_size=5) | st.integers() | st.none(), st.integers(1, 65535)).map(list)
        | st.lists(st.integers(1, 100), min_size=3, max_size=4) | st.lists(st.text(max_size=3), max_size=1)
        | junk.filter(lambda v: v is not None and not isinstance(v, list))
    )


MISSING = object()


def mutated_hello(identity: Identity, nonce: bytes, mutation) -> bytes:
    hello = valid_hello(identity, nonce)
    field, value = mutation
    if value is MISSING:
        del hello[field]
    else:
        hello[field] = value
    return msgpack.packb(hello, use_bin_type=True)


# ------------------------------------------------------------------------------------ parsing the HELLO


@given(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32), listens,
       st.binary(min_size=32, max_size=32), st.sampled_from([SEALED, PLAINTEXT]))
def test_valid_hello_parses(public_key, nonce, listen, ephemeral, transport):
    hello = msgpack.packb({"v": rpc.PROTOCOL_VERSION, "pk": public_key, "nonce": nonce, "listen": listen,
                           "eph": ephemeral, "transport": transport}, use_bin_type=True)
    assert tuple(parse_hello(hello)) == (public_key, nonce, tuple(listen) if listen else None, ephemeral,
                                         transport, False)


@given(hello_mutations())
@example(("v", True))  # True == 1 in Python: was taken for version 1 (fixed)
@example(("v", 1.0))
@example(("listen", ["h", True]))  # a bool port was accepted as port 1 (fixed)
def test_one_wrong_hello_field_is_a_handshake_error(mutation):
    with pytest.raises(HandshakeFailed):
        parse_hello(mutated_hello(CLIENT, os.urandom(32), mutation))


@given(st.binary(max_size=200) | st.builds(lambda v: msgpack.packb(v, use_bin_type=True),
                                          st.recursive(junk, lambda c: st.lists(c, max_size=3)
                                                       | st.dictionaries(junk.filter(lambda k: not isinstance(
                                                           k, list)), c, max_size=3), max_leaves=8)))
def test_any_hello_bytes_give_a_result_or_a_handshake_error(payload):
    try:
        public_key, nonce, listen, ephemeral, transport = parse_hello(payload)
    except HandshakeFailed:
        return
    assert len(public_key) == 32 and len(nonce) == 32 and (listen is None or 0 < listen[1] < 65536)
    assert len(ephemeral) == 32 and transport in (SEALED, PLAINTEXT)


# ------------------------------------------------------------------------------- the handshake over streams


@st.composite
def handshake_faults(draw):
    """What the hand-rolled peer gets wrong; None: nothing (a valid handshake)."""
    kind = draw(st.sampled_from(["none", "hello field", "hello frame", "proof", "proof frame", "refuses"]))
    if kind == "none":
        return None
    if kind == "hello field":
        return kind, draw(hello_mutations())
    if kind == "hello frame":
        return kind, draw(st.sampled_from(["as proof", "as data", "oversized", "close"]))
    if kind == "proof":
        return kind, draw(st.sampled_from(["other key", "their role", "swapped hellos", "no domain",
                                           "truncated", "extended", "random", "empty"]))
    if kind == "proof frame":
        return kind, draw(st.sampled_from(["as hello", "data first", "close"]))
    return kind, draw(st.binary(max_size=40))


def proof_for(fault: str | None, mine: bytes, theirs: bytes) -> bytes:
    """The client's (initiator's) PROOF for the HELLO payloads `mine` and `theirs`, with `fault` in it."""
    transcript = transcript_hash(mine, theirs)
    data = proof_message(Role.INITIATOR, transcript)
    if fault == "other key":
        return OTHER.sign(data)
    if fault == "their role":  # what the server signs: reflected back
        return CLIENT.sign(proof_message(Role.RESPONDER, transcript))
    if fault == "swapped hellos":
        return CLIENT.sign(proof_message(Role.INITIATOR, transcript_hash(theirs, mine)))
    if fault == "no domain":
        return CLIENT.sign(data[len(DOMAIN):])
    signature = CLIENT.sign(data)
    if fault == "truncated":
        return signature[:-1]
    if fault == "extended":
        return signature + b"\x00"
    if fault == "random":
        return os.urandom(64)
    if fault == "empty":
        return b""
    return signature


async def faulty_peer(stream, fault) -> None:
    """The client side of a handshake, written out by hand with `fault` in it."""
    parser = framing.FrameParser(1 << 20)
    nonce = os.urandom(32)
    kind, detail = fault if fault else (None, None)
    hello = mutated_hello(CLIENT, nonce, detail) if kind == "hello field" else \
        msgpack.packb(valid_hello(CLIENT, nonce), use_bin_type=True)
    if kind == "hello frame":
        if detail == "close":
            await stream.aclose()
            return
        if detail == "as proof":
            await stream.send_all(framing.control_frame(framing.PROOF, hello))
        elif detail == "as data":
            await stream.send_all(framing.HEADER.pack(framing.HEADER.size - 4 + 8 + len(hello), framing.FIRST
                                                      | framing.LAST, 1) + framing.TOTAL.pack(len(hello)) + hello)
        else:
            await stream.send_all(framing.control_frame(framing.HELLO, bytes(framing.MAX_CONTROL_BYTES + 1)))
    elif kind == "refuses":
        await stream.send_all(framing.control_frame(framing.ERROR, detail))
    else:
        await stream.send_all(framing.control_frame(framing.HELLO, hello))
    events: list = []
    while not events:
        data = await stream.receive_some(65536)
        if not data:
            return
        events = parser.receive(data)
    proof = proof_for(detail if kind == "proof" else None, hello, events[0].payload)
    if kind == "proof frame":
        if detail == "close":
            await stream.aclose()
            return
        if detail == "as hello":
            await stream.send_all(framing.control_frame(framing.HELLO, proof))
            return
        outbox = framing.Outbox()
        outbox.add(1, [b"early"])
        await stream.send_all(b"".join(bytes(f) for f in outbox.next_frames()))
    await stream.send_all(framing.control_frame(framing.PROOF, proof))


@given(handshake_faults())
@example(None)
@example(("proof", "other key"))
@example(("hello field", ("v", 1)))  # the unsealed version 1
def test_a_handshake_with_one_thing_wrong_is_a_handshake_error(fault):
    note(repr(fault))

    async def main():
        network = MemoryNetwork()
        client_end, server_end = network.stream_pair("mallory", "server")
        node = RPCNode(SERVER, network.host("server"), handshake_timeout=5.0)
        outcome: dict = {}

        async def server():
            try:
                outcome["peer"] = (await node._handshake(server_end, Role.RESPONDER)).peer_id
            except HandshakeError as error:
                outcome["error"] = error
            await server_end.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(server)
            try:
                await faulty_peer(client_end, fault)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            with trio.fail_after(10):  # virtual seconds: the handshake timeout ends any wait
                while not outcome:
                    await trio.sleep(0.1)
            await client_end.aclose()
        return outcome

    outcome = run_trio(main)
    if fault is None:
        assert outcome.get("peer") == CLIENT.peer_id, outcome
    else:
        assert isinstance(outcome.get("error"), HandshakeError), outcome


@settings(max_examples=min(settings.default.max_examples, 15))
@given(handshake_faults().filter(lambda fault: fault is not None))
@example(("proof", "other key"))
def test_the_listener_refuses_a_broken_handshake_and_keeps_serving(fault):
    async def main():
        network = MemoryNetwork(latency=0.001)
        async with RPCNode(SERVER, network.host("server"), handshake_timeout=2.0) as server, \
                RPCNode(OTHER, network.host("good")) as good:
            async def echo(ctx, args):
                return args

            server.register("echo", echo)
            address = await server.listen("server", 0)
            stream = await network.host("mallory").connect_tcp(address)
            try:
                await faulty_peer(stream, fault)
                with trio.fail_after(10):
                    while await stream.receive_some(65536):
                        pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            await stream.aclose()
            with trio.fail_after(10):
                while not server.stats["handshake_failures"]:
                    await trio.sleep(0.01)
            assert server.stats["connections_accepted"] == 0
            assert await good.call(address, "echo", "still serving", timeout=5) == "still serving"

    run_trio(main)


async def completed_handshake(network: MemoryNetwork, address) -> hand_rolled.RawChannel:
    return await hand_rolled.handshake(await network.host("mallory").connect_tcp(address), CLIENT)


@given(st.integers(0, 100), st.integers(1, 64), st.integers(1, 2**31))
@example(0, 1, 1)  # a frame carrying more than its message announced used to crash the memory reader (fixed)
def test_a_frame_longer_than_its_message_closes_only_that_connection(total, extra, stream_id):
    async def main():
        network = MemoryNetwork(latency=0.001)
        async with RPCNode(SERVER, network.host("server")) as server, RPCNode(OTHER, network.host("good")) as good:
            async def echo(ctx, args):
                return args

            server.register("echo", echo)
            address = await server.listen("server", 0)
            channel = await completed_handshake(network, address)
            stream = channel.stream
            payload = bytes(total + extra)
            await channel.send(framing.HEADER.pack(framing.HEADER.size - 4 + 8 + len(payload),
                                                   framing.FIRST | framing.LAST, stream_id)
                               + framing.TOTAL.pack(total))
            await trio.sleep(0.01)  # virtual time: the payload arrives as a later record, opened into the message
            await channel.send(payload)
            with trio.fail_after(10):
                try:
                    while await stream.receive_some(65536):
                        pass
                except trio.BrokenResourceError:
                    pass
            assert server.stats["protocol_errors"] == 1
            assert await good.call(address, "echo", "still serving", timeout=5) == "still serving"

    run_trio(main)


# ------------------------------------------------------------------------------------------- error frames


class Throttled(RemoteError):
    code = "test.handshake_properties.throttled"


rpc.register_error_code(Throttled.code, Throttled)
REGISTERED = {cls.code: cls for cls in (RemoteError, rpc.UnknownMethod, rpc.BadRequest, rpc.HandlerFailed,
                                        Throttled)}

codes = st.sampled_from(sorted(REGISTERED)) | st.text(max_size=20)
envelopes = st.one_of(
    st.tuples(st.just("error"), st.tuples(st.just(1), codes, st.text(max_size=40)).map(list)),
    st.tuples(st.just("result"), st.tuples(st.just(0), junk).map(list)),
    st.tuples(st.just("rejected"), st.one_of(
        junk.filter(lambda v: not isinstance(v, list)),
        st.just([]),
        st.tuples(st.integers(2, 2**31) | st.integers(-(2**31), -1) | st.text(max_size=3) | st.none()
                  | st.floats(allow_nan=False).filter(lambda f: f not in (0, 1)), junk).map(list),
        st.tuples(st.just(1), codes).map(list),
        st.just([1]),
    )),
)


@given(envelopes)
@example(("error", [1, "no.such.code", "who knows"]))
def test_responses_decode_to_results_typed_errors_or_response_rejected(case):
    expected, message = case
    note(repr(message))

    async def main():
        connection = RPCConnection(initiator=True, peer_id=SERVER.peer_id, address=("server", 1), idle_timeout=None,
                                   stats={"calls_received": 0, "error_replies": 0, "rejected_messages": 0})
        stream_id = connection.start_call("echo", None, deadline=10.0, now=0.0)
        connection.data_to_send(0.0)
        outbox = framing.Outbox()
        outbox.add(stream_id, [wire.encode_bytes(message)])
        reply = b"".join(bytes(f) for f in outbox.next_frames(budget=1 << 30))
        (event,) = connection.receive_data(reply, 0.0)
        assert event.stream_id == stream_id
        return event

    event = run_trio(main)
    if expected == "result":
        assert isinstance(event, CallCompleted) and event.result == message[1]
    elif expected == "rejected":
        assert isinstance(event, CallFailed) and isinstance(event.error, ResponseRejected)
    else:
        code, text = message[1], message[2]
        cls = REGISTERED.get(code, RemoteError)
        assert isinstance(event, CallFailed)
        assert type(event.error) is cls and event.error.code == code and event.error.message == text
        assert event.error.peer == SERVER.peer_id
