"""The sans-I/O RPC connection protocol (peer/p2p/rpc_protocol.py), driven with bytes and numbers only.

Two cores face each other (`alice` dialed, `bob` accepted); a test moves `data_to_send` of one into
`receive_data` of the other and passes time as a number. Covers stream ids, replies and typed error replies,
unknown methods, bad messages, byte-by-byte feeding and every split boundary (including the zero-copy
`receive_target` path), deadlines expiring as time is passed, cancellation both ways, the idle check, frames
with one field wrong (RemoteProtocolError) and our own misuse (LocalProtocolError).
"""

from __future__ import annotations

import pytest
import torch

from peer.p2p import framing, wire
from peer.p2p.identity import Identity
from peer.p2p.rpc_protocol import (
    BadRequest,
    CallCompleted,
    CallFailed,
    CallTimeout,
    ConnectionFailed,
    ConnectionIdle,
    HandlerFailed,
    LocalProtocolError,
    RemoteError,
    RemoteProtocolError,
    RequestCancelled,
    RequestReceived,
    ResponseRejected,
    RPCConnection,
    UnknownMethod,
    register_error_code,
)

ALICE = Identity.from_seed(b"alice").peer_id
BOB = Identity.from_seed(b"bob").peer_id
BOB_ADDRESS = ("10.0.0.2", 4100)


class Throttled(RemoteError):
    code = "test.rpc_protocol.throttled"


register_error_code(Throttled.code, Throttled)


def stats() -> dict[str, int]:
    return {"calls_received": 0, "error_replies": 0, "rejected_messages": 0}


def pair(**options) -> tuple[RPCConnection, RPCConnection]:
    options = {"idle_timeout": None, **options}
    alice = RPCConnection(initiator=True, peer_id=BOB, address=BOB_ADDRESS, stats=stats(), **options)
    bob = RPCConnection(initiator=False, peer_id=ALICE, methods={"echo", "sleep"}, stats=stats(), **options)
    return alice, bob


def wire_bytes(core: RPCConnection, now: float = 0.0) -> bytes:
    out = bytearray()
    while True:
        writes = core.data_to_send(now)
        if not writes:
            return bytes(out)
        for buffer in writes:
            out += buffer


def pump(source: RPCConnection, target: RPCConnection, now: float = 0.0) -> list:
    return target.receive_data(wire_bytes(source, now), now)


def test_a_call_is_a_request_event_and_its_reply_completes_it():
    alice, bob = pair()
    stream_id = alice.start_call("echo", {"x": [1, 2]}, deadline=10.0, now=1.0)
    assert stream_id == 1
    (request,) = pump(alice, bob, now=1.5)
    assert request == RequestReceived(1, "echo", {"x": [1, 2]}, 10.5)  # 9 s left, counted from bob's clock
    bob.send_reply(1, {"x": [1, 2]})
    assert pump(bob, alice) == [CallCompleted(1, {"x": [1, 2]})]
    assert not alice.calls and not bob.requests and not alice.busy and not bob.busy
    assert bob.stats == {"calls_received": 1, "error_replies": 0, "rejected_messages": 0}


def test_stream_ids_are_odd_for_the_dialer_even_for_the_other_side_and_never_collide():
    alice, bob = pair()
    bob.methods = alice.methods = {"echo"}
    assert [alice.start_call("echo", i, deadline=10, now=0) for i in range(3)] == [1, 3, 5]
    assert [bob.start_call("echo", i, deadline=10, now=0) for i in range(2)] == [2, 4]
    from_alice = pump(alice, bob)
    from_bob = pump(bob, alice)
    assert [e.stream_id for e in from_alice] == [1, 3, 5] and [e.stream_id for e in from_bob] == [2, 4]
    for event in from_alice:
        bob.send_reply(event.stream_id, event.args * 10)
    for event in from_bob:
        alice.send_reply(event.stream_id, event.args * 100)
    assert pump(bob, alice) == [CallCompleted(1, 0), CallCompleted(3, 10), CallCompleted(5, 20)]
    assert pump(alice, bob) == [CallCompleted(2, 0), CallCompleted(4, 100)]


