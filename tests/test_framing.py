"""The sans-I/O framing: chunk interleaving, limits before allocation, hostile byte streams."""

import random

import pytest

from peer.p2p import framing


def drain(outbox: framing.Outbox) -> bytes:
    out = bytearray()
    while outbox:
        for frame in outbox.next_frames():
            out += frame
    return bytes(out)


def test_messages_roundtrip_through_arbitrary_splits():
    outbox = framing.Outbox(chunk_bytes=1000)
    messages = {1: [b"a" * 5000, memoryview(b"b" * 123)], 3: [b"small"], 5: [b"x" * 999, b"y"]}
    for stream_id, parts in messages.items():
        outbox.add(stream_id, parts)
    data = drain(outbox)
    rng = random.Random(3)
    parser = framing.FrameParser(max_message_bytes=10_000, chunk_bytes=1000)
    received = {}
    position = 0
    while position < len(data):
        step = rng.randint(1, 700)
        for event in parser.receive(data[position:position + step]):
            assert isinstance(event, framing.MessageReceived)
            received[event.stream_id] = bytes(event.data)
        position += step
    assert received == {k: b"".join(bytes(p) for p in v) for k, v in messages.items()}


def test_small_message_is_not_stuck_behind_a_big_one():
    outbox = framing.Outbox(chunk_bytes=1000)
    outbox.add(1, [b"z" * 100_000])
    parser = framing.FrameParser(max_message_bytes=1 << 20, chunk_bytes=1000)
    parser.receive(b"".join(bytes(f) for f in outbox.next_frames(budget=1)))  # the big transfer is under way
    outbox.add(3, [b"ping"])
    frames_until_ping = 0
    while True:
        frames = outbox.next_frames(budget=1)
        frames_until_ping += 1
        events = parser.receive(b"".join(bytes(f) for f in frames))
        if any(isinstance(e, framing.MessageReceived) and e.stream_id == 3 for e in events):
            break
    assert frames_until_ping <= 2


def test_oversized_message_is_rejected_before_allocation_and_stream_goes_on():
    outbox = framing.Outbox(chunk_bytes=1000)
    outbox.add(1, [b"q" * 5000])
    outbox.add(3, [b"ok"])
    parser = framing.FrameParser(max_message_bytes=4000, chunk_bytes=1000)
    events = parser.receive(drain(outbox))
    assert isinstance(events[0], framing.MessageRejected) and events[0].size == 5000
    assert [e.stream_id for e in events if isinstance(e, framing.MessageReceived)] == [3]


def test_claimed_huge_size_allocates_nothing():
    header = framing.HEADER.pack(framing.HEADER.size - 4 + 8, framing.FIRST, 1) + framing.TOTAL.pack(10**15)
    parser = framing.FrameParser(max_message_bytes=1 << 30)
    events = parser.receive(header)
    assert isinstance(events[0], framing.MessageRejected)


def test_cancel_after_partial_send_tells_receiver_to_discard():
    outbox = framing.Outbox(chunk_bytes=1000)
    outbox.add(1, [b"w" * 10_000])
    parser = framing.FrameParser(max_message_bytes=1 << 20, chunk_bytes=1000)
    parser.receive(b"".join(bytes(f) for f in outbox.next_frames(budget=1)))
    assert parser.open_streams == 1
    outbox.cancel(1)
    events = parser.receive(drain(outbox))
    assert events == [framing.StreamCancelled(1)] and parser.open_streams == 0


@pytest.mark.parametrize("garbage", [
    framing.HEADER.pack(10**9, 0, 1),                 # frame longer than any allowed
    framing.HEADER.pack(framing.HEADER.size - 4, 0x77, 1),  # unknown kind
    framing.HEADER.pack(framing.HEADER.size - 4 + 3, framing.LAST, 9) + b"abc",  # continuation of nothing
])
def test_protocol_violations_raise_framing_error(garbage):
    with pytest.raises(framing.FramingError):
        framing.FrameParser(1 << 20).receive(garbage)


def test_random_bytes_only_ever_raise_framing_error():
    rng = random.Random(11)
    for _ in range(2000):
        parser = framing.FrameParser(max_message_bytes=1 << 16)
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
        try:
            parser.receive(data)
        except framing.FramingError:
            pass


def test_receive_budget_bounds_memory_held_by_half_received_messages():
    budget = framing.ReceiveBudget(3000)
    parsers = [framing.FrameParser(max_message_bytes=2000, chunk_bytes=1000, budget=budget) for _ in range(2)]
    announce = [framing.HEADER.pack(framing.HEADER.size - 4 + 8, framing.FIRST, sid) + framing.TOTAL.pack(1500)
                for sid in (1, 3)]
    # one connection may hold one maximal message's worth: the second announcement is refused
    events = parsers[0].receive(b"".join(announce))
    assert [type(e) for e in events] == [framing.MessageRejected] and "budget" in events[0].reason
    # the node's budget is shared: the other connection gets what is left, then no more
    assert parsers[1].receive(announce[0]) == [] and budget.available == 0
    # small single-frame messages are never refused for budget
    outbox = framing.Outbox(chunk_bytes=1000)
    outbox.add(7, [b"ping"])
    events = parsers[1].receive(b"".join(bytes(f) for f in outbox.next_frames()))
    assert [type(e) for e in events] == [framing.MessageReceived]
    for parser in parsers:
        parser.close()  # connections end: the budget comes back whole
    assert budget.available == 3000
