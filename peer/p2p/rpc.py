"""Authenticated request/response RPC over any `peer.p2p.net.Network`, multiplexed on one connection per peer pair.

Why this shape:
- Every TCP connection starts with a handshake in which each side signs the other's fresh nonce, so a call is
  attributed to the PeerID that holds the key, never to a claimed one (`CallContext.peer_id`).
- Calls are multiplexed by stream id on one pooled connection; the framing layer (`peer.p2p.framing`) interleaves
  chunks, so a 100 MB tensor never holds up a small call, and tensors travel without copies (`peer.p2p.wire`).
- Every call has a deadline that also bounds the remote handler; cancelling a caller cancels the handler.
- Errors come back as typed frames and are raised as `RemoteError` subclasses; an unknown method is answered at
  once. Nothing a remote peer sends can crash the node: bad frames close that connection, bad messages get an
  error reply to that call only.
"""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import msgpack
import trio

from peer.p2p import framing, wire
from peer.p2p.identity import Identity, PeerID, verify_signature
from peer.p2p.lifetime import owned_nursery
from peer.p2p.net import Address, Network, ReceiveInto, receiver_into

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_HANDSHAKE_DOMAIN = b"swarmd-rpc-handshake-v1|"
_NONCE_BYTES = 32
_COALESCE_BYTES = 64 * 1024
_SCRATCH_BYTES = 64 * 1024


# ------------------------------------------------------------------------------------------------------- errors


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


class ResponseRejected(RPCError):
    """The peer's answer broke the wire limits or could not be decoded."""


class RemoteError(RPCError):
    """The remote handler answered with an error; `code` selects the subclass raised here."""

    code = "remote_error"


class UnknownMethod(RemoteError):
    code = "unknown_method"


class BadRequest(RemoteError):
    code = "bad_request"


class HandlerFailed(RemoteError):
    code = "internal"


_ERROR_CLASSES: dict[str, type[RemoteError]] = {}


def register_error_code(code: str, cls: type[RemoteError]) -> type[RemoteError]:
    """Make errors with `code` arrive as `cls` on callers (e.g. `moe.errors.ExpertNotFound`)."""
    existing = _ERROR_CLASSES.get(code)
    if existing is not None and existing is not cls:
        raise ValueError(f"error code {code!r} is already registered to {existing.__name__}")
    if cls.code != code:
        raise ValueError(f"{cls.__name__}.code is {cls.code!r}, not {code!r}")
    _ERROR_CLASSES[code] = cls
    return cls


for _cls in (RemoteError, UnknownMethod, BadRequest, HandlerFailed):
    register_error_code(_cls.code, _cls)


# ------------------------------------------------------------------------------------------------------ calls


@dataclass(frozen=True)
class CallContext:
    """Who is calling: the authenticated PeerID, and the listen address it announced (None for client mode)."""

    peer_id: PeerID
    address: Address | None
    method: str


Handler = Callable[[CallContext, Any], Awaitable[Any]]