def test_tensors_cross_and_big_chunks_leave_as_zero_copy_views():
    alice, bob = pair()
    tensor = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: several chunks
    alice.start_call("echo", tensor, deadline=10, now=0)
    writes = []
    while batch := alice.data_to_send(0):  # one chunk per round; unsealed, the views stay valid
        writes += batch
    assert any(isinstance(w, memoryview) and len(w) >= 1 << 20 for w in writes)
    data = b"".join(bytes(w) for w in writes)
    (request,) = bob.receive_data(data, 0)
    assert torch.equal(request.args, tensor)


def test_a_reply_queued_behind_a_big_message_waits_for_one_chunk_of_it_not_all():
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=10, now=0)
    (ping,) = pump(alice, bob)
    bob.start_call("echo", torch.zeros((3 << 18) - 1024, dtype=torch.float32), deadline=10, now=0)  # 3 chunks
    rounds = [b"".join(bytes(w) for w in bob.data_to_send(0))]
    assert len(rounds[0]) < 2 * framing.CHUNK_BYTES  # one chunk per write round, not the whole message
    bob.send_reply(ping.stream_id, "pong")
    while writes := bob.data_to_send(0):
        rounds.append(b"".join(bytes(w) for w in writes))
    assert len(rounds) == 3
    parser = framing.FrameParser(wire.DEFAULT_LIMITS.max_message_bytes)
    arrivals = [(index, event.stream_id) for index, data in enumerate(rounds) for event in parser.receive(data)]
    assert arrivals == [(2, ping.stream_id), (2, 2)]  # the reply leaves ahead of the request's last chunk


def test_small_frames_are_coalesced_into_one_write():
    alice, bob = pair()
    for index in range(50):
        alice.start_call("echo", index, deadline=10, now=0)
    writes = alice.data_to_send(0)
    assert len(writes) == 1
    assert [e.args for e in bob.receive_data(writes[0], 0)] == list(range(50))


# ---------------------------------------------------------------------------------------- splits


def three_requests() -> tuple[RPCConnection, bytes]:
    alice, bob = pair(chunk_bytes=64)
    alice.start_call("echo", b"x" * 200, deadline=10, now=0)  # several chunks, interleaved with the others
    alice.start_call("echo", "small", deadline=10, now=0)
    alice.start_call("sleep", {"seconds": 3}, deadline=10, now=0)
    return bob, wire_bytes(alice)


def summary(events: list) -> list:
    return [(e.stream_id, e.method, e.args, e.deadline) for e in events]


EXPECTED = [(3, "echo", "small", 10.0), (5, "sleep", {"seconds": 3}, 10.0), (1, "echo", b"x" * 200, 10.0)]


def test_byte_by_byte_feeding_gives_the_same_events():
    bob, data = three_requests()
    events = []
    for index in range(len(data)):
        events += bob.receive_data(data[index:index + 1], 0)
    assert summary(events) == EXPECTED


def test_every_split_boundary_gives_the_same_events():
    _, data = three_requests()
    for cut in range(len(data) + 1):
        bob, _ = three_requests()
        events = bob.receive_data(data[:cut], 0) + bob.receive_data(data[cut:], 0)
        assert summary(events) == EXPECTED, cut


@pytest.mark.parametrize("step", [1, 7, 64, 10_000])
def test_the_zero_copy_path_reads_payloads_into_their_targets(step):
    """What the trio driver does with recv_into: read into `receive_target()` when there is one, else into a
    scratch buffer for `receive_data`; both paths give the same events."""
    bob, data = three_requests()
    events, position, targeted = [], 0, 0
    while position < len(data):
        target = bob.receive_target()
        if target is not None:
            n = min(len(target), step, len(data) - position)
            target[:n] = data[position:position + n]
            events += bob.advance(n, 0)
            targeted += n
        else:
            n = min(step, len(data) - position)
            events += bob.receive_data(data[position:position + n], 0)
        position += n
    assert summary(events) == EXPECTED
    if 1 < step < len(data):
        assert targeted  # some payload bytes went straight into message buffers


# ---------------------------------------------------------------------------------------- errors


def test_typed_error_replies_become_the_registered_class_with_peer_address_and_method():
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=10, now=0)
    alice.start_call("echo", 2, deadline=10, now=0)
    pump(alice, bob)
    bob.send_error(1, Throttled.code, "three per minute")
    bob.send_error(3, "newer.peer.code", "you would not know")
    first, second = pump(bob, alice)
    assert type(first.error) is Throttled and first.error.message == "three per minute"
    assert (first.error.peer, first.error.address, first.error.method) == (BOB, BOB_ADDRESS, "echo")
    assert type(second.error) is RemoteError and second.error.code == "newer.peer.code"
    assert bob.stats["error_replies"] == 2


