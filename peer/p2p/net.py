"""Transports: real trio sockets, or an in-memory network for deterministic simulation.

Everything above this module (RPC, DHT, MoE, averaging) talks to a `Network`: TCP-like byte streams for RPC and
datagrams for the DHT. `RealNetwork` maps them onto trio sockets. `MemoryNetwork` keeps them in memory with
per-link latency, loss, bandwidth and partitions, driven only by trio's clock, so hundreds of peers run under
`trio.testing.MockClock(autojump_threshold=0)` deterministically (seeded randomness) and in seconds.

A peer on the memory network uses the view returned by `MemoryNetwork.host(name)`: that view is the peer's own
`Network`, so the simulator knows which link each packet crosses.
"""

from __future__ import annotations

import collections
import errno
import heapq
import ipaddress
import itertools
import operator
import random
import socket as stdlib_socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

Address = tuple[str, int]
StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]
MAX_DATAGRAM_BYTES = 65507


class UDPEndpoint(ABC):
    """A bound datagram socket: one per peer, on the same port number as its TCP listener."""

    address: Address

    @abstractmethod
    async def sendto(self, data: bytes, address: Address) -> None: ...

    @abstractmethod
    async def recvfrom(self) -> tuple[bytes, Address]: ...

    @abstractmethod
    def close(self) -> None: ...

    async def __aenter__(self) -> "UDPEndpoint":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class Network(ABC):
    @abstractmethod
    async def connect_tcp(self, address: Address) -> trio.abc.Stream:
        """Open a byte stream to `address`; raises OSError when nothing listens there."""

    @abstractmethod
    async def serve_tcp(
        self, handler: StreamHandler, host: str, port: int, *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on host:port (0 = any free port), report the bound Address through `task_status`, then run
        `handler(stream)` for each incoming connection in its own task until cancelled. The stream is closed
        when its handler returns."""

    @abstractmethod
    async def open_udp(self, host: str, port: int) -> UDPEndpoint:
        """Bind a datagram socket; raises OSError when the port is taken."""

    async def resolve(self, address: Address) -> Address:
        """The address with its host name resolved, so datagram replies (which come from an IP) match it."""
        await trio.lowlevel.checkpoint()
        return address


async def _run_handler_and_close(handler: StreamHandler, stream: trio.abc.Stream) -> None:
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)


# ---------------------------------------------------------------------------------------------------- real sockets


class _RealUDPEndpoint(UDPEndpoint):
    def __init__(self, sock: trio.socket.SocketType):
        self._socket = sock
        host, port = sock.getsockname()[:2]
        self.address = (host, port)

    async def sendto(self, data: bytes, address: Address) -> None:
        try:
            await self._socket.sendto(data, address)
        except OSError:
            # Datagrams are fire-and-forget: an unreachable address is the same as a lost packet.
            pass

    async def recvfrom(self) -> tuple[bytes, Address]:
        while True:
            try:
                data, address = await self._socket.recvfrom(MAX_DATAGRAM_BYTES)
            except ConnectionRefusedError:
                continue  # ICMP port unreachable for an earlier sendto; not about this receive
            return data, (address[0], address[1])

    def close(self) -> None:
        self._socket.close()


class RealNetwork(Network):
    """trio sockets over the operating system's network."""

    async def resolve(self, address: Address) -> Address:
        host, port = address
        try:
            ipaddress.ip_address(host)
            return address
        except ValueError:
            pass
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=stdlib_socket.SOCK_DGRAM)
        except stdlib_socket.gaierror as error:
            raise OSError(error.errno, f"cannot resolve host {host!r}: {error.strerror}") from None
        preferred = sorted(infos, key=lambda info: info[0] != stdlib_socket.AF_INET)
        return (str(preferred[0][4][0]), port)

    async def connect_tcp(self, address: Address) -> trio.abc.Stream:
        host, port = address
        return await trio.open_tcp_stream(host, port)

    async def serve_tcp(
        self, handler: StreamHandler, host: str, port: int, *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        task_status.started((bound[0], bound[1]))

        async def handle(stream: trio.abc.Stream) -> None:
            await _run_handler_and_close(handler, stream)

        await trio.serve_listeners(handle, listeners)

    async def open_udp(self, host: str, port: int) -> UDPEndpoint:
        sock = trio.socket.socket(stdlib_socket.AF_INET, stdlib_socket.SOCK_DGRAM)
        try:
            await sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        return _RealUDPEndpoint(sock)


# ---------------------------------------------------------------------------------------------------- in memory


@dataclass
class LinkConditions:
    """One direction of a link: seconds of one-way delay, probability a datagram is lost, bytes per second."""

    latency: float = 0.0
    loss: float = 0.0
    bandwidth: float | None = None


class _Waker:
    """A resettable event: waiters take the current event, `notify` sets it and starts a fresh one."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def current(self) -> trio.Event:
        return self._event

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()


class _Pipe:
    """One direction of an in-memory TCP connection: ordered, reliable, delayed by the link's conditions."""

    def __init__(self, network: "MemoryNetwork", source: str, destination: str):
        self.network = network
        self.source = source
        self.destination = destination
        self.chunks: collections.deque[tuple[float, bytes]] = collections.deque()
        self.busy_until = 0.0
        self.sender_closed = False
        self.receiver_closed = False
        self.reset = False
        self.waker = _Waker()

    def link_up(self) -> bool:
        return self.network.link_up(self.source, self.destination)


class _Exclusive:
    """`with guard:` raises `trio.BusyResourceError` when another task is inside (trio's stream contract)."""

    def __init__(self, message: str):
        self._message = message
        self._held = False

    def __enter__(self) -> None:
        if self._held:
            raise trio.BusyResourceError(self._message)
        self._held = True

    def __exit__(self, *exc_info: object) -> None:
        self._held = False


class MemoryStream(trio.abc.HalfCloseableStream):
    """One end of an in-memory TCP connection, behaving as a trio stream must (it passes
    `trio.testing.check_two_way_stream`): concurrent sends or receives raise `BusyResourceError`,
    `receive_some(0)` is a `ValueError` rather than an empty read that looks like EOF, use after `aclose` raises
    `ClosedResourceError`.

    `receive_into(buffer)` mirrors a real socket's `recv_into`: the RPC reader uses `receive_into` on both kinds of
    stream (see `receiver_into`), so simulated connections run the same zero-copy receive path as real ones."""

    def __init__(self, outgoing: _Pipe, incoming: _Pipe):
        self._outgoing = outgoing
        self._incoming = incoming
        self._send_guard = _Exclusive("another task is already sending on this stream")
        self._receive_guard = _Exclusive("another task is already receiving on this stream")
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_guard:
            pipe = self._outgoing
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            if pipe.sender_closed:
                raise trio.ClosedResourceError("send_eof was called on this stream")
            if pipe.reset or pipe.receiver_closed:
                raise trio.BrokenResourceError("connection reset by peer")
            data = bytes(data)
            await trio.lowlevel.checkpoint()
            if not data:
                return
            conditions = pipe.network.conditions(pipe.source, pipe.destination)
            now = trio.current_time()
            start = max(now, pipe.busy_until)
            transmit = len(data) / conditions.bandwidth if conditions.bandwidth else 0.0
            pipe.busy_until = start + transmit
            pipe.chunks.append((pipe.busy_until + conditions.latency, data))
            pipe.waker.notify()
            if transmit:
                await trio.sleep_until(pipe.busy_until)  # backpressure, like a full socket buffer

    async def wait_send_all_might_not_block(self) -> None:
        with self._send_guard:
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)  # TypeError for 1.5, as a socket stream would raise
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        with self._receive_guard:
            data = await self._next_chunk(max_bytes)
            return bytes(data)

    async def receive_into(self, buffer: bytearray | memoryview) -> int:
        """Copy the next available bytes into `buffer` (as `socket.recv_into`); 0 means end of stream."""
        view = memoryview(buffer).cast("B")
        if not len(view):
            raise ValueError("receive_into needs a non-empty buffer")
        with self._receive_guard:
            data = await self._next_chunk(len(view))
            view[: len(data)] = data
            return len(data)

    async def _next_chunk(self, max_bytes: int | None) -> bytes:
        pipe = self._incoming
        while True:
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            if pipe.reset:
                raise trio.BrokenResourceError("connection reset by peer")
            wake = pipe.waker.current()
            if pipe.chunks and pipe.link_up():
                deliver_at, data = pipe.chunks[0]
                if deliver_at <= trio.current_time():
                    await trio.lowlevel.checkpoint()
                    if self._closed:
                        raise trio.ClosedResourceError("stream was closed")
                    if max_bytes is not None and len(data) > max_bytes:
                        pipe.chunks[0] = (deliver_at, data[max_bytes:])
                        return data[:max_bytes]
                    pipe.chunks.popleft()
                    return data
                with trio.move_on_at(deliver_at):
                    await wake.wait()
                continue
            if not pipe.chunks and pipe.sender_closed:
                await trio.lowlevel.checkpoint()
                return b""
            await wake.wait()

    async def send_eof(self) -> None:
        with self._send_guard:
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            self._outgoing.sender_closed = True
            self._outgoing.waker.notify()
            await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._outgoing.sender_closed = True
            self._incoming.receiver_closed = True
            self._outgoing.waker.notify()
            self._incoming.waker.notify()
        await trio.lowlevel.checkpoint()


