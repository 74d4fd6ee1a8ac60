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
from typing import Awaitable, Callable, Container

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

    async def connect_tcp_from(self, address: Address, local_port: int) -> trio.abc.Stream:
        """Open a byte stream to `address` from `local_port`, which other sockets of this host may use at the
        same time (SO_REUSEADDR/SO_REUSEPORT). Why: a hole punch must leave through the NAT mapping an open
        connection already holds, so its outbound socket shares that connection's local port
        (`peer.p2p.punch`). Networks that cannot bind an outbound socket say so with an OSError."""
        await trio.lowlevel.checkpoint()
        raise OSError(errno.EOPNOTSUPP, f"{type(self).__name__} cannot bind an outbound connection to a port")


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

    async def connect_tcp_from(self, address: Address, local_port: int) -> trio.abc.Stream:
        host, port = await self.resolve(address)
        sock = trio.socket.socket(stdlib_socket.AF_INET, stdlib_socket.SOCK_STREAM)
        try:
            sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
            if hasattr(stdlib_socket, "SO_REUSEPORT"):
                sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEPORT, 1)
            await sock.bind(("0.0.0.0", local_port))
            await sock.connect((host, port))
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)

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


# What one direction of an in-memory connection holds unread before `send_all` blocks, as a socket's send and
# receive buffers together would. Without it a sender on an unlimited link never blocks: under the autojump clock
# a flooding task stays runnable forever, so virtual time stops and the queue grows without end.
PIPE_BUFFER = 4 << 20


class _Pipe:
    """One direction of an in-memory TCP connection: ordered, reliable, delayed by the link's conditions, with
    `PIPE_BUFFER` bytes of buffer between the two ends."""

    def __init__(self, network: "MemoryNetwork", source: str, destination: str):
        self.network = network
        self.source = source
        self.destination = destination
        self.chunks: collections.deque[tuple[float, bytes]] = collections.deque()
        self.busy_until = 0.0
        self.sender_closed = False
        self.receiver_closed = False
        self.reset = False
        self.queued = 0  # bytes sent and not yet received
        self.waker = _Waker()  # notified on data, space, close, reset and topology changes

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

    def __init__(self, outgoing: _Pipe, incoming: _Pipe, *, local_address: Address | None = None,
                 remote_address: Address | None = None):
        self._outgoing = outgoing
        self._incoming = incoming
        # as a socket's getsockname() / getpeername(): behind a simulated NAT the remote end sees the mapping
        self.local_address = local_address
        self.remote_address = remote_address
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
            pipe.queued += len(data)
            pipe.waker.notify()
            if transmit:
                await trio.sleep_until(pipe.busy_until)  # backpressure, like a full socket buffer
            while pipe.queued > PIPE_BUFFER:  # the receiver is behind: wait for it, as a full socket buffer would
                if self._closed:
                    raise trio.ClosedResourceError("stream was closed")
                if pipe.reset or pipe.receiver_closed:
                    raise trio.BrokenResourceError("connection reset by peer")
                await pipe.waker.current().wait()

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
        waited = False  # this call blocked already: it was a checkpoint, and needs no second one
        while True:
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            if pipe.reset:
                raise trio.BrokenResourceError("connection reset by peer")
            wake = pipe.waker.current()
            if pipe.chunks and pipe.link_up():
                deliver_at, data = pipe.chunks[0]
                if deliver_at <= trio.current_time():
                    if not waited:
                        await trio.lowlevel.checkpoint()
                    if self._closed:
                        raise trio.ClosedResourceError("stream was closed")
                    if max_bytes is not None and len(data) > max_bytes:
                        pipe.chunks[0] = (deliver_at, data[max_bytes:])
                        data = data[:max_bytes]
                    else:
                        pipe.chunks.popleft()
                    pipe.queued -= len(data)
                    if pipe.queued + len(data) > PIPE_BUFFER >= pipe.queued:
                        pipe.waker.notify()  # a blocked sender has room again
                    return data
                with trio.move_on_at(deliver_at):
                    await wake.wait()
                waited = True
                continue
            if not pipe.chunks and pipe.sender_closed:
                if not waited:
                    await trio.lowlevel.checkpoint()
                return b""
            await wake.wait()
            waited = True

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
TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


