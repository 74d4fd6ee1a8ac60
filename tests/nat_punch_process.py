"""Child processes of the network-namespace punch test (tests/scenarios/test_nat_netns.py), run inside test hosts:

- `relay PORT`: a public byte relay. Tells each connection the address it came from (`u16 length | msgpack
  [host, port]`: what its NAT mapping looks like from outside), then splices the first two connections together.
- `punch RELAY_HOST:PORT SEED EXPECTED_SEED`: a peer with identity `Identity.from_seed(SEED)` opens its side
  channel to the relay from a reusable port, reads its observed address and punches to the peer of
  `EXPECTED_SEED` (`peer.p2p.punch.HolePuncher`); prints one JSON line with the outcome.
"""

from __future__ import annotations

import json
import struct
import sys

import msgpack
import trio

from peer.p2p.identity import Identity
from peer.p2p.net import RealNetwork, parse_address
from peer.p2p.punch import HolePuncher, PunchFailed
from peer.p2p.rpc import RPCNode

LENGTH = struct.Struct(">H")


async def _splice(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
    try:
        async for data in source:
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def splice_in_pairs(waiting: list[tuple[trio.abc.Stream, trio.Event]], stream: trio.abc.Stream) -> None:
    """A test byte relay's core, shared with tests/p2p/test_punch.py: the first connection waits in `waiting` for the
    second, then the two are spliced both ways until either ends."""
    if not waiting:
        done = trio.Event()
        waiting.append((stream, done))
        await done.wait()
        return
    first, done = waiting.pop()
    try:
        async with trio.open_nursery() as splices:
            splices.start_soon(_splice, first, stream)
            splices.start_soon(_splice, stream, first)
    finally:
        done.set()


async def relay(port: int) -> None:
    waiting: list[tuple[trio.abc.Stream, trio.Event]] = []

    async def handler(stream: trio.SocketStream) -> None:
        host, remote_port = stream.socket.getpeername()[:2]
        payload = msgpack.packb([host, remote_port])
        await stream.send_all(LENGTH.pack(len(payload)) + payload)
        await splice_in_pairs(waiting, stream)

    print(json.dumps({"event": "relay", "port": port}), flush=True)
    await trio.serve_tcp(handler, port, host="0.0.0.0")


async def read_exactly(stream: trio.abc.Stream, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = await stream.receive_some(count - len(data))
        if not chunk:
            raise EOFError("the relay closed the side channel")
        data += chunk
    return data


async def punch(relay_address: str, seed: str, expected_seed: str) -> None:
    network = RealNetwork()
    identity, expected = Identity.from_seed(seed.encode()), Identity.from_seed(expected_seed.encode()).peer_id
    async with RPCNode(identity, network) as rpc:
        with trio.fail_after(30):
            side = await network.connect_tcp_from(parse_address(relay_address), 0)
            (length,) = LENGTH.unpack(await read_exactly(side, LENGTH.size))
            host, port = msgpack.unpackb(await read_exactly(side, length))
        puncher = HolePuncher(rpc, timeout=30.0, min_window=10.0)
        try:
            punched = await puncher.punch(side, (host, port), expected)
        except PunchFailed as error:
            outcome = {"ok": False, "error": str(error)}
        else:
            outcome = {"ok": True, "peer": punched.handshake.peer_id.hex(), "address": list(punched.address),
                       "remote": list(punched.stream.socket.getpeername()[:2])}  # type: ignore[attr-defined]
            await punched.stream.aclose()
        print(json.dumps({"event": "punch", "observed": [host, port], **outcome, "stats": puncher.stats()}),
              flush=True)
        await side.aclose()


def main(argv: list[str]) -> None:
    if argv[0] == "relay":
        trio.run(relay, int(argv[1]))
    else:
        trio.run(punch, argv[1], argv[2], argv[3])


if __name__ == "__main__":
    main(sys.argv[1:])