ReceiveInto = Callable[[memoryview | bytearray], Awaitable[int]]


def receiver_into(stream: trio.abc.ReceiveStream) -> ReceiveInto:
    """The `recv_into`-style receive of a stream: the socket's own for trio socket streams, `receive_into` for
    in-memory ones, and for any other stream (a wrapper) a copy from `receive_some`. One receive path for the
    RPC reader, whatever carries the bytes."""
    sock = getattr(stream, "socket", None)
    if sock is not None and hasattr(sock, "recv_into"):
        return sock.recv_into  # type: ignore[no-any-return]
    receive_into = getattr(stream, "receive_into", None)
    if receive_into is not None:
        return receive_into  # type: ignore[no-any-return]

    async def copy_into(buffer: memoryview | bytearray) -> int:
        view = memoryview(buffer).cast("B")
        data = await stream.receive_some(len(view))
        view[: len(data)] = data
        return len(data)

    return copy_into


class _MemoryUDPEndpoint(UDPEndpoint):
    def __init__(self, network: "MemoryNetwork", address: Address):
        self.network = network
        self.address = address
        self.queue: list[tuple[float, int, bytes, Address]] = []
        self.waker = _Waker()
        self.closed = False
        self.crashed = False

    async def sendto(self, data: bytes, address: Address) -> None:
        if self.crashed:
            await trio.lowlevel.checkpoint()  # a dead host's packets go nowhere
            return
        if self.closed:
            raise trio.ClosedResourceError("socket was closed")
        await trio.lowlevel.checkpoint()
        self.network._deliver_datagram(self.address, address, bytes(data))

    async def recvfrom(self) -> tuple[bytes, Address]:
        while True:
            if self.crashed:
                await trio.sleep_forever()  # until the test cancels the dead host's tasks
            if self.closed:
                raise trio.ClosedResourceError("socket was closed")
            wake = self.waker.current()
            if self.queue:
                deliver_at = self.queue[0][0]
                if deliver_at <= trio.current_time():
                    _, _, data, source = heapq.heappop(self.queue)
                    await trio.lowlevel.checkpoint()
                    return data, source
                with trio.move_on_at(deliver_at):
                    await wake.wait()
                continue
            await wake.wait()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.network._udp.get(self.address) is self:  # after a crash a restarted peer may own it
                del self.network._udp[self.address]
            self.waker.notify()


