"""The transports behave alike: real sockets and the in-memory network under MockClock."""

import itertools

import pytest
import trio
import trio.testing

from peer.p2p.net import MemoryNetwork, RealNetwork


async def echo_handler(stream):
    try:
        while data := await stream.receive_some(65536):
            await stream.send_all(data)
    except trio.BrokenResourceError:
        pass  # the other side crashed


async def _echo_roundtrip(client_net, server_net, host):
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server_net.serve_tcp, echo_handler, host, 0)
        stream = await client_net.connect_tcp(address)
        payload = bytes(range(256)) * 1000
        await stream.send_all(payload)
        received = b""
        while len(received) < len(payload):
            received += await stream.receive_some(65536)
        assert received == payload
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_real_tcp_echo():
    await _echo_roundtrip(RealNetwork(), RealNetwork(), "127.0.0.1")


async def test_real_udp_roundtrip():
    net = RealNetwork()
    a = await net.open_udp("127.0.0.1", 0)
    b = await net.open_udp("127.0.0.1", 0)
    async with a, b:
        await a.sendto(b"ping", b.address)
        with trio.fail_after(5):
            data, source = await b.recvfrom()
        assert data == b"ping" and source == a.address


async def test_memory_tcp_latency_and_bandwidth(autojump_clock):
    net = MemoryNetwork(latency=0.05, bandwidth=1_000_000)
    start = trio.current_time()
    await _echo_roundtrip(net.host("a"), net.host("b"), "b")
    elapsed = trio.current_time() - start
    # connect (1 RTT) + 256 kB each way at 1 MB/s + latency: deterministic virtual time
    assert 0.1 + 0.256 * 2 <= elapsed < 1.0


async def test_memory_udp_loss_is_seeded_and_partition_drops(autojump_clock):
    async def delivered(seed):
        net = MemoryNetwork(latency=0.01, loss=0.5, seed=seed)
        a = await net.host("a").open_udp("a", 1)
        b = await net.host("b").open_udp("b", 1)
        for i in range(100):
            await a.sendto(bytes([i]), b.address)
        got = []
        with trio.move_on_after(1):
            while True:
                got.append((await b.recvfrom())[0])
        return got

    first, second = await delivered(7), await delivered(7)
    assert first == second and 20 < len(first) < 80

    net = MemoryNetwork(latency=0.01)
    a = await net.host("a").open_udp("a", 1)
    b = await net.host("b").open_udp("b", 1)
    net.partition(["a"], ["b"])
    await a.sendto(b"lost", b.address)
    net.heal()
    await a.sendto(b"kept", b.address)
    with trio.fail_after(1):
        assert (await b.recvfrom())[0] == b"kept"


async def test_memory_crash_resets_connections_and_refuses_new(autojump_clock):
    net = MemoryNetwork(latency=0.01)
    server = net.host("srv")
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve_tcp, echo_handler, "srv", 0)
        stream = await net.host("cli").connect_tcp(address)
        net.crash("srv")
        with pytest.raises(trio.BrokenResourceError):
            with trio.fail_after(1):
                await stream.receive_some(10)
        with pytest.raises(ConnectionRefusedError):
            await net.host("cli").connect_tcp(address)
        nursery.cancel_scope.cancel()


async def test_memory_partition_stalls_stream_until_healed(autojump_clock):
    net = MemoryNetwork(latency=0.01)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(net.host("b").serve_tcp, echo_handler, "b", 0)
        stream = await net.host("a").connect_tcp(address)
        net.partition(["a"], ["b"])
        await stream.send_all(b"x")
        with trio.move_on_after(5) as scope:
            await stream.receive_some(10)
        assert scope.cancelled_caught
        net.heal()
        with trio.fail_after(1):
            assert await stream.receive_some(10) == b"x"
        nursery.cancel_scope.cancel()


async def test_memory_stream_is_a_conforming_trio_stream():
    """The simulator's streams behave as trio's stream contract says (busy errors, closing, EOF, half-close)."""
    from trio.testing import check_half_closeable_stream, check_two_way_stream

    network = MemoryNetwork()

    async def pair() -> tuple[trio.abc.Stream, trio.abc.Stream]:
        return network.stream_pair("a", "b")

    # no clogged-stream maker: in-memory sends never block on a full buffer (only a bandwidth limit slows them)
    await check_two_way_stream(pair, None)
    await check_half_closeable_stream(pair, None)


async def test_memory_stream_receive_into_matches_receive_some():
    network = MemoryNetwork()
    server_host, client_host = network.host("srv"), network.host("cli")
    received = bytearray()
    at_eof = trio.Event()

    async def handler(stream: trio.abc.Stream) -> None:
        buffer = bytearray(7)  # smaller than what arrives: the rest stays for the next call
        while count := await stream.receive_into(buffer):
            received.extend(buffer[:count])
        at_eof.set()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_once, server_host, handler)
        stream = await client_host.connect_tcp(("srv", port))
        await stream.send_all(b"0123456789" * 5)
        await stream.aclose()
        with trio.fail_after(5):
            await at_eof.wait()
        nursery.cancel_scope.cancel()
    assert bytes(received) == b"0123456789" * 5
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_into(bytearray(1))


_names = itertools.count()


async def _serve_once(host, handler, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `handler` on a free port of `host`; reports the port."""
    async with trio.open_nursery() as nursery:
        address = await nursery.start(host.serve_tcp, handler, host.name, 0)
        task_status.started(address[1])
