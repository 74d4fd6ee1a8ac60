"""The secure channel end to end: two real peers on 127.0.0.1 with a hostile proxy between them.

The proxy relays the handshake untouched (it is a man in the middle that the peers do not know about), then
attacks the sealed records of one direction: a byte flipped in a record's length, ciphertext or tag, a record
dropped, duplicated, moved behind the next one, replayed, or cut short, or a record of its own injected. Each
attack must close the connection with a typed error on the receiving side (`SecureChannelError`, logged and
counted as a protocol error), the caller's call must fail, and no handler may ever see a message that the
honest caller did not send exactly once. A proxy that swaps the ephemeral key of a HELLO (to read the traffic)
breaks the handshake; an `--insecure-transport` peer and a default peer refuse each other with one clear line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgpack
import pytest
import trio

from peer.p2p import framing, seal
from peer.p2p.handshake import Handshake, Role
from peer.p2p.identity import Identity
from peer.p2p.net import RealNetwork
from peer.p2p.rpc import CallTimeout, ConnectionFailed, HandshakeError, RPCNode
from peer.p2p.rpc_protocol import RequestReceived, RPCConnection, SecureChannelError

ATTACKS = ["flip length", "flip ciphertext", "flip tag", "drop", "duplicate", "reorder", "replay", "truncate",
           "inject"]


class SealedStreamSplitter:
    """Cuts one direction of a connection into the handshake's two control frames and then sealed records."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.frames_left = 2  # HELLO and PROOF

    def feed(self, data: bytes) -> tuple[bytes, list[bytes]]:
        """(handshake bytes to pass through, whole records)."""
        self.buffer += data
        passthrough = bytearray()
        while self.frames_left and len(self.buffer) >= framing.HEADER.size:
            length = framing.HEADER.unpack_from(self.buffer)[0]
            end = 4 + length
            if len(self.buffer) < end:
                break
            passthrough += self.buffer[:end]
            del self.buffer[:end]
            self.frames_left -= 1
        records = []
        while not self.frames_left and len(self.buffer) >= 4:
            end = 4 + seal.LENGTH.unpack_from(self.buffer)[0]
            if len(self.buffer) < end:
                break
            records.append(bytes(self.buffer[:end]))
            del self.buffer[:end]
        return bytes(passthrough), records