def test_an_unknown_method_is_answered_at_once_without_an_event():
    alice, bob = pair()
    alice.start_call("no_such_method", None, deadline=10, now=0)
    assert pump(alice, bob) == []
    (failed,) = pump(bob, alice)
    assert isinstance(failed.error, UnknownMethod) and "no_such_method" in failed.error.message
    assert bob.stats == {"calls_received": 1, "error_replies": 1, "rejected_messages": 0}


def raw_message(stream_id: int, parts: list) -> bytes:
    outbox = framing.Outbox()
    outbox.add(stream_id, parts)
    return b"".join(bytes(f) for f in outbox.next_frames(budget=1 << 30))


def bob_answer(bob: RPCConnection, data: bytes) -> list:
    assert bob.receive_data(data, 0) == []
    return [wire.decode(e.data) for e in framing.FrameParser(1 << 20).receive(wire_bytes(bob))]


@pytest.mark.parametrize("body, reason", [
    (wire.encode(["echo", 5.0]), "malformed request envelope"),
    (wire.encode([b"echo", 5.0, None]), "malformed request envelope"),
    (wire.encode(["echo", "soon", None]), "malformed request envelope"),
    (wire.encode(["echo", True, None]), "malformed request envelope"),
    (wire.encode({"method": "echo"}), "malformed request envelope"),
    ([b"\x00\x00\x00\x10garbage"], "undecodable request"),
])
def test_bad_requests_get_a_bad_request_reply_and_the_connection_goes_on(body, reason):
    _, bob = pair()
    ((flag, code, text),) = bob_answer(bob, raw_message(1, body))
    assert (flag, code) == (1, BadRequest.code) and reason in text
    assert summary(bob.receive_data(raw_message(3, wire.encode(["echo", None, "fine"])), 0)) == [
        (3, "echo", "fine", None)]


def test_an_oversized_request_is_refused_before_it_is_stored():
    _, bob = pair(limits=wire.Limits(max_message_bytes=1000))
    ((_, code, text),) = bob_answer(bob, raw_message(1, [b"\x00" * 2000]))
    assert code == BadRequest.code and "exceeds" in text
    assert bob.stats["rejected_messages"] == 1


@pytest.mark.parametrize("reply", [[2, "x"], [], "just a string", [1, "code"], [0.5]])
def test_malformed_replies_fail_only_their_call(reply):
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=10, now=0)
    alice.start_call("echo", 2, deadline=10, now=0)
    pump(alice, bob)
    (failed,) = alice.receive_data(raw_message(1, wire.encode(reply)), 0)
    assert isinstance(failed.error, ResponseRejected) and failed.error.method == "echo"
    bob.send_reply(3, "second")
    assert pump(bob, alice) == [CallCompleted(3, "second")]


def test_an_oversized_reply_is_rejected_for_its_call():
    alice, _ = pair(limits=wire.Limits(max_message_bytes=1000))
    alice.start_call("echo", 1, deadline=10, now=0)
    (failed,) = alice.receive_data(raw_message(1, [b"\x00" * 2000]), 0)
    assert isinstance(failed.error, ResponseRejected) and "exceeds" in failed.error.message


def valid_request() -> bytes:
    return raw_message(1, wire.encode(["echo", 5.0, "x"]))


def with_header(data: bytes, *, length: int | None = None, kind: int | None = None,
                stream_id: int | None = None) -> bytes:
    old_length, old_kind, old_stream = framing.HEADER.unpack_from(data)
    header = framing.HEADER.pack(old_length if length is None else length, old_kind if kind is None else kind,
                                 old_stream if stream_id is None else stream_id)
    return header + data[framing.HEADER.size:]


