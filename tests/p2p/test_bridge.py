"""Synchronous code drives trio services through the bridge; closing it leaves nothing running."""

import threading

import pytest
import trio
import trio.lowlevel

from peer.p2p.bridge import Bridge, BridgeClosed
from peer.p2p.identity import Identity
from peer.p2p.net import RealNetwork
from peer.p2p.rpc import RPCNode


def test_run_returns_results_and_raises_errors():
    with Bridge.start() as bridge:
        async def add(a, b):
            await trio.lowlevel.checkpoint()
            return a + b

        async def fail():
            raise KeyError("missing")

        assert bridge.run(add, 2, 3) == 5
        with pytest.raises(KeyError):
            bridge.run(fail)


def test_services_run_until_close_and_calls_after_close_fail():
    bridge = Bridge.start()
    cancelled = threading.Event()

    async def service(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started("up")
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    assert bridge.start_and_wait(service) == "up"
    bridge.close()
    assert cancelled.is_set()
    with pytest.raises(BridgeClosed):
        bridge.run(trio.sleep, 0)


def test_rpc_call_from_synchronous_code():
    with Bridge.start() as bridge:
        async def serve(task_status=trio.TASK_STATUS_IGNORED):
            async with RPCNode(Identity.generate(), RealNetwork()) as server, \
                    RPCNode(Identity.generate(), RealNetwork()) as client:
                async def square(ctx, x):
                    return x * x

                server.register("square", square)
                await server.listen("127.0.0.1", 0)
                task_status.started((client, server.address))
                await trio.sleep_forever()

        client, address = bridge.start_and_wait(serve)
        results = [bridge.run(lambda n=n: client.call(address, "square", n, timeout=5)) for n in range(20)]
        assert results == [n * n for n in range(20)]


def test_run_soon_runs_plain_functions_in_order_before_a_later_run_and_refuses_once_closed():
    bridge = Bridge.start()
    seen: list[tuple[int, bool]] = []
    for index in range(50):
        bridge.run_soon(lambda i=index: seen.append((i, bridge.in_bridge_thread)))

    async def snapshot() -> list[tuple[int, bool]]:
        return list(seen)

    assert bridge.run(snapshot) == [(i, True) for i in range(50)]
    bridge.close()
    with pytest.raises(BridgeClosed):
        bridge.run_soon(seen.clear)