async def receive_prefix(stream: trio.abc.ReceiveStream, count: int, timeout: float, *, have: bytes = b""
                         ) -> bytes | None:
    """The first `count` bytes of `stream` (`have`: the ones already read), which decide what protocol speaks on
    it (RPC, a relay's circuit, a hole-punch request): fewer when `timeout` passes first, None when the stream
    ends or breaks before. One prefix reader for every port that serves more than one protocol."""
    first = have
    with trio.move_on_after(timeout):
        try:
            while len(first) < count:
                data = await stream.receive_some(count - len(first))
                if not data:
                    return None
                first += data
        except TRANSPORT_ERRORS:
            return None
    return first


def remote_address(stream: trio.abc.Stream) -> Address | None:
    """The remote end's address as this side's socket sees it (an in-memory stream's `remote_address`): what a
    relay reports as observed, and what limits before authentication are keyed on (`peer.p2p.budget.ip_group`)
    -- never an address the remote wrote itself."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        remote = getattr(stream, "remote_address", None)
        return (str(remote[0]), int(remote[1])) if remote is not None else None
    try:
        name = sock.getpeername()
    except OSError:
        return None
    return (str(name[0]), int(name[1])) if name else None


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
        # Why `waited`: a receive that blocked was a checkpoint already; a second one per datagram (a schedule
        # point, a pass of trio's scheduler) was a fifth of the scheduling work of a 500-node DHT simulation
        waited = False
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
                    if not waited:
                        await trio.lowlevel.checkpoint()
                    return data, source
                with trio.move_on_at(deliver_at):
                    await wake.wait()
                waited = True
                continue
            await wake.wait()
            waited = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.network._udp.get(self.address) is self:  # after a crash a restarted peer may own it
                del self.network._udp[self.address]
            self.waker.notify()


NAT_KINDS = ("masquerade", "symmetric")
SYN_RETRY = 1.0  # seconds between simulated SYN retransmissions (Linux's initial RTO)


@dataclass
class _Mapping:
    """One NAT translation: the inside endpoint, its public port, and the remote endpoints it sent to (the
    only ones whose packets the router lets back in: address-and-port dependent filtering, as conntrack's)."""

    inside: Address
    public_port: int
    remotes: set[Address]
    last_used: float
    pipes: list[_Pipe]

    def live(self, now: float, timeout: float) -> bool:
        if now - self.last_used <= timeout:
            return True
        return any(not (p.sender_closed and p.receiver_closed) and not p.reset for p in self.pipes)


class MemoryNAT:
    """A home router in front of some hosts of a MemoryNetwork: hosts behind it reach out, nobody reaches in.

    `masquerade` is a Linux MASQUERADE router with a DROP policy for new inbound packets: each inside endpoint
    (host, port) gets one public port on the router (its own port number when free, as Linux keeps it) for every
    destination, and a packet from outside reaches it only when it comes from an endpoint the inside one has sent
    to (conntrack ESTABLISHED,RELATED). So replies and simultaneous opens pass, dial-backs and unsolicited
    connections are dropped silently (a connect hangs until the caller's timeout, as through a real DROP rule).
    `symmetric` gives every (inside endpoint, remote endpoint) pair a fresh public port, so the address a third
    peer observed is useless to anyone else and hole punching fails. Mappings not used for `timeout` seconds
    (and, for TCP, held by no open connection) expire. Protocols ("tcp", "udp") have separate tables, as in
    conntrack. `stats()` counts what was translated, forwarded in and dropped."""

    def __init__(self, name: str, kind: str = "masquerade", *, timeout: float = 120.0):
        if kind not in NAT_KINDS:
            raise ValueError(f"unknown NAT kind {kind!r} (expected one of {', '.join(NAT_KINDS)})")
        self.name = name
        self.kind = kind
        self.timeout = timeout
        self.hosts: set[str] = set()
        self._by_port: dict[str, dict[int, _Mapping]] = {"tcp": {}, "udp": {}}
        self._by_inside: dict[str, dict[tuple[Address, Address | None], _Mapping]] = {"tcp": {}, "udp": {}}
        self._next_port = 20000
        self.counters: dict[str, int] = {
            f"{protocol}_{what}": 0 for protocol in ("tcp", "udp")
            for what in ("mappings", "outbound", "inbound_forwarded", "inbound_dropped")
        }

    def stats(self) -> dict[str, int | str]:
        return {"name": self.name, "kind": self.kind, **self.counters}

    def _free(self, protocol: str, port: int, now: float) -> bool:
        mapping = self._by_port[protocol].get(port)
        return mapping is None or not mapping.live(now, self.timeout)

    def _allocate(self, protocol: str, preferred: int | None, now: float) -> int:
        if preferred is not None and self._free(protocol, preferred, now):
            return preferred
        for _ in range(65536):
            port = self._next_port
            self._next_port = 1024 + (self._next_port - 1024 + 1) % (65536 - 1024)
            if self._free(protocol, port, now):
                return port
        raise OSError(errno.EADDRNOTAVAIL, f"NAT {self.name} has no free {protocol} port left")

    def outbound(self, protocol: str, inside: Address, remote: Address, now: float) -> _Mapping:
        """Translate a packet from `inside` to `remote`: the mapping it leaves through (made when needed), which
        from now on lets `remote`'s packets in."""
        self.counters[f"{protocol}_outbound"] += 1
        key = (inside, remote if self.kind == "symmetric" else None)
        mapping = self._by_inside[protocol].get(key)
        if mapping is None or not mapping.live(now, self.timeout) or \
                self._by_port[protocol].get(mapping.public_port) is not mapping:
            port = self._allocate(protocol, inside[1] if self.kind == "masquerade" else None, now)
            mapping = _Mapping(inside, port, set(), now, [])
            self._by_inside[protocol][key] = mapping
            self._by_port[protocol][port] = mapping
            self.counters[f"{protocol}_mappings"] += 1
        mapping.remotes.add(remote)
        mapping.last_used = now
        return mapping

    def inbound(self, protocol: str, public_port: int, remote: Address, now: float) -> _Mapping | None:
        """The mapping a packet from `remote` to this router's `public_port` is forwarded through, or None when
        the router drops it (nothing inside sent to `remote` from that port)."""
        mapping = self._by_port[protocol].get(public_port)
        if mapping is None or not mapping.live(now, self.timeout) or remote not in mapping.remotes:
            self.counters[f"{protocol}_inbound_dropped"] += 1
            return None
        self.counters[f"{protocol}_inbound_forwarded"] += 1
        mapping.last_used = now
        return mapping


class _Attempt:
    """A connect in flight from `local` toward `remote` (as dialed): a SYN sent, waiting for an answer. An
    inbound SYN from exactly `remote` to `local` meanwhile completes it instead (TCP simultaneous open)."""

    def __init__(self, local: Address, remote: Address):
        self.local = local
        self.remote = remote
        self.stream: MemoryStream | None = None
        self.done = trio.Event()


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

    `add_nat(router)` and `host(name, behind=router)` put hosts behind a NAT (`MemoryNAT`): others see their
    traffic come from the router's name and a mapped port, and reach them only through what the NAT lets in.
    Hosts behind the same router reach each other by name (one LAN); a host's own name is not routed from
    outside it. Link conditions and partitions stay per host name (the router adds no delay of its own).
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
        self._nats: dict[str, MemoryNAT] = {}
        self._behind: dict[str, MemoryNAT] = {}
        self._attempts: dict[tuple[Address, Address], _Attempt] = {}
        self._ephemeral = itertools.count()

    def host(self, name: str, *, behind: str | None = None) -> "MemoryHost":
        """Host `name`'s view of the network; `behind` puts it behind that router's NAT (see `add_nat`)."""
        if behind is not None:
            self.place_behind(name, behind)
        return MemoryHost(self, name)

    # --------------------------------------------------------------------------------------------- NAT

    def add_nat(self, router: str, kind: str = "masquerade", *, timeout: float = 120.0) -> MemoryNAT:
        """A NAT router named `router` (its name is the public address of the hosts behind it)."""
        if router in self._nats or router in self._behind:
            raise ValueError(f"{router!r} is already a router or a host behind one")
        nat = self._nats[router] = MemoryNAT(router, kind, timeout=timeout)
        return nat

    def place_behind(self, host: str, router: str) -> None:
        nat = self._nats.get(router)
        if nat is None:
            raise ValueError(f"no NAT router {router!r}: add it with add_nat first")
        current = self._behind.get(host)
        if current is not None and current is not nat:
            raise ValueError(f"{host!r} is already behind {current.name!r}")
        if host in self._nats:
            raise ValueError(f"{host!r} is a router")
        nat.hosts.add(host)
        self._behind[host] = nat

    def nat(self, router: str) -> MemoryNAT:
        return self._nats[router]

    def behind(self, host: str) -> MemoryNAT | None:
        """The NAT `host` sits behind, or None for a public host."""
        return self._behind.get(host)

    def _outbound(self, protocol: str, source: Address, destination: Address,
                  now: float) -> tuple[Address, _Mapping | None] | None:
        """What leaves `source`'s side for `destination`: the source address others see (after its router's
        translation) and the mapping used; None when the packet goes nowhere (a private name from outside, or
        a router's own public address from behind it: no hairpinning)."""
        source_nat = self._behind.get(source[0])
        destination_nat = self._behind.get(destination[0])
        if destination_nat is not None:
            return (source, None) if destination_nat is source_nat else None
        if source_nat is None:
            return source, None
        if destination[0] == source_nat.name:
            return None
        mapping = source_nat.outbound(protocol, source, destination, now)
        return (source_nat.name, mapping.public_port), mapping

    def _inbound(self, protocol: str, seen: Address, destination: Address,
                 now: float) -> tuple[Address, _Mapping | None] | None:
        """Where a packet from `seen` to `destination` arrives: the inside endpoint behind a router (None when
        the router drops it), else `destination` itself."""
        nat = self._nats.get(destination[0])
        if nat is None:
            return destination, None
        mapping = nat.inbound(protocol, destination[1], seen, now)
        return None if mapping is None else (mapping.inside, mapping)

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
        if self._behind:
            for host in (source, destination):
                nat = self._behind.get(host)
                if nat is not None and nat.name in self._down:  # the router itself is cut off
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
        if self._nats:
            now = trio.current_time()
            outbound = self._outbound("udp", source, destination, now)
            inbound = None if outbound is None else self._inbound("udp", outbound[0], destination, now)
            if outbound is None or inbound is None:
                self.datagrams_dropped += 1
                return
            # link conditions between the two hosts; the receiver sees the translated source
            self._deliver_translated(source[0], outbound[0], inbound[0], data)
            return
        self._deliver_translated(source[0], source, destination, data)

    def _deliver_translated(self, source_host: str, source: Address, destination: Address, data: bytes) -> None:
        endpoint = self._udp.get(destination)
        conditions = self.conditions(source_host, destination[0])
        if (
            endpoint is None
            or not self.link_up(source_host, destination[0])
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

    def _ephemeral_port(self) -> int:
        return 32768 + next(self._ephemeral) % 28232  # Linux's default ip_local_port_range

    async def _connect(self, source: str, address: Address, local_port: int | None = None) -> MemoryStream:
        if self._nats or local_port is not None or self._attempts:
            return await self._connect_through(source, address, local_port or self._ephemeral_port())
        host, port = address
        local = (source, self._ephemeral_port())
        rtt = self.conditions(source, host).latency + self.conditions(host, source).latency
        while not self.link_up(source, host):  # noqa: ASYNC110 (a simulated SYN retransmission, not a wait on our own state)
            await trio.sleep(1.0)  # SYN retransmission: hangs until the caller's deadline or the link heals
        await trio.sleep(rtt)
        listener = self._listeners.get((host, port))
        if listener is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"connection refused by {host}:{port}")
        client, server = self.stream_pair(source, host, client_address=local, server_address=address)
        listener.send_channel.send_nowait(server)
        return client

    async def _connect_through(self, source: str, address: Address, local_port: int) -> MemoryStream:
        """A connect where NATs or simultaneous opens may play a part: a SYN leaves `source` (its router maps it
        at once), arrives one link latency later where the destination's router filters it, and is answered by a
        connect in flight from there toward this very source (simultaneous open), else by a listener, else by a
        reset. A dropped SYN is sent again every `SYN_RETRY` s until the caller gives up, as a kernel would."""
        local = (source, local_port)
        key = (local, address)
        if key in self._attempts:
            raise OSError(errno.EADDRINUSE, f"a connect from {source}:{local_port} to {address[0]}:{address[1]} "
                                            f"is already in flight")
        attempt = self._attempts[key] = _Attempt(local, address)
        try:
            while attempt.stream is None:
                retry_at = trio.current_time() + SYN_RETRY
                now = trio.current_time()
                outbound = self._outbound("tcp", local, address, now) if self.link_up(source, address[0]) else None
                if outbound is not None:
                    seen, mapping = outbound
                    with trio.move_on_after(self.conditions(source, address[0]).latency):
                        await attempt.done.wait()  # the other side's SYN may complete it first
                    if attempt.stream is not None:
                        break
                    if self._syn_arrives(attempt, seen, mapping):
                        await trio.sleep(self.conditions(address[0], source).latency)  # the SYN-ACK
                        break
                with trio.move_on_at(retry_at):
                    await attempt.done.wait()
        finally:
            del self._attempts[key]
        assert attempt.stream is not None
        return attempt.stream

    def _syn_arrives(self, attempt: _Attempt, seen: Address, mapping: _Mapping | None) -> bool:
        """The SYN of `attempt` (coming from `seen`) reaches its destination now: True when a connection was made
        (both ends set), False when a router dropped it; ConnectionRefusedError when nothing takes it."""
        now = trio.current_time()
        inbound = self._inbound("tcp", seen, attempt.remote, now)
        if inbound is None or not self.link_up(attempt.local[0], inbound[0][0]):
            return False
        inside, inside_mapping = inbound
        counterpart = self._attempts.get((inside, seen))
        if counterpart is not None and counterpart.stream is not None:
            counterpart = None  # that connect already completed another way
        listener = self._listeners.get(inside)
        if counterpart is None and listener is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED,
                                         f"connection refused by {attempt.remote[0]}:{attempt.remote[1]}")
        client, server = self.stream_pair(attempt.local[0], inside[0], client_address=attempt.local,
                                          server_address=inside, seen_by_client=attempt.remote, seen_by_server=seen)
        for held in (mapping, inside_mapping):
            if held is not None:
                held.pipes.extend((client._outgoing, client._incoming))
        attempt.stream = client
        attempt.done.set()
        if counterpart is not None:
            counterpart.stream = server
            counterpart.done.set()
        else:
            assert listener is not None
            listener.send_channel.send_nowait(server)
        return True

    def stream_pair(self, source: str, destination: str, *, client_address: Address | None = None,
                    server_address: Address | None = None, seen_by_client: Address | None = None,
                    seen_by_server: Address | None = None) -> tuple[MemoryStream, MemoryStream]:
        """Both ends of a new connection from host `source` to host `destination`, under the links' conditions
        (what `connect_tcp` builds once a listener accepted; tests use it to get a bare pair). The addresses are
        what each end's `local_address` / `remote_address` say (by default each end sees the other's own)."""
        forward = _Pipe(self, source, destination)
        backward = _Pipe(self, destination, source)
        self._pipes.extend((forward, backward))
        client = MemoryStream(forward, backward, local_address=client_address,
                              remote_address=seen_by_client or server_address)
        server = MemoryStream(backward, forward, local_address=server_address,
                              remote_address=seen_by_server or client_address)
        return client, server

    def prune(self) -> None:
        """Forget pipes whose both ends are closed; long simulations call this now and then."""
        self._pipes = [p for p in self._pipes if not (p.sender_closed and p.receiver_closed) and not p.reset]


