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
from typing import Callable, Hashable, Iterator, Sequence, Union

from peer.p2p import budget as _budget
from peer.p2p.budget import Accountant, LimitReached

Buffer = Union[bytes, bytearray, memoryview]
Allocator = Callable[[int], Union[bytearray, memoryview]]

HEADER = struct.Struct("<IBI")
TOTAL = struct.Struct("<Q")
CHUNK_BYTES = 1024 * 1024
MAX_CONTROL_BYTES = 64 * 1024
MAX_OPEN_STREAMS = 4096  # messages arriving at once on one connection (each costs a little bookkeeping)

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
    over_budget: bool = False  # refused for the receive budget (the peer's share, a stall, an eviction)


@dataclass
class StreamCancelled:
    stream_id: int


@dataclass
class ControlFrame:
    kind: int
    payload: bytes


Event = Union[MessageReceived, MessageRejected, StreamCancelled, ControlFrame]


class ReceiveBudget:
    """Bytes that partly received messages hold, per remote peer and for the whole node (one `Accountant`,
    resource `message_bytes`), shared by every connection of a node.

    Why charged as bytes arrive, not as announced: when the whole announced size was reserved up front, two
    identities announcing 1 GiB each and trickling it held the node's whole budget, and every honest message
    over a chunk was refused ("receiver busy"). Now an announcement holds nothing; each chunk is charged when
    its frame starts, so a peer holds what it actually sent, up to its share (`per_peer`, always below the
    total). When the total is full, the peer holding the most loses its largest partial message (`evict`), so a
    newcomer who holds less still gets in; a message whose chunks stop coming is dropped after
    `stall_timeout` (`FrameParser.expire_stalled`)."""

    RESOURCE = "message_bytes"

    def __init__(self, limit: int, per_peer: int | None = None, *, stall_timeout: float = 30.0,
                 accountant: Accountant | None = None):
        if accountant is None:
            accountant = Accountant({("total", self.RESOURCE): limit, ("peer", self.RESOURCE): per_peer or limit})
        self.accountant = accountant
        self.limit = int(accountant.limit("total", self.RESOURCE) or limit)
        self.per_peer = int(accountant.limit("peer", self.RESOURCE) or self.limit)
        self.stall_timeout = stall_timeout
        self._parsers: dict[Hashable, set[FrameParser]] = {}
        self.evicted = 0

    @property
    def available(self) -> int:
        return int(self.limit - self.accountant.amount(_budget.TOTAL, self.RESOURCE))

    def held_by(self, owner: Hashable) -> int:
        return int(self.accountant.amount(("peer", owner), self.RESOURCE))

    def take(self, size: int, owner: Hashable = None) -> str | None:
        """Charge `size` bytes to `owner`; None when granted, else the refusal (naming the limit and the peer).
        A full total evicts from the peer holding the most, when that is someone holding more than `owner`."""
        scopes = (("peer", owner),)
        try:
            self.accountant.take(scopes, self.RESOURCE, size, peer=owner)
            return None
        except LimitReached as refusal:
            if refusal.scope != _budget.TOTAL:
                return refusal.message
            message = refusal.message
        while self.accountant.over(scopes, self.RESOURCE, size) == (_budget.TOTAL, self.limit):
            heaviest = self.accountant.heaviest("peer", self.RESOURCE)
            if heaviest is None or heaviest[0][1] == owner or heaviest[1] <= self.held_by(owner) + size:
                return message
            if not self._evict(heaviest[0][1]):
                return message
        self.accountant.add(scopes, self.RESOURCE, size)
        return None

    def give_back(self, size: int, owner: Hashable = None) -> None:
        self.accountant.give_back((("peer", owner),), self.RESOURCE, size)

    def _evict(self, owner: Hashable) -> bool:
        for parser in sorted(self._parsers.get(owner, ()), key=lambda p: -p.held):
            if parser.evict_largest(f"evicted: the node's receive budget is full and peer "
                                    f"{_short(owner)} holds the most of it"):
                self.evicted += 1
                return True
        return False

    def register(self, parser: "FrameParser") -> None:
        self._parsers.setdefault(parser.owner, set()).add(parser)

    def unregister(self, parser: "FrameParser") -> None:
        parsers = self._parsers.get(parser.owner)
        if parsers is not None:
            parsers.discard(parser)
            if not parsers:
                del self._parsers[parser.owner]


def _short(owner: Hashable) -> str:
    short = getattr(owner, "short", None)
    return str(short() if short is not None else owner)


@dataclass
class _Partial:
    data: bytearray | memoryview | None  # None while discarding a rejected message
    charged: int = 0  # bytes of it charged to the receive budget (those of the chunks that started)
    filled: int = 0
    progress_at: float = 0.0  # when its last chunk completed (or it started): `expire_stalled` reads it


