"""Sans-I/O framing for RPC connections: multiplexed, chunked messages over one byte stream.

Why chunks: a 100 MB tensor must not hold up a small call that shares the connection. Every message is cut into
chunks of at most `CHUNK_BYTES`, and the `Outbox` sends one chunk of each waiting message in turn (round robin),
so a small call waits for at most a few chunk times. Chunks reference the caller's buffers (memoryviews): a
tensor's bytes go from its storage to the socket without a copy, and the `FrameParser` copies each arriving byte
exactly once, straight into the message's own buffer, which the wire codec then decodes without copying.

Frame: `u32 length | u8 kind | u32 stream_id | payload`, length counting kind, stream_id and payload.
A message's first chunk carries its total size (u64) ahead of the data, so the receiver checks limits and
allocates once. No sockets, clocks or trio here: bytes in, events and bytes out.
"""

from __future__ import annotations

import collections
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, Union

Buffer = Union[bytes, bytearray, memoryview]
Allocator = Callable[[int], Union[bytearray, memoryview]]

HEADER = struct.Struct("<IBI")
TOTAL = struct.Struct("<Q")
CHUNK_BYTES = 1024 * 1024
MAX_CONTROL_BYTES = 64 * 1024

FIRST = 0x01  # the payload starts with the message's total size
LAST = 0x02  # the message is complete after this chunk
CANCEL = 0x10  # the sender gave up on this stream: drop what arrived, stop any handler
HELLO = 0x20  # handshake frames: small, whole, stream id 0
PROOF = 0x21
ERROR = 0x30  # a connection-level error report before closing (e.g. a failed handshake)
_DATA_KINDS = {FIRST, FIRST | LAST, 0, LAST}


class FramingError(Exception):
    """The byte stream broke the framing rules; the connection cannot continue."""


@dataclass
class MessageReceived:
    stream_id: int
    data: bytearray | memoryview  # writable: the wire codec decodes tensors in place


@dataclass
class MessageRejected:
    """A message announced a size over the limit: its chunks are discarded, the connection goes on."""

    stream_id: int
    size: int
    reason: str


@dataclass
class StreamCancelled:
    stream_id: int


@dataclass
class ControlFrame:
    kind: int
    payload: bytes


Event = Union[MessageReceived, MessageRejected, StreamCancelled, ControlFrame]


class ReceiveBudget:
    """Bytes that partly received messages may hold, shared by every connection of a node: a peer that announces
    huge messages and then trickles (or sends nothing) gets rejections, not gigabytes of zeroed buffers."""

    def __init__(self, limit: int):
        self.limit = limit
        self.available = limit

    def take(self, size: int) -> bool:
        if size > self.available:
            return False
        self.available -= size
        return True

    def give_back(self, size: int) -> None:
        self.available = min(self.limit, self.available + size)


@dataclass
class _Partial:
    data: bytearray | memoryview | None  # None while discarding a rejected message
    budgeted: bool = False
    filled: int = 0


