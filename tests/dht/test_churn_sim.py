"""Churn on the in-memory network under MockClock (issue 3): records outlive the nodes that first held them.

Scenario: N nodes, stores from random nodes; a quarter of the nodes crash without warning; virtual time passes;
another quarter is replaced by newcomers; virtual time passes; then every key is read from a random live node.
At least 99% must still be readable, and every lookup finishes within its deadline.

k is small (5) on purpose: with the default k = 20 the chance that all replicas of a key die is negligible, so the
test would pass without republishing. With k = 5 and half of the original nodes gone, roughly 3% of the keys would
lose every replica if nobody re-stored them (0.5^5): the 99% bar is only met because holders republish to the
current k closest nodes and hand records to newcomers. Everything is seeded (identities, message ids, network), so
a run is reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import trio
from dht_swarm import RunningNode, start_node

from dht import DHTConfig
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork

CONFIG = DHTConfig(k=5, republish_interval=60.0, refresh_interval=60.0, maintenance_interval=20.0, max_timeout=1.0,
                   lookup_timeout=5.0)
SETTLE = 150.0  # virtual seconds between waves: a few maintenance rounds (refresh + republish) on every node


@dataclass
class ChurnOutcome:
    keys: int
    readable: int
    durations: list[float]  # virtual seconds per final get


async def _churn(node_count: int, key_count: int, seed: int) -> ChurnOutcome:
    rng = random.Random(seed)
    network = MemoryNetwork(latency=0.005, seed=seed)
    nodes: dict[str, RunningNode] = {}

    async def join(nursery: trio.Nursery, host: str) -> None:
        alive = list(nodes.values())
        initial = [r.node.address for r in rng.sample(alive, min(3, len(alive)))]
        nodes[host] = await start_node(
            nursery, host, initial, network=network.host(host), config=CONFIG, clock=trio.current_time,
            identity=Identity.from_seed(f"churn:{seed}:{host}".encode()), seed=rng.getrandbits(32),
        )

    def crash(host: str) -> None:
        network.crash(host)  # its socket vanishes: nothing more is delivered to it or from it
        nodes.pop(host).kill()

    async with trio.open_nursery() as nursery:
        for index in range(node_count):
            await join(nursery, f"n{index}")
        expiration = trio.current_time() + 100_000
        for index in range(key_count):
            writer = nodes[rng.choice(sorted(nodes))].node
            assert await writer.store(f"churn:{index}", index, expiration)

        quarter = node_count // 4
        for host in rng.sample(sorted(nodes), quarter):
            crash(host)
        await trio.sleep(SETTLE)
        originals = [h for h in sorted(nodes) if h.startswith("n")]
        for number, host in enumerate(rng.sample(originals, quarter)):
            crash(host)
            await join(nursery, f"new{number}")
        await trio.sleep(SETTLE)

        readable, durations = 0, []
        for index in range(key_count):
            reader = nodes[rng.choice(sorted(nodes))].node
            started = trio.current_time()
            with trio.fail_after(CONFIG.lookup_timeout + 0.001):  # a lookup never outlives its own deadline
                record = await reader.get(f"churn:{index}")
            durations.append(trio.current_time() - started)
            readable += record is not None and record.value == index
        nursery.cancel_scope.cancel()
    return ChurnOutcome(key_count, readable, durations)


def _check(outcome: ChurnOutcome) -> None:
    assert outcome.readable >= 0.99 * outcome.keys, f"{outcome.readable} of {outcome.keys} keys readable"
    ordered = sorted(outcome.durations)
    p95 = ordered[int(0.95 * len(ordered)) - 1]
    # Dead contacts must not make lookups wait out the hard request timeout while live peers can answer.
    assert p95 < CONFIG.max_timeout, f"get p95 {p95:.3f} s (virtual)"


async def test_records_survive_a_quarter_crashing_and_a_quarter_replaced_small(autojump_clock):
    _check(await _churn(node_count=100, key_count=200, seed=7))


@pytest.mark.slow
async def test_records_survive_a_quarter_crashing_and_a_quarter_replaced_500_nodes(autojump_clock):
    # 500 keys: without republishing about 3% (15) would lose every replica, three times what the 99% bar allows;
    # 1,000 keys showed the same in 5.4 minutes of CI, 500 in 3.7

    _check(await _churn(node_count=500, key_count=500, seed=3))