class FrameParser:
    """Turns received bytes into events. `max_message_bytes` is checked before anything is allocated; every
    chunk's bytes are charged to `owner` (the remote peer) in `budget` as its frame starts."""

    def __init__(self, max_message_bytes: int, chunk_bytes: int = CHUNK_BYTES, budget: ReceiveBudget | None = None,
                 allocate: Allocator = bytearray, owner: Hashable = None):
        """`allocate(n)` makes a message's writable n-byte buffer. `bytearray` zero-fills it, which for big
        tensors costs as much as receiving them; the RPC layer passes `wire.message_buffer` (uninitialised
        memory: safe, because a message is delivered only once every byte of it has arrived, and untouched
        pages of it take no memory, so an announced size that never arrives costs nothing)."""
        self.max_message_bytes = max_message_bytes
        self.allocate = allocate
        self.budget = budget or ReceiveBudget(2 * max_message_bytes)
        self.owner = owner
        self.now = 0.0  # the driver's clock at the current input (sans-I/O: set by whoever feeds the parser)
        self.held = 0  # budgeted bytes held by this connection
        self.max_frame_bytes = max(chunk_bytes, MAX_CONTROL_BYTES) + TOTAL.size + HEADER.size
        self._header = bytearray()
        self._partials: dict[int, _Partial] = {}
        self._dropped: list[Event] = []  # rejections decided outside `receive` (eviction), reported by it
        # state of the frame being read
        self._kind = 0
        self._stream_id = 0
        self._remaining = 0
        self._control: bytearray | None = None
        self._prefix = bytearray()  # the u64 total of a FIRST frame while it arrives
        self._in_frame = False
        self.budget.register(self)

    @property
    def open_streams(self) -> int:
        return len(self._partials)

    @property
    def in_frame(self) -> bool:
        """Part of a frame (or of its header) arrived and the rest has not."""
        return self._in_frame or bool(self._header)

    def receive(self, data: Buffer) -> list[Event]:
        events: list[Event] = self._take_dropped()
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

    def _take_dropped(self) -> list[Event]:
        events, self._dropped = self._dropped, []
        return events

    def _charge(self, partial: _Partial, size: int) -> str | None:
        """Charge `size` more bytes of `partial` (a chunk starting); the refusal when its peer is at its share."""
        if not size:
            return None
        refusal = self.budget.take(size, self.owner)
        if refusal is None:
            partial.charged += size
            self.held += size
        return refusal

    def _release(self, partial: _Partial | None) -> None:
        if partial is not None and partial.charged:
            self.budget.give_back(partial.charged, self.owner)
            self.held -= partial.charged
            partial.charged = 0

    def _drop(self, stream_id: int, partial: _Partial, reason: str, events: list[Event]) -> None:
        """Stop receiving a message: its memory and budget go back now, its remaining bytes are discarded."""
        size = len(partial.data) if partial.data is not None else 0
        self._release(partial)
        partial.data = None
        events.append(MessageRejected(stream_id, size, reason, over_budget=True))

    def evict_largest(self, reason: str) -> bool:
        """Drop this connection's partly received message holding the most budget (the node's receive budget is
        full and this peer holds the most); reported by the next `receive`, `advance` or `expire_stalled`."""
        candidates = [(p.charged, sid) for sid, p in self._partials.items() if p.data is not None and p.charged]
        if not candidates:
            return False
        _, stream_id = max(candidates)
        self._drop(stream_id, self._partials[stream_id], reason, self._dropped)
        return True

    def next_stall_deadline(self) -> float | None:
        """When the soonest partly received message is dropped unless a chunk of it completes first."""
        times = [p.progress_at for p in self._partials.values() if p.data is not None]
        return min(times) + self.budget.stall_timeout if times else None

    def expire_stalled(self, now: float) -> list[Event]:
        """Drop the messages whose last chunk completed `stall_timeout` or more ago (a sender that announced a
        big message and then trickles, or stopped): `MessageRejected` for each, and the evictions pending."""
        events = self._take_dropped()
        limit = now - self.budget.stall_timeout
        for stream_id, partial in list(self._partials.items()):
            if partial.data is not None and partial.progress_at <= limit:
                self._drop(stream_id, partial, f"message stalled: no chunk for {self.budget.stall_timeout:.3g} s "
                                               f"after {partial.filled} of {len(partial.data)} bytes", events)
        return events

    def close(self) -> None:
        """The connection ended: whatever was half received no longer counts against the budget."""
        for partial in self._partials.values():
            self._release(partial)
        self._partials.clear()
        self.budget.unregister(self)

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
        events: list[Event] = self._take_dropped()
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
            if kind & FIRST and len(self._partials) >= MAX_OPEN_STREAMS:
                raise FramingError(f"more than {MAX_OPEN_STREAMS} messages arriving at once")
            if not kind & FIRST:
                partial = self._partials[stream_id]
                if partial.data is not None:
                    refusal = self._charge(partial, body)
                    if refusal is not None:
                        self._drop(stream_id, partial, refusal, events)
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
            elif total > self.budget.per_peer:
                self._partials[self._stream_id] = _Partial(None)
                events.append(MessageRejected(self._stream_id, total, (
                    f"message of {total} bytes exceeds limit message_bytes_per_peer={self.budget.per_peer} for "
                    f"peer {_short(self.owner)}"), over_budget=True))
            else:  # nothing reserved for the announced size: the bytes are charged as their chunks start
                partial = _Partial(None, progress_at=self.now)
                # except a whole message in this read (one chunk, all here): it is delivered before `feed`
                # returns and holds nothing meanwhile, so charging and releasing it would only cost (an echo
                # call's share of the accountant, issue 40's `budget_overhead`)
                whole = kind & LAST and len(view) >= self._remaining
                refusal = None if whole else self._charge(partial, self._remaining)
                if refusal is not None:
                    self._partials[self._stream_id] = partial
                    events.append(MessageRejected(self._stream_id, total, refusal, over_budget=True))
                else:
                    partial.data = self.allocate(total)
                    self._partials[self._stream_id] = partial
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
            return
        going = self._partials.get(stream_id)
        if going is not None:
            going.progress_at = self.now  # a chunk completed: the stall clock starts again


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
