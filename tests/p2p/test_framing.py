"""The sans-I/O framing: chunk interleaving, limits before allocation, hostile byte streams."""

import random
import struct

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


def hostile_stream(rng: random.Random) -> bytes:
    """Frames a peer could plausibly send: an Outbox's chunks of a few messages (and a control frame), then one
    corruption -- a header field changed, payload bytes flipped, bytes cut or inserted -- so that most inputs
    get past the header checks and exercise payload parsing (random bytes almost never do: their first four
    bytes are a frame length over the limit)."""
    outbox = framing.Outbox(chunk_bytes=rng.randint(1, 200))
    for stream_id in rng.sample(range(1, 40), rng.randint(1, 4)):
        outbox.add(stream_id, [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 400)))])
    if rng.random() < 0.3:
        outbox.add_control(framing.control_frame(rng.choice([framing.HELLO, framing.ERROR]), b"hi"))
    frames = [bytes(f) for f in outbox.next_frames(budget=1 << 20)]
    index = rng.randrange(len(frames))
    frame = bytearray(frames[index])
    corruption = rng.choice(["length", "kind", "stream_id", "payload", "cut", "insert"])
    if corruption == "length":
        struct.pack_into("<I", frame, 0, max(0, struct.unpack_from("<I", frame)[0] + rng.randint(-20, 20)))
    elif corruption == "kind":
        frame[4] = rng.choice([0, framing.FIRST, framing.LAST, framing.FIRST | framing.LAST, framing.CANCEL,
                               framing.HELLO, rng.getrandbits(8)])
    elif corruption == "stream_id":
        struct.pack_into("<I", frame, 5, rng.choice([0, 1, 2, rng.getrandbits(32)]))
    elif corruption == "payload" and len(frame) > framing.HEADER.size:
        position = rng.randrange(framing.HEADER.size, len(frame))
        frame[position] ^= 1 << rng.randrange(8)
    elif corruption == "cut":
        del frame[rng.randrange(len(frame)):]
    else:
        frame[rng.randrange(len(frame) + 1):0] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 9)))
    frames[index] = bytes(frame)
    return b"".join(frames)


def test_hostile_streams_only_ever_raise_framing_error_and_most_reach_payload_parsing(monkeypatch):
    consume = framing.FrameParser._consume

    def counting_consume(self, view, events):
        self.reached_payload = True
        return consume(self, view, events)

    monkeypatch.setattr(framing.FrameParser, "_consume", counting_consume)
    rng = random.Random(11)
    cases, deep, errors = 2000, 0, 0
    for _ in range(cases):
        parser = framing.FrameParser(max_message_bytes=1 << 16, chunk_bytes=200)
        data = hostile_stream(rng)
        position = 0
        try:
            while position < len(data):
                step = rng.randint(1, 300)
                parser.receive(data[position:position + step])
                position += step
        except framing.FramingError:
            errors += 1
        deep += getattr(parser, "reached_payload", False)
        parser.close()
        assert parser.budget.available == parser.budget.limit  # nothing half received stays counted
    assert deep >= 0.8 * cases, f"only {deep} of {cases} inputs reached payload parsing"
    assert 0.1 * cases < errors < cases  # corruptions are caught, and some leave a valid reading


def _chunk(stream_id: int, kind: int, payload: bytes, total: int | None = None) -> bytes:
    prefix = framing.TOTAL.pack(total) if total is not None else b""
    return framing.HEADER.pack(framing.HEADER.size - 4 + len(prefix) + len(payload), kind, stream_id) + prefix + payload


