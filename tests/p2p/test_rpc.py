"""RPC between separate peers: real sockets on 127.0.0.1 and the in-memory network under MockClock alike."""

from __future__ import annotations

import contextlib
import random

import msgpack
import pytest
import torch
import trio
import trio.testing

from peer.p2p import framing, wire
from peer.p2p.budget import BudgetLimits
from peer.p2p.identity import Identity
from peer.p2p.rpc import (
    BadRequest,
    BudgetExceeded,
    CallTimeout,
    ConnectionFailed,
    HandlerFailed,
    HandshakeError,
    UnknownMethod,
)
from peer.testing import hand_rolled
from tests.p2p.rpc_peers import (
    QuotaExceeded,
    Swarmlet,
    expect_closed,
    node_cancelled_events,
    raw_connect,
    send_raw_request,
)


@pytest.fixture(params=["real", "memory"])
def transport(request):
    return request.param


@pytest.fixture
def clock(transport):
    """MockClock for the simulated network (virtual time, deterministic); the real clock for real sockets."""
    return trio.testing.MockClock(autojump_threshold=0) if transport == "memory" else "real-clock"


async def test_call_roundtrip_with_tensors_and_authenticated_caller(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        payload = {"x": torch.arange(12, dtype=torch.float32).view(3, 4), "tag": "hello", "n": [1, 2.5, None]}
        result = await a.call(b.address, "echo", payload, timeout=5)
        assert torch.equal(result["x"], payload["x"]) and result["tag"] == "hello" and result["n"] == [1, 2.5, None]
        assert await a.call(b.address, "whoami", timeout=5) == bytes(a.peer_id)
        assert await b.call(a.address, "whoami", timeout=5) == bytes(b.peer_id)


async def test_hundred_concurrent_calls_each_way(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        results = {}

        async def one(caller, callee, index):
            results[(caller.peer_id, index)] = await caller.call(callee.address, "echo", index, timeout=10)

        async with trio.open_nursery() as nursery:
            for index in range(100):
                nursery.start_soon(one, a, b, index)
                nursery.start_soon(one, b, a, index)
        assert len(results) == 200 and all(k[1] == v for k, v in results.items())
        assert a.connection_count() <= 2 and b.connection_count() <= 2  # pooled: one per direction at most


async def test_typed_errors_unknown_method_and_handler_failure(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        with trio.fail_after(1):  # answered at once, never a silent timeout
            with pytest.raises(UnknownMethod, match="no_such_method"):
                await a.call(b.address, "no_such_method", timeout=30)
        with pytest.raises(QuotaExceeded, match="3 calls") as caught:
            await a.call(b.address, "fail", "typed", timeout=5)
        assert caught.value.peer == b.peer_id and caught.value.method == "fail"
        with pytest.raises(HandlerFailed, match="ValueError: boom"):
            await a.call(b.address, "fail", "untyped", timeout=5)
        assert await a.call(b.address, "echo", 7, timeout=5) == 7  # still serving


async def test_deadline_raises_call_timeout_and_stops_remote_handler(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        cancelled = node_cancelled_events[id(b)] = trio.Event()
        start = trio.current_time()
        with pytest.raises(CallTimeout):
            await a.call(b.address, "sleep", {"seconds": 1000}, timeout=0.3)
        assert trio.current_time() - start < 1.0
        with trio.fail_after(2):
            await cancelled.wait()


async def test_cancelling_the_caller_cancels_the_handler(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        cancelled = node_cancelled_events[id(b)] = trio.Event()
        with trio.move_on_after(0.2):
            await a.call(b.address, "sleep", {"seconds": 1000}, timeout=60)
        with trio.fail_after(2):
            await cancelled.wait()
        assert await a.call(b.address, "echo", "after", timeout=5) == "after"


async def _kill_callee_during_call(swarm: Swarmlet, method: str, args, kill_when) -> tuple[object, float]:
    """Start peer b, call it from a, kill b (cancel its nursery; on the memory network also crash its host)
    once `kill_when(b)` is satisfied, and return what the call raised and how long it took."""
    async with swarm.peer("a") as a:
        outcome = []
        b_scope = trio.CancelScope()
        ready = trio.Event()
        holder = {}

        async def run_b():
            with b_scope:
                async with swarm.peer("b") as b:
                    holder["b"] = b
                    ready.set()
                    await trio.sleep_forever()

        async def caller():
            try:
                await a.call(holder["b"].address, method, args, timeout=20)
                outcome.append("finished")
            except (ConnectionFailed, CallTimeout) as error:
                outcome.append(error)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_b)
            await ready.wait()
            start = trio.current_time()
            nursery.start_soon(caller)
            await kill_when(holder["b"])
            if swarm.memory:
                swarm.memory.crash("b")
            b_scope.cancel()
        return outcome[0], trio.current_time() - start


async def test_peer_killed_mid_call_fails_with_connection_failed(transport, clock):
    swarm = Swarmlet(transport)

    async def handler_running(b):
        while not b.stats["calls_received"]:
            await trio.sleep(0.001)

    error, elapsed = await _kill_callee_during_call(swarm, "sleep", {"seconds": 1000}, handler_running)
    assert isinstance(error, ConnectionFailed) and "connection lost" in str(error)
    assert elapsed < 20


async def test_peer_killed_mid_stream_fails_with_connection_failed(autojump_clock):
    swarm = Swarmlet("memory")
    swarm.memory.set_link("a", "b", bandwidth=50_000_000)  # 32 MB take 0.64 s to cross: kill at 0.05 s

    async def part_way(b):
        await trio.sleep(0.05)

    error, elapsed = await _kill_callee_during_call(swarm, "double", torch.zeros(8_000_000), part_way)
    assert isinstance(error, ConnectionFailed) and error.peer is not None
    assert elapsed < 1


async def test_reconnects_after_the_connection_drops(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        assert await a.call(b.address, "echo", 1, timeout=5) == 1
        for connection in list(b._all_connections):
            await connection.stream.aclose()
        with trio.fail_after(5):
            while a.connection_count():
                await trio.sleep(0.01)
        assert await a.call(b.address, "echo", 2, timeout=5) == 2


async def test_expected_peer_id_mismatch_is_rejected(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        with pytest.raises(HandshakeError, match="not"):
            await a.call(b.address, "echo", 1, timeout=5, peer_id=Identity.generate().peer_id)
        assert await a.call(b.address, "echo", 1, timeout=5, peer_id=b.peer_id) == 1


async def test_client_mode_peer_calls_without_listening(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a", listen=False) as client, swarm.peer("b") as server:
        assert client.address is None
        assert await client.call(server.address, "whoami", timeout=5) == bytes(client.peer_id)


async def test_large_transfer_does_not_block_small_calls(transport, clock):
    swarm = Swarmlet(transport)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        if swarm.memory:
            swarm.memory.set_link("a", "b", bandwidth=100_000_000)  # 100 MB/s: the big call takes ~2 s
        big = torch.ones(25_000_000)  # 100 MB
        done = {}

        async def big_call():
            result = await a.call(b.address, "double", big, timeout=60)
            done["big"] = trio.current_time()
            assert float(result[12345]) == 2.0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(big_call)
            with trio.fail_after(10):  # wait until the big transfer is really under way
                while not any(c.protocol.partly_sent for c in a._all_connections):
                    await trio.sleep(0.0005)  # a poll (lets virtual time advance), not a head start
            start = trio.current_time()
            assert await a.call(b.address, "echo", "small", timeout=30) == "small"
            done["small"] = trio.current_time()
        if swarm.memory:  # deterministic virtual time: a few 1 MiB chunk times at 100 MB/s
            assert done["small"] - start < 0.1
        assert done["small"] < done["big"]


# ---------------------------------------------------------------------------------------------- hostile input


async def test_hostile_connections_are_closed_and_the_server_keeps_serving(transport, clock):
    swarm = Swarmlet(transport, handshake_timeout=1.0)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        # random bytes instead of a handshake
        stream = await raw_connect(swarm, b.address)
        await stream.send_all(bytes(random.Random(1).getrandbits(8) for _ in range(4096)))
        await expect_closed(stream)
        # connects and never speaks: closed after the handshake timeout
        silent = await raw_connect(swarm, b.address)
        await expect_closed(silent, within=5)
        # a proof signed by another key than the one announced
        forged = await raw_connect(swarm, b.address)
        with contextlib.suppress(trio.BrokenResourceError):  # the server may close before our proof is sent
            await hand_rolled.handshake(forged, hand_rolled.ForgingIdentity())
        await expect_closed(forged)
        assert b.stats["handshake_failures"] >= 2
        # a frame over the framing limit after a good handshake (sealed: an authenticated but hostile peer)
        rude = await hand_rolled.handshake(await raw_connect(swarm, b.address))
        await rude.send(framing.HEADER.pack(10**9, 0, 1))
        await expect_closed(rude.stream)
        assert await a.call(b.address, "echo", "still here", timeout=5) == "still here"


async def test_bad_messages_get_error_replies_and_the_connection_keeps_working(transport, clock):
    limits = wire.Limits(max_message_bytes=1 << 20)
    swarm = Swarmlet(transport, limits=limits)
    async with swarm.peer("b") as b:
        channel = await hand_rolled.handshake(await raw_connect(swarm, b.address))
        # truncated / undecodable request body
        reply = await send_raw_request(channel, 1, [b"\x00\x00\x00\x10garbage"])
        assert reply[0] == 1 and reply[1] == BadRequest.code
        # a message over the size limit: rejected without being stored
        reply = await send_raw_request(channel, 3, [b"\x00" * (2 << 20)])
        assert reply[0] == 1 and reply[1] == BadRequest.code and "exceeds" in reply[2]
        # deep nesting
        nested: list = []
        for _ in range(1000):
            nested = [nested]
        body = msgpack.packb(["echo", 5.0, nested])
        reply = await send_raw_request(channel, 5, [len(body).to_bytes(4, "little"), body])
        assert reply[0] == 1 and reply[1] == BadRequest.code
        # a tensor header claiming 10**12 elements
        header = msgpack.packb(["float32", [10**12], 0, 64, 4 * 10**12], use_bin_type=True)
        body = msgpack.packb(["echo", 5.0, msgpack.ExtType(1, header)], use_bin_type=True)
        reply = await send_raw_request(channel, 7, [len(body).to_bytes(4, "little"), body])
        assert reply[0] == 1 and reply[1] == BadRequest.code
        # the same connection still works for a well-formed call
        reply = await send_raw_request(channel, 9, wire.encode(["echo", 5.0, "fine"]))
        assert reply == [0, "fine"]


async def test_announced_but_unsent_messages_cannot_exhaust_memory(transport, clock):
    """Announcing holds nothing (the budget is charged as bytes arrive), and a message whose bytes stop coming is
    dropped after the stall timeout with a `BudgetExceeded` reply naming the limit."""
    limits = wire.Limits(max_message_bytes=1 << 20)
    swarm = Swarmlet(transport, limits=limits,
                     budget_limits=BudgetLimits(message_bytes_per_peer=1 << 20, message_bytes_total=2 << 20,
                                                message_stall_timeout=1.0))
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        channel = await hand_rolled.handshake(await raw_connect(swarm, b.address))
        claims = b"".join(framing.HEADER.pack(framing.HEADER.size - 4 + 8, framing.FIRST, sid)
                          + framing.TOTAL.pack(1 << 20) for sid in range(1, 41, 2))  # 20 MiB announced
        await channel.send(claims)
        assert await a.call(b.address, "echo", "small calls still work", timeout=5) == "small calls still work"
        assert b.receive_budget.available == b.receive_budget.limit  # the liar holds nothing
        with trio.fail_after(10):
            rejected = []
            while len(rejected) < 20:
                for event in await channel.receive_events():
                    if isinstance(event, framing.MessageReceived):
                        rejected.append(wire.decode(event.data))
        assert all(reply[1] == BudgetExceeded.code and "stalled" in reply[2] for reply in rejected)
        await channel.stream.aclose()
        assert b.receive_budget.available == b.receive_budget.limit


async def test_simulated_connections_take_the_zero_copy_receive_path(autojump_clock, monkeypatch):
    """On the in-memory network, message payloads are received with `receive_into` straight into the message
    buffer, as real sockets do with `recv_into` (one receive path for both)."""
    from peer.p2p.net import MemoryStream

    sizes: list[int] = []
    original = MemoryStream.receive_into

    async def counting(self, buffer):
        sizes.append(len(memoryview(buffer)))
        return await original(self, buffer)

    monkeypatch.setattr(MemoryStream, "receive_into", counting)
    swarm = Swarmlet("memory")
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        tensor = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: several chunks
        result = await a.call(b.address, "echo", tensor, timeout=30)
        assert torch.equal(result, tensor)
    assert sizes, "the RPC reader never used receive_into on a simulated connection"
    # a payload's sealed record went straight into a record-sized target, not the 64 KiB read-ahead (which took
    # the record's first bytes with its header)
    assert max(sizes) >= (1 << 20) - (64 << 10)


async def test_a_request_sent_with_the_proof_is_served(autojump_clock):
    """Bytes behind the PROOF in the same read belong to the connection (the handshake hands them on)."""
    swarm = Swarmlet("memory")
    async with swarm.peer("b") as b:
        outbox = framing.Outbox()
        outbox.add(1, wire.encode(["echo", 5.0, "with the proof"]))
        request = b"".join(bytes(f) for f in outbox.next_frames())
        channel = await hand_rolled.handshake(await raw_connect(swarm, b.address), trailing=request)
        with trio.fail_after(5):
            while True:
                replies = [e for e in await channel.receive_events() if isinstance(e, framing.MessageReceived)]
                if replies:
                    break
        assert wire.decode(replies[0].data) == [0, "with the proof"]


async def test_idle_connections_close_and_busy_ones_stay(autojump_clock):
    swarm = Swarmlet("memory", idle_timeout=10.0)
    async with swarm.peer("a") as a, swarm.peer("b") as b:
        assert await a.call(b.address, "echo", 1, timeout=5) == 1
        await trio.sleep(11)  # virtual: nothing moved for the idle timeout
        assert a.connection_count() == 0 and b.connection_count() == 0
        start = trio.current_time()
        assert await a.call(b.address, "sleep", {"seconds": 25}, timeout=60) == "slept"  # 2.5 idle timeouts
        assert trio.current_time() - start >= 25
        assert a.stats["connections_opened"] == 2  # the long call kept its connection
