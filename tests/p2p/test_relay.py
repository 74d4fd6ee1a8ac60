"""Circuit relays: the sans-I/O core byte by byte, then relays, private peers and dialers as separate RPC nodes on
the in-memory network (virtual time) and on 127.0.0.1, including hostile dialers and a relay that corrupts."""

from __future__ import annotations

import os
from contextlib import AsyncExitStack

import msgpack
import pytest
import trio
import trio.testing

from peer.p2p import relay
from peer.p2p.identity import PeerID
from peer.p2p.relay import (
    AcceptRequest,
    CircuitOpened,
    CircuitToSelf,
    ConnectRequest,
    MalformedRequest,
    NoReservation,
    RelayCore,
    RelayedAddress,
    RelayError,
    RelayLimitReached,
    RelayProtocolError,
    RequestReader,
    ResponseReader,
)
from peer.p2p.relay_service import RelayService
from peer.p2p.rpc import CallTimeout, ConnectionFailed, HandshakeError, RPCError
from tests.p2p.relay_net import Net

A, B, C = (PeerID(bytes([n]) * 20) for n in (1, 2, 3))

# ------------------------------------------------------------------------------------------------ sans-I/O core


def feed_bytewise(reader, data: bytes):
    """Feed one byte at a time, as the reader asks; returns the result and checks it never asks past the end."""
    result = None
    for index in range(len(data)):
        assert reader.next_read_size() >= 1
        result = reader.receive_data(data[index:index + 1])
        if result is not None:
            assert index == len(data) - 1, "the reader finished before its message ended"
    return result


def test_requests_and_responses_round_trip_split_anywhere():
    token = bytes(range(16))
    assert feed_bytewise(RequestReader(), relay.connect_request(A, B)) == ConnectRequest(A, B)
    assert feed_bytewise(RequestReader(), relay.accept_request(token)) == AcceptRequest(token)
    assert feed_bytewise(ResponseReader(), relay.ok_response(("10.0.0.1", 4321))) == CircuitOpened(("10.0.0.1", 4321))
    whole = ResponseReader()
    assert whole.receive_data(relay.ok_response(None)) == CircuitOpened(None)
    with pytest.raises(RelayLimitReached, match="full"):
        ResponseReader().receive_data(relay.error_response(RelayLimitReached("full")))


def test_the_reader_never_takes_bytes_past_its_message():
    data = relay.connect_request(A, B)
    reader = RequestReader()
    assert reader.next_read_size() == len(relay.MAGIC) + 4
    reader.receive_data(data[:12])
    assert reader.next_read_size() == len(data) - 12
    with pytest.raises(relay.LocalProtocolError):
        reader.receive_data(data[12:] + b"x")
    with pytest.raises(relay.LocalProtocolError):
        RequestReader().receive_data(data + b"x")


@pytest.mark.parametrize("data, words", [
    (b"SWRELAY2" + b"\0\0\0\x05hello", "bad magic"),
    (relay.MAGIC + b"\xff\xff\xff\xff", "length"),
    (relay.MAGIC + b"\0\0\0\0", "length"),
    (relay.MAGIC + b"\0\0\0\x02\xc1\xc1", "unreadable"),
    (relay.MAGIC + b"\0\0\0\x01\x05", "no map"),
])
def test_malformed_framing_is_a_typed_refusal(data, words):
    reader = RequestReader()
    with pytest.raises(MalformedRequest, match=words):
        reader.receive_data(data[:reader.next_read_size()])
        reader.receive_data(data[len(relay.MAGIC) + 4:])


@pytest.mark.parametrize("message, words", [
    ({"op": "explode"}, "unknown op"),
    ({"op": "connect", "target": b"short", "source": bytes(20)}, "20-byte"),
    ({"op": "connect", "target": bytes(20)}, "20-byte"),
    ({"op": "accept", "token": 5}, "token"),
])
def test_malformed_requests_are_typed_refusals(message, words):
    body = msgpack.packb(message, use_bin_type=True)
    with pytest.raises(MalformedRequest, match=words):
        feed_bytewise(RequestReader(), relay.MAGIC + len(body).to_bytes(4, "big") + body)