class HostileProxy:
    """Relays client <-> server; attacks the client's record number `target` (the second call's request)."""

    def __init__(self, attack: str, target: int = 1):
        self.attack = attack
        self.target = target
        self.held: bytes | None = None
        self.holding = trio.Event()
        self.seen: list[bytes] = []

    def rewrite(self, record: bytes) -> list[bytes]:
        index = len(self.seen)
        self.seen.append(record)
        if self.held is not None:  # reorder: the record after the held one goes first
            held, self.held = self.held, None
            return [record, held]
        if index != self.target:
            return [record]
        attack, mutated = self.attack, bytearray(record)
        if attack == "flip length":
            mutated[0] ^= 0x01
        elif attack == "flip ciphertext":
            mutated[4] ^= 0x80
        elif attack == "flip tag":
            mutated[-1] ^= 0x01
        elif attack == "drop":
            return []
        elif attack == "duplicate":
            return [record, record]
        elif attack == "reorder":
            self.held = record
            self.holding.set()
            return []
        elif attack == "replay":
            return [record, self.seen[0]]
        elif attack == "truncate":
            return [record[:len(record) // 2], b""]  # b"": close the server's side now
        elif attack == "inject":
            forged = bytes(64)
            return [record, seal.LENGTH.pack(len(forged)) + forged]
        return [bytes(mutated)]

    async def relay(self, source: trio.SocketStream, sink: trio.SocketStream, attacked: bool) -> None:
        splitter = SealedStreamSplitter()
        try:
            while data := await source.receive_some(1 << 20):
                if not attacked:
                    await sink.send_all(data)
                    continue
                passthrough, records = splitter.feed(data)
                if passthrough:
                    await sink.send_all(passthrough)
                for record in records:
                    for piece in self.rewrite(record):
                        if not piece:
                            await sink.aclose()
                            return
                        await sink.send_all(piece)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await sink.aclose()

    async def serve(self, server_port: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        connections = 0

        async def handle(client: trio.SocketStream) -> None:
            nonlocal connections
            connections += 1
            if connections > 1:  # one attacked connection per test: a reconnect must not get through
                await client.aclose()
                return
            server = await trio.open_tcp_stream("127.0.0.1", server_port)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.relay, client, server, True)
                nursery.start_soon(self.relay, server, client, False)

        await trio.serve_tcp(handle, 0, host="127.0.0.1", task_status=task_status)


@pytest.mark.parametrize("attack", ATTACKS)
async def test_an_attacked_sealed_stream_closes_and_no_handler_sees_a_forged_message(attack, caplog):
    caplog.set_level(logging.WARNING, logger="peer.p2p.rpc")
    handled: list[str] = []
    async with RPCNode(Identity.generate(), RealNetwork()) as server, \
            RPCNode(Identity.generate(), RealNetwork()) as client:
        async def echo(ctx, args):
            handled.append(args)
            return args

        server.register("echo", echo)
        address = await server.listen("127.0.0.1", 0)
        proxy = HostileProxy(attack)
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(proxy.serve, address[1])
            via = ("127.0.0.1", listeners[0].socket.getsockname()[1])
            with trio.fail_after(20):
                assert await client.call(via, "echo", "call 0", timeout=10, peer_id=server.peer_id) == "call 0"
                failures: list[Exception] = []
                if attack == "reorder":  # call 1 is held by the proxy until call 2's record overtakes it
                    async def held_call() -> None:
                        try:
                            await client.call(via, "echo", "call 1", timeout=10)
                        except (ConnectionFailed, CallTimeout) as error:
                            failures.append(error)

                    nursery.start_soon(held_call)
                    await proxy.holding.wait()
                    with pytest.raises(ConnectionFailed):
                        await client.call(via, "echo", "call 2", timeout=10)
                elif attack == "drop":
                    with pytest.raises(CallTimeout):  # its request never arrived
                        await client.call(via, "echo", "call 1", timeout=0.5)
                    with pytest.raises(ConnectionFailed):  # the next record is out of place: closed
                        await client.call(via, "echo", "call 2", timeout=10)
                else:
                    try:
                        result = await client.call(via, "echo", "call 1", timeout=10)
                    except ConnectionFailed:
                        result = None
                    if attack in ("duplicate", "replay", "inject"):
                        assert result in ("call 1", None)  # genuine, served; then the extra record breaks it
                    else:
                        assert result is None
                while not server.stats["protocol_errors"]:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    # every message a handler saw was sent by the caller, once; nothing after the attack
    assert handled in (["call 0"], ["call 0", "call 1"]), handled
    assert server.stats["protocol_errors"] == 1
    assert any("sealed stream broken" in record.getMessage() for record in caplog.records), caplog.text


async def test_a_proxy_that_swaps_an_ephemeral_key_breaks_the_handshake():
    """To read the traffic, a man in the middle must put its own X25519 key in a HELLO; then the signature of
    the other side covers a transcript this side never saw."""
    mallory_key = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")

    async with RPCNode(Identity.generate(), RealNetwork()) as server, \
            RPCNode(Identity.generate(), RealNetwork()) as client:
        async def echo(ctx, args):
            raise AssertionError("no call may get through")

        server.register("echo", echo)
        address = await server.listen("127.0.0.1", 0)

        async def handle(client_stream: trio.SocketStream) -> None:
            upstream = await trio.open_tcp_stream(*address)
            hello = await client_stream.receive_some(65536)  # the client's HELLO, whole in one read on loopback
            body = msgpack.unpackb(hello[framing.HEADER.size:])
            body["eph"] = mallory_key
            payload = msgpack.packb(body, use_bin_type=True)
            await upstream.send_all(framing.control_frame(framing.HELLO, payload))

            async def pipe(a, b):
                try:
                    while data := await a.receive_some(65536):
                        await b.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                finally:
                    await b.aclose()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pipe, client_stream, upstream)
                nursery.start_soon(pipe, upstream, client_stream)

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
            via = ("127.0.0.1", listeners[0].socket.getsockname()[1])
            with pytest.raises(HandshakeError, match="could not prove"):
                await client.call(via, "echo", "x", timeout=10)
            with trio.fail_after(10):
                while not server.stats["handshake_failures"]:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert server.stats["connections_accepted"] == 0


@asynccontextmanager
async def _echo_pair(*, client_secure: bool, server_secure: bool) -> AsyncIterator[tuple[RPCNode, RPCNode, tuple]]:
    """A server serving `echo` on 127.0.0.1 and a client, each secure or not; yields (server, client, address)."""
    async with RPCNode(Identity.generate(), RealNetwork(), secure=server_secure) as server, \
            RPCNode(Identity.generate(), RealNetwork(), secure=client_secure) as client:
        async def echo(ctx, args):
            return args

        server.register("echo", echo)
        yield server, client, await server.listen("127.0.0.1", 0)


@pytest.mark.parametrize("client_secure, server_secure", [(False, True), (True, False)])
async def test_an_insecure_and_a_default_peer_refuse_each_other_with_one_clear_line(client_secure, server_secure):
    async with _echo_pair(client_secure=client_secure, server_secure=server_secure) as (server, client, address):
        with pytest.raises(HandshakeError) as caught:
            await client.call(address, "echo", "x", timeout=10)
        message = str(caught.value)
        assert "--insecure-transport" in message and "both sides must agree" in message and "\n" not in message
        with trio.fail_after(10):
            while not server.stats["handshake_failures"]:
                await trio.sleep(0.01)


async def test_two_insecure_peers_talk_in_plaintext():
    async with _echo_pair(client_secure=False, server_secure=False) as (server, client, address):
        assert await client.call(address, "echo", "plain", timeout=10) == "plain"
        (connection,) = client._connections.values()
        assert connection.protocol.sealer is None


def sealed_handshake():
    alice, bob = Handshake(Identity.generate(), Role.INITIATOR), Handshake(Identity.generate(), Role.RESPONDER)
    to_bob, to_alice = alice.data_to_send(), bob.data_to_send()
    alice.receive_data(to_alice)
    bob.receive_data(to_bob)
    (alice_done,) = alice.receive_data(bob.data_to_send())
    (bob_done,) = bob.receive_data(alice.data_to_send())
    return alice_done, bob_done


def test_the_core_refuses_every_flipped_byte_with_a_typed_error_and_no_request():
    """Sans-I/O: a sealed request with any one byte flipped gives `SecureChannelError`, never a request."""
    alice_done, bob_done = sealed_handshake()

    def server() -> RPCConnection:
        return RPCConnection(initiator=False, peer_id=bob_done.peer_id, keys=bob_done.keys, methods={"echo"},
                             idle_timeout=None)

    caller = RPCConnection(initiator=True, peer_id=alice_done.peer_id, keys=alice_done.keys, idle_timeout=None)
    caller.start_call("echo", "secret", deadline=10.0, now=0.0)
    sealed = b"".join(bytes(b) for b in caller.data_to_send(0.0))
    assert b"secret" not in sealed
    for index in range(len(sealed)):
        tampered = bytearray(sealed)
        tampered[index] ^= 0x04
        receiver = server()
        events: list = []
        with pytest.raises(SecureChannelError) as caught:
            events = receiver.receive_data(bytes(tampered), 0.0)
            receiver.end_of_stream()  # a flipped length may only make the record look longer: cut short
        assert isinstance(caught.value.error, seal.SealError) and events == []
    (request,) = server().receive_data(sealed, 0.0)
    assert isinstance(request, RequestReceived) and request.args == "secret"
