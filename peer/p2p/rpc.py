"""Authenticated request/response RPC over any `peer.p2p.net.Network`, multiplexed on one connection per peer pair.

Why this shape:
- Every TCP connection starts with an authenticated key exchange (`peer.p2p.handshake`), so a call is
  attributed to the PeerID that holds the key, never to a claimed one (`CallContext.peer_id`), and everything
  after it is sealed (`peer.p2p.seal`): a byte changed on the way closes the connection before any handler runs.
  `secure=False` (`--insecure-transport`) sends frames unsealed; both ends must agree.
- Calls are multiplexed by stream id on one pooled connection; the framing layer (`peer.p2p.framing`) interleaves
  chunks, so a 100 MB tensor never holds up a small call, and tensors travel without copies (`peer.p2p.wire`).
- Every call has a deadline that also bounds the remote handler; cancelling a caller cancels the handler.
- Errors come back as typed frames and are raised as `RemoteError` subclasses; an unknown method is answered at
  once. Nothing a remote peer sends can crash the node: bad frames close that connection, bad messages get an
  error reply to that call only.

Why the split into cores and drivers: what the protocol decides lives in two sans-I/O objects that never touch a
socket, a task or a clock -- the handshake (`peer.p2p.handshake.Handshake`) and the connection protocol
(`peer.p2p.rpc_protocol.RPCConnection`: stream ids, replies, error codes, deadlines, cancellation, idleness) --
so they are tested byte by byte. This module is their trio driver: `RPCNode` dials, accepts, pools connections
and bounds the connect and handshake phases; `Connection` moves bytes between the socket and its core (reading
message payloads straight into their buffers with `receiver_into`), wakes the tasks waiting for replies, runs
handlers under cancel scopes, and sleeps until the core's next deadline. The error classes are defined with the
core and re-exported here, where callers have always imported them.
"""

from __future__ import annotations

import logging
import math
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from peer.p2p import budget, framing, relay, wire
from peer.p2p.handshake import (
    PROTOCOL_VERSION,
    Handshake,
    HandshakeComplete,
    HandshakeFailed,
    PeerNotAllowed,
    Role,
    SwarmKeyMismatch,
)
from peer.p2p.identity import Identity, PeerID, SwarmKey
from peer.p2p.lifetime import owned_nursery
from peer.p2p.net import (
    TRANSPORT_ERRORS,
    Address,
    Network,
    ReceiveInto,
    receive_prefix,
    receiver_into,
    remote_address,
)
from peer.p2p.rpc_protocol import (
    BadRequest,
    BudgetExceeded,
    CallCompleted,
    CallFailed,
    CallTimeout,
    ConnectionFailed,
    ConnectionIdle,
    Event,
    HandlerFailed,
    HandshakeError,
    LocalProtocolError,
    NotAllowed,
    NotInSwarm,
    RemoteError,
    RemoteProtocolError,
    RequestCancelled,
    RequestReceived,
    ResponseRejected,
    RPCConnection,
    RPCError,
    UnknownMethod,
    register_error_code,
)

__all__ = [
    "PROTOCOL_VERSION", "RPCError", "BudgetExceeded", "CallTimeout", "ConnectionFailed",
    "HandshakeError", "NotInSwarm", "NotAllowed",
    "ResponseRejected",
    "RemoteError", "UnknownMethod", "BadRequest", "HandlerFailed", "LocalProtocolError", "RemoteProtocolError",
    "register_error_code", "CallContext", "Handler", "Connection", "RPCNode",
]

logger = logging.getLogger(__name__)

_SCRATCH_BYTES = 64 * 1024


# ------------------------------------------------------------------------------------------------------ calls


@dataclass(frozen=True)
class CallContext:
    """Who is calling: the authenticated PeerID, the listen address it announced (None for client mode), and the
    address its connection comes from as this node observes it (what per-IP limits key on; None when unknown)."""

    peer_id: PeerID
    address: Address | None
    method: str
    observed: Address | None = None


