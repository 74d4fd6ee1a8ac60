"""State download benchmark: the verified parallel download (`averaging.state.load_state`) from one holder against
three, and the speed of the content hash (`averaging.state_hash`).

(a) hashing: `state_digest` of a 100 MB float32 state (best of 3), MB/s.
(b) loopback: three holder processes on 127.0.0.1 serve the same 100 MB state (sealed RPC, as deployed); this
    process downloads it with the agreed hash from holder 0 alone, then from all three, alternating, `--repeats`
    times each; medians of the wall time. On loopback the network is not the bottleneck (the CPU is: sealing,
    opening, hashing and copying on 2 cores shared by 4 processes), so this says what the parallel path costs
    where bandwidth is free, not what it gains.
(c) simulated links: the in-memory network, each holder behind its own link of `--link-mbps` MB/s (a home uplink),
    `--sim-mb` MB of state, one source against three, in the network's virtual time (MockClock): what the
    parallel path gains where each holder's uplink is the bottleneck.

    .venv/bin/python benchmarks/bench_state.py [--mb 100] [--repeats 3] [--sim-mb 32] [--link-mbps 10]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_state(mb: float):
    import torch

    generator = torch.Generator().manual_seed(0)
    numel = int(mb * 1e6) // 4
    big = numel * 9 // 10
    return [torch.randn(big, generator=generator), torch.randn(numel - big - 7, generator=generator),
            torch.arange(7, dtype=torch.int64)]


def holder_main(args: argparse.Namespace) -> None:
    import torch
    import trio

    from averaging.state import StateConfig, install_state_server
    from peer.p2p.identity import Identity
    from peer.p2p.net import RealNetwork
    from peer.p2p.rpc import RPCNode

    torch.set_num_threads(1)
    tensors = make_state(args.mb)

    async def run() -> None:
        identity = Identity.generate()
        async with RPCNode(identity, RealNetwork()) as rpc:
            _, port = await rpc.listen("127.0.0.1", 0)
            server = install_state_server(rpc, lambda: ({"step": 1}, tensors), config=StateConfig(max_snapshots=8))
            print(json.dumps({"port": port, "peer_id": identity.peer_id.hex()}), flush=True)
            await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)  # until the parent closes it
            print(json.dumps({"blocks_served": server.blocks_served}), flush=True)

    trio.run(run)


def bench_hash(mb: float) -> float:
    from averaging.state_hash import state_digest

    tensors = make_state(mb)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        state_digest(tensors)
        best = min(best, time.perf_counter() - started)
    return mb / best


def bench_loopback(mb: float, repeats: int) -> dict:
    import torch
    import trio

    from averaging.state import load_state
    from averaging.state_hash import state_digest
    from peer.p2p.identity import Identity, PeerID
    from peer.p2p.net import RealNetwork
    from peer.p2p.rpc import RPCNode

    reference = make_state(mb)
    expected = state_digest(reference)
    holders = [subprocess.Popen([sys.executable, __file__, "--holder", "--mb", str(mb)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        candidates = []
        for process in holders:
            assert process.stdout is not None
            ready = json.loads(process.stdout.readline())
            candidates.append((PeerID.from_hex(ready["peer_id"]), ("127.0.0.1", ready["port"])))
        times: dict[int, list[float]] = {1: [], 3: []}
        blocks_from: list[int] = []

        async def run() -> None:
            async with RPCNode(Identity.generate(), RealNetwork()) as rpc:
                into = [torch.zeros_like(t) for t in reference]
                for _ in range(repeats):
                    for count in (1, 3):
                        started = time.perf_counter()
                        state = await load_state(rpc, candidates[:count], into=into, expected_hash=expected,
                                                 timeout=120)
                        times[count].append(time.perf_counter() - started)
                        assert all(torch.equal(a, b) for a, b in zip(into, reference))
                        if count == 3:
                            blocks_from[:] = [state.blocks_from.get(p, 0) for p, _ in candidates]

        trio.run(run)
    finally:
        for process in holders:
            if process.stdin is not None:
                process.stdin.close()
        for process in holders:
            process.wait(timeout=30)
    one, three = statistics.median(times[1]), statistics.median(times[3])
    return {"loopback_mb": mb, "loopback_one_source_s": round(one, 3), "loopback_three_sources_s": round(three, 3),
            "loopback_one_source_mb_s": round(mb / one, 1), "loopback_three_sources_mb_s": round(mb / three, 1),
            "loopback_speedup": round(one / three, 2), "loopback_blocks_per_holder": blocks_from}


def bench_simulated(mb: float, link_mb_s: float) -> dict:
    import torch
    import trio
    import trio.testing

    from averaging.state import StateConfig, install_state_server, load_state
    from averaging.state_hash import state_digest
    from peer.p2p.net import MemoryNetwork
    from peer.testing.sim_peers import start_peers

    reference = make_state(mb)
    expected = state_digest(reference)
    result: dict[str, float] = {}

    async def run() -> None:
        memory = MemoryNetwork(latency=0.02, seed=1)
        async with trio.open_nursery() as nursery:
            peers = await start_peers(nursery, 4, memory=memory, with_dht=False)
            *holders, newcomer = peers
            for holder in holders:
                # hashed on the event loop: MockClock's autojump would let virtual time run while a thread works
                install_state_server(holder.rpc, lambda: ({"step": 1}, reference),
                                     config=StateConfig(hash_in_thread_bytes=1 << 62))
                memory.set_link(holder.name, newcomer.name, bandwidth=link_mb_s * 1e6)
            for count in (1, 3):
                started = trio.current_time()
                await load_state(newcomer.rpc, [(h.peer_id, h.address) for h in holders[:count]],
                                 expected_hash=expected, timeout=600)
                result[count] = trio.current_time() - started
            nursery.cancel_scope.cancel()

    torch.set_num_threads(1)
    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    return {"sim_mb": mb, "sim_link_mb_s": link_mb_s, "sim_one_source_s": round(result[1], 3),
            "sim_three_sources_s": round(result[3], 3), "sim_speedup": round(result[1] / result[3], 2),
            "sim_bound_one_s": round(mb / link_mb_s, 3), "sim_bound_three_s": round(mb / link_mb_s / 3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--holder", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sim-mb", type=float, default=32.0)
    parser.add_argument("--link-mbps", type=float, default=10.0, help="simulated link, MB/s per holder")
    args = parser.parse_args()
    if args.holder:
        holder_main(args)
        return
    figures: dict = {"hash_mb_s": round(bench_hash(args.mb), 1)}
    print(f"state_digest: {figures['hash_mb_s']} MB/s over {args.mb:g} MB", flush=True)
    figures.update(bench_loopback(args.mb, args.repeats))
    print(f"loopback {args.mb:g} MB: one source {figures['loopback_one_source_s']} s, three sources "
          f"{figures['loopback_three_sources_s']} s (blocks per holder {figures['loopback_blocks_per_holder']})",
          flush=True)
    figures.update(bench_simulated(args.sim_mb, args.link_mbps))
    print(f"simulated {args.sim_mb:g} MB over {args.link_mbps:g} MB/s links: one source "
          f"{figures['sim_one_source_s']} s, three {figures['sim_three_sources_s']} s (virtual time)", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
