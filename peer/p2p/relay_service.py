"""The trio drivers of circuit relays (`peer.p2p.relay` holds the protocol core): the relay service a public peer
runs, and the reservations a private peer keeps.

Why reservations are RPC calls: the private peer's connection to its relay is an ordinary authenticated RPC
connection (so the relay knows which PeerID it holds a reservation for, and the private peer that it talks to the
relay it chose). `relay.reserve` registers, then `relay.poll` is a long poll the relay answers with the circuits
offered since (a token each, and the dialer's observed address); the private peer opens one fresh outbound
connection to the relay per circuit and sends `accept` with the token, and the relay splices it to the dialer.
Everything a private peer does is outbound, which is all a NAT lets through. A relay that dies fails the
outstanding poll at once (its connection resets) or within `POLL_SECONDS + POLL_SLACK`, and the private peer
replaces it from the candidates it is given.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Awaitable, Callable

import trio

from peer.p2p import budget, punch, relay
from peer.p2p.handshake import HandshakeComplete
from peer.p2p.identity import PeerID
from peer.p2p.lifetime import owned_nursery
from peer.p2p.net import TRANSPORT_ERRORS, Address, receive_prefix, receiver_into, remote_address
from peer.p2p.rpc import CallContext, RPCError, RPCNode

logger = logging.getLogger(__name__)

INFO_METHOD = "relay.info"
RESERVE_METHOD = "relay.reserve"
POLL_METHOD = "relay.poll"
POLL_SECONDS = 4.0  # a poll is answered after this long without offers (keeps dead relays detected quickly)
POLL_SLACK = 3.0
REQUEST_TIMEOUT = 5.0  # seconds for a circuit stream's request to arrive
# a spliced circuit with no byte either way for this long is closed: honest ends close an idle circuit sooner
# (`RPCNode.circuit_idle_timeout`), this bounds how long one that does not holds a `--relay-limit` slot
IDLE_TIMEOUT = 60.0
SPLICE_CHUNK = 256 * 1024


_observed = remote_address


class RelayService:
    """A public peer's relay: registers the RPC methods and the circuit stream prefix on `rpc`, and splices
    circuits. Use `await nursery.start(service.run)`; leaving `run` closes every circuit."""

    def __init__(self, rpc: RPCNode, *, limit: int, rate: float | None = None, total_rate: float | None = None,
                 accept_timeout: float = 5.0, idle_timeout: float = IDLE_TIMEOUT):
        self.rpc = rpc
        self.core = relay.RelayCore(rpc.peer_id, limit=limit, rate=rate, total_rate=total_rate,
                                    accept_timeout=accept_timeout, budget_limits=rpc.budget_limits)
        self.idle_timeout = idle_timeout
        self._offer_wakeups: dict[PeerID, trio.Event] = {}
        # token -> where the accept handler hands its stream (and the event it waits on until the splice ends)
        self._accepted: dict[bytes, trio.MemorySendChannel[tuple[trio.abc.Stream, trio.Event]]] = {}
        self._circuits: set[trio.CancelScope] = set()
        self._offered: dict[bytes, trio.CancelScope] = {}  # token -> the scope of its dialer's task (eviction)
        self._requests = 0  # circuit streams whose request is being read
        self._pending = budget.OldestFirst(rpc.accountant, "relay_requests")
        self._running = False

    def stats(self) -> dict[str, Any]:
        usage = self.core.accountant.usage()
        return {**self.core.stats, "limit": self.core.limit, "circuits": self.core.circuits,
                "reserved_peers": len(self.core.reservations),
                "budget": {resource: usage[resource] for resource in ("circuits", "reservations")}}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        rpc = self.rpc
        rpc.register(INFO_METHOD, self._handle_info)
        rpc.register(RESERVE_METHOD, self._handle_reserve)
        rpc.register(POLL_METHOD, self._handle_poll)
        rpc.register_stream(relay.MAGIC, self._handle_stream)
        self._running = True
        try:
            async with owned_nursery() as nursery:
                nursery.start_soon(self._expire_loop)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._running = False
            for scope in list(self._circuits):
                scope.cancel()
            for name in (INFO_METHOD, RESERVE_METHOD, POLL_METHOD):
                rpc.unregister(name)
            rpc.unregister_stream(relay.MAGIC)

    async def _expire_loop(self) -> None:
        while True:
            await trio.sleep(1.0)
            self.core.expire(trio.current_time())

    # ------------------------------------------------------------------------------------ reservations

    async def _handle_info(self, context: CallContext, args: Any) -> dict[str, Any]:
        return {"limit": self.core.limit, "circuits": self.core.circuits}

    async def _handle_reserve(self, context: CallContext, args: Any) -> dict[str, Any]:
        group = budget.ip_group(context.observed[0]) if context.observed is not None else "?"
        self.core.reserve(context.peer_id, trio.current_time(), group)
        return {"grace": self.core.grace, "poll": POLL_SECONDS}

    async def _handle_poll(self, context: CallContext, args: Any) -> list[dict[str, Any]]:
        """Long poll: the circuits offered to the caller, as soon as there is one, or [] after POLL_SECONDS."""
        peer = context.peer_id
        offers = self.core.poll_started(peer, trio.current_time())
        try:
            with trio.move_on_after(POLL_SECONDS):
                while not offers:
                    wakeup = self._offer_wakeups.setdefault(peer, trio.Event())
                    await wakeup.wait()
                    offers = self.core.take_offers(peer)
        finally:
            self.core.poll_ended(peer, trio.current_time())
        return [{"token": offer.token, "source": bytes(offer.source),
                 "observed": list(offer.observed) if offer.observed else None} for offer in offers]

    def _wake(self, peer: PeerID) -> None:
        wakeup = self._offer_wakeups.pop(peer, None)
        if wakeup is not None:
            wakeup.set()

    # ----------------------------------------------------------------------------------------- circuits

    async def _handle_stream(self, stream: trio.abc.Stream, first: bytes) -> None:
        """A circuit stream (runs in the RPC listener's task for it; the stream closes when this returns)."""
        # Before its request is read a stream is only its IP group: when too many are being read (from that
        # group, or in all), the oldest is closed to let this one in, rather than refusing every newcomer while
        # idle streams hold the slots (300 of them made every honest dial fail, issue 40). Honest requests
        # arrive in one round trip, so the oldest is almost always one that only waits.
        scope = trio.CancelScope(deadline=trio.current_time() + REQUEST_TIMEOUT)
        observed = _observed(stream)
        group = budget.ip_group(observed[0]) if observed is not None else "?"
        for victim in self._pending.admit(group, scope):
            self.core.stats["requests_evicted"] += 1
            victim.cancel()  # type: ignore[attr-defined]  # tokens are the pending reads' scopes
        reader = relay.RequestReader()
        request = None
        self._requests += 1
        try:
            with scope:
                try:
                    request = reader.receive_data(first) or await relay.read_message(stream, reader)
                except relay.MalformedRequest as error:
                    await self._refuse(stream, error)
                    return
                except TRANSPORT_ERRORS:
                    return
        finally:
            self._requests -= 1
            self._pending.leave(group, scope)
        if request is None:
            return
        if isinstance(request, relay.ConnectRequest):
            await self._connect(stream, request)
        else:
            await self._accept(stream, request)

    async def _refuse(self, stream: trio.abc.Stream, error: relay.RelayError) -> None:
        with trio.move_on_after(REQUEST_TIMEOUT):
            try:
                await stream.send_all(relay.error_response(error))
            except TRANSPORT_ERRORS:
                pass

    async def _connect(self, stream: trio.abc.Stream, request: relay.ConnectRequest) -> None:
        token = os.urandom(relay.TOKEN_BYTES)
        try:
            offer = self.core.request_circuit(request, _observed(stream), token, trio.current_time())
        except relay.RelayError as error:
            await self._refuse(stream, error)
            return
        for victim in self.core.drain_evicted():  # circuits this one displaced (see RelayCore): ended now
            logger.debug("relay: evicted a circuit to %s: %s", victim.target.short(), victim.evicted)
            evicted = self._offered.get(victim.token)
            if evicted is not None:
                evicted.cancel()
        send, receive = trio.open_memory_channel[tuple[trio.abc.Stream, trio.Event]](1)
        self._accepted[token] = send
        self._wake(request.target)
        accepted: tuple[trio.abc.Stream, trio.Event] | None = None
        try:
            with trio.CancelScope() as self._offered[token]:  # cancelled when a newcomer evicts this circuit
                try:
                    with trio.move_on_at(offer.deadline):
                        accepted = await receive.receive()
                finally:
                    self._accepted.pop(token, None)
                    receive.close()  # an accept arriving now finds the channel broken and gives up
                if accepted is not None:
                    try:
                        await self._splice(stream, accepted[0], offer)
                    finally:
                        accepted[1].set()
        finally:
            self._offered.pop(token, None)
            self.core.withdraw(offer)
        if accepted is None:
            await self._refuse(stream, relay.RelayLimitReached(offer.evicted) if offer.evicted else relay.RelayError(
                f"peer {request.target.short()} did not take the circuit within {self.core.accept_timeout:.3g} s"))

    async def _accept(self, stream: trio.abc.Stream, request: relay.AcceptRequest) -> None:
        try:
            offer = self.core.accept(request, trio.current_time())
        except relay.RelayError as error:
            await self._refuse(stream, error)
            return
        send = self._accepted.get(offer.token)
        done = trio.Event()
        with trio.move_on_after(REQUEST_TIMEOUT):
            try:
                await stream.send_all(relay.ok_response(offer.observed))
            except TRANSPORT_ERRORS:
                return
        if send is None:  # the dialer gave up meanwhile
            return
        try:
            send.send_nowait((stream, done))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        # the dialer's task splices; this stream must stay open until it is done (the splice is bounded by its
        # idle timeout, and leaving `run` cancels it)
        await done.wait()

    async def _splice(self, dialer: trio.abc.Stream, target: trio.abc.Stream, offer: relay.Offer | None = None) -> None:
        """Forward bytes both ways under the caps until either side ends, nothing moves for `idle_timeout`, or the
        circuit has carried its `circuit_bytes` (then the relay ends it: the RPC layer dials a fresh one)."""
        try:
            with trio.move_on_after(REQUEST_TIMEOUT):
                await dialer.send_all(relay.ok_response(_observed(target)))
        except TRANSPORT_ERRORS:
            return
        scope = trio.CancelScope(deadline=trio.current_time() + self.idle_timeout)
        self._circuits.add(scope)
        limiter = self.core.circuit_limiter(offer)

        async def pump(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
            # one buffer per direction, reused: `receive_some` would allocate (and, this large, mmap) per read
            buffer = bytearray(SPLICE_CHUNK)
            view = memoryview(buffer)
            receive_into = receiver_into(source)
            try:
                while True:
                    size = await receive_into(buffer)
                    if not size:
                        break
                    now = trio.current_time()
                    scope.deadline = now + self.idle_timeout
                    delay = self.core.relayed(size, limiter, now)
                    if delay > 0:
                        await trio.sleep(delay)
                    await sink.send_all(view[:size])  # sent before it returns: the buffer is free again
            except TRANSPORT_ERRORS:
                pass
            except relay.RelayLimitReached as error:
                logger.info("relay: %s", error)
            scope.cancel()  # one side ended: the circuit ends (the RPC layer has no half-closed connections)

        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pump, dialer, target)
                    nursery.start_soon(pump, target, dialer)
        finally:
            self._circuits.discard(scope)
            self.core.circuit_ended(limiter)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(target)


class RelayReservations:
    """A private peer's side: keeps reservations with `want` relays picked from `candidates()` by measured RTT,
    replaces one that fails, serves the circuits they offer through `rpc.accept`, and calls `on_change` with the
    relayed address (`relay.RelayedAddress.to_address`) each time the set of relays changes.

    `candidates` returns (PeerID, address) of public peers that may relay (the daemon reads the peer directory);
    `run` reports `started` once the first reservation holds."""

    def __init__(self, rpc: RPCNode, candidates: Callable[[], Awaitable[list[tuple[PeerID, Address]]]], *,
                 on_change: Callable[[Address | None], None] | None = None, want: int = 2,
                 retry: float = 1.0, timeout: float = 3.0):
        self.rpc = rpc
        self.candidates = candidates
        self.on_change = on_change
        self.want = want
        self.retry = retry
        self.timeout = timeout
        self.relays: dict[PeerID, Address] = {}  # in the order they were reserved
        self._pending: dict[PeerID, Address] = {}  # picked, being reserved: already in the announced address
        self.rtts: dict[PeerID, float] = {}
        self.failed: dict[PeerID, float] = {}  # relay -> when it failed (not picked again for a while)
        self.stats = {"reservations": 0, "relay_failures": 0, "circuits_accepted": 0, "accept_failures": 0}
        self._changed = trio.Event()
        self._first = trio.Event()
        self.on_incoming: Callable[[relay.Circuit], None] | None = None  # each accepted circuit (hole punching)
        # answers a dialer's hole-punch request on an accepted circuit (`peer.p2p.punch.HolePuncher.answer`): the
        # direct stream and its handshake, or None to keep the circuit
        self.answer_punch: Callable[[relay.Circuit, PeerID], Awaitable[
            tuple[trio.abc.Stream, HandshakeComplete] | None]] = punch.HolePuncher(
                rpc, timeout=punch.UPGRADE_TIMEOUT, min_window=punch.UPGRADE_WINDOW).answer

    @property
    def address(self) -> Address | None:
        relays = {**self.relays, **self._pending}
        if not relays:
            return None
        return relay.RelayedAddress(self.rpc.peer_id, tuple(relays.items())[:relay.MAX_RELAYS]).to_address()

    async def wait_reserved(self) -> None:
        """Until the first reservation holds (the caller bounds the wait)."""
        await self._first.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        delay = self.retry
        async with owned_nursery() as nursery:
            while True:
                if len(self.relays) < self.want:
                    picked = await self._pick(self.want - len(self.relays))
                    self._pending = dict(picked)
                    self._announce()  # before the reservations' connections: their handshakes announce it
                    for peer, address in picked:
                        await self._start(nursery, peer, address)
                    # nobody new to ask: ask the candidates less often, up to every 8 retries
                    delay = self.retry if picked else min(2 * delay, 8 * self.retry)
                if self.relays and not started:
                    task_status.started()
                    started = True
                self._changed = trio.Event()
                with trio.move_on_after(delay if len(self.relays) < self.want else math.inf):
                    await self._changed.wait()

    async def _pick(self, count: int) -> list[tuple[PeerID, Address]]:
        """The `count` candidates with the lowest RTT of a fresh connection and handshake (`RPCNode.probe`: no
        pooled connection is opened before the relayed address is announced, so every pooled connection's
        handshake tells the remote the relayed address)."""
        try:
            with trio.move_on_after(self.timeout):
                candidates = await self.candidates()
        except Exception as error:  # a failed directory read: try again next round
            logger.debug("cannot list relay candidates: %s", error)
            return []
        now = trio.current_time()
        fresh = [(peer, address) for peer, address in candidates[:32]
                 if peer != self.rpc.peer_id and peer not in self.relays
                 and now - self.failed.get(peer, -math.inf) > 10 * self.retry]
        measured: list[tuple[float, PeerID, Address]] = []

        async def measure(peer: PeerID, address: Address) -> None:
            try:
                start = trio.current_time()
                await self.rpc.probe(address, peer_id=peer, timeout=self.timeout)
                measured.append((trio.current_time() - start, peer, address))
            except RPCError as error:
                logger.debug("relay candidate %s: %s", peer.short(), error)

        async with trio.open_nursery() as nursery:
            for peer, address in fresh:
                nursery.start_soon(measure, peer, address)
        measured.sort(key=lambda item: item[0])
        for rtt, peer, _ in measured:
            self.rtts[peer] = rtt
        return [(peer, address) for _, peer, address in measured[:count]]

    async def _start(self, nursery: trio.Nursery, peer: PeerID, address: Address) -> None:
        try:
            await self.rpc.call(address, RESERVE_METHOD, None, timeout=self.timeout, peer_id=peer)
        except RPCError as error:
            logger.info("relay %s refused a reservation: %s", peer.short(), error)
            self.failed[peer] = trio.current_time()
            self._pending.pop(peer, None)
            self._announce()
            return
        self._pending.pop(peer, None)
        self.relays[peer] = address
        self.stats["reservations"] += 1
        self._announce()
        nursery.start_soon(self._keep, nursery, peer, address)

    def _announce(self) -> None:
        if self.relays:
            self._first.set()
        if self.on_change is not None:
            self.on_change(self.address)

    async def _keep(self, nursery: trio.Nursery, peer: PeerID, address: Address) -> None:
        """Poll the relay for offered circuits until it fails; then drop it and wake the picker."""
        try:
            while True:
                try:
                    offers = await self.rpc.call(address, POLL_METHOD, None, timeout=POLL_SECONDS + POLL_SLACK,
                                                 peer_id=peer)
                except relay.NoReservation:  # the relay forgot it (restarted, or a poll came too late): renew
                    await self.rpc.call(address, RESERVE_METHOD, None, timeout=self.timeout, peer_id=peer)
                    continue
                for offer in offers if isinstance(offers, list) else []:
                    token = offer.get("token") if isinstance(offer, dict) else None
                    source = offer.get("source") if isinstance(offer, dict) else None
                    if isinstance(token, bytes) and len(token) == relay.TOKEN_BYTES:
                        dialer = PeerID(source) if isinstance(source, bytes) and len(source) == 20 else None
                        nursery.start_soon(self._take, peer, address, token, dialer)
        except RPCError as error:
            logger.info("relay %s lost: %s", peer.short(), error)
            self.stats["relay_failures"] += 1
            self.failed[peer] = trio.current_time()
            self.relays.pop(peer, None)
            self._announce()
            self._changed.set()

    async def _take(self, peer: PeerID, address: Address, token: bytes, dialer: PeerID | None) -> None:
        """Accept one offered circuit: a fresh outbound stream to the relay, then RPC on it as if accepted --
        or, when the dialer asks for a hole punch first (`peer.p2p.punch.PREFIX`) and it works, on the direct
        connection it made."""
        stream = None
        with trio.move_on_after(self.timeout):
            try:
                stream = await relay.connect_shareable(self.rpc.network, address)
                await stream.send_all(relay.accept_request(token))
                opened = await relay.read_message(stream, relay.ResponseReader())
            except (*TRANSPORT_ERRORS, relay.RelayError, relay.RelayProtocolError) as error:
                logger.debug("cannot take a circuit from relay %s: %s", peer.short(), error)
                opened = None
        if opened is None or stream is None:
            self.stats["accept_failures"] += 1
            if stream is not None:
                await trio.aclose_forcefully(stream)
            return
        self.stats["circuits_accepted"] += 1
        circuit = relay.Circuit(stream, peer, address, opened.observed)
        if self.on_incoming is not None:
            self.on_incoming(circuit)
        try:
            first = await receive_prefix(stream, len(punch.PREFIX), self.rpc.handshake_timeout)
            if first is None or len(first) < len(punch.PREFIX):
                return
            if first != punch.PREFIX:  # a dialer that does not punch: these are its handshake's first bytes
                await self.rpc.accept(stream, initial=first, relayed=True)
                return
            upgraded = await self.answer_punch(circuit, dialer) if dialer is not None else None
            if upgraded is None:  # no punch here, or it failed: RPC on the circuit
                await self.rpc.accept(stream, relayed=True)
                return
            await trio.aclose_forcefully(stream)  # the direct connection replaces the circuit
            direct, handshake = upgraded
            try:
                await self.rpc.accept(direct, handshake=handshake)
            finally:
                await trio.aclose_forcefully(direct)
        finally:
            await trio.aclose_forcefully(stream)
