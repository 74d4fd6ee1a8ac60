"""Issue 40: 1,000 concurrent `moe.forward` calls from one identity left 869 MB held after they ended. Over real
sockets on 127.0.0.1, an expert server, a flooding identity and an honest caller as separate RPC nodes: the flood
past the identity's share is refused at once (naming the limit and the peer), honest calls succeed meanwhile, and
30 s after the flood the process's RSS is back within 128 MB of its level before (the server gives freed heap
pages back, `peer.p2p.memory`: without it, 250 MB stayed)."""

from __future__ import annotations

import pytest
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
MB = 1 << 20


@pytest.mark.slow
async def test_a_thousand_concurrent_forward_calls_from_one_identity():
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

            honest_results = []
            with trio.fail_after(300):
                async with trio.open_nursery() as nursery:
                    for _ in range(1000):
                        nursery.start_soon(flood_one)
                    for _ in range(10):  # honest calls from another peer, during the flood
                        outputs = await calls.forward(honest, address, server_id, "ffn.0", [batch], timeout=120)
                        honest_results.append(outputs[0].shape)
            assert honest_results == [(ROWS, HIDDEN)] * 10
            assert outcomes["ok"] + outcomes["refused"] == 1000 and outcomes["refused"] > 0
            assert "requests_per_peer" in messages[0] and flooder.peer_id.short() in messages[0]
            await trio.sleep(30)
            growth = rss_bytes() - before
            assert growth <= 128 * MB, f"RSS grew by {growth / MB:.0f} MB"