def test_a_response_that_is_none_is_a_remote_protocol_error():
    for message in ({"nothing": 1}, {"ok": True, "observed": [1, 2, 3]}):
        body = msgpack.packb(message)
        with pytest.raises(RelayProtocolError):
            ResponseReader().receive_data(len(body).to_bytes(4, "big") + body)
    with pytest.raises(RelayError):  # an unknown error code still arrives as a relay refusal
        body = msgpack.packb({"ok": False, "code": "relay.martian", "message": "?"})
        ResponseReader().receive_data(len(body).to_bytes(4, "big") + body)


def test_relayed_addresses_round_trip_and_malformed_ones_are_refused():
    relayed = RelayedAddress(A, ((B, ("127.0.0.1", 4000)), (C, ("relay.example", 4001))))
    address = relayed.to_address()
    assert address[1] == 4000 and relay.is_relayed(address)
    assert relay.parse_relayed(address) == relayed
    assert not relay.is_relayed(("127.0.0.1", 4000))
    for host in ("relay:zz", f"relay:{A.hex()}", f"relay:{A.hex()};{B.hex()}@host:0",
                 f"relay:{A.hex()};{B.hex()}@:4000", f"relay:{A.hex()};nothex@h:1"):
        with pytest.raises(MalformedRequest):
            relay.parse_relayed((host, 1))


def test_core_refuses_circuits_to_self_to_nobody_and_beyond_the_limit():
    core = RelayCore(A, limit=2, grace=5.0, accept_timeout=3.0)
    with pytest.raises(CircuitToSelf):
        core.request_circuit(ConnectRequest(A, B), None, b"t" * 16, 0.0)  # to the relay itself
    with pytest.raises(CircuitToSelf):
        core.request_circuit(ConnectRequest(B, B), None, b"t" * 16, 0.0)  # from a peer to itself
    with pytest.raises(NoReservation):
        core.request_circuit(ConnectRequest(B, C), None, b"t" * 16, 0.0)
    with pytest.raises(CircuitToSelf):
        core.reserve(A, 0.0)
    core.reserve(B, 0.0)
    first = core.request_circuit(ConnectRequest(B, C), ("1.2.3.4", 5), b"1" * 16, 0.0)
    core.request_circuit(ConnectRequest(B, C), None, b"2" * 16, 0.0)
    with pytest.raises(RelayLimitReached):
        core.request_circuit(ConnectRequest(B, C), None, b"3" * 16, 0.0)
    assert core.stats["circuits_refused"] == 4
    assert [offer.token for offer in core.poll_started(B, 1.0)] == [b"1" * 16, b"2" * 16]
    assert core.accept(AcceptRequest(b"1" * 16), 1.0) is first
    with pytest.raises(NoReservation):  # a token is good once
        core.accept(AcceptRequest(b"1" * 16), 1.0)
    core.expire(3.5)  # the second offer was never accepted: its slot frees at its deadline
    assert core.circuits == 1
    core.withdraw(first)
    core.withdraw(first)  # the dialer's end and the circuit's end both free it: once
    assert core.circuits == 0
    with pytest.raises(NoReservation):
        core.accept(AcceptRequest(b"2" * 16), 4.0)


def test_core_forgets_a_reservation_grace_seconds_after_its_last_poll():
    core = RelayCore(A, limit=4, grace=5.0)
    core.reserve(B, 0.0)
    core.poll_started(B, 1.0)
    core.expire(100.0)  # a poll outstanding: kept however long it lasts
    assert core.is_reserved(B)
    core.poll_ended(B, 100.0)
    core.expire(104.0)
    assert core.is_reserved(B)
    core.expire(105.0)
    assert not core.is_reserved(B)
    with pytest.raises(NoReservation):
        core.poll_started(B, 106.0)