class _Listener:
    def __init__(self, host: str, port: int):
        self.host = host
        self.port = port
        self.send_channel, self.receive_channel = trio.open_memory_channel[MemoryStream](float("inf"))


class MemoryNetwork:
    """A simulated network of named hosts, shared by every peer in one trio run.

    Conditions are per directed link, with a default for all links. Partitions cut links: streams across a cut
    stall (as TCP would until a timeout) and datagrams are dropped. `crash(host)` models SIGKILL: its connections
    are reset and its ports close; `freeze(host)` models a hung machine: it simply stops answering.
    """

    def __init__(self, *, latency: float = 0.0, loss: float = 0.0, bandwidth: float | None = None, seed: int = 0):
        self.default = LinkConditions(latency, loss, bandwidth)
        self.random = random.Random(seed)
        self._links: dict[tuple[str, str], LinkConditions] = {}
        self._cut: set[frozenset[str]] = set()
        self._down: set[str] = set()
        self._listeners: dict[Address, _Listener] = {}
        self._udp: dict[Address, _MemoryUDPEndpoint] = {}
        self._pipes: list[_Pipe] = []
        self._ports = itertools.count(10000)
        self._sequence = itertools.count()
        self.datagrams_sent = 0
        self.datagrams_dropped = 0

    def host(self, name: str) -> "MemoryHost":
        return MemoryHost(self, name)

    # --------------------------------------------------------------------------------------------- conditions

    def set_link(self, source: str, destination: str, *, symmetric: bool = True, **conditions: float | None) -> None:
        self._links[(source, destination)] = LinkConditions(**{**self.default.__dict__, **conditions})
        if symmetric:
            self._links[(destination, source)] = LinkConditions(**{**self.default.__dict__, **conditions})

    def conditions(self, source: str, destination: str) -> LinkConditions:
        return self._links.get((source, destination), self.default)

    def link_up(self, source: str, destination: str) -> bool:
        if source in self._down or destination in self._down:
            return False
        return frozenset((source, destination)) not in self._cut

    def partition(self, *groups: list[str] | set[str]) -> None:
        """Cut every link between hosts of different groups (hosts in no group keep their links)."""
        for index, group in enumerate(groups):
            for other in groups[index + 1:]:
                for a in group:
                    for b in other:
                        self._cut.add(frozenset((a, b)))
        self._topology_changed()

    def isolate(self, host: str) -> None:
        """Cut `host` off from everyone (its process keeps running)."""
        self._down.add(host)
        self._topology_changed()

    def heal(self) -> None:
        self._cut.clear()
        self._down.clear()
        self._topology_changed()

    def crash(self, host: str) -> None:
        """The host's process died: listeners and UDP sockets vanish, its connections are reset. Tasks of the
        dead host that still run (until the test cancels them) see their datagrams vanish and receive nothing."""
        for address in [a for a in self._listeners if a[0] == host]:
            listener = self._listeners.pop(address)
            listener.send_channel.close()
        for address in [a for a in self._udp if a[0] == host]:
            endpoint = self._udp.pop(address)
            endpoint.crashed = True
            endpoint.waker.notify()
        for pipe in self._pipes:
            if host in (pipe.source, pipe.destination):
                pipe.reset = True
                pipe.waker.notify()
        self._pipes = [p for p in self._pipes if not p.reset]

    def freeze(self, host: str) -> None:
        """The host hangs: nothing it sent is delivered and nothing reaches it, with no reset anywhere."""
        self.isolate(host)

    def _topology_changed(self) -> None:
        for pipe in self._pipes:
            pipe.waker.notify()

    # --------------------------------------------------------------------------------------------- transport

    def _deliver_datagram(self, source: Address, destination: Address, data: bytes) -> None:
        self.datagrams_sent += 1
        endpoint = self._udp.get(destination)
        conditions = self.conditions(source[0], destination[0])
        if (
            endpoint is None
            or not self.link_up(source[0], destination[0])
            or (conditions.loss and self.random.random() < conditions.loss)
        ):
            self.datagrams_dropped += 1
            return
        deliver_at = trio.current_time() + conditions.latency
        if conditions.bandwidth:
            deliver_at += len(data) / conditions.bandwidth
        heapq.heappush(endpoint.queue, (deliver_at, next(self._sequence), data, source))
        endpoint.waker.notify()

    def _free_port(self, host: str) -> int:
        while True:
            port = next(self._ports)
            if (host, port) not in self._listeners and (host, port) not in self._udp:
                return port

    async def _connect(self, source: str, address: Address) -> MemoryStream:
        host, port = address
        rtt = self.conditions(source, host).latency + self.conditions(host, source).latency
        while not self.link_up(source, host):  # noqa: ASYNC110 (a simulated SYN retransmission, not a wait on our own state)
            await trio.sleep(1.0)  # SYN retransmission: hangs until the caller's deadline or the link heals
        await trio.sleep(rtt)
        listener = self._listeners.get((host, port))
        if listener is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"connection refused by {host}:{port}")
        client, server = self.stream_pair(source, host)
        listener.send_channel.send_nowait(server)
        return client

    def stream_pair(self, source: str, destination: str) -> tuple[MemoryStream, MemoryStream]:
        """Both ends of a new connection from host `source` to host `destination`, under the links' conditions
        (what `connect_tcp` builds once a listener accepted; tests use it to get a bare pair)."""
        forward = _Pipe(self, source, destination)
        backward = _Pipe(self, destination, source)
        self._pipes.extend((forward, backward))
        return MemoryStream(forward, backward), MemoryStream(backward, forward)

    def prune(self) -> None:
        """Forget pipes whose both ends are closed; long simulations call this now and then."""
        self._pipes = [p for p in self._pipes if not (p.sender_closed and p.receiver_closed) and not p.reset]