def test_receive_budget_charges_bytes_as_they_arrive_per_peer_and_evicts_the_heaviest():
    budget = framing.ReceiveBudget(3000, per_peer=2000)
    a1, a2, b, c = (framing.FrameParser(max_message_bytes=4000, chunk_bytes=1000, budget=budget, owner=owner)
                    for owner in ("a", "a", "b", "c"))
    # announcing holds nothing: two 1,500-byte messages announced (with an empty first chunk) cost no budget
    assert a1.receive(_chunk(1, framing.FIRST, b"", total=1500) + _chunk(3, framing.FIRST, b"", total=1500)) == []
    assert budget.available == 3000
    # bytes are charged as their chunks start: peer a reaches its share of 2000 over its two connections
    assert a1.receive(_chunk(1, 0, b"x" * 1000) + _chunk(3, 0, b"y" * 900)) == []
    assert a2.receive(_chunk(5, framing.FIRST, b"z" * 100, total=200)) == []
    assert budget.held_by("a") == 2000 and budget.available == 1000
    events = a1.receive(_chunk(3, 0, b"y" * 1))  # over a's share: that message is dropped, a's other one stays
    assert [type(e) for e in events] == [framing.MessageRejected] and events[0].over_budget
    assert "message_bytes_per_peer" in events[0].reason and budget.held_by("a") == 1100
    # a message larger than any peer's share is refused at its announcement
    events = b.receive(_chunk(7, framing.FIRST, b"", total=2500))
    assert [type(e) for e in events] == [framing.MessageRejected] and "message_bytes_per_peer" in events[0].reason
    # b and c fill the total; then c, holding less than a, gets in by evicting a's largest message
    assert b.receive(_chunk(9, framing.FIRST, b"q" * 1000, total=1900)) == []
    assert c.receive(_chunk(11, framing.FIRST, b"r" * 900, total=1900)) == []
    assert budget.available == 0
    assert c.receive(_chunk(11, 0, b"r" * 100)) == []
    assert budget.held_by("c") == 1000 and budget.held_by("a") == 100 and budget.evicted == 1
    events = a1.receive(_chunk(1, framing.LAST, b"x" * 500))  # its sender goes on: told, and discarded
    assert [type(e) for e in events] == [framing.MessageRejected] and "evicted" in events[0].reason
    # small single-frame messages get through for whoever has budget left
    outbox = framing.Outbox(chunk_bytes=1000)
    outbox.add(13, [b"ping"])
    events = a2.receive(b"".join(bytes(f) for f in outbox.next_frames()))
    assert [type(e) for e in events] == [framing.MessageReceived]
    for parser in (a1, a2, b, c):
        parser.close()  # connections end: the budget comes back whole
    assert budget.available == 3000


def test_a_whole_message_in_one_read_is_not_charged_and_one_arriving_in_pieces_is(monkeypatch):
    budget = framing.ReceiveBudget(3000, per_peer=2000)
    parser = framing.FrameParser(max_message_bytes=4000, chunk_bytes=1000, budget=budget, owner="a")
    charges = []
    take = budget.take
    monkeypatch.setattr(budget, "take", lambda size, owner=None: charges.append(size) or take(size, owner))
    whole = _chunk(1, framing.FIRST | framing.LAST, b"x" * 500, total=500)
    assert [type(e) for e in parser.receive(whole)] == [framing.MessageReceived] and charges == []
    # the same message split across two reads holds its bytes in between: charged while it arrives
    assert parser.receive(whole[:100]) == [] and charges == [500] and budget.held_by("a") == 500
    assert [type(e) for e in parser.receive(whole[100:])] == [framing.MessageReceived]
    assert budget.available == 3000
    parser.close()


def test_a_stalled_message_is_dropped_and_gives_its_budget_back():
    budget = framing.ReceiveBudget(10_000, stall_timeout=30.0)
    parser = framing.FrameParser(max_message_bytes=10_000, chunk_bytes=1000, budget=budget, owner="slow")
    parser.now = 100.0
    assert parser.receive(_chunk(1, framing.FIRST, b"x" * 1000, total=5000)) == []
    parser.now = 120.0
    assert parser.receive(_chunk(1, 0, b"x" * 1000)) == []
    assert parser.next_stall_deadline() == 150.0 and parser.expire_stalled(149.0) == []
    parser.now = 140.0
    assert parser.receive(_chunk(1, 0, b"x" * 100)[:20]) == []  # a chunk begun, trickling: no progress
    events = parser.expire_stalled(150.0)
    assert [type(e) for e in events] == [framing.MessageRejected] and "stalled" in events[0].reason
    assert budget.available == 10_000 and parser.next_stall_deadline() is None
    parser.close()
