"""RPC peers for tests, and raw connections to them (tests/p2p/test_rpc.py, test_wire_codecs.py, test_budgets.py).

- `Swarmlet`: a few RPC peers on one network (in memory, or real sockets on 127.0.0.1), each serving the test
  handlers of `register_test_handlers`: echo, whoami, fail (`QuotaExceeded`, a typed remote error registered
  here, or an untyped failure), sleep (setting `node_cancelled_events[id(node)]`, if a test put one there, when
  the handler is cancelled) and double.
- `raw_connect`: a plain stream to a peer, no handshake (hostile input starts here); `send_raw_request`: one
  request's frames over a hand-rolled channel (peer/testing/hand_rolled.py) and the decoded reply on its stream;
  `expect_closed`: waits for the peer to close such a stream.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from peer.p2p import framing, wire
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork, RealNetwork
from peer.p2p.rpc import RemoteError, RPCNode, register_error_code
from peer.testing import hand_rolled


class QuotaExceeded(RemoteError):
    code = "test.quota_exceeded"


register_error_code(QuotaExceeded.code, QuotaExceeded)


class Swarmlet:
    """A few RPC peers on one network, for tests."""

    def __init__(self, transport: str, **node_options):
        self.transport = transport
        self.memory = MemoryNetwork(latency=0.002, seed=5) if transport == "memory" else None
        self.node_options = node_options

    def network(self, name: str):
        return self.memory.host(name) if self.memory else RealNetwork()

    def host(self, name: str) -> str:
        return name if self.memory else "127.0.0.1"

    @asynccontextmanager
    async def peer(self, name: str, listen: bool = True, **options):
        async with RPCNode(Identity.generate(), self.network(name), **{**self.node_options, **options}) as node:
            register_test_handlers(node)
            if listen:
                await node.listen(self.host(name), 0)
            yield node


def register_test_handlers(node: RPCNode) -> None:
    async def echo(ctx, args):
        return args

    async def whoami(ctx, args):
        return bytes(ctx.peer_id)

    async def fail(ctx, args):
        if args == "typed":
            raise QuotaExceeded("only 3 calls per minute")
        raise ValueError("boom")

    async def sleep(ctx, args):
        try:
            await trio.sleep(args["seconds"])
        except trio.Cancelled:
            args_event = node_cancelled_events.get(id(node))
            if args_event is not None:
                args_event.set()
            raise
        return "slept"

    async def double(ctx, tensor):
        return tensor * 2

    node.register("echo", echo)
    node.register("whoami", whoami)
    node.register("fail", fail)
    node.register("sleep", sleep)
    node.register("double", double)


node_cancelled_events: dict[int, trio.Event] = {}


async def raw_connect(swarm: Swarmlet, address):
    return await swarm.network("mallory").connect_tcp(address)


async def send_raw_request(channel: hand_rolled.RawChannel, stream_id: int, body_parts):
    await channel.send_frames(stream_id, body_parts)
    with trio.fail_after(5):
        while True:
            for event in await channel.receive_events():
                if isinstance(event, framing.MessageReceived) and event.stream_id == stream_id:
                    return wire.decode(event.data)


async def expect_closed(stream: trio.abc.Stream, within: float = 10) -> None:
    """Reads `stream` until the other side closes it (anything it still sends is dropped); fails after `within`
    seconds."""
    with trio.fail_after(within):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