class FrameParser:
    """Turns received bytes into events. `max_message_bytes` is checked before anything is allocated."""

    def __init__(self, max_message_bytes: int, chunk_bytes: int = CHUNK_BYTES, budget: ReceiveBudget | None = None,
                 allocate: Allocator = bytearray):
        """`allocate(n)` makes a message's writable n-byte buffer. `bytearray` zero-fills it, which for big
        tensors costs as much as receiving them; the RPC layer passes `wire.message_buffer` (uninitialised
        memory: safe, because a message is delivered only once every byte of it has arrived)."""
        self.max_message_bytes = max_message_bytes
        self.allocate = allocate
        self.budget = budget or ReceiveBudget(2 * max_message_bytes)
        self._pending = 0  # budgeted bytes held by this connection
        self.max_frame_bytes = max(chunk_bytes, MAX_CONTROL_BYTES) + TOTAL.size + HEADER.size
        self._header = bytearray()
        self._partials: dict[int, _Partial] = {}
        # state of the frame being read
        self._kind = 0
        self._stream_id = 0
        self._remaining = 0
        self._control: bytearray | None = None
        self._prefix = bytearray()  # the u64 total of a FIRST frame while it arrives
        self._in_frame = False

    @property
    def open_streams(self) -> int:
        return len(self._partials)

    def receive(self, data: Buffer) -> list[Event]:
        events: list[Event] = []
        view = memoryview(data)
        while view:
            if not self._in_frame:
                need = HEADER.size - len(self._header)
                self._header += view[:need]
                view = view[need:]
                if len(self._header) < HEADER.size:
                    break
                self._start_frame(events)
                if not self._in_frame:
                    continue
            view = self._consume(view, events)
        return events

    def _take_budget(self, size: int) -> bool:
        """A connection holds at most one maximal message's worth; the node's shared budget bounds the rest."""
        if self._pending + size > self.max_message_bytes or not self.budget.take(size):
            return False
        self._pending += size
        return True

    def _release(self, partial: _Partial | None) -> None:
        if partial is not None and partial.data is not None and partial.budgeted:
            self.budget.give_back(len(partial.data))
            self._pending -= len(partial.data)

    def close(self) -> None:
        """The connection ended: whatever was half received no longer counts against the budget."""
        for partial in self._partials.values():
            self._release(partial)
        self._partials.clear()

    def receive_target(self) -> memoryview | None:
        """Where the next payload bytes belong while a message chunk is arriving, so a driver can read from the
        socket straight into the message (`recv_into`) and then call `advance`: no intermediate copy."""
        if not self._in_frame or self._control is not None or self._remaining == 0:
            return None
        if self._kind & FIRST and len(self._prefix) < TOTAL.size:
            return None
        partial = self._partials.get(self._stream_id)
        if partial is None or partial.data is None:
            return None
        if partial.filled + self._remaining > len(partial.data):
            # the frame carries more than the message announced: let `receive` raise FramingError (a short or
            # empty target would have the driver read nothing, or into the next message's place)
            return None
        return memoryview(partial.data)[partial.filled:partial.filled + self._remaining]

    def advance(self, n: int) -> list[Event]:
        """`n` bytes were written into the view `receive_target` returned."""
        events: list[Event] = []
        partial = self._partials[self._stream_id]
        partial.filled += n
        self._remaining -= n
        if not self._remaining:
            self._finish_frame(events)
        return events

    def _start_frame(self, events: list[Event]) -> None:
        length, kind, stream_id = HEADER.unpack(self._header)
        self._header.clear()
        body = length - (HEADER.size - 4)
        if body < 0 or length > self.max_frame_bytes:
            raise FramingError(f"frame of {length} bytes is outside the allowed 5..{self.max_frame_bytes}")
        self._kind, self._stream_id, self._remaining = kind, stream_id, body
        self._prefix.clear()
        self._control = None
        if kind in _DATA_KINDS:
            if not kind & FIRST and stream_id not in self._partials:
                raise FramingError(f"continuation for unknown stream {stream_id}")
            if kind & FIRST and stream_id in self._partials:
                raise FramingError(f"stream {stream_id} started twice")
            if kind & FIRST and body < TOTAL.size:
                raise FramingError("first chunk without its size")
        elif kind in (CANCEL,):
            if body:
                raise FramingError("cancel frame with a payload")
        elif kind in (HELLO, PROOF, ERROR):
            if body > MAX_CONTROL_BYTES:
                raise FramingError("control frame too large")
            self._control = bytearray()
        else:
            raise FramingError(f"unknown frame kind {kind:#x}")
        self._in_frame = True
        if body == 0:
            self._finish_frame(events)

    def _consume(self, view: memoryview, events: list[Event]) -> memoryview:
        kind = self._kind
        if self._control is not None:
            take = min(self._remaining, len(view))
            self._control += view[:take]
            self._remaining -= take
            view = view[take:]
            if not self._remaining:
                self._finish_frame(events)
            return view
        if kind & FIRST and len(self._prefix) < TOTAL.size:
            take = min(TOTAL.size - len(self._prefix), len(view))
            self._prefix += view[:take]
            self._remaining -= take
            view = view[take:]
            if len(self._prefix) < TOTAL.size:
                return view
            (total,) = TOTAL.unpack(self._prefix)
            if total > self.max_message_bytes:
                self._partials[self._stream_id] = _Partial(None)
                events.append(
                    MessageRejected(self._stream_id, total, f"message of {total} bytes exceeds the limit of "
                                                            f"{self.max_message_bytes}")
                )
            elif not self._kind & LAST and not self._take_budget(total):
                self._partials[self._stream_id] = _Partial(None)
                events.append(MessageRejected(self._stream_id, total, f"receiver busy: {total} more bytes in "
                                                                      f"flight exceed its receive budget"))
            else:  # single-frame messages skip the budget: one frame at a time per connection bounds them
                self._partials[self._stream_id] = _Partial(self.allocate(total), budgeted=not self._kind & LAST)
            if not self._remaining:
                self._finish_frame(events)
                return view
        partial = self._partials[self._stream_id]
        take = min(self._remaining, len(view))
        if partial.data is not None:
            end = partial.filled + take
            if end > len(partial.data):
                raise FramingError(f"stream {self._stream_id} sent more than its announced size")
            partial.data[partial.filled:end] = view[:take]
        partial.filled += take
        self._remaining -= take
        view = view[take:]
        if not self._remaining:
            self._finish_frame(events)
        return view

    def _finish_frame(self, events: list[Event]) -> None:
        self._in_frame = False
        kind, stream_id = self._kind, self._stream_id
        if self._control is not None:
            events.append(ControlFrame(kind, bytes(self._control)))
            self._control = None
            return
        if kind == CANCEL:
            self._release(self._partials.pop(stream_id, None))
            events.append(StreamCancelled(stream_id))
            return
        if kind & LAST:
            partial = self._partials.pop(stream_id)
            self._release(partial)
            if partial.data is None:
                return  # already reported as rejected
            if partial.filled != len(partial.data):
                raise FramingError(f"stream {stream_id} ended after {partial.filled} of {len(partial.data)} bytes")
            events.append(MessageReceived(stream_id, partial.data))


