"""The RPC connection protocol as a sans-I/O core: call ids, multiplexing, deadlines, cancellation, error frames.

Why a core apart from the trio driver (`peer.p2p.rpc.Connection`): everything a connection decides -- which stream
id a call gets, what a reply means, which error class a code maps to, when a call's deadline has passed, when an
idle connection may close, what a hostile byte means -- is plain data handling. Kept free of sockets, tasks,
cancel scopes and clocks (time is passed in as a number), it can be driven byte by byte in tests, every split
boundary and every expiry reached by passing a number, and the driver shrinks to moving bytes, waking tasks and
running handlers. The same holds for the handshake (`peer.p2p.handshake`), whose result this core is built from:
given the handshake's session keys, the core seals what it sends and opens what it receives (`peer.p2p.seal`)
below the framing, so the driver moves ciphertext exactly as it moved plaintext, zero-copy reads included.

Shape (h11-like): `receive_data(bytes, now)` (or `receive_target()` + `advance(n, now)` for zero-copy reads)
returns events (`RequestReceived`, `RequestCancelled`, `CallCompleted`, `CallFailed`); `start_call`, `cancel_call`,
`send_reply`, `send_error`, `abandon_request` queue frames, which `data_to_send(now)` hands out as buffers to write
in order; `next_deadline()` says when to call `timeouts(now)`, which expires calls and requests and reports an
idle connection (`ConnectionIdle`).

Errors, three kinds kept apart:
- `RemoteProtocolError`: the remote broke the protocol (a bad frame, a control frame after the handshake, a
  reused stream id; `SecureChannelError`: a sealed record that does not open); the connection cannot continue
  and the core refuses further input.
- `LocalProtocolError`: we asked for something the protocol does not allow (a call on a closed connection, a
  second reply to one request): a bug on our side, raised at the call that made it.
- `RPCError` subclasses: what one call's caller sees. Replies `[1, code, text]` map to the `RemoteError` subclass
  registered for `code` (`register_error_code`), in `remote_error` only; a single bad message fails only its call
  (`ResponseRejected`) or gets an error reply (`BadRequest`), and the connection goes on.

Messages: request `[method, timeout_s | None, args]`, reply `[0, result]` or `[1, code, text]`, each one framed
message (`peer.p2p.framing`) on its own stream id: odd ids for the calls of the side that dialed, even for the
other side's, so replies and requests never collide.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Container, MutableMapping, Union

from peer.p2p import framing, seal, wire
from peer.p2p.budget import Accountant, LimitReached, Scope
from peer.p2p.identity import PeerID

Address = tuple[str, int]  # (host, port), as `peer.p2p.net.Address`; not imported, the core needs no trio

_COALESCE_BYTES = 64 * 1024


# ------------------------------------------------------------------------------------------------------- errors


class LocalProtocolError(Exception):
    """We asked the protocol to do something it does not allow: a bug on this side, never the remote's doing."""


class RemoteProtocolError(Exception):
    """The remote sent something the protocol does not allow; the connection (or handshake) cannot go on.

    `events` are those the same input produced before the bad byte (replies that did arrive complete): the driver
    delivers them before it closes, so no call that was answered is reported lost."""

    def __init__(self, message: str, events: "list[Event] | None" = None):
        super().__init__(message)
        self.events: list[Event] = events if events is not None else []


class SecureChannelError(RemoteProtocolError):
    """The sealed stream was altered on the way (a record changed, dropped, duplicated, reordered, replayed or cut
    short: `error` says which check failed). Nothing from that record on reached the framing, so no handler saw
    any of it."""

    def __init__(self, error: seal.SealError, events: "list[Event] | None" = None):
        super().__init__(f"sealed stream broken: {error}", events)
        self.error = error