def test_rate_limiter_caps_bytes_per_second():
    limiter = relay.RateLimiter(1000.0)
    assert limiter.delay(1000, 0.0) == 0.0  # one second's burst
    assert limiter.delay(500, 0.0) == pytest.approx(0.5)
    assert limiter.delay(500, 1.0) == pytest.approx(0.0)
    assert relay.RateLimiter(None).delay(10**9, 0.0) == 0.0


# --------------------------------------------------------------------------------------------- separate peers


@pytest.fixture(params=["memory", "real"])
def net(request):
    return Net(request.param)


@pytest.fixture
def clock(net):
    return trio.testing.MockClock(autojump_threshold=0) if net.memory else "real-clock"


async def test_a_trainer_calls_a_private_peer_through_a_relay_end_to_end(net, clock):
    served: list = []
    async with AsyncExitStack() as stack:
        relay_a, service_a = await stack.enter_async_context(net.relay("ra"))
        relay_b, service_b = await stack.enter_async_context(net.relay("rb"))
        private, reservations = await stack.enter_async_context(net.private("p", [relay_a, relay_b], served))
        with trio.fail_after(30):
            while len(reservations.relays) < 2:
                await trio.sleep(0.05)
        dialer = await stack.enter_async_context(net.dialer("d"))
        address = private.announce
        assert relay.is_relayed(address) and private.address is None
        with trio.fail_after(30):
            reply = await dialer.call(address, "echo", {"x": b"\0" * 100_000}, timeout=10, peer_id=private.peer_id)
        assert reply["caller"] == bytes(dialer.peer_id)  # authenticated end to end: the relay is not the caller
        assert served[0][0] == dialer.peer_id and len(served[0][1]["x"]) == 100_000
        assert dialer.stats["circuits_dialed"] == 1 and private.stats["circuits_accepted"] == 1
        relayed_bytes = service_a.core.stats["bytes_relayed"] + service_b.core.stats["bytes_relayed"]
        assert relayed_bytes > 200_000  # the call and its reply went through a relay
        for _ in range(3):  # the circuit is a pooled connection like any other
            await dialer.call(address, "echo", 1, timeout=10)
        assert dialer.stats["circuits_dialed"] == 1