def control_frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload) + HEADER.size - 4, kind, 0) + payload


def cancel_frame(stream_id: int) -> bytes:
    return HEADER.pack(HEADER.size - 4, CANCEL, stream_id)


@dataclass
class _Outgoing:
    stream_id: int
    parts: list[memoryview]
    total: int
    part_index: int = 0
    part_offset: int = 0
    sent: int = 0
    started: bool = False


@dataclass
class Outbox:
    """Messages waiting to be sent, interleaved chunk by chunk so small messages never wait behind big ones."""

    chunk_bytes: int = CHUNK_BYTES
    _queue: collections.deque[_Outgoing] = field(default_factory=collections.deque)
    _by_stream: dict[int, _Outgoing] = field(default_factory=dict)
    _control: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self._queue) or bool(self._control)

    @property
    def partly_sent(self) -> int:
        """Messages whose first chunks left and whose rest is still waiting."""
        return sum(1 for item in self._queue if item.started)

    def add(self, stream_id: int, parts: Sequence[Buffer]) -> None:
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        item = _Outgoing(stream_id, views, sum(len(v) for v in views))
        self._queue.append(item)
        self._by_stream[stream_id] = item

    def add_control(self, frame: bytes) -> None:
        self._control.append(frame)

    def cancel(self, stream_id: int) -> None:
        """Stop sending a stream. A message that never left is just dropped; if any of it left (or all of it:
        the other side may be handling it), a CANCEL frame tells the receiver to discard it and stop work."""
        item = self._by_stream.pop(stream_id, None)
        if item is not None:
            self._queue.remove(item)
            if not item.started:
                return
        self._control.append(cancel_frame(stream_id))

    def next_frames(self, budget: int = 4 * CHUNK_BYTES) -> list[Buffer]:
        """Frames to write now: control frames first, then one chunk per waiting message in turn, up to `budget`
        bytes. The returned buffers are written in order; big chunks are zero-copy views of the message."""
        out: list[Buffer] = list(self._control)
        self._control = []
        size = sum(len(f) for f in out)
        while self._queue and size < budget:
            item = self._queue.popleft()
            for piece in self._chunk(item):
                out.append(piece)
                size += len(piece)
            if item.sent < item.total:
                self._queue.append(item)
            else:
                del self._by_stream[item.stream_id]
        return out

    def _chunk(self, item: _Outgoing) -> Iterator[Buffer]:
        kind = 0 if item.started else FIRST
        room = min(self.chunk_bytes, item.total - item.sent)
        pieces: list[memoryview] = []
        while room:
            part = item.parts[item.part_index]
            take = min(room, len(part) - item.part_offset)
            pieces.append(part[item.part_offset:item.part_offset + take])
            item.part_offset += take
            item.sent += take
            room -= take
            if item.part_offset == len(part):
                item.part_index += 1
                item.part_offset = 0
        if item.sent == item.total:
            kind |= LAST
        payload = sum(len(p) for p in pieces)
        prefix = TOTAL.pack(item.total) if not item.started else b""
        header = HEADER.pack(payload + len(prefix) + HEADER.size - 4, kind, item.stream_id) + prefix
        item.started = True
        if payload <= 16 * 1024:
            yield b"".join([header, *pieces])  # small: one buffer, so many small frames coalesce into one write
        else:
            yield header
            yield from pieces