class RPCError(Exception):
    """A call failed. Carries the peer, the address and the method, so one log line says everything."""

    def __init__(
        self,
        message: str,
        *,
        peer: PeerID | None = None,
        address: Address | None = None,
        method: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.peer = peer
        self.address = address
        self.method = method

    def __str__(self) -> str:
        where = []
        if self.method:
            where.append(self.method)
        if self.address:
            where.append(f"to {self.address[0]}:{self.address[1]}")
        if self.peer:
            where.append(f"(peer {self.peer.short()})")
        return f"{' '.join(where)}: {self.message}" if where else self.message


class CallTimeout(RPCError):
    """No answer before the call's deadline."""


class ConnectionFailed(RPCError):
    """Could not connect, the handshake failed, or the connection was lost while the call was in flight."""


class HandshakeError(ConnectionFailed):
    """The other side could not prove its identity, spoke another protocol version, or was not the peer expected."""


class NotInSwarm(HandshakeError):
    """The other side is not in this peer's private swarm: one of the two holds a swarm key and the other none,
    or they hold different keys (peer/p2p/handshake.py)."""


class NotAllowed(HandshakeError):
    """The other side's PeerID is not on this peer's allow list (`--allow-peers`)."""


class ResponseRejected(RPCError):
    """The peer's answer broke the wire limits or could not be decoded."""


_ERROR_CLASSES: dict[str, type[RemoteError]] = {}


def register_error_code(code: str, cls: type[RemoteError]) -> type[RemoteError]:
    """Make errors with `code` arrive as `cls` on callers (e.g. `moe.errors.ExpertNotFound`). A class that names
    its code in its header is registered already (see `RemoteError`)."""
    existing = _ERROR_CLASSES.get(code)
    if existing is not None and existing is not cls:
        raise ValueError(f"error code {code!r} is already registered to {existing.__name__}")
    if cls.code != code:
        raise ValueError(f"{cls.__name__}.code is {cls.code!r}, not {code!r}")
    _ERROR_CLASSES[code] = cls
    return cls


class RemoteError(RPCError):
    """The remote handler answered with an error; `code` selects the subclass raised here.

    A family of typed errors names each one's wire code in the class header, `class NoState(RemoteError,
    code="averaging.no_state")`, which sets `code` and registers the class for it: the code and the
    registration are one statement, so no error of any module's family can reach its callers as a bare
    `RemoteError` because a registration was forgotten. A subclass without `code=` is not registered
    (`register_error_code` still registers one by hand)."""

    code = "remote_error"

    def __init_subclass__(cls, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
            register_error_code(code, cls)


register_error_code(RemoteError.code, RemoteError)


class UnknownMethod(RemoteError, code="unknown_method"):
    """The remote serves no method of that name."""


class BadRequest(RemoteError, code="bad_request"):
    """The remote could not take the request as sent (undecodable, malformed, over a wire limit)."""


class HandlerFailed(RemoteError, code="internal"):
    """The remote's handler raised something that is not a typed error (or returned an unencodable result)."""


class BudgetExceeded(RemoteError, code="budget.exceeded"):
    """The remote refused the call at once: it would have taken this peer (or the method, or the remote node)
    past one of its resource limits (`peer.p2p.budget`); the message names the limit and the peer."""


def remote_error(code: str, text: str, *, peer: PeerID | None = None, address: Address | None = None,
                 method: str | None = None) -> RemoteError:
    """The one place an error reply's code becomes an exception: the registered class, else `RemoteError`
    carrying the unknown code (so a newer peer's codes still reach callers intact)."""
    cls = _ERROR_CLASSES.get(code, RemoteError)
    error = cls(text, peer=peer, address=address, method=method)
    if cls is RemoteError:
        error.code = code
    return error


# ------------------------------------------------------------------------------------------------------ events


@dataclass(slots=True)
class RequestReceived:
    """The remote calls `method`: run its handler, then `send_reply` / `send_error` (or `abandon_request`)."""

    stream_id: int
    method: str
    args: Any
    deadline: float | None  # absolute, on the clock `now` is read from: the caller's deadline bounds the handler


@dataclass(slots=True)
class RequestCancelled:
    """Stop the handler of a request: the remote gave up on it (`expired` False) or its deadline passed (True)."""

    stream_id: int
    expired: bool


@dataclass(slots=True)
class CallCompleted:
    stream_id: int
    result: Any


@dataclass(slots=True)
class CallFailed:
    """The call is over with `error`: a typed remote error, a rejected reply, its deadline, or the connection lost."""

    stream_id: int
    error: RPCError


@dataclass(slots=True)
class ConnectionIdle:
    """Nothing moved for `idle_timeout` and nothing is in flight, or a frame started arriving and did not
    finish within the stall timeout (`reason` "stalled": a sender trickling bytes to hold the connection):
    the driver should close the connection."""

    reason: str = "idle"


Event = Union[RequestReceived, RequestCancelled, CallCompleted, CallFailed, ConnectionIdle]


@dataclass(slots=True)
class _Call:
    method: str
    deadline: float
    timeout: float


@dataclass(slots=True)
class _Request:
    deadline: float | None
    cancelled: bool = False
    charged: tuple[Scope, ...] = ()  # where its `requests` budget is charged, given back when it ends


# ------------------------------------------------------------------------------------------------------- core


class RPCConnection:
    """One authenticated connection's protocol state, built from the handshake's `HandshakeComplete`.

    `initiator` picks the stream ids (odd for the side that dialed); `peer_id` and `address` go into every error;
    `methods` answers "is there a handler?" so unknown methods get an `UnknownMethod` reply at once; `stats` (the
    node's counters, shared by its connections) counts `calls_received`, `error_replies` and `rejected_messages`.
    """

    def __init__(
        self,
        *,
        initiator: bool,
        peer_id: PeerID,
        address: Address | None = None,
        limits: wire.Limits = wire.DEFAULT_LIMITS,
        methods: Container[str] = (),
        budget: framing.ReceiveBudget | None = None,
        idle_timeout: float | None = 300.0,
        now: float = 0.0,
        stats: MutableMapping[str, int] | None = None,
        chunk_bytes: int = framing.CHUNK_BYTES,
        keys: seal.SessionKeys | None = None,
        accountant: Accountant | None = None,
    ):
        self.initiator = initiator
        self.peer_id = peer_id
        self.address = address
        self.limits = limits
        self.methods = methods
        self.idle_timeout = idle_timeout
        self.stats: MutableMapping[str, int] = stats if stats is not None else {
            "calls_received": 0, "error_replies": 0, "rejected_messages": 0}
        self.parser = framing.FrameParser(limits.max_message_bytes, chunk_bytes, budget=budget,
                                          allocate=wire.message_buffer, owner=peer_id)
        self.parser.now = now
        # requests in flight per peer and per method (`peer.p2p.budget`); None: unbounded (tests of the core)
        self.accountant = accountant
        self.frame_at = now  # when the last whole frame arrived: a frame begun long after is a stalled one
        self.outbox = framing.Outbox(chunk_bytes=chunk_bytes)
        # None on an `--insecure-transport` connection: frames go as they are
        self.sealer = seal.Sealer(keys.send) if keys is not None else None
        self.opener = seal.Opener(keys.receive) if keys is not None else None
        self.calls: dict[int, _Call] = {}
        self.requests: dict[int, _Request] = {}
        self.last_activity = now
        self.closed = False
        self.broken: RemoteProtocolError | None = None
        self._parity = 1 if initiator else 0
        self._next_stream_id = 1 if initiator else 2
        self._deadlines: list[tuple[float, int]] = []  # (deadline, stream id), stale entries skipped lazily

    # ---------------------------------------------------------------------------------------- state

    @property
    def busy(self) -> bool:
        """Calls, requests or bytes in flight: an idle timeout must not close the connection."""
        return bool(self.calls) or bool(self.requests) or bool(self.outbox)

    @property
    def partly_sent(self) -> int:
        """Messages whose first chunks left and whose rest is still waiting (see `framing.Outbox`)."""
        return self.outbox.partly_sent

    def _check_open(self, action: str) -> None:
        if self.closed:
            raise LocalProtocolError(f"{action} on a closed connection to peer {self.peer_id.short()}")

    def _is_my_stream(self, stream_id: int) -> bool:
        return stream_id % 2 == self._parity

    # ---------------------------------------------------------------------------------------- calling

    def start_call(self, method: str, args: Any, *, deadline: float, now: float,
                   compression: wire.Compression = wire.Compression.NONE) -> int:
        """Queue a call; its answer (or failure) arrives as an event with the returned stream id. The remote
        handler is told the time left, so it stops when the caller would stop waiting. Raises `wire.WireError`
        (nothing queued) when `args` cannot be encoded."""
        self._check_open(f"call {method!r}")
        timeout = max(0.0, deadline - now)
        parts = wire.encode([method, timeout, args], compression=compression)
        stream_id = self._next_stream_id
        self._next_stream_id = (stream_id + 2) % (1 << 32) or (1 if stream_id % 2 else 2)
        if stream_id in self.calls:
            raise LocalProtocolError(f"stream id {stream_id} is still in use: 2**31 calls in flight")
        self.calls[stream_id] = _Call(method, deadline, timeout)
        self._push_deadline(deadline, stream_id)
        self.outbox.add(stream_id, parts)
        return stream_id

    def cancel_call(self, stream_id: int) -> None:
        """The caller gave up: forget the call; if any of it was sent, a CANCEL frame stops the remote handler."""
        if self.calls.pop(stream_id, None) is not None and not self.closed:
            self.outbox.cancel(stream_id)

    # ---------------------------------------------------------------------------------------- serving

    def _take_request(self, stream_id: int, action: str) -> _Request | None:
        request = self.requests.pop(stream_id, None)
        if request is None and not self.closed:
            raise LocalProtocolError(f"{action} for stream {stream_id}, which has no request in flight")
        self._give_back(request)
        return request

    def _give_back(self, request: _Request | None) -> None:
        if request is not None and request.charged and self.accountant is not None:
            self.accountant.give_back(request.charged, "requests")
            request.charged = ()

    def send_reply(self, stream_id: int, result: Any) -> None:
        """Answer a request. A cancelled or expired request's reply is dropped (the caller is gone); raises
        `wire.WireError` with the request still open when `result` cannot be encoded (then `send_error`)."""
        request = self.requests.get(stream_id)
        if request is None or request.cancelled or self.closed:
            self._take_request(stream_id, "reply")
            return
        parts = wire.encode([0, result])
        self._give_back(self.requests.pop(stream_id))
        self.outbox.add(stream_id, parts)

    def send_error(self, stream_id: int, code: str, message: str) -> None:
        """Answer a request with a typed error (the caller raises the class registered for `code`)."""
        request = self._take_request(stream_id, "error reply")
        if request is not None and not request.cancelled and not self.closed:
            self._queue_error(stream_id, code, message)

    def abandon_request(self, stream_id: int) -> None:
        """The handler ended without an answer (it was cancelled): forget the request."""
        self._take_request(stream_id, "abandon")

    def _queue_error(self, stream_id: int, code: str, message: str) -> None:
        self.stats["error_replies"] += 1
        self.outbox.add(stream_id, wire.encode([1, code, message]))

    # ---------------------------------------------------------------------------------------- receiving

    def receive_target(self) -> memoryview | None:
        """Where the next received bytes belong when they can be read in place (read into it, then `advance`):
        a message payload arriving, or on a sealed connection always the opener's record buffer. None means read
        into any buffer and pass it to `receive_data`."""
        if self.opener is not None:
            return self.opener.receive_target()
        return self.parser.receive_target()

    def advance(self, n: int, now: float) -> list[Event]:
        """`n` bytes were written into the view `receive_target` returned."""
        events: list[Event] = []
        if self._accepts_input():
            self._note_input(now)
            try:
                if self.opener is not None:
                    self.opener.advance(n)
                    self._open_records(now, events)
                else:
                    self._on_frames(self.parser.advance(n), now, events)
            except framing.FramingError as error:
                raise self._break(str(error), events) from None
            except seal.SealError as error:
                raise self._break_seal(error, events) from None
        return events

    def receive_data(self, data: framing.Buffer, now: float) -> list[Event]:
        """Bytes from the remote, any amount, split anywhere. Raises `RemoteProtocolError` when they break the
        protocol; the connection is unusable after that. Bytes that arrive once the connection is closed (a
        race with the remote, not an error) are dropped."""
        events: list[Event] = []
        if self._accepts_input():
            self._note_input(now)
            try:
                if self.opener is not None:
                    view = memoryview(data).cast("B")
                    while view:
                        target = self.opener.receive_target()
                        take = min(len(target), len(view))
                        target[:take] = view[:take]
                        view = view[take:]
                        self.opener.advance(take)
                        self._open_records(now, events)
                else:
                    self._on_frames(self.parser.receive(data), now, events)
            except framing.FramingError as error:
                raise self._break(str(error), events) from None
            except seal.SealError as error:
                raise self._break_seal(error, events) from None
        return events

    def end_of_stream(self) -> None:
        """The remote closed the stream. Raises `SecureChannelError` when it closed inside a sealed record (cut
        short on the way); a close between records or frames is an ordinary close."""
        if self.opener is not None and self.broken is None:
            try:
                self.opener.end_of_stream()
            except seal.SealError as error:
                raise self._break_seal(error, []) from None

    def _open_records(self, now: float, events: list[Event]) -> None:
        """Open every whole record that arrived, each straight into the message it belongs to when it is a
        payload chunk (the sender seals a big chunk as a record of its own), else through the opener's scratch."""
        opener, parser = self.opener, self.parser
        assert opener is not None
        while (size := opener.ready()) is not None:
            target = parser.receive_target()
            if target is not None and 0 < size <= len(target):
                opener.open_into(target[:size])
                self._on_frames(parser.advance(size), now, events)
            else:
                self._on_frames(parser.receive(opener.open()), now, events)

    def _accepts_input(self) -> bool:
        if self.broken is not None:
            raise LocalProtocolError(f"input after a protocol error from peer {self.peer_id.short()}: "
                                     f"{self.broken}")
        return not self.closed

    def _break(self, reason: str, events: list[Event]) -> RemoteProtocolError:
        self.broken = RemoteProtocolError(reason, [e for e in events if type(e) in (CallCompleted, CallFailed)])
        return self.broken

    def _break_seal(self, error: seal.SealError, events: list[Event]) -> RemoteProtocolError:
        self.broken = SecureChannelError(error, [e for e in events if type(e) in (CallCompleted, CallFailed)])
        return self.broken

    def _on_frames(self, frames: list[framing.Event], now: float, events: list[Event]) -> None:
        if frames or not self.parser.in_frame:
            # activity is whole frames (or a frame boundary reached), not bytes: a peer that trickles a byte now
            # and then never completes a frame neither refreshes the idle timer nor escapes the stall check
            self.last_activity = self.frame_at = now
        for frame in frames:
            if type(frame) is framing.MessageReceived:
                if frame.stream_id % 2 == self._parity:
                    event = self._on_reply(frame.stream_id, frame.data)
                else:
                    event = self._on_request(frame.stream_id, frame.data, now)
                if event is not None:
                    events.append(event)
            elif type(frame) is framing.MessageRejected:
                self.stats["rejected_messages"] += 1
                if self._is_my_stream(frame.stream_id):
                    call = self.calls.pop(frame.stream_id, None)
                    if call is not None:
                        events.append(CallFailed(frame.stream_id, ResponseRejected(
                            frame.reason, peer=self.peer_id, address=self.address, method=call.method)))
                else:
                    code = BudgetExceeded.code if frame.over_budget else BadRequest.code
                    self._queue_error(frame.stream_id, code, frame.reason)
            elif type(frame) is framing.StreamCancelled:
                request = self.requests.get(frame.stream_id)
                if request is not None and not request.cancelled and not self._is_my_stream(frame.stream_id):
                    request.cancelled = True
                    events.append(RequestCancelled(frame.stream_id, expired=False))
            elif type(frame) is framing.ControlFrame:
                raise framing.FramingError(f"unexpected control frame {frame.kind:#x} after the handshake")

    def _on_reply(self, stream_id: int, data: bytearray | memoryview) -> Event | None:
        call = self.calls.pop(stream_id, None)
        if call is None:
            return None  # the caller gave up already
        try:
            message = wire.decode(data, limits=self.limits)
            if not isinstance(message, list) or not message or message[0] not in (0, 1):
                raise wire.WireError("malformed response envelope")
            if message[0] == 0:
                return CallCompleted(stream_id, message[1] if len(message) > 1 else None)
            code, text = str(message[1]), str(message[2])
        except (wire.WireError, IndexError) as error:
            return CallFailed(stream_id, ResponseRejected(str(error), peer=self.peer_id, address=self.address,
                                                          method=call.method))
        return CallFailed(stream_id, remote_error(code, text, peer=self.peer_id, address=self.address,
                                                  method=call.method))

    def _on_request(self, stream_id: int, data: bytearray | memoryview, now: float) -> Event | None:
        self.stats["calls_received"] += 1
        if stream_id in self.requests:
            raise framing.FramingError(f"stream {stream_id} reused while its request is in flight")
        try:
            message = wire.decode(data, limits=self.limits)
        except wire.WireError as error:
            self._queue_error(stream_id, BadRequest.code, f"undecodable request: {error}")
            return None
        if (
            type(message) is not list
            or len(message) != 3
            or type(message[0]) is not str
            or not (message[1] is None or type(message[1]) in (int, float))
        ):
            self._queue_error(stream_id, BadRequest.code, "malformed request envelope")
            return None
        method, timeout, args = message
        if method not in self.methods:
            self._queue_error(stream_id, UnknownMethod.code, f"unknown method {method!r}")
            return None
        charged: tuple[Scope, ...] = ()
        if self.accountant is not None:  # refused at once when over its share: never queued without bound
            charged = (("peer", self.peer_id), ("protocol", method))
            try:
                self.accountant.take(charged, "requests", peer=self.peer_id)
            except LimitReached as refusal:
                self._queue_error(stream_id, BudgetExceeded.code, refusal.message)
                return None
        deadline = None if timeout is None else now + max(0.0, float(timeout))
        self.requests[stream_id] = _Request(deadline, charged=charged)
        if deadline is not None:
            self._push_deadline(deadline, stream_id)
        return RequestReceived(stream_id, method, args, deadline)

    # ---------------------------------------------------------------------------------------- sending

    def data_to_send(self, now: float) -> list[framing.Buffer]:
        """Buffers to write, in order, now: small frames joined into writes of up to 64 KiB (many small replies
        leave in one system call), big chunks as zero-copy views of the message (sealed: one record each). Empty
        when nothing waits. Write them all before the next call: a sealed connection reuses their buffers.

        At most about one chunk's worth per call: whatever is queued meanwhile (a small reply, a cancel, a ping)
        waits behind one chunk of each big message ahead of it, not behind four, and a sealed connection's
        writer starts sending after sealing one record rather than four megabytes."""
        if self.sealer is not None:
            self.sealer.recycle()
        writes: list[framing.Buffer] = []
        if not self.outbox:
            return writes
        self.last_activity = now
        small: list[framing.Buffer] = []
        small_size = 0
        for frame in self.outbox.next_frames(self.outbox.chunk_bytes):
            if len(frame) < _COALESCE_BYTES:
                small.append(frame)
                small_size += len(frame)
                if small_size < _COALESCE_BYTES:
                    continue
            if small:
                writes.append(small[0] if len(small) == 1 else b"".join(small))
                small, small_size = [], 0
            if len(frame) >= _COALESCE_BYTES:
                writes.append(frame)
        if small:
            writes.append(small[0] if len(small) == 1 else b"".join(small))
        if self.sealer is not None:  # one record per write: a big chunk's payload opens in place on the other side
            return [record for write in writes for record in self.sealer.seal(write)]
        return writes

    # ---------------------------------------------------------------------------------------- time

    def _push_deadline(self, deadline: float, stream_id: int) -> None:
        """Answered calls leave their entries behind (deleting from a heap is dear); once stale ones outnumber
        live ones the heap is rebuilt, so it stays within twice the calls in flight (plus a constant)."""
        heap = self._deadlines
        heapq.heappush(heap, (deadline, stream_id))
        if len(heap) > 2 * (len(self.calls) + len(self.requests)) + 1024:
            self._deadlines = [entry for entry in heap if self._live(*entry)]
            heapq.heapify(self._deadlines)

    def next_deadline(self) -> float | None:
        """When `timeouts` has something to do (a call's or request's deadline, or the idle check); None: never."""
        heap = self._deadlines
        while heap and not self._live(*heap[0]):
            heapq.heappop(heap)
        candidates = []
        if heap:
            candidates.append(heap[0][0])
        if self.idle_timeout is not None and not self.closed:
            candidates.append(self.last_activity + self.idle_timeout)
        stalled = self.stall_deadline()
        if stalled is not None:
            candidates.append(stalled)
        return min(candidates) if candidates else None

    def stall_deadline(self) -> float | None:
        """When a message (or a frame) that started arriving is dropped (closed) unless it makes progress: a
        driver that sleeps until `next_deadline` asks this after input, which may have started one."""
        if self.closed or self.broken is not None:
            return None
        stalled = self.parser.next_stall_deadline() if self.parser.open_streams else None
        if self._mid_frame():
            frame = self.frame_at + self.parser.budget.stall_timeout
            stalled = frame if stalled is None else min(stalled, frame)
        return stalled

    def _mid_frame(self) -> bool:
        """Part of a frame (or of a sealed record) arrived and the rest has not."""
        return self.parser.in_frame or (self.opener is not None and self.opener.mid_record)

    def _note_input(self, now: float) -> None:
        """Input arrives: a frame that starts with it starts its stall clock now."""
        self.parser.now = now
        if not self._mid_frame():
            self.frame_at = now

    def _live(self, deadline: float, stream_id: int) -> bool:
        if stream_id % 2 == self._parity:
            call = self.calls.get(stream_id)
            return call is not None and call.deadline == deadline
        request = self.requests.get(stream_id)
        return request is not None and not request.cancelled and request.deadline == deadline

    def timeouts(self, now: float) -> list[Event]:
        """Everything due by `now`: calls past their deadline fail with `CallTimeout` (and their streams are
        cancelled), requests past theirs are cancelled, and an idle connection is reported once."""
        events: list[Event] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, stream_id = heapq.heappop(heap)
            if not self._live(deadline, stream_id):
                continue
            if stream_id % 2 == self._parity:
                call = self.calls.pop(stream_id)
                if not self.closed:
                    self.outbox.cancel(stream_id)
                events.append(CallFailed(stream_id, CallTimeout(
                    f"no answer within {call.timeout:.3g} s", peer=self.peer_id, address=self.address,
                    method=call.method)))
            else:
                self.requests[stream_id].cancelled = True
                events.append(RequestCancelled(stream_id, expired=True))
        if not self.closed and self.broken is None:
            if self._mid_frame() and now >= self.frame_at + self.parser.budget.stall_timeout:
                self.closed = True  # a frame begun and not finished: someone trickling bytes to hold us
                events.append(ConnectionIdle("stalled"))
                return events
            self.parser.now = now
            activity = self.last_activity, self.frame_at
            self._on_frames(self.parser.expire_stalled(now), now, events)
            self.last_activity, self.frame_at = activity  # dropping a message is no input from the peer
        # the same sum as `next_deadline`'s: `now - last_activity` at that deadline can round below the timeout,
        # and a driver woken at it would find nothing due and wait for the same deadline again (a livelock under
        # a mock clock, where time only moves when every task waits)
        if (self.idle_timeout is not None and not self.closed
                and now >= self.last_activity + self.idle_timeout):
            if self.busy:
                self.last_activity = now  # a slow transfer or a long handler: look again one timeout later
            else:
                self.closed = True
                events.append(ConnectionIdle())
        return events

    # ---------------------------------------------------------------------------------------- closing

    def connection_lost(self, reason: str) -> list[Event]:
        """The byte stream ended (or is being closed): every call in flight fails with `ConnectionFailed`,
        half-received messages give their receive budget back, and the core accepts nothing more."""
        self.closed = True
        self.parser.close()
        events: list[Event] = [
            CallFailed(stream_id, ConnectionFailed(f"connection lost: {reason}", peer=self.peer_id,
                                                   address=self.address, method=call.method))
            for stream_id, call in self.calls.items()
        ]
        self.calls.clear()
        for stream_id, request in self.requests.items():
            if not request.cancelled:
                request.cancelled = True
                events.append(RequestCancelled(stream_id, expired=False))
        return events