async def test_a_private_peer_moves_to_another_relay_when_its_relay_dies(net, clock):
    async def run_relay(name, task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            async with net.relay(name) as (node, _):
                task_status.started((node, scope))
                await trio.sleep_forever()

    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        started = [await nursery.start(run_relay, name) for name in ("r1", "r2", "r3")]
        relays = [node for node, _ in started]
        private, reservations = await stack.enter_async_context(net.private("p", relays))
        with trio.fail_after(30):
            while len(reservations.relays) < 2:
                await trio.sleep(0.05)
        dialer = await stack.enter_async_context(net.dialer("d"))
        await dialer.call(private.announce, "echo", 1, timeout=10)
        victim = next(iter(reservations.relays))
        index = [node.peer_id for node in relays].index(victim)
        killed_at = trio.current_time()
        started[index][1].cancel()  # the relay goes away, with its connections
        with trio.fail_after(30):
            while victim in reservations.relays or len(reservations.relays) < 2:
                await trio.sleep(0.05)
        if net.memory:  # virtual time: exact; on real sockets the loaded machine decides the wall time
            assert trio.current_time() - killed_at < 10
        assert reservations.stats["relay_failures"] >= 1
        assert victim.hex() not in private.announce[0]
        fresh = await stack.enter_async_context(net.dialer("d2"))
        reply = await fresh.call(private.announce, "echo", 2, timeout=10, peer_id=private.peer_id)
        assert reply["args"] == 2


async def test_hostile_circuit_requests_are_answered_with_typed_errors(net, clock):
    async with AsyncExitStack() as stack:
        relay_node, service = await stack.enter_async_context(net.relay("r", limit=3, accept_timeout=2.0))
        private, reservations = await stack.enter_async_context(net.private("p", [relay_node], want=1))
        with trio.fail_after(30):
            while not reservations.relays:
                await trio.sleep(0.05)
        dialer = await stack.enter_async_context(net.dialer("d"))
        relay_at = ((relay_node.peer_id, relay_node.address),)
        with trio.fail_after(30):
            with pytest.raises(CircuitToSelf):  # a circuit to the relay itself
                await dialer.call(RelayedAddress(relay_node.peer_id, relay_at).to_address(), "echo", timeout=5)
            with pytest.raises(NoReservation):  # to nobody
                await dialer.call(RelayedAddress(PeerID(os.urandom(20)), relay_at).to_address(), "echo", timeout=5)
            with pytest.raises(CircuitToSelf):  # from the private peer to itself
                await private.call(private.announce, "echo", timeout=5)
            # garbage after the magic: a typed refusal, and the relay keeps serving
            stream = await net.network("d").connect_tcp(relay_node.address)
            await stream.send_all(relay.MAGIC + b"\0\0\0\x03abc")
            with pytest.raises(MalformedRequest):
                await relay.read_message(stream, ResponseReader())
            await stream.aclose()
            # an RPC handshake still works on the port the relay shares
            await dialer.call(relay_node.address, relay_service_info(), None, timeout=5)
        assert service.core.circuits == 0


def relay_service_info() -> str:
    from peer.p2p.relay_service import INFO_METHOD

    return INFO_METHOD


async def test_a_circuit_request_flood_beyond_the_limit_is_refused_and_bounded(net, clock):
    """A reserved peer that never takes its circuits: `limit` requests wait for it (then fail when their offer
    expires), every one beyond is refused at once, and afterwards the relay has every slot back."""
    async with AsyncExitStack() as stack:
        relay_node, service = await stack.enter_async_context(net.relay("r", limit=3, accept_timeout=2.0))
        sleeper = await stack.enter_async_context(net.dialer("s"))
        from peer.p2p.relay_service import RESERVE_METHOD

        await sleeper.call(relay_node.address, RESERVE_METHOD, None, timeout=5)  # reserves, never polls
        outcomes: list[type] = []

        async def request() -> None:
            stream = await net.network("f").connect_tcp(relay_node.address)
            try:
                await stream.send_all(relay.connect_request(sleeper.peer_id, PeerID(os.urandom(20))))
                await relay.read_message(stream, ResponseReader())
                outcomes.append(CircuitOpened)
            except RelayError as error:
                outcomes.append(type(error))
            finally:
                await stream.aclose()

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(12):
                    nursery.start_soon(request)
        assert outcomes.count(RelayLimitReached) == 9
        assert outcomes.count(RelayError) == 3  # the offers nobody took
        assert service.core.circuits == 0 and service.core.stats["circuits_refused"] == 9


async def test_idle_circuit_streams_cannot_lock_out_an_honest_dial(net, clock):
    """Issue 40: 300 bare streams that open the relay protocol and wait made every honest dial through the relay
    fail with `RelayLimitReached`. Now the oldest waiting stream is closed for each newcomer past the per-IP
    (and total) cap, the rest end at the request timeout, and an honest dial through the relay succeeds during
    the flood."""
    async with AsyncExitStack() as stack:
        relay_node, service = await stack.enter_async_context(net.relay("r", limit=2))
        private, reservations = await stack.enter_async_context(net.private("p", [relay_node], want=1))
        with trio.fail_after(30):
            while not reservations.relays:
                await trio.sleep(0.05)
        dialer = await stack.enter_async_context(net.dialer("d"))
        streams = []
        with trio.fail_after(60):
            for _ in range(300):
                stream = await net.network("f").connect_tcp(relay_node.address)
                await stream.send_all(relay.MAGIC)
                streams.append(stream)
            assert await dialer.call(private.announce, "echo", 7, timeout=20, peer_id=private.peer_id) is not None
            for stream in streams:  # none answered: each closed when evicted or at the request timeout
                with pytest.raises(trio.BrokenResourceError):
                    await relay.read_message(stream, ResponseReader())
                await stream.aclose()
        cap = relay_node.budget_limits.relay_requests_per_ip
        assert service.core.stats["requests_evicted"] >= 300 - cap and service._requests == 0
        from peer.p2p.relay_service import RESERVE_METHOD

        await dialer.call(relay_node.address, RESERVE_METHOD, None, timeout=5)


class _HostileStream(trio.abc.Stream):
    """Forwards everything to `inner` but what a subclass's `send_all` does to the bytes sent."""

    inner: trio.abc.Stream

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


class CorruptingStream(_HostileStream):
    """Forwards to `inner`, flipping one bit of the `nth` chunk sent through it (or dropping that chunk)."""

    def __init__(self, inner: trio.abc.Stream, nth: int, drop: bool = False):
        self.inner, self.nth, self.sent, self.drop = inner, nth, 0, drop

    async def send_all(self, data) -> None:
        self.sent += 1
        if self.sent == self.nth:
            if self.drop:
                return
            data = bytearray(data)
            data[len(data) // 2] ^= 0x10
        await self.inner.send_all(data)


def corrupting_relay(toward: str, nth: int, drop: bool = False):
    class CorruptingRelay(RelayService):
        async def _splice(self, dialer, target, offer=None):
            if toward == "dialer":
                await super()._splice(CorruptingStream(dialer, nth, drop), target, offer)
            else:
                await super()._splice(dialer, CorruptingStream(target, nth, drop), offer)

    return CorruptingRelay


@pytest.mark.parametrize("toward, nth, drop, error", [
    ("dialer", 2, False, HandshakeError),  # chunk 1 is the relay's ok, then the private peer's hello and proof
    ("dialer", 5, False, ConnectionFailed),  # a sealed reply
    ("private", 4, False, ConnectionFailed),  # a sealed request (chunks 1, 2: the dialer's hello, proof)
    # dropped chunks: the next record's counter fails it (ConnectionFailed), or, with no next one, the call's
    # deadline does (CallTimeout) -- a dropped handshake message, a dropped request, a dropped reply
    ("dialer", 2, True, (ConnectionFailed, CallTimeout)),
    ("private", 4, True, (ConnectionFailed, CallTimeout)),
    ("dialer", 5, True, (ConnectionFailed, CallTimeout)),
])
async def test_a_relay_that_corrupts_or_drops_spliced_bytes_fails_the_call_with_a_typed_error(net, clock, toward,
                                                                                              nth, drop, error):
    """Each call is bounded by its timeout, the failure is typed, and no handler sees an altered message."""
    served: list = []
    async with AsyncExitStack() as stack:
        relay_node, _ = await stack.enter_async_context(net.relay(
            "r", service_class=corrupting_relay(toward, nth, drop)))
        private, reservations = await stack.enter_async_context(net.private("p", [relay_node], served, want=1))
        with trio.fail_after(30):
            while not reservations.relays:
                await trio.sleep(0.05)
        dialer = await stack.enter_async_context(net.dialer("d"))
        with trio.fail_after(60):
            with pytest.raises(error):
                for attempt in range(8):  # a call per chunk until the corrupted one
                    began = trio.current_time()
                    await dialer.call(private.announce, "echo", attempt, timeout=5)
        if net.memory:  # virtual time: the failed call ended within its timeout
            assert trio.current_time() - began <= 5 + 1e-6
        assert all(args in range(8) for _, args in served)  # no handler saw altered bytes
        assert len(served) < 8


class DelayingStream(_HostileStream):
    """Forwards to `inner`, from its `start`th chunk on holding each one `hold` seconds, or trickling it a byte
    per `trickle` seconds."""

    def __init__(self, inner: trio.abc.Stream, start: int, hold: float = 0.0, trickle: float = 0.0):
        self.inner, self.start, self.hold, self.trickle, self.sent = inner, start, hold, trickle, 0

    async def send_all(self, data) -> None:
        self.sent += 1
        if self.sent < self.start:
            await self.inner.send_all(data)
            return
        await trio.sleep(self.hold)
        if not self.trickle:
            await self.inner.send_all(data)
            return
        for index in range(len(data)):
            await self.inner.send_all(data[index:index + 1])
            await trio.sleep(self.trickle)


def delaying_relay(toward: str, start: int, **delay):
    class DelayingRelay(RelayService):
        async def _splice(self, dialer, target, offer=None):
            if toward == "dialer":
                await super()._splice(DelayingStream(dialer, start, **delay), target, offer)
            else:
                await super()._splice(dialer, DelayingStream(target, start, **delay), offer)

    return DelayingRelay


DELAYS = [  # chunk 1 toward the dialer is the relay's own ok, 2 and 3 the private peer's hello and proof
    ("dialer", 1, {"hold": 30.0}),  # the circuit's ok itself
    ("dialer", 2, {"hold": 30.0}),  # the handshake through it
    ("private", 1, {"hold": 30.0}),  # the dialer's hello
    ("dialer", 2, {"trickle": 1.0}),  # the handshake, a byte a second
]


@pytest.mark.parametrize("toward, start, delay", DELAYS)
async def test_a_relay_that_delays_spliced_bytes_fails_the_call_within_its_timeout(autojump_clock, toward, start,
                                                                                   delay):
    """A relay that holds every spliced chunk for longer than the call's timeout, or trickles it: the call fails
    with a typed `CallTimeout` (or `ConnectionFailed`), within its timeout, and no handler ran."""
    net = Net("memory")
    served: list = []
    async with AsyncExitStack() as stack:
        relay_node, _ = await stack.enter_async_context(net.relay(
            "slow", service_class=delaying_relay(toward, start, **delay)))
        private, reservations = await stack.enter_async_context(net.private("p", [relay_node], served, want=1))
        with trio.fail_after(30):
            while not reservations.relays:
                await trio.sleep(0.05)
        dialer = await stack.enter_async_context(net.dialer("d"))
        began = trio.current_time()
        with pytest.raises((CallTimeout, ConnectionFailed)):
            await dialer.call(private.announce, "echo", 1, timeout=5)
        assert trio.current_time() - began <= 5 + 1e-6
        assert served == []


@pytest.mark.parametrize("toward, start, delay", DELAYS)
async def test_a_caller_moves_on_from_a_delaying_relay_to_the_targets_other_relay(autojump_clock, toward, start,
                                                                                  delay):
    """The target's first relay delays the circuit (its ok, or the handshake through it): the dial gives that
    relay its share of the connect timeout and then takes the circuit through the second, honest one; the call is
    answered within its timeout."""
    net = Net("memory")
    served: list = []
    async with AsyncExitStack() as stack:
        slow, _ = await stack.enter_async_context(net.relay(
            "slow", service_class=delaying_relay(toward, start, **delay)))
        honest, honest_service = await stack.enter_async_context(net.relay("honest"))
        private, reservations = await stack.enter_async_context(net.private("p", [slow, honest], served))
        with trio.fail_after(30):
            while len(reservations.relays) < 2:
                await trio.sleep(0.05)
        address = RelayedAddress(private.peer_id, ((slow.peer_id, slow.address),
                                                   (honest.peer_id, honest.address))).to_address()
        dialer = await stack.enter_async_context(net.dialer("d"))
        began = trio.current_time()
        reply = await dialer.call(address, "echo", 1, timeout=10, peer_id=private.peer_id)
        assert reply["args"] == 1 and trio.current_time() - began < 10
        assert honest_service.core.stats["circuits_opened"] == 1 and honest_service.core.stats["bytes_relayed"] > 0
        assert served == [(dialer.peer_id, 1)]


async def test_a_caller_refused_by_a_full_relay_goes_through_the_targets_other_relay(autojump_clock):
    """The first relay runs its `limit` circuits already (`RelayLimitReached`): the dial goes on to the second
    relay at once. With only the full relay, the dial tries again (a pause, doubling) until its connect timeout,
    then fails with the relay's typed refusal."""
    net = Net("memory")
    async with AsyncExitStack() as stack:
        full, full_service = await stack.enter_async_context(net.relay("full", limit=1))
        other, other_service = await stack.enter_async_context(net.relay("other", limit=1))
        private, reservations = await stack.enter_async_context(net.private("p", [full, other]))
        with trio.fail_after(30):
            while len(reservations.relays) < 2:
                await trio.sleep(0.05)
        first_only = RelayedAddress(private.peer_id, ((full.peer_id, full.address),)).to_address()
        both = RelayedAddress(private.peer_id, ((full.peer_id, full.address),
                                                (other.peer_id, other.address))).to_address()
        holder = await stack.enter_async_context(net.dialer("holder"))
        await holder.call(first_only, "echo", 0, timeout=10)  # holds the full relay's one circuit (pooled)
        assert full_service.core.circuits == 1
        dialer = await stack.enter_async_context(net.dialer("d", connect_timeout=1.0))
        began = trio.current_time()
        with pytest.raises(RelayLimitReached):
            await dialer.call(first_only, "echo", 1, timeout=10)
        assert trio.current_time() - began <= 1.0 + 1e-6
        refused = full_service.core.stats["circuits_refused"]
        assert refused >= 3  # the first try and the retries after 0.25 and 0.5 s pauses
        began = trio.current_time()
        assert (await dialer.call(both, "echo", 2, timeout=10))["args"] == 2
        assert trio.current_time() - began < 1.0  # no time spent waiting on the full relay
        assert full_service.core.stats["circuits_refused"] == refused + 1
        assert other_service.core.stats["circuits_opened"] == 1
        # the holder's circuit closes once idle for the circuit idle timeout: a dial waiting on the full relay
        # alone gets the slot then, within its connect timeout
        from peer.p2p.rpc import CIRCUIT_IDLE_TIMEOUT

        patient = await stack.enter_async_context(net.dialer("patient"))
        assert patient.connect_timeout > CIRCUIT_IDLE_TIMEOUT
        assert (await patient.call(first_only, "echo", 3, timeout=10))["args"] == 3
        assert full_service.core.stats["circuits_refused"] > refused + 1  # it was refused, then retried


async def test_a_dead_relay_in_a_relayed_address_is_skipped_for_the_next(net, clock):
    async with AsyncExitStack() as stack:
        relay_node, _ = await stack.enter_async_context(net.relay("r"))
        private, reservations = await stack.enter_async_context(net.private("p", [relay_node], want=1))
        with trio.fail_after(30):
            while not reservations.relays:
                await trio.sleep(0.05)
        dead = (PeerID(os.urandom(20)), (net.host("r"), 1))
        live = relay.parse_relayed(private.announce).relays
        address = RelayedAddress(private.peer_id, (dead, *live)).to_address()
        dialer = await stack.enter_async_context(net.dialer("d"))
        with trio.fail_after(30):
            assert (await dialer.call(address, "echo", 7, timeout=10))["args"] == 7
        with pytest.raises(RPCError):
            await dialer.call(RelayedAddress(private.peer_id, (dead,)).to_address(), "echo", 7, timeout=5)


@pytest.mark.parametrize("caps", [{"rate": 100_000.0}, {"total_rate": 100_000.0}])
async def test_the_byte_caps_hold_a_circuit_to_its_rate_in_virtual_time(autojump_clock, caps):
    """300 kB each way through a relay capped at 100 kB/s (one second's burst): at least 5 s of virtual time."""
    net = Net("memory")
    async with AsyncExitStack() as stack:
        relay_node, service = await stack.enter_async_context(net.relay("r", **caps))
        private, reservations = await stack.enter_async_context(net.private("p", [relay_node], want=1))
        with trio.fail_after(30):
            while not reservations.relays:
                await trio.sleep(0.05)
        dialer = await stack.enter_async_context(net.dialer("d"))
        await dialer.call(private.announce, "echo", 0, timeout=10)  # the circuit and handshake first
        start = trio.current_time()
        reply = await dialer.call(private.announce, "echo", b"\0" * 300_000, timeout=60)
        assert len(reply["args"]) == 300_000
        assert trio.current_time() - start >= 5.0 - 0.1
        assert service.core.stats["bytes_relayed"] >= 600_000