@dataclass
class _PendingCall:
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    error: RPCError | None = None

    def finish(self, result: Any = None, error: RPCError | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()


@dataclass
class _PendingConnect:
    done: trio.Event = field(default_factory=trio.Event)
    connection: "Connection | None" = None
    error: RPCError | None = None


# ------------------------------------------------------------------------------------------------- connection


class Connection:
    """One authenticated connection: a reader, a writer, and the handlers of calls it brought in."""

    def __init__(
        self,
        node: "RPCNode",
        stream: trio.abc.Stream,
        parser: framing.FrameParser,
        *,
        initiator: bool,
        peer_id: PeerID,
        remote_listen: Address | None,
        dialed: Address | None,
    ):
        self.node = node
        self.stream = stream
        self.parser = parser
        self.peer_id = peer_id
        self.remote_listen = remote_listen
        self.dialed = dialed
        self.outbox = framing.Outbox()
        self.calls: dict[int, _PendingCall] = {}
        self.handlers: dict[int, trio.CancelScope] = {}
        self.closed = False
        self.close_reason = "closed"
        self.last_activity = trio.current_time()
        self._next_stream_id = 1 if initiator else 2
        self._writer_wakeup = trio.Event()
        self._nursery: trio.Nursery | None = None

    @property
    def label(self) -> Address | None:
        return self.dialed or self.remote_listen

    def next_stream_id(self) -> int:
        stream_id = self._next_stream_id
        self._next_stream_id = (self._next_stream_id + 2) % (1 << 32) or (1 if stream_id % 2 else 2)
        return stream_id

    def enqueue(self, stream_id: int, parts: list) -> None:
        self.outbox.add(stream_id, parts)
        self._writer_wakeup.set()

    def cancel_stream(self, stream_id: int) -> None:
        if not self.closed:
            self.outbox.cancel(stream_id)
            self._writer_wakeup.set()

    async def run(self, first_events: list[framing.Event]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                nursery.start_soon(self._idle_watchdog)
                await self._reader(first_events)
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            self.parser.close()
            for call in self.calls.values():
                call.finish(error=ConnectionFailed(f"connection lost: {self.close_reason}", peer=self.peer_id,
                                                   address=self.label))
            self.node._forget(self)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    def _close(self, reason: str) -> None:
        if not self.closed:
            self.close_reason = reason
            self.closed = True
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _reader(self, first_events: list[framing.Event]) -> None:
        try:
            self._handle_events(first_events)
            await self._read_into_messages(receiver_into(self.stream))
        except framing.FramingError as error:
            self.node.stats["protocol_errors"] += 1
            logger.warning("closing connection to peer %s: %s", self.peer_id.short(), error)
            self.close_reason = f"protocol error: {error}"
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self.close_reason = f"reset ({error.__class__.__name__})"

    async def _read_into_messages(self, receive_into: ReceiveInto) -> None:
        """Read message payloads straight into their final buffers (one copy, by the kernel on real sockets);
        in-memory streams take the same path (`MemoryStream.receive_into`)."""
        scratch = bytearray(_SCRATCH_BYTES)
        scratch_view = memoryview(scratch)
        while True:
            target = self.parser.receive_target()
            if target is not None:
                received = await receive_into(target)
                if not received:
                    self.close_reason = "closed by peer"
                    return
                events = self.parser.advance(received)
            else:
                received = await receive_into(scratch)
                if not received:
                    self.close_reason = "closed by peer"
                    return
                events = self.parser.receive(scratch_view[:received])
            self.last_activity = trio.current_time()
            if events:
                self._handle_events(events)

    async def _writer(self) -> None:
        try:
            while True:
                if not self.outbox:
                    self._writer_wakeup = trio.Event()
                    await self._writer_wakeup.wait()
                    continue
                small: list = []
                small_size = 0
                for frame in self.outbox.next_frames():
                    if len(frame) < _COALESCE_BYTES:
                        small.append(frame)
                        small_size += len(frame)
                        if small_size < _COALESCE_BYTES:
                            continue
                    if small:
                        await self.stream.send_all(b"".join(small))
                        small, small_size = [], 0
                    if len(frame) >= _COALESCE_BYTES:
                        await self.stream.send_all(frame)
                if small:
                    await self.stream.send_all(b"".join(small))
                self.last_activity = trio.current_time()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self._close(f"send failed ({error.__class__.__name__})")

    async def _idle_watchdog(self) -> None:
        """Close connections that carry nothing (including half-sent frames from a peer gone quiet)."""
        timeout = self.node.idle_timeout
        while True:
            await trio.sleep_until(self.last_activity + timeout)
            idle = trio.current_time() - self.last_activity >= timeout
            if idle and not self.calls and not self.handlers and not self.outbox:
                self._close("idle")
                return
            if idle:
                self.last_activity = trio.current_time()

    # ---------------------------------------------------------------------------------------- events

    def _is_my_stream(self, stream_id: int) -> bool:
        return stream_id % 2 == self._next_stream_id % 2

    def _handle_events(self, events: list[framing.Event]) -> None:
        for event in events:
            if isinstance(event, framing.MessageReceived):
                if self._is_my_stream(event.stream_id):
                    self._on_response(event.stream_id, event.data)
                else:
                    self._on_request(event.stream_id, event.data)
            elif isinstance(event, framing.MessageRejected):
                self.node.stats["rejected_messages"] += 1
                if self._is_my_stream(event.stream_id):
                    call = self.calls.get(event.stream_id)
                    if call is not None:
                        call.finish(error=ResponseRejected(event.reason, peer=self.peer_id, address=self.label))
                else:
                    self._send_error(event.stream_id, BadRequest.code, event.reason)
            elif isinstance(event, framing.StreamCancelled):
                scope = self.handlers.get(event.stream_id)
                if scope is not None:
                    scope.cancel()
            elif isinstance(event, framing.ControlFrame):
                raise framing.FramingError(f"unexpected control frame {event.kind:#x} after the handshake")

    def _on_response(self, stream_id: int, data: bytearray) -> None:
        call = self.calls.get(stream_id)
        if call is None:
            return  # the caller gave up already
        try:
            message = wire.decode(data, limits=self.node.limits)
            if not isinstance(message, list) or not message or message[0] not in (0, 1):
                raise wire.WireError("malformed response envelope")
            if message[0] == 0:
                call.finish(result=message[1] if len(message) > 1 else None)
                return
            code, text = str(message[1]), str(message[2])
        except (wire.WireError, IndexError) as error:
            call.finish(error=ResponseRejected(str(error), peer=self.peer_id, address=self.label))
            return
        cls = _ERROR_CLASSES.get(code, RemoteError)
        error = cls(text, peer=self.peer_id, address=self.label)
        if cls is RemoteError:
            error.code = code
        call.finish(error=error)

    def _on_request(self, stream_id: int, data: bytearray) -> None:
        self.node.stats["calls_received"] += 1
        try:
            message = wire.decode(data, limits=self.node.limits)
        except wire.WireError as error:
            self._send_error(stream_id, BadRequest.code, f"undecodable request: {error}")
            return
        if (
            not isinstance(message, list)
            or len(message) != 3
            or not isinstance(message[0], str)
            or not (message[1] is None or isinstance(message[1], (int, float)))
        ):
            self._send_error(stream_id, BadRequest.code, "malformed request envelope")
            return
        method, timeout, args = message
        handler = self.node._handlers.get(method)
        if handler is None:
            self._send_error(stream_id, UnknownMethod.code, f"unknown method {method!r}")
            return
        assert self._nursery is not None
        scope = trio.CancelScope()
        if timeout is not None:
            scope.deadline = trio.current_time() + max(0.0, float(timeout))
        self.handlers[stream_id] = scope
        self._nursery.start_soon(self._serve_call, stream_id, method, args, handler, scope)

    async def _serve_call(self, stream_id: int, method: str, args: Any, handler: Handler,
                          scope: trio.CancelScope) -> None:
        context = CallContext(self.peer_id, self.remote_listen, method)
        try:
            with scope:
                try:
                    result = await handler(context, args)
                    parts = wire.encode([0, result])
                except RemoteError as error:  # a typed refusal (bad input, no such expert...): still a failed call
                    self.node.stats["handler_errors"] += 1
                    parts = wire.encode([1, error.code, error.message])
                except wire.WireError as error:
                    self.node.stats["handler_failures"] += 1
                    logger.error("%s handler returned an unencodable result: %s", method, error)
                    parts = wire.encode([1, HandlerFailed.code, f"unencodable result: {error}"])
                except Exception as error:  # a bug in a handler must not take the connection down
                    self.node.stats["handler_failures"] += 1
                    logger.exception("%s handler failed for peer %s", method, self.peer_id.short())
                    parts = wire.encode([1, HandlerFailed.code, f"{error.__class__.__name__}: {error}"])
                self.enqueue(stream_id, parts)
                self.node.stats["calls_served"] += 1
            if scope.cancelled_caught:  # past the caller's deadline, or the caller cancelled it
                self.node.stats["handlers_cancelled"] += 1
        finally:
            self.handlers.pop(stream_id, None)

    def _send_error(self, stream_id: int, code: str, message: str) -> None:
        self.node.stats["error_replies"] += 1
        self.enqueue(stream_id, wire.encode([1, code, message]))


# ------------------------------------------------------------------------------------------------------ node


class RPCNode:
    """A peer's RPC endpoint: calls out to others, and (after `listen`) serves registered handlers.

    Use as `async with RPCNode(identity, network) as node:`; the node owns a nursery for its listener,
    connections and handlers, and leaving the block closes all of them.
    """

    def __init__(
        self,
        identity: Identity,
        network: Network,
        *,
        limits: wire.Limits = wire.DEFAULT_LIMITS,
        connect_timeout: float = 5.0,
        handshake_timeout: float = 5.0,
        idle_timeout: float = 300.0,
        announce: Address | None = None,
    ):
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.network = network
        self.limits = limits
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.address: Address | None = None
        self.announce = announce
        # Failed calls, as `peer status` counts them: served ones refused before a handler ran (error_replies),
        # answered with a typed error (handler_errors), crashed (handler_failures) or cut short by the caller's
        # deadline or cancellation (handlers_cancelled); and this node's own calls that failed (calls_failed).
        self.stats: dict[str, int] = {
            key: 0
            for key in (
                "calls_sent", "calls_failed", "calls_received", "calls_served", "error_replies",
                "handler_errors", "handler_failures", "handlers_cancelled", "handshake_failures",
                "protocol_errors", "rejected_messages",
                "connections_opened", "connections_accepted",
            )
        }
        self._handlers: dict[str, Handler] = {}
        self._connections: dict[Address, Connection] = {}
        self._connecting: dict[Address, _PendingConnect] = {}
        self._all_connections: set[Connection] = set()
        self._nursery: trio.Nursery | None = None
        self._lifetime_cm: Any = None
        self.receive_budget = framing.ReceiveBudget(2 * limits.max_message_bytes)

    # ----------------------------------------------------------------------------------- lifetime

    @asynccontextmanager
    async def _lifetime(self) -> AsyncIterator["RPCNode"]:
        async with owned_nursery() as nursery:
            self._nursery = nursery
            try:
                yield self
            finally:
                self._nursery = None

    async def __aenter__(self) -> "RPCNode":
        self._lifetime_cm = self._lifetime()
        return await self._lifetime_cm.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._lifetime_cm.__aexit__(*exc_info)

    def _require_nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("use the RPCNode inside `async with RPCNode(...) as node:`")
        return self._nursery

    # ----------------------------------------------------------------------------------- serving

    def register(self, name: str, handler: Handler) -> None:
        if name in self._handlers:
            raise ValueError(f"a handler for {name!r} is already registered")
        self._handlers[name] = handler

    def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)

    async def listen(self, host: str, port: int) -> Address:
        """Start accepting connections on host:port (0 picks a free port); returns the bound address."""
        self.address = await self._require_nursery().start(self.network.serve_tcp, self._accept, host, port)
        return self.address

    @property
    def announced_address(self) -> Address | None:
        return self.announce or self.address

    async def _accept(self, stream: trio.abc.Stream) -> None:
        parser = framing.FrameParser(self.limits.max_message_bytes, budget=self.receive_budget,
                                     allocate=wire.message_buffer)
        try:
            peer_id, remote_listen, events = await self._handshake(stream, parser)
        except HandshakeError as error:
            parser.close()
            self.stats["handshake_failures"] += 1
            logger.debug("rejected incoming connection: %s", error)
            return
        self.stats["connections_accepted"] += 1
        connection = Connection(self, stream, parser, initiator=False, peer_id=peer_id,
                                remote_listen=remote_listen, dialed=None)
        self._all_connections.add(connection)
        await connection.run(events)

    # ----------------------------------------------------------------------------------- calling

    async def call(
        self,
        address: Address,
        method: str,
        args: Any = None,
        *,
        timeout: float,
        peer_id: PeerID | None = None,
        compression: wire.Compression = wire.Compression.NONE,
    ) -> Any:
        """Call `method` on the peer at `address`; raises an `RPCError` subclass on any failure."""
        address = (str(address[0]), int(address[1]))
        deadline = trio.current_time() + timeout
        self.stats["calls_sent"] += 1
        connection: Connection | None = None
        try:
            with trio.move_on_at(deadline):
                connection = await self._get_connection(address, peer_id, method)
                stream_id = connection.next_stream_id()
                pending = _PendingCall()
                connection.calls[stream_id] = pending
                try:
                    remaining = max(0.0, deadline - trio.current_time())
                    connection.enqueue(stream_id, wire.encode([method, remaining, args], compression=compression))
                    await pending.done.wait()
                finally:
                    connection.calls.pop(stream_id, None)
                    if not pending.done.is_set():
                        connection.cancel_stream(stream_id)
                if pending.error is not None:
                    pending.error.method = method
                    pending.error.address = address
                    raise pending.error
                return pending.result
            raise CallTimeout(f"no answer within {timeout:.3g} s", address=address, method=method,
                              peer=connection.peer_id if connection else peer_id)
        except RPCError:
            self.stats["calls_failed"] += 1
            raise

    async def _get_connection(self, address: Address, peer_id: PeerID | None, method: str) -> Connection:
        connection = self._connections.get(address)
        if connection is None or connection.closed:
            pending = self._connecting.get(address)
            if pending is None:
                pending = self._connecting[address] = _PendingConnect()
                self._require_nursery().start_soon(self._connect, address, pending)
            await pending.done.wait()
            if pending.error is not None:
                error = pending.error
                raise type(error)(error.message, peer=error.peer, address=address, method=method)
            connection = pending.connection
            assert connection is not None
        if peer_id is not None and connection.peer_id != peer_id:
            raise HandshakeError(f"the peer at this address is {connection.peer_id.short()}, "
                                 f"not {peer_id.short()}", peer=peer_id, address=address, method=method)
        return connection

    async def _connect(self, address: Address, pending: _PendingConnect) -> None:
        """Runs in the node's nursery, so one caller giving up never breaks a connection others wait for."""
        opened = None
        try:
            opened = await self._open(address)
        except HandshakeError as error:
            self.stats["handshake_failures"] += 1
            pending.error = error
        except RPCError as error:
            pending.error = error
        finally:
            if self._connecting.get(address) is pending:
                del self._connecting[address]
            if opened is None:
                if pending.error is None:
                    pending.error = ConnectionFailed("the node is shutting down", address=address)
                pending.done.set()
        if opened is None:
            return
        stream, parser, peer_id, remote_listen, events = opened
        self.stats["connections_opened"] += 1
        connection = Connection(self, stream, parser, initiator=True, peer_id=peer_id,
                                remote_listen=remote_listen, dialed=address)
        self._connections[address] = connection
        self._all_connections.add(connection)
        pending.connection = connection
        pending.done.set()
        await connection.run(events)

    async def _open(self, address: Address) -> tuple:
        with trio.move_on_after(self.connect_timeout):
            try:
                stream = await self.network.connect_tcp(address)
            except OSError as error:
                raise ConnectionFailed(f"cannot connect: {error.strerror or error}", address=address) from None
            try:
                parser = framing.FrameParser(self.limits.max_message_bytes, budget=self.receive_budget,
                                             allocate=wire.message_buffer)
                peer_id, remote_listen, events = await self._handshake(stream, parser)
            except BaseException:
                parser.close()
                await trio.aclose_forcefully(stream)
                raise
            return stream, parser, peer_id, remote_listen, events
        raise ConnectionFailed(f"no connection within {self.connect_timeout:.3g} s", address=address)

    def _forget(self, connection: Connection) -> None:
        self._all_connections.discard(connection)
        if connection.dialed is not None and self._connections.get(connection.dialed) is connection:
            del self._connections[connection.dialed]

    def connection_count(self) -> int:
        return len(self._all_connections)

    # ----------------------------------------------------------------------------------- handshake

    async def _handshake(
        self, stream: trio.abc.Stream, parser: framing.FrameParser
    ) -> tuple[PeerID, Address | None, list[framing.Event]]:
        """Both sides send HELLO (version, public key, nonce, listen address), then PROOF: a signature of the
        other side's nonce followed by their own. Returns the authenticated PeerID, the announced address and
        any events that arrived behind the proof."""
        nonce = os.urandom(_NONCE_BYTES)
        listen = self.announced_address
        hello = msgpack.packb(
            {"v": PROTOCOL_VERSION, "pk": self.identity.public_key, "nonce": nonce,
             "listen": [listen[0], listen[1]] if listen else None},
            use_bin_type=True,
        )
        backlog: list[framing.Event] = []
        with trio.move_on_after(self.handshake_timeout) as scope:
            try:
                await stream.send_all(framing.control_frame(framing.HELLO, hello))
                theirs = self._parse_hello(await self._read_control(stream, parser, framing.HELLO, backlog))
                public_key, their_nonce, remote_listen = theirs
                proof = self.identity.sign(_HANDSHAKE_DOMAIN + their_nonce + nonce)
                await stream.send_all(framing.control_frame(framing.PROOF, proof))
                their_proof = await self._read_control(stream, parser, framing.PROOF, backlog)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                raise HandshakeError(f"connection lost during handshake ({error.__class__.__name__})") from None
            except framing.FramingError as error:
                raise HandshakeError(f"not a swarmd peer: {error}") from None
        if scope.cancelled_caught:
            raise HandshakeError(f"handshake not completed within {self.handshake_timeout:.3g} s")
        peer_id = PeerID.from_public_key(public_key)
        if not verify_signature(public_key, their_proof, _HANDSHAKE_DOMAIN + nonce + their_nonce):
            raise HandshakeError("the peer could not prove it holds its key", peer=peer_id)
        return peer_id, remote_listen, backlog

    async def _read_control(self, stream: trio.abc.Stream, parser: framing.FrameParser, kind: int,
                            backlog: list[framing.Event]) -> bytes:
        while True:
            while backlog:
                event = backlog.pop(0)
                if isinstance(event, framing.ControlFrame) and event.kind == kind:
                    return event.payload  # whatever follows stays in the backlog for the connection
                if isinstance(event, framing.ControlFrame) and event.kind == framing.ERROR:
                    raise HandshakeError(f"peer refused: {event.payload[:200].decode('utf-8', 'replace')}")
                raise framing.FramingError("unexpected frame during the handshake")
            data = await stream.receive_some(framing.MAX_CONTROL_BYTES)
            if not data:
                raise HandshakeError("connection closed during handshake")
            backlog.extend(parser.receive(data))

    @staticmethod
    def _parse_hello(payload: bytes) -> tuple[bytes, bytes, Address | None]:
        try:
            hello = msgpack.unpackb(payload, raw=False, max_str_len=1024, max_bin_len=1024,
                                    max_array_len=16, max_map_len=16)
        except Exception as error:  # msgpack raises several unrelated types for garbage
            raise HandshakeError(f"unreadable hello: {error.__class__.__name__}") from None
        if not isinstance(hello, dict):
            raise HandshakeError("unreadable hello")
        if type(hello.get("v")) is not int or hello["v"] != PROTOCOL_VERSION:  # True and 1.0 equal 1 in Python
            raise HandshakeError(f"protocol version {hello.get('v')!r}, expected {PROTOCOL_VERSION}")
        public_key, nonce, listen = hello.get("pk"), hello.get("nonce"), hello.get("listen")
        if not isinstance(public_key, bytes) or len(public_key) != 32:
            raise HandshakeError("hello without a valid public key")
        if not isinstance(nonce, bytes) or len(nonce) != _NONCE_BYTES:
            raise HandshakeError("hello without a valid nonce")
        address: Address | None = None
        if listen is not None:
            if (not isinstance(listen, list) or len(listen) != 2 or not isinstance(listen[0], str)
                    or type(listen[1]) is not int or not 0 < listen[1] < 65536):  # a bool is no port
                raise HandshakeError("hello with a malformed listen address")
            address = (listen[0], listen[1])
        return public_key, nonce, address