class MemoryHost(Network):
    """One host's view of a MemoryNetwork."""

    def __init__(self, network: MemoryNetwork, name: str):
        self.network = network
        self.name = name

    async def connect_tcp(self, address: Address) -> trio.abc.Stream:
        return await self.network._connect(self.name, address)

    async def serve_tcp(
        self, handler: StreamHandler, host: str, port: int, *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        host = self.name if host in ("", "0.0.0.0", self.name) else host
        if host != self.name:
            raise OSError(errno.EADDRNOTAVAIL, f"{host} is not an address of memory host {self.name}")
        port = port or self.network._free_port(host)
        if (host, port) in self.network._listeners:
            raise OSError(errno.EADDRINUSE, f"address {host}:{port} already in use")
        listener = _Listener(host, port)
        self.network._listeners[(host, port)] = listener
        try:
            task_status.started((host, port))
            async with trio.open_nursery() as nursery:
                async for stream in listener.receive_channel:
                    nursery.start_soon(_run_handler_and_close, handler, stream)
        finally:
            if self.network._listeners.get((host, port)) is listener:
                del self.network._listeners[(host, port)]

    async def open_udp(self, host: str, port: int) -> UDPEndpoint:
        await trio.lowlevel.checkpoint()
        host = self.name if host in ("", "0.0.0.0", self.name) else host
        if host != self.name:
            raise OSError(errno.EADDRNOTAVAIL, f"{host} is not an address of memory host {self.name}")
        port = port or self.network._free_port(host)
        if (host, port) in self.network._udp:
            raise OSError(errno.EADDRINUSE, f"address {host}:{port} already in use")
        endpoint = _MemoryUDPEndpoint(self.network, (host, port))
        self.network._udp[(host, port)] = endpoint
        return endpoint


def parse_address(text: str, *, default_port: int | None = None) -> Address:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port), with a message that says what was wrong."""
    text = text.strip()
    host, separator, port_text = text.rpartition(":")
    if not separator:
        if default_port is None:
            raise ValueError(f"{text!r} is not HOST:PORT")
        host, port_text = text, str(default_port)
    host = host.strip("[]")
    if not host:
        raise ValueError(f"{text!r} has no host (expected HOST:PORT)")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{text!r} has a port that is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{text!r} has a port outside 1..65535")
    return host, port
