"""Property tests of the sealed records (peer/p2p/seal.py), in the style of the codec and framing properties.

Writes are sealed by a `Sealer` (with small records, so a write spans many), the byte stream is fed to an
`Opener` split anywhere -- copied in (`receive_data`) or read in place (`receive_target`/`advance`, as the RPC
reader does) -- and must come out exactly as written. Then the stream is attacked: one byte flipped at any
position (length header, ciphertext or tag), a record dropped, duplicated, moved or replayed from another
connection, the stream cut anywhere, a different key: each must raise a `SealError` subclass, and the opener must
never hand out a byte of the altered record or anything after it.

Hypothesis runs under the `ci` profile registered in tests/conftest.py; `HYPOTHESIS_PROFILE=thorough` runs more.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st

from peer.p2p import seal
from peer.p2p.seal import Opener, RecordForged, RecordTooLarge, Sealer, SealError, SessionKeys, StreamTruncated

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))

writes = st.lists(st.binary(max_size=400), min_size=1, max_size=6)
record_sizes = st.integers(1, 64) | st.integers(1, 1024)


def sealed(data: list[bytes], max_record: int, key: bytes = KEY) -> list[bytes]:
    """The records for `data`, as separate byte strings."""
    sealer = Sealer(key, max_record_bytes=max_record)
    return [bytes(record) for write in data for record in sealer.seal(write)]


def feed_copies(opener: Opener, stream: bytes, cuts: list[int]) -> bytes:
    out = bytearray()
    previous = 0
    for cut in sorted(set(cuts)) + [len(stream)]:
        for plaintext in opener.receive_data(stream[previous:cut]):
            out += plaintext
        previous = cut
    return bytes(out)


def feed_in_place(opener: Opener, stream: bytes, step: int) -> bytes:
    """The RPC reader's path: read into `receive_target()` (at most `step` bytes at a time), decrypt with
    `open_into` into a buffer of the record's size."""
    out = bytearray()
    position = 0
    while True:
        while (size := opener.ready()) is not None:
            destination = bytearray(size)
            opener.open_into(destination)
            out += destination
        if position == len(stream):
            return bytes(out)
        target = opener.receive_target()
        take = min(len(target), step, len(stream) - position)
        target[:take] = stream[position:position + take]
        position += take
        opener.advance(take)


@given(writes, record_sizes, st.lists(st.integers(0, 4000), max_size=10))
@example([b""], 1, [])
@example([b"x" * 400], 1, [1, 2, 3])
def test_any_split_of_the_sealed_stream_opens_to_exactly_what_was_written(data, max_record, cuts):
    stream = b"".join(sealed(data, max_record))
    opener = Opener(KEY, max_record_bytes=max_record)
    assert feed_copies(opener, stream, [c for c in cuts if c <= len(stream)]) == b"".join(data)
    opener.end_of_stream()


@given(writes, record_sizes, st.integers(1, 5000))
def test_reading_in_place_opens_to_exactly_what_was_written(data, max_record, step):
    stream = b"".join(sealed(data, max_record))
    opener = Opener(KEY, max_record_bytes=max_record)
    assert feed_in_place(opener, stream, step) == b"".join(data)
    opener.end_of_stream()


def opened_until_failure(opener: Opener, stream: bytes) -> tuple[list[bytes], SealError | None]:
    """Feed `stream` one byte at a time; the plaintexts handed out before the first error, and that error."""
    plaintexts: list[bytes] = []
    try:
        for index in range(len(stream)):
            plaintexts += opener.receive_data(stream[index:index + 1])
        opener.end_of_stream()
    except SealError as error:
        return plaintexts, error
    return plaintexts, None


def record_starts(records: list[bytes]) -> list[int]:
    starts, position = [], 0
    for record in records:
        starts.append(position)
        position += len(record)
    return starts


@given(writes, record_sizes, st.data())
def test_a_flipped_byte_anywhere_fails_and_nothing_from_its_record_on_is_handed_out(data, max_record, draw):
    records = sealed(data, max_record)
    stream = bytearray(b"".join(records))
    position = draw.draw(st.integers(0, len(stream) - 1))
    bit = draw.draw(st.integers(0, 7))
    stream[position] ^= 1 << bit
    starts = record_starts(records)
    hit = max(index for index, start in enumerate(starts) if start <= position)
    note(f"byte {position} of {len(stream)}, in record {hit}")
    plaintexts, error = opened_until_failure(Opener(KEY, max_record_bytes=max_record), bytes(stream))
    # a flipped length may make the record look longer (then the stream ends inside it) or out of range
    assert isinstance(error, (RecordForged, RecordTooLarge, StreamTruncated)), error
    opener_plain = [bytes(seal_plain) for seal_plain in plaintexts]
    honest = [Opener(KEY, max_record_bytes=max_record).receive_data(b"".join(records[:i + 1]))[-1]
              for i in range(hit)]
    assert opener_plain == honest  # only the records before the altered one


