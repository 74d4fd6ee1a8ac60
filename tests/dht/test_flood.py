"""A store flood on real sockets: one host sends 100,000 stock `store` datagrams for unique keys as fast as it
can, from many source ports; an honest client on another loopback address stores new keys meanwhile. The
honest keys must get in and be readable, the victim's store must stay within its bounds, and serving an honest
request must cost the victim's storage a bounded amount of work (counted, not timed: a full scan of the 2,000
records held would show up as thousands of heap entries touched)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from dht import DHTConfig, DHTNode
from dht import protocol as proto
from dht.storage import Sender

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLOODER = os.path.join(ROOT, "benchmarks", "bench_flood.py")
HONEST_HOST = "127.0.0.2"
VICTIM_CONFIG = DHTConfig(max_records=2000, max_bytes=3 * 2**20)
# The honest client retries quickly and never gives up on the victim: datagrams the kernel drops at the
# flooded socket are not what this test is about.
HONEST_CONFIG = DHTConfig(max_timeout=0.25, initial_timeout=0.25, failures_to_evict=10**9)
FLOOD_KEYS = 100_000
HONEST_KEYS = 30


class StorageWorkMeter:
    """Heap entries the victim's storage touches while serving each store request from the honest host."""

    def __init__(self, node: DHTNode, host: str):
        self.work: list[int] = []
        server, storage = node._server, node._storage
        handle = server.handle

        def measured(request: proto.Request, now: float, local_now: float):
            if request.address[0] != host or "store" not in request.name:
                return handle(request, now, local_now)
            before = storage.work
            try:
                return handle(request, now, local_now)
            finally:
                self.work.append(storage.work - before)

        server.handle = measured


