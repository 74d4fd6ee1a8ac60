"""The flood of test_server_flood.py, run in a process of its own (`python -m tests.moe.flood_scenario`), so that
its RSS figure does not depend on what earlier tests of the same pytest process left in the heap: in a clean-clone
`make test` (slow tests in random order) it measured 166 MB of growth after other tests had run first, while it
passed alone 3 runs of 3. Prints one JSON line: the outcomes and the growth."""

from __future__ import annotations

import json
from typing import Any

import torch
import trio

from moe import calls
from moe.experts import make_expert
from peer.p2p.identity import Identity
from peer.p2p.memory import rss_bytes
from peer.p2p.net import RealNetwork
from peer.p2p.rpc import BudgetExceeded, RPCNode
from tests.moe.serving import serving

HIDDEN = 512
ROWS = 256  # 512 KiB of input per call: 1,000 calls are half a gigabyte
SETTLE_S = 30.0  # how long after the flood the RSS is read


async def flood() -> dict[str, Any]:
    """1,000 concurrent forwards from one identity beside 10 honest calls from another, then the RSS growth."""
    expert = make_expert("ffn.0", "ffn", HIDDEN, seed=0)
    batch = torch.randn(ROWS, HIDDEN)
    async with serving([expert]) as (server, honest, address, server_id):
        async with RPCNode(Identity.generate(), RealNetwork()) as flooder:
            for node in (honest, flooder):  # connections, the runtime and the allocator warmed up
                for _ in range(3):
                    await calls.forward(node, address, server_id, "ffn.0", [batch], timeout=60)
            before = rss_bytes()
            outcomes = {"ok": 0, "refused": 0}
            messages: list[str] = []

            async def flood_one() -> None:
                try:
                    await calls.forward(flooder, address, server_id, "ffn.0", [batch], timeout=120)
                    outcomes["ok"] += 1
                except BudgetExceeded as error:
                    outcomes["refused"] += 1
                    messages.append(str(error))

            honest_shapes = []
            with trio.fail_after(300):
                async with trio.open_nursery() as nursery:
                    for _ in range(1000):
                        nursery.start_soon(flood_one)
                    for _ in range(10):  # honest calls from another peer, during the flood
                        outputs = await calls.forward(honest, address, server_id, "ffn.0", [batch], timeout=120)
                        honest_shapes.append(list(outputs[0].shape))
            await trio.sleep(SETTLE_S)
            return {**outcomes, "honest_shapes": honest_shapes, "first_refusal": messages[0] if messages else None,
                    "flooder": flooder.peer_id.short(), "growth_bytes": rss_bytes() - before}


if __name__ == "__main__":
    print(json.dumps(trio.run(flood)))