class MemoryHost(Network):
    """One host's view of a MemoryNetwork."""

    def __init__(self, network: MemoryNetwork, name: str):
        self.network = network
        self.name = name

    def _bind(self, host: str, port: int, bound: Container[Address]) -> Address:
        """The address a listener or UDP endpoint asking for `host`:`port` gets, refused as a real socket's bind
        would be: a host that is not this one (the wildcard means this one), or an address already in `bound`
        (TCP and UDP each have their own table); port 0 picks a free port."""
        host = self.name if host in ("", "0.0.0.0", self.name) else host
        if host != self.name:
            raise OSError(errno.EADDRNOTAVAIL, f"{host} is not an address of memory host {self.name}")
        port = port or self.network._free_port(host)
        if (host, port) in bound:
            raise OSError(errno.EADDRINUSE, f"address {host}:{port} already in use")
        return host, port

    async def connect_tcp(self, address: Address) -> trio.abc.Stream:
        return await self.network._connect(self.name, address)

    async def connect_tcp_from(self, address: Address, local_port: int) -> trio.abc.Stream:
        return await self.network._connect(self.name, address, local_port or None)

    async def serve_tcp(
        self, handler: StreamHandler, host: str, port: int, *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        host, port = self._bind(host, port, self.network._listeners)
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
        host, port = self._bind(host, port, self.network._udp)
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