Handler = Callable[[CallContext, Any], Awaitable[Any]]
CIRCUIT_IDLE_TIMEOUT = 3.0  # seconds before an idle connection through a relay closes (and frees its slot)
# a raw protocol sharing the RPC port (the relay's circuits): gets the stream and the prefix bytes already read
StreamHandler = Callable[[trio.abc.Stream, bytes], Awaitable[None]]


class _PendingCall:
    """A caller waiting for its reply; the reader (or the timer, or the connection's end) finishes it."""

    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Any = None
        self.error: RPCError | None = None

    def finish(self, result: Any = None, error: RPCError | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()


@dataclass
class _PendingConnect:
    done: trio.Event
    connection: "Connection | None" = None
    error: RPCError | None = None


# ------------------------------------------------------------------------------------------------- connection


class Connection:
    """The trio driver of one authenticated connection: a reader, a writer, a timer, and the handlers of the
    calls it brought in, all in one nursery. Decisions are the core's (`protocol`); this only does the I/O."""

    def __init__(self, node: "RPCNode", stream: trio.abc.Stream, handshake: HandshakeComplete, *,
                 dialed: Address | None, relayed: bool = False):
        self.node = node
        self.stream = stream
        self.peer_id = handshake.peer_id
        self.remote_listen = handshake.remote_listen
        self.observed = remote_address(stream)
        self.dialed = dialed
        self.protocol = RPCConnection(
            initiator=handshake.role is Role.INITIATOR, peer_id=handshake.peer_id, address=self.label,
            limits=node.limits, methods=node._handlers, budget=node.receive_budget,
            idle_timeout=node.circuit_idle_timeout if relayed else node.idle_timeout,
            now=trio.current_time(), stats=node.stats, keys=handshake.keys, accountant=node.accountant,
        )
        self._leftover = handshake.leftover
        self.waiters: dict[int, _PendingCall] = {}
        self.handlers: dict[int, trio.CancelScope] = {}
        self.closed = False
        self.close_reason = "closed"
        self._writer_wakeup = trio.Event()
        self._timer_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def label(self) -> Address | None:
        return self.dialed or self.remote_listen

    async def call(self, method: str, args: Any, *, deadline: float,
                   compression: wire.Compression = wire.Compression.NONE) -> Any:
        """One call on this connection; the core fails it with `CallTimeout` at `deadline` (trio clock)."""
        protocol = self.protocol
        stream_id = protocol.start_call(method, args, deadline=deadline, now=trio.current_time(),
                                        compression=compression)
        waiter = self.waiters[stream_id] = _PendingCall()
        self._writer_wakeup.set()
        self._schedule(deadline)
        try:
            await waiter.done.wait()
        finally:
            if not waiter.done.is_set():  # the caller was cancelled: stop the remote handler too
                del self.waiters[stream_id]
                protocol.cancel_call(stream_id)
                self._writer_wakeup.set()
        if waiter.error is not None:
            raise waiter.error
        return waiter.result

    def _schedule(self, deadline: float | None) -> None:
        """Wake the timer earlier if `deadline` comes before the one it sleeps until."""
        scope = self._timer_scope
        if deadline is not None and scope is not None and deadline < scope.deadline:
            scope.deadline = deadline

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                nursery.start_soon(self._timer)
                await self._reader()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            self._deliver(self.protocol.connection_lost(self.close_reason))
            self.node._forget(self)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    def _close(self, reason: str) -> None:
        if not self.closed:
            self.close_reason = reason
            self.closed = True
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # ---------------------------------------------------------------------------------------- tasks

    async def _reader(self) -> None:
        try:
            if self._leftover:
                self._deliver(self.protocol.receive_data(self._leftover, trio.current_time()))
                self._leftover = b""
            await self._read_into_messages(receiver_into(self.stream))
        except RemoteProtocolError as error:
            self._deliver(error.events)
            self.node.stats["protocol_errors"] += 1
            where = f" at {self.label[0]}:{self.label[1]}" if self.label else ""
            logger.warning("closing connection to peer %s%s: protocol error while receiving: %s",
                           self.peer_id.short(), where, error)
            self.close_reason = f"protocol error: {error}"
        except TRANSPORT_ERRORS as error:
            self.close_reason = f"reset ({error.__class__.__name__})"

    async def _read_into_messages(self, receive_into: ReceiveInto) -> None:
        """Read message payloads straight into their final buffers (one copy, by the kernel on real sockets);
        in-memory streams take the same path (`MemoryStream.receive_into`)."""
        protocol = self.protocol
        # a sealed connection always reads into its opener's buffer: the scratch is for unsealed ones
        scratch = bytearray(_SCRATCH_BYTES if protocol.opener is None else 1)
        scratch_view = memoryview(scratch)
        current_time = trio.current_time
        while True:
            target = protocol.receive_target()
            if target is not None:
                received = await receive_into(target)
                if not received:
                    protocol.end_of_stream()  # raises when the stream was cut inside a sealed record
                    self.close_reason = "closed by peer"
                    return
                events = protocol.advance(received, current_time())
            else:
                received = await receive_into(scratch)
                if not received:
                    protocol.end_of_stream()
                    self.close_reason = "closed by peer"
                    return
                events = protocol.receive_data(scratch_view[:received], current_time())
            self.node.stats["bytes_received"] += received
            stalled = protocol.stall_deadline()
            if stalled is not None:
                self._schedule(stalled)
            if events:
                self._deliver(events)
            elif protocol.outbox:  # error replies the core queued on its own
                self._writer_wakeup.set()

    async def _writer(self) -> None:
        protocol, stream = self.protocol, self.stream
        try:
            while True:
                writes = protocol.data_to_send(trio.current_time())
                if not writes:
                    self._writer_wakeup = trio.Event()
                    await self._writer_wakeup.wait()
                    continue
                for buffer in writes:
                    await stream.send_all(buffer)
                    self.node.stats["bytes_sent"] += memoryview(buffer).nbytes
        except TRANSPORT_ERRORS as error:
            self._close(f"send failed ({error.__class__.__name__})")

    async def _timer(self) -> None:
        """Sleep until the core's next deadline, then let it expire what is due (calls, handlers, idleness)."""
        protocol = self.protocol
        while True:
            deadline = protocol.next_deadline()
            with trio.CancelScope(deadline=math.inf if deadline is None else deadline) as scope:
                self._timer_scope = scope
                await trio.sleep_forever()
            self._timer_scope = None
            self._deliver(protocol.timeouts(trio.current_time()))

    # ---------------------------------------------------------------------------------------- events

    def _deliver(self, events: list[Event]) -> None:
        for event in events:
            if type(event) is CallCompleted:
                waiter = self.waiters.pop(event.stream_id, None)
                if waiter is not None:
                    waiter.finish(result=event.result)
            elif type(event) is CallFailed:
                waiter = self.waiters.pop(event.stream_id, None)
                if waiter is not None:
                    waiter.finish(error=event.error)
            elif type(event) is RequestReceived:
                self._start_handler(event)
            elif type(event) is RequestCancelled:
                scope = self.handlers.get(event.stream_id)
                if scope is not None:
                    scope.cancel()
            elif type(event) is ConnectionIdle:
                self._close(event.reason)
        if self.protocol.outbox:
            self._writer_wakeup.set()

    def _start_handler(self, request: RequestReceived) -> None:
        assert self._nursery is not None
        scope = self.handlers[request.stream_id] = trio.CancelScope()
        self._schedule(request.deadline)
        self._nursery.start_soon(self._serve_call, request.stream_id, request.method, request.args,
                                 self.node._handlers[request.method], scope)

    async def _serve_call(self, stream_id: int, method: str, args: Any, handler: Handler,
                          scope: trio.CancelScope) -> None:
        context = CallContext(self.peer_id, self.remote_listen, method, self.observed)
        protocol, stats = self.protocol, self.node.stats
        answered = False
        started = trio.current_time()
        try:
            with scope:
                try:
                    try:
                        result = await handler(context, args)
                    except RemoteError as error:  # a typed refusal (bad input, no such expert...): a failed call
                        stats["handler_errors"] += 1
                        protocol.send_error(stream_id, error.code, error.message)
                    else:
                        protocol.send_reply(stream_id, result)
                except wire.WireError as error:
                    stats["handler_failures"] += 1
                    logger.error("%s handler returned an unencodable result for peer %s: %s", method,
                                 self.peer_id.short(), error)
                    protocol.send_error(stream_id, HandlerFailed.code, f"unencodable result: {error}")
                except Exception as error:  # a bug in a handler must not take the connection down
                    stats["handler_failures"] += 1
                    logger.exception("%s handler failed for peer %s", method, self.peer_id.short())
                    protocol.send_error(stream_id, HandlerFailed.code, f"{error.__class__.__name__}: {error}")
                answered = True
                self._writer_wakeup.set()
                stats["calls_served"] += 1
            if scope.cancelled_caught:  # past the caller's deadline, or the caller cancelled it
                stats["handlers_cancelled"] += 1
        finally:
            self.handlers.pop(stream_id, None)
            if not answered:
                protocol.abandon_request(stream_id)
            if self.node.on_served is not None:  # metrics (peer/metrics.py): latency by method
                self.node.on_served(method, trio.current_time() - started, answered)


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
        circuit_idle_timeout: float = CIRCUIT_IDLE_TIMEOUT,
        announce: Address | None = None,
        secure: bool = True,
        swarm_key: SwarmKey | None = None,
        allowed_peers: frozenset[PeerID] | None = None,
        budget_limits: budget.BudgetLimits = budget.DEFAULT_BUDGET,
    ):
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.network = network
        self.limits = limits
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        # a connection through a relay's circuit holds one of the relay's `--relay-limit` slots: closed sooner
        self.circuit_idle_timeout = circuit_idle_timeout
        self.address: Address | None = None
        self.announce = announce
        self.secure = secure  # False: `--insecure-transport`, frames unsealed (the remote must agree)
        self.swarm_key = swarm_key  # a private swarm's: only holders complete a handshake (peer/p2p/handshake.py)
        self.allowed_peers = allowed_peers  # `--allow-peers`: None accepts any PeerID
        # Failed calls, as `peer status` counts them: served ones refused before a handler ran (error_replies),
        # answered with a typed error (handler_errors), crashed (handler_failures) or cut short by the caller's
        # deadline or cancellation (handlers_cancelled); and this node's own calls that failed (calls_failed).
        self.stats: dict[str, int] = {
            key: 0
            for key in (
                "calls_sent", "calls_failed", "calls_received", "calls_served", "error_replies",
                "handler_errors", "handler_failures", "handlers_cancelled", "handshake_failures",
                "handshakes_not_in_swarm",
                "protocol_errors", "rejected_messages",
                "connections_opened", "connections_accepted", "bytes_sent", "bytes_received",
                "circuits_dialed", "circuits_accepted", "handshakes_evicted", "connections_refused",
            )
        }
        self._handlers: dict[str, Handler] = {}
        self._stream_handlers: dict[bytes, StreamHandler] = {}  # by the 8-byte prefix their streams start with
        # called with each circuit this node dials through a relay (a direct-connection upgrade can use it)
        self.on_circuit: Callable[[relay.Circuit], None] | None = None
        # tried on each circuit this node dials, before RPC runs on it (hole punching, `peer.p2p.punch`): the
        # direct stream and its completed handshake, or None to keep the circuit
        self.upgrade_circuit: Callable[[relay.Circuit, PeerID], Awaitable[
            tuple[trio.abc.Stream, HandshakeComplete] | None]] | None = None
        # called after every served call with (method, seconds, answered); set by whoever exports metrics
        self.on_served: Callable[[str, float, bool], None] | None = None
        self._connections: dict[Address, Connection] = {}
        self._connecting: dict[Address, _PendingConnect] = {}
        self._all_connections: set[Connection] = set()
        self._nursery: trio.Nursery | None = None
        self._lifetime_cm: AbstractAsyncContextManager[RPCNode] | None = None
        # what remote peers may make this node hold, in one place (`peer.p2p.budget`): requests per peer and
        # per method, bytes of partly received messages, inbound connections per peer, handshakes per IP group
        self.budget_limits = budget_limits
        self.accountant = budget.Accountant.from_limits(budget_limits)
        self.receive_budget = framing.ReceiveBudget(budget_limits.message_bytes_total,
                                                    stall_timeout=budget_limits.message_stall_timeout,
                                                    accountant=self.accountant)
        self._handshakes = budget.OldestFirst(self.accountant, "handshakes")

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
        assert self._lifetime_cm is not None, "__aexit__ without __aenter__"
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

    def register_stream(self, prefix: bytes, handler: StreamHandler) -> None:
        """Serve incoming streams that start with the 8 bytes `prefix` with `handler` instead of RPC (the relay
        service's circuit requests share the RPC port, so a private peer needs to reach one port only)."""
        if len(prefix) != len(relay.MAGIC) or prefix in self._stream_handlers:
            raise ValueError(f"a stream prefix is {len(relay.MAGIC)} bytes, registered once: {prefix!r}")
        self._stream_handlers[prefix] = handler

    def unregister_stream(self, prefix: bytes) -> None:
        self._stream_handlers.pop(prefix, None)

    async def accept(self, stream: trio.abc.Stream, *, initial: bytes = b"",
                     handshake: HandshakeComplete | None = None, relayed: bool = False) -> None:
        """Serve RPC on a stream that reached this node another way than its listener (a relay circuit, or the
        direct connection a hole punch made of one): the handshake runs on it as on any accepted connection
        (`initial`: its first bytes, already read), or has run already (`handshake`). `relayed`: the stream is
        a circuit (closed after `circuit_idle_timeout` idle)."""
        self.stats["circuits_accepted"] += 1
        await self._accept(stream, dispatch=False, initial=initial, handshake=handshake, relayed=relayed)

    async def _accept(self, stream: trio.abc.Stream, dispatch: bool = True, initial: bytes = b"",
                      handshake: HandshakeComplete | None = None, relayed: bool = False) -> None:
        if handshake is not None:
            await self._serve_inbound(Connection(self, stream, handshake, dialed=None, relayed=relayed))
            return
        # Before authentication a stranger is only its IP group: the prefix read and the handshake share one
        # deadline, and when too many are pending the oldest is closed to let this one in (`OldestFirst`).
        scope = trio.CancelScope(deadline=trio.current_time() + self.handshake_timeout)
        observed = remote_address(stream)
        group = budget.ip_group(observed[0]) if observed is not None else "?"
        for victim in self._handshakes.admit(group, scope):
            self.stats["handshakes_evicted"] += 1
            victim.cancel()  # type: ignore[attr-defined]  # tokens are the pending handshakes' scopes
        first = initial
        handler: StreamHandler | None = None
        try:
            with scope:
                if dispatch and self._stream_handlers:  # read the prefix before our hello: it may be no RPC peer
                    prefix = await receive_prefix(stream, len(relay.MAGIC), self.handshake_timeout, have=initial)
                    if prefix is None:
                        return
                    first = prefix
                    handler = self._stream_handlers.get(first)
                    if handler is None and len(first) < len(relay.MAGIC):
                        self.stats["handshake_failures"] += 1
                        return
                if handler is None:
                    handshake = await self._handshake(stream, Role.RESPONDER, initial=first)
        except HandshakeError as error:
            self.stats["handshake_failures"] += 1
            if isinstance(error, NotInSwarm):  # someone outside a private swarm (or with the wrong key) knocked
                self.stats["handshakes_not_in_swarm"] += 1
            logger.debug("rejected incoming connection: %s", error)
            return
        finally:
            self._handshakes.leave(group, scope)
        if handler is not None:
            await handler(stream, first)
            return
        if handshake is None:  # past the deadline, or evicted for a newer one
            self.stats["handshake_failures"] += 1
            return
        if dispatch:  # a circuit counts as circuits_accepted (`accept`)
            self.stats["connections_accepted"] += 1
        await self._serve_inbound(Connection(self, stream, handshake, dialed=None, relayed=relayed))

    async def _serve_inbound(self, connection: Connection) -> None:
        """Run an accepted connection, charged to its peer's `connections` budget (refused when over it)."""
        scopes = (("peer", connection.peer_id),)
        try:
            self.accountant.take(scopes, "connections", peer=connection.peer_id)
        except budget.LimitReached as refusal:
            self.stats["connections_refused"] += 1
            logger.debug("refused a connection: %s", refusal)
            return
        try:
            self._all_connections.add(connection)
            await connection.run()
        finally:
            self.accountant.give_back(scopes, "connections")

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
        """Call `method` on the peer at `address`; raises an `RPCError` subclass on any failure. The deadline
        bounds connecting here, and then the call in the connection's core (which also tells the remote handler)."""
        address = (str(address[0]), int(address[1]))
        deadline = trio.current_time() + timeout
        self.stats["calls_sent"] += 1
        try:
            connection = self._connections.get(address)
            if connection is None or connection.closed or (peer_id is not None and connection.peer_id != peer_id):
                connection = None  # connect first (or explain the mismatch), within the deadline
                with trio.move_on_at(deadline):
                    connection = await self._get_connection(address, peer_id, method)
            if connection is None:
                raise CallTimeout(f"no answer within {timeout:.3g} s", address=address, method=method, peer=peer_id)
            return await connection.call(method, args, deadline=deadline, compression=compression)
        except RPCError:
            self.stats["calls_failed"] += 1
            raise

    def is_connected(self, address: Address) -> bool:
        """An open connection to `address` is pooled (a call there needs no dial or handshake first)."""
        connection = self._connections.get(address)
        return connection is not None and not connection.closed

    async def _get_connection(self, address: Address, peer_id: PeerID | None, method: str) -> Connection:
        connection = self._connections.get(address)
        if connection is None or connection.closed:
            pending = self._connecting.get(address)
            if pending is None:
                pending = self._connecting[address] = _PendingConnect(trio.Event())
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
        stream, handshake, relayed = opened
        self.stats["connections_opened"] += 1
        connection = Connection(self, stream, handshake, dialed=address, relayed=relayed)
        self._connections[address] = connection
        self._all_connections.add(connection)
        pending.connection = connection
        pending.done.set()
        await connection.run()

    async def _open(self, address: Address) -> tuple[trio.abc.Stream, HandshakeComplete, bool]:
        """A connection's stream and handshake, and whether it runs through a relay's circuit."""
        with trio.move_on_after(self.connect_timeout):
            try:
                if relay.is_relayed(address):  # through a relay's circuit; the handshake runs end to end
                    relayed = relay.parse_relayed(address)
                    stream, handshake, through_relay = await relay.dial_through_relays(
                        self.network, relayed, source=self.peer_id, timeout=self.connect_timeout,
                        establish=lambda circuit: self._establish_circuit(circuit, relayed.target))
                    self.stats["circuits_dialed"] += 1
                    return stream, handshake, through_relay
                stream = await self.network.connect_tcp(address)
            except OSError as error:
                raise ConnectionFailed(f"cannot connect: {error.strerror or error}", address=address) from None
            except relay.RelayError as error:
                raise type(error)(error.message, address=address) from None
            except relay.RelayProtocolError as error:
                raise ConnectionFailed(str(error), address=address) from None
            try:
                handshake = await self._handshake(stream, Role.INITIATOR)
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            return stream, handshake, False
        raise ConnectionFailed(f"no connection within {self.connect_timeout:.3g} s", address=address)

    async def _establish_circuit(self, circuit: relay.Circuit,
                                 target: PeerID) -> tuple[trio.abc.Stream, HandshakeComplete, bool]:
        """On a fresh circuit to `target`: a hole punch (`upgrade_circuit`), else the handshake through it."""
        if self.on_circuit is not None:
            self.on_circuit(circuit)
        if self.upgrade_circuit is not None:
            upgraded = await self.upgrade_circuit(circuit, target)
            if upgraded is not None:  # a direct connection: the circuit is not needed
                await trio.aclose_forcefully(circuit.stream)
                return (*upgraded, False)
        return circuit.stream, await self._handshake(circuit.stream, Role.INITIATOR, expected_peer=target), True

    async def probe(self, address: Address, *, peer_id: PeerID, timeout: float) -> None:
        """Open a fresh connection to `address`, complete the handshake with `peer_id` there, and close it: can
        this node reach that address now (a reachability dial-back)? Never uses or joins the connection pool,
        so an existing connection in either direction cannot answer for it. Raises `ConnectionFailed`
        (`HandshakeError` when someone else answers) on failure."""
        address = (str(address[0]), int(address[1]))
        with trio.move_on_after(timeout):
            try:
                stream = await self.network.connect_tcp(address)
            except OSError as error:
                raise ConnectionFailed(f"cannot connect: {error.strerror or error}", address=address,
                                       peer=peer_id) from None
            try:
                await self._handshake(stream, Role.INITIATOR, expected_peer=peer_id)
            except HandshakeError as error:
                raise HandshakeError(error.message, peer=peer_id, address=address) from None
            finally:
                await trio.aclose_forcefully(stream)
            return
        raise ConnectionFailed(f"no connection within {timeout:.3g} s", address=address, peer=peer_id)

    def _forget(self, connection: Connection) -> None:
        self._all_connections.discard(connection)
        if connection.dialed is not None and self._connections.get(connection.dialed) is connection:
            del self._connections[connection.dialed]

    def connection_count(self) -> int:
        return len(self._all_connections)

    def close_connections(self, reason: str) -> None:
        """Close every connection (calls on them fail with `ConnectionFailed`). A handshake announces this node's
        address once per connection, so after the announced address changed for good (a private peer now reached
        through relays) the connections that told the old one are closed; the next calls open fresh ones."""
        for connection in list(self._all_connections):
            connection._close(reason)


    # ----------------------------------------------------------------------------------- handshake

    async def _handshake(self, stream: trio.abc.Stream, role: Role,
                         expected_peer: PeerID | None = None, initial: bytes = b"") -> HandshakeComplete:
        """Drive a `Handshake` over `stream` within `handshake_timeout`; every failure is a `HandshakeError`.
        `initial`: bytes of the remote's already read (the prefix `_accept` looked at)."""
        handshake = Handshake(self.identity, role, listen=self.announced_address, expected_peer=expected_peer,
                              secure=self.secure, swarm_key=self.swarm_key, allowed_peers=self.allowed_peers)
        with trio.move_on_after(self.handshake_timeout):
            try:
                if initial:
                    handshake.receive_data(initial)  # a prefix is shorter than any frame: no event yet
                await stream.send_all(handshake.data_to_send())
                while True:
                    data = await stream.receive_some(framing.MAX_CONTROL_BYTES)
                    if not data:
                        raise handshake.connection_closed()
                    events = handshake.receive_data(data)
                    reply = handshake.data_to_send()
                    if reply:
                        await stream.send_all(reply)
                    if events:
                        return events[0]
            except TRANSPORT_ERRORS as error:
                raise HandshakeError(f"connection lost during handshake ({error.__class__.__name__})") from None
            except HandshakeFailed as error:
                await self._send_last_words(stream, handshake.data_to_send())
                kind = (NotInSwarm if isinstance(error, SwarmKeyMismatch) else
                        NotAllowed if isinstance(error, PeerNotAllowed) else HandshakeError)
                raise kind(str(error), peer=error.peer_id) from None
        raise HandshakeError(f"handshake not completed within {self.handshake_timeout:.3g} s")

    async def _send_last_words(self, stream: trio.abc.Stream, data: bytes) -> None:
        """What a failed handshake still queued (our PROOF, an ERROR refusal), so the remote reaches its own
        verdict rather than seeing a closed connection; best effort, briefly bounded."""
        if not data:
            return
        with trio.move_on_after(min(1.0, self.handshake_timeout)):
            try:
                await stream.send_all(data)
            except TRANSPORT_ERRORS:
                pass