@pytest.mark.parametrize("frame, reason", [
    (with_header(valid_request(), length=10**9), "outside the allowed"),
    (with_header(valid_request(), length=3), "outside the allowed"),
    (with_header(valid_request(), kind=0x7F), "unknown frame kind"),
    (with_header(valid_request(), kind=0), "continuation for unknown stream"),
    (with_header(valid_request(), kind=framing.LAST), "continuation for unknown stream"),
    (valid_request()[:framing.HEADER.size] + framing.TOTAL.pack(3) + valid_request()[framing.HEADER.size + 8:],
     "more than its announced size"),
    (framing.HEADER.pack(framing.HEADER.size - 4 + 1, framing.CANCEL, 1) + b"x", "cancel frame with a payload"),
    (framing.control_frame(framing.HELLO, b"again"), "unexpected control frame"),
    (framing.control_frame(framing.ERROR, b"bye"), "unexpected control frame"),
])
def test_a_frame_with_one_field_wrong_is_a_remote_protocol_error(frame, reason):
    _, bob = pair()
    with pytest.raises(RemoteProtocolError, match=reason):
        bob.receive_data(frame, 0)
    with pytest.raises(LocalProtocolError):  # the connection is over: feeding it more is our bug
        bob.receive_data(valid_request(), 0)


def test_a_stream_id_reused_while_its_request_runs_is_a_remote_protocol_error():
    _, bob = pair()
    bob.receive_data(valid_request(), 0)
    with pytest.raises(RemoteProtocolError, match="reused"):
        bob.receive_data(valid_request(), 0)


def test_replies_that_arrived_before_a_bad_frame_are_still_delivered():
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=10, now=0)
    alice.start_call("echo", 2, deadline=10, now=0)
    pump(alice, bob)
    bob.send_reply(1, "one")
    data = wire_bytes(bob) + framing.control_frame(framing.HELLO, b"?")
    with pytest.raises(RemoteProtocolError) as caught:
        alice.receive_data(data, 0)
    assert caught.value.events == [CallCompleted(1, "one")]
    (lost,) = alice.connection_lost("protocol error")
    assert lost.stream_id == 3 and isinstance(lost.error, ConnectionFailed)


# ---------------------------------------------------------------------------------------- time


def test_a_call_expires_when_its_deadline_is_passed_and_the_handler_is_cancelled():
    alice, bob = pair()
    alice.start_call("sleep", {"seconds": 100}, deadline=5.0, now=0.0)
    assert alice.next_deadline() == 5.0
    pump(alice, bob)
    assert alice.timeouts(4.999) == []
    (expired,) = alice.timeouts(5.0)
    assert isinstance(expired.error, CallTimeout) and str(expired.error) == (
        f"sleep to 10.0.0.2:4100 (peer {BOB.short()}): no answer within 5 s")
    assert alice.next_deadline() is None and alice.timeouts(50.0) == []
    assert pump(alice, bob) == [RequestCancelled(1, expired=False)]  # the CANCEL frame reached bob
    bob.send_reply(1, "too late")  # the handler finished anyway: its reply is dropped
    assert wire_bytes(bob) == b"" and not bob.requests


def test_a_late_reply_after_expiry_is_ignored():
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=1.0, now=0.0)
    pump(alice, bob)
    alice.timeouts(2.0)
    bob.send_reply(1, 1)
    late = wire_bytes(bob)
    alice.data_to_send(2.0)  # the CANCEL frame
    assert alice.receive_data(late, 2.0) == []


def test_a_request_expires_on_the_handler_side_too():
    alice, bob = pair()
    alice.start_call("sleep", {"seconds": 100}, deadline=3.0, now=0.0)
    (request,) = pump(alice, bob, now=0.25)
    assert request.deadline == 3.25 and bob.next_deadline() == 3.25
    assert bob.timeouts(3.25) == [RequestCancelled(1, expired=True)]
    assert bob.timeouts(4.0) == [] and bob.busy  # still in flight until the handler is gone
    bob.abandon_request(1)
    assert not bob.busy and bob.next_deadline() is None


def test_a_request_without_a_timeout_has_no_deadline():
    _, bob = pair()
    (request,) = bob.receive_data(raw_message(1, wire.encode(["echo", None, "x"])), 0)
    assert request.deadline is None and bob.next_deadline() is None


def test_the_earliest_deadline_comes_first_and_answered_calls_drop_out():
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=30.0, now=0.0)
    alice.start_call("echo", 2, deadline=10.0, now=0.0)
    alice.start_call("echo", 3, deadline=20.0, now=0.0)
    assert alice.next_deadline() == 10.0
    pump(alice, bob)
    bob.send_reply(3, 2)
    pump(bob, alice)
    assert alice.next_deadline() == 20.0
    (expired,) = alice.timeouts(25.0)
    assert expired.stream_id == 5 and alice.next_deadline() == 30.0


