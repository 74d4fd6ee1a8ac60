"""Interop both ways with the stock `kademlia` package (issue 3), on real sockets on 127.0.0.1.

Stock nodes run in a child process (`stock_node.py`; asyncio never enters this process). What a user relies on:
a stock node can join a swarmd DHT and store plain values that swarmd nodes read; swarmd nodes store plain values
that stock nodes read; in a network of both kinds, stores and gets from either kind keep working, even when a node
vanishes; and our extension RPCs never reach a stock node more than once (no stock node pays a timeout for them
twice, and none is ever sent a batched request it cannot answer).
"""

from __future__ import annotations

import math
import random

import trio
from dht_swarm import start_node
from stock_node import StockNodes

HOST = "127.0.0.1"
TEST_DEADLINE = 60.0  # every test is bounded; the stock process is killed when its block exits


def _extension_requests(received: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {method: senders for method, senders in received.items() if method.startswith("swarmd_")}


def _assert_extensions_sent_at_most_once(received: dict[str, dict[str, int]], stock_node: int) -> None:
    """Only the capability probe may reach a stock node, once per sender; never a batched request."""
    extensions = _extension_requests(received)
    assert set(extensions) <= {"swarmd_hello"}, (stock_node, extensions)
    for sender, count in extensions.get("swarmd_hello", {}).items():
        assert count == 1, f"stock node {stock_node} was probed {count} times by {sender}"


async def test_stock_node_joins_through_ours_and_its_plain_values_are_read_by_ours():
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, StockNodes.open(1, seed="join") as stock:
            first = await start_node(nursery, HOST)
            second = await start_node(nursery, HOST, [first.node.address])
            found = await stock.bootstrap(0, [first.node.address])
            assert {(host, port) for _, host, port in found} == {first.node.address, second.node.address}
            values = {"interop:bytes": b"\x00\xffraw", "interop:str": "hello", "interop:int": 42, "interop:float": 2.5}
            for key, value in values.items():
                ok, _ = await stock.set(0, key, value)
                assert ok
            for reader in (first.node, second.node):
                for key, value in values.items():
                    record = await reader.get(key)
                    assert record is not None, key
                    assert record.value == value and type(record.value) is type(value)
                    assert record.expiration_time == math.inf  # stock values never expire
            nursery.cancel_scope.cancel()


async def test_plain_values_stored_by_ours_are_read_by_stock_nodes():
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, StockNodes.open(3, seed="read") as stock:
            ours = [await start_node(nursery, HOST)]
            ours.append(await start_node(nursery, HOST, [ours[0].node.address]))
            for index in range(3):
                await stock.bootstrap(index, [ours[index % 2].node.address])
            writer = ours[1].node
            values = {f"from-ours:{i}": v for i, v in enumerate([b"bytes", "text", 7, -1.5, True])}
            for key, value in values.items():
                assert await writer.store(key, value, math.inf)
            for index in range(3):
                for key, value in values.items():
                    got, _ = await stock.get(index, key)
                    assert got == value and type(got) is type(value), (index, key, got)
                    # what the stock node holds is the plain value itself, not a swarmd envelope
                    held = await stock.local(index, key)
                    assert held is None or held == value
            nursery.cancel_scope.cancel()


async def test_mixed_network_of_stock_and_our_nodes_keeps_working():
    rng = random.Random(3)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, StockNodes.open(4, seed="mixed") as stock:
            ours = [await start_node(nursery, HOST)]
            # Interleave the joins so each kind bootstraps through the other (always through a node already in).
            for index in range(4):
                await stock.bootstrap(index, [rng.choice(ours).node.address])
                if index < 3:
                    ours.append(await start_node(nursery, HOST, [rng.choice(stock.addresses[: index + 1])]))
            stock_keys = {f"mixed:stock:{i}": f"stock-value-{i}".encode() for i in range(8)}
            our_keys = {f"mixed:ours:{i}": f"our-value-{i}" for i in range(8)}
            for key, value in stock_keys.items():
                ok, _ = await stock.set(rng.randrange(4), key, value)
                assert ok
            for key, value in our_keys.items():
                assert await rng.choice(ours).node.store(key, value, math.inf)
            every = {**stock_keys, **our_keys}
            for key, value in every.items():
                got, _ = await stock.get(rng.randrange(4), key)
                assert got == value, ("stock get", key, got)
                record = await rng.choice(ours).node.get(key)
                assert record is not None and record.value == value, ("our get", key, record)
            # Batched operations from ours: swarmd peers get one batch, stock peers plain stores/find_values.
            batch = {f"mixed:batch:{i}": i for i in range(12)}
            assert all(await ours[0].node.store_many([(k, v, math.inf) for k, v in batch.items()]))
            fetched = await ours[3].node.get_many(list(batch))
            assert {k: (r.value if r else None) for k, r in fetched.items()} == batch
            for key, value in batch.items():
                got, _ = await stock.get(rng.randrange(4), key)
                assert got == value

            # A stock node vanishes: the rest of the network still stores and reads, from both kinds.
            await stock.stop_node(2)
            for key, value in every.items():
                record = await rng.choice(ours).node.get(key)
                assert record is not None and record.value == value, key
                got, _ = await stock.get(rng.choice([0, 1, 3]), key)
                assert got == value, key
            assert await ours[1].node.store("mixed:after-loss", b"still here", math.inf)
            got, _ = await stock.get(3, "mixed:after-loss")
            assert got == b"still here"

            for index in (0, 1, 3):
                _assert_extensions_sent_at_most_once(await stock.received(index), index)
            nursery.cancel_scope.cancel()


async def test_stock_nodes_are_probed_once_however_many_batched_requests_ours_makes():
    """Each of our nodes asks a stock node `swarmd_hello` once; every later request is a stock RPC."""
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, StockNodes.open(2, seed="probe") as stock:
            ours = [await start_node(nursery, HOST)]
            await stock.bootstrap(0, [ours[0].node.address])
            await stock.bootstrap(1, [ours[0].node.address])
            ours.append(await start_node(nursery, HOST, [stock.addresses[0]]))
            for round_index in range(5):
                for running in ours:
                    items = [(f"probe:{round_index}:{i}", i, math.inf) for i in range(6)]
                    assert all(await running.node.store_many(items))
                    fetched = await running.node.get_many([key for key, _, _ in items])
                    assert [r.value for r in fetched.values()] == list(range(6))
            our_addresses = {f"{h}:{p}" for h, p in (r.node.address for r in ours)}
            for index in range(2):
                received = await stock.received(index)
                _assert_extensions_sent_at_most_once(received, index)
                assert set(received.get("swarmd_hello", {})) <= our_addresses
                # the stock node did get the work: plain stores and lookups from ours
                assert sum(received.get("store", {}).values()) > 0
                assert sum(received.get("find_value", {}).values()) > 0
            nursery.cancel_scope.cancel()