@pytest.mark.parametrize("attack", ["drop", "duplicate", "swap", "replay from another connection"])
@given(st.lists(st.binary(min_size=1, max_size=50), min_size=3, max_size=6), st.data())
def test_records_out_of_place_fail_authentication(attack, data, draw):
    records = sealed(data, 64)
    index = draw.draw(st.integers(0, len(records) - 2))
    altered = list(records)
    if attack == "drop":
        del altered[index]
    elif attack == "duplicate":
        altered.insert(index, records[index])
    elif attack == "swap":
        altered[index], altered[index + 1] = altered[index + 1], altered[index]
    else:  # the same key sealed another conversation (a stale capture): its record `index + 1` in our place
        other = sealed([b"captured " + bytes([n]) for n in range(len(records))], 64)
        altered[index] = other[index + 1]
    assert altered != records
    plaintexts, error = opened_until_failure(Opener(KEY, max_record_bytes=64), b"".join(altered))
    assert isinstance(error, RecordForged), error
    assert len(plaintexts) == index + (attack == "duplicate")  # a duplicate fails as the second copy


@given(writes, record_sizes, st.data())
def test_a_stream_cut_inside_a_record_is_truncated_and_cut_between_records_is_clean(data, max_record, draw):
    records = sealed(data, max_record)
    stream = b"".join(records)
    cut = draw.draw(st.integers(0, len(stream) - 1))
    plaintexts, error = opened_until_failure(Opener(KEY, max_record_bytes=max_record), stream[:cut])
    boundaries = set(record_starts(records))
    if cut in boundaries:
        assert error is None
    else:
        assert isinstance(error, StreamTruncated), error
    complete = sum(1 for start in record_starts(records) if start < cut and start + len(records[
        record_starts(records).index(start)]) <= cut)
    assert len(plaintexts) == complete


@given(writes)
def test_another_key_opens_nothing(data):
    plaintexts, error = opened_until_failure(Opener(OTHER_KEY, max_record_bytes=64), b"".join(sealed(data, 64)))
    assert isinstance(error, RecordForged) and plaintexts == []


def test_a_broken_opener_stays_broken():
    records = sealed([b"one", b"two"], 64)
    opener = Opener(OTHER_KEY)
    with pytest.raises(RecordForged):
        opener.receive_data(records[0])
    for call in (opener.ready, opener.receive_target, opener.end_of_stream):
        with pytest.raises(RecordForged):
            call()


def test_lengths_outside_the_record_limits_are_refused_before_reading_the_body():
    for size in (0, seal.TAG_BYTES - 1, 64 + seal.TAG_BYTES + 1, 2**32 - 1):
        with pytest.raises(RecordTooLarge):
            Opener(KEY, max_record_bytes=64).receive_data(seal.LENGTH.pack(size))


def test_a_big_record_grows_the_buffers_once_and_opens_in_place():
    """A 1 MiB record goes from the receive buffer straight into the destination (no scratch copy)."""
    payload = bytes(range(256)) * 4096
    (record,) = Sealer(KEY).seal(payload)
    opener = Opener(KEY)
    assert feed_in_place(opener, bytes(record), 1 << 30) == payload


def test_session_keys_check_their_size_and_never_print():
    keys = SessionKeys(KEY, OTHER_KEY)
    assert "0102" not in repr(keys) and repr(keys) == "SessionKeys(...)"
    with pytest.raises(ValueError):
        SessionKeys(b"short", KEY)


@given(st.lists(st.integers(0, 3 * 70_000), min_size=1, max_size=5), st.integers(0, 2**32))
def test_reused_record_buffers_never_change_a_record_before_it_is_written(sizes, seed):
    """Big records are sealed into buffers the sealer reuses after `recycle()`: what was written before each
    recycle (copied out, as a socket does) opens to exactly the data, round after round."""
    sealer = Sealer(KEY, max_record_bytes=70_000)
    opener = Opener(KEY, max_record_bytes=70_000)
    written, expected = bytearray(), bytearray()
    for round_, size in enumerate(sizes):
        data = bytes([(seed + round_) % 256]) * size
        expected += data
        for record in sealer.seal(data):
            written += record  # the write: copied before the next round may reuse the buffer
        sealer.recycle()
    assert b"".join(opener.receive_data(bytes(written))) == bytes(expected)
    assert len(sealer._free) <= 8