def test_answered_calls_do_not_pile_up_in_the_deadline_heap():
    alice, bob = pair()
    for index in range(5000):
        alice.start_call("echo", index, deadline=1000.0 + index, now=0.0)
        (request,) = pump(alice, bob)
        bob.send_reply(request.stream_id, index)
        pump(bob, alice)
    assert len(alice._deadlines) < 2000


def test_cancelling_a_call_that_left_tells_the_handler_one_that_did_not_sends_nothing():
    alice, bob = pair()
    sent = alice.start_call("sleep", {}, deadline=10, now=0)
    pump(alice, bob)
    unsent = alice.start_call("sleep", {}, deadline=10, now=0)
    alice.cancel_call(sent)
    alice.cancel_call(unsent)
    assert pump(alice, bob) == [RequestCancelled(sent, expired=False)]
    assert not alice.calls and alice.next_deadline() is None
    bob.abandon_request(sent)
    assert not bob.busy


def test_an_idle_connection_is_reported_once_a_busy_one_is_looked_at_again_later():
    alice, bob = pair(idle_timeout=60.0)
    assert alice.next_deadline() == 60.0
    alice.start_call("sleep", {}, deadline=1000, now=10.0)
    pump(alice, bob, now=10.0)
    assert alice.next_deadline() == 70.0
    assert alice.timeouts(70.0) == [] and alice.next_deadline() == 130.0  # a call in flight: not idle
    assert bob.timeouts(70.0) == []  # bob runs its handler
    bob.send_reply(1, "done")
    pump(bob, alice, now=100.0)
    assert alice.timeouts(159.0) == []
    assert alice.timeouts(160.0) == [ConnectionIdle()]
    assert alice.timeouts(500.0) == [] and alice.next_deadline() is None


def test_the_idle_deadline_it_names_is_due_at_that_time_whatever_the_rounding():
    """`next_deadline` is last_activity + timeout; at exactly that time the connection must be found idle (with
    last activity at 495.435, 495.435 + 300 - 495.435 is below 300 in floats: a driver would wake up forever)."""
    for last in (495.435, 835.765, 228.762, 0.25):
        alice, _ = pair(idle_timeout=300.0)
        alice.last_activity = last
        deadline = alice.next_deadline()
        assert deadline is not None and alice.timeouts(deadline) == [ConnectionIdle()]


# ---------------------------------------------------------------------------------------- closing


def test_a_lost_connection_fails_every_call_and_cancels_every_request():
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=10, now=0)
    alice.start_call("sleep", {}, deadline=10, now=0)
    pump(alice, bob)
    lost = alice.connection_lost("reset (BrokenResourceError)")
    assert [e.stream_id for e in lost] == [1, 3]
    assert all(type(e) is CallFailed and isinstance(e.error, ConnectionFailed)
               and "connection lost: reset" in e.error.message for e in lost)
    assert bob.connection_lost("closed by peer") == [RequestCancelled(1, False), RequestCancelled(3, False)]
    bob.send_reply(1, "nobody listens")  # handlers ending after the end are no error
    bob.abandon_request(3)
    assert alice.receive_data(b"late bytes", 1.0) == []  # bytes racing the close are dropped


# ---------------------------------------------------------------------------------------- our mistakes


def test_replying_twice_or_to_no_request_is_our_bug():
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=10, now=0)
    pump(alice, bob)
    bob.send_reply(1, 1)
    with pytest.raises(LocalProtocolError):
        bob.send_reply(1, 1)
    with pytest.raises(LocalProtocolError):
        bob.send_error(7, HandlerFailed.code, "no such request")
    with pytest.raises(LocalProtocolError):
        bob.abandon_request(9)


def test_an_unencodable_reply_leaves_the_request_open_for_an_error_reply():
    alice, bob = pair()
    alice.start_call("echo", 1, deadline=10, now=0)
    pump(alice, bob)
    with pytest.raises(wire.WireError):
        bob.send_reply(1, object())
    bob.send_error(1, HandlerFailed.code, "unencodable result")
    (failed,) = pump(bob, alice)
    assert isinstance(failed.error, HandlerFailed)


def test_calling_on_a_closed_connection_is_our_bug():
    alice, _ = pair()
    alice.connection_lost("closed")
    with pytest.raises(LocalProtocolError, match="closed connection"):
        alice.start_call("echo", 1, deadline=10, now=0)
