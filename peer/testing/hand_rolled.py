"""A hand-rolled RPC client for tests that break the protocol on purpose, after (or during) a real handshake.

It runs the real sans-I/O `Handshake`, then seals whatever bytes a test wants to send (valid frames or not) with
the session keys, exactly as a peer would, and opens and parses what comes back: so a test of a hostile but
authenticated peer reaches the framing and the RPC core, not just the sealing layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from peer.p2p import framing, seal
from peer.p2p.handshake import Handshake, HandshakeComplete, Role
from peer.p2p.identity import Identity


class ForgingIdentity(Identity):
    """Announces its own key but signs with another one: its PROOF cannot verify."""

    def __init__(self) -> None:
        super().__init__(Identity.generate()._private_key)
        self._signer = Identity.generate()

    def sign(self, data: bytes) -> bytes:
        return self._signer.sign(data)


@dataclass
class RawChannel:
    stream: trio.abc.Stream
    done: HandshakeComplete
    parser: framing.FrameParser = field(default_factory=lambda: framing.FrameParser(1 << 22))
    sealer: seal.Sealer | None = None
    opener: seal.Opener | None = None

    def __post_init__(self) -> None:
        if self.done.keys is not None:
            self.sealer = seal.Sealer(self.done.keys.send)
            self.opener = seal.Opener(self.done.keys.receive)

    def seal(self, data: bytes) -> bytes:
        """`data` as this side's next records (or as it is on an insecure connection)."""
        if self.sealer is None:
            return data
        return b"".join(bytes(record) for record in self.sealer.seal(data))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(self.seal(data))

    async def send_frames(self, stream_id: int, parts: list[Any]) -> None:
        outbox = framing.Outbox()
        outbox.add(stream_id, parts)
        await self.send(b"".join(bytes(f) for f in outbox.next_frames(budget=1 << 30)))

    def feed(self, data: bytes | bytearray) -> list[framing.Event]:
        plaintexts = [data] if self.opener is None else self.opener.receive_data(data)
        return [event for plaintext in plaintexts for event in self.parser.receive(plaintext)]

    async def receive_events(self) -> list[framing.Event]:
        """The frame events of the next read (an empty list at end of stream, or for a partial record)."""
        data = await self.stream.receive_some(65536)
        if not data:
            raise trio.BrokenResourceError("closed")
        return self.feed(data)


async def handshake_reply(stream: trio.abc.Stream, shake: Handshake) -> list[HandshakeComplete]:
    """Reads `stream` into the initiator's `shake` (its HELLO already sent) until the handshake completes;
    returns its events (the `HandshakeComplete`); raises its error if the other side closes first."""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise shake.connection_closed()
        events = shake.receive_data(data)
        if events:
            return events


async def handshake(stream: trio.abc.Stream, identity: Identity | None = None, *, secure: bool = True,
                    trailing: bytes | None = None) -> RawChannel:
    """The initiator's side of a real handshake over `stream`; our PROOF goes out together with `trailing`
    (plaintext, sealed here) in one write, as a fast peer sends its first request."""
    shake = Handshake(identity or Identity.generate(), Role.INITIATOR, secure=secure)
    await stream.send_all(shake.data_to_send())
    events = await handshake_reply(stream, shake)
    channel = RawChannel(stream, events[0])
    leftover = channel.feed(events[0].leftover) if events[0].leftover else []
    assert not leftover
    await stream.send_all(shake.data_to_send() + (channel.seal(trailing) if trailing else b""))
    return channel