@asynccontextmanager
async def _flooder(victim: DHTNode, *options: str) -> AsyncIterator[trio.Process]:
    """The flood aimed at `victim`: bench_flood.py's `--flooder` with `options`, in another process (it floods
    until it has sent its count or its stdin closes, then prints a JSON summary); killed if still running."""
    process = await trio.lowlevel.open_process(
        [sys.executable, FLOODER, "--flooder", f"127.0.0.1:{victim.address[1]}", *options],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()


async def _until_full(victim: DHTNode) -> None:
    with trio.fail_after(120):
        while not victim.stats()["storage"]["stores_refused_full"]:
            await trio.sleep(0.01)  # polling the condition: the flood has filled the store


async def _sent(flooder: trio.Process) -> int:
    """Waits for the flooder to end and returns the datagrams it says it sent."""
    output = b""
    with trio.fail_after(120):
        while chunk := await flooder.stdout.receive_some():
            output += chunk
        await flooder.wait()
    return json.loads(output.decode().splitlines()[-1])["sent"]


async def test_a_flood_of_new_keys_from_one_host_leaves_room_and_cheap_service_for_honest_peers():
    async with DHTNode.open("127.0.0.1", 0, config=VICTIM_CONFIG) as victim:
        meter = StorageWorkMeter(victim, HONEST_HOST)
        async with DHTNode.open(HONEST_HOST, 0, [victim.address], client_mode=True, config=HONEST_CONFIG) as honest:
            async with _flooder(victim, "--count", str(FLOOD_KEYS), "--ports", "64", "--rate", "0") as flooder:
                await _until_full(victim)
                held_at_full = dict(victim.stats()["storage"])
                await flooder.stdin.aclose()  # the flooder stops once it sent FLOOD_KEYS
                for i in range(HONEST_KEYS):
                    with trio.fail_after(60):
                        while not await honest.store(f"honest-{i}", i, honest.now() + 600):
                            pass  # lost in the flood: try again
                    storage = victim.stats()["storage"]
                    assert storage["records_held"] <= VICTIM_CONFIG.max_records
                    assert storage["bytes_held"] <= VICTIM_CONFIG.max_bytes
                sent = await _sent(flooder)
            assert sent >= FLOOD_KEYS

            for i in range(HONEST_KEYS):
                assert victim.local_record(f"honest-{i}").value == i
                assert (await honest.get(f"honest-{i}")).value == i
    storage = victim.stats()["storage"]
    assert held_at_full["records_held"] == VICTIM_CONFIG.max_records
    assert storage["records_held"] == VICTIM_CONFIG.max_records  # still full: the flood was refused, not let in
    assert storage["stores_refused_full"] > 0 and storage["records_evicted"] >= HONEST_KEYS
    # the flooder (any id, any port of 127.0.0.1) holds the rest; the honest host holds exactly its keys
    assert victim._storage.account_usage(Sender.remote("127.0.0.1", b"\x00" * 20))[0][0] \
        == VICTIM_CONFIG.max_records - HONEST_KEYS
    assert victim._storage.account_usage(Sender.remote(HONEST_HOST, b"\x00" * 20))[0][0] == HONEST_KEYS
    assert len(meter.work) >= HONEST_KEYS
    assert sum(meter.work) / len(meter.work) <= 16, meter.work  # O(1) heap work: no walk over 2,000 records
    assert max(meter.work) <= 64, meter.work


# The honest client here runs with the default eviction rule: it must keep reaching the victim through a flood
# that makes the kernel drop some of its datagrams, and find it again the moment the flood stops.
RANDOM_ID_HONEST_CONFIG = DHTConfig(max_timeout=0.25, initial_timeout=0.25)
ATTEMPTS_DURING = 10
ATTEMPTS_AFTER = 2


async def _store_with_attempts(node: DHTNode, key: str, value: int, attempts: int) -> int:
    """Tries needed to store `key` (each try is one full store: lookup and replicas); 0 if none succeeded."""
    for attempt in range(1, attempts + 1):
        if await node.store(key, value, node.now() + 600):
            return attempt
    return 0


async def test_a_flood_with_a_made_up_sender_id_per_datagram_leaves_honest_stores_working_during_and_after():
    """Each flood datagram claims a fresh random node id from one of 64 ports. None of those ids may enter the
    victim's routing table (nobody at those ports answers a ping with them), so the victim never hands them out
    in find_node replies: honest stores succeed while the flood lasts (a few tries allowed for datagrams the
    kernel drops), and right after it, with the store still full of flood records; a new client (as `peer
    status` is) meets nobody but the victim."""
    async with DHTNode.open("127.0.0.1", 0, config=VICTIM_CONFIG) as victim:
        async with DHTNode.open(HONEST_HOST, 0, [victim.address], client_mode=True,
                                config=RANDOM_ID_HONEST_CONFIG) as honest:
            async with _flooder(victim, "--count", "5000", "--ports", "64", "--rate", "2500",
                                "--random-ids") as flooder:
                await _until_full(victim)
                during = [await _store_with_attempts(honest, f"during-{i}", i, ATTEMPTS_DURING)
                          for i in range(HONEST_KEYS)]
                flooding_still = flooder.returncode is None
                await flooder.stdin.aclose()
                sent = await _sent(flooder)
            assert flooding_still
            assert sent >= 5000
            assert all(during), during
            after = [await _store_with_attempts(honest, f"after-{i}", i, ATTEMPTS_AFTER) for i in range(HONEST_KEYS)]
            assert all(after), after
            assert victim.stats()["storage"]["records_held"] == VICTIM_CONFIG.max_records  # still full
            for i in range(HONEST_KEYS):
                assert (await honest.get(f"during-{i}")).value == i
                assert (await honest.get(f"after-{i}")).value == i
            assert victim.routing_table_ids() == []  # the only other node is a client: nobody verified
            async with DHTNode.open(HONEST_HOST, 0, [victim.address], client_mode=True) as fresh:
                assert (await fresh.get("after-0")).value == 0
                assert fresh.stats()["peers_known"] == 1  # no made-up contact was handed out to chase
