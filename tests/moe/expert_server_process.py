"""A minimal expert-server peer in its own process, for tests and benchmarks that SIGKILL servers.

    python tests/moe/expert_server_process.py --uids ffn.0 ffn.1 --hidden 256 [--dht-peer 127.0.0.1:PORT]

Runs an RPC node on 127.0.0.1 (a free port), a DHT node on the same port (a new DHT, or joining --dht-peer) and
an ExpertServer declaring its experts there. Prints one JSON line once it serves:
`{"address": [host, port], "peer_id": hex}`, then serves until killed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import trio  # noqa: E402

from dht import DHTNode  # noqa: E402
from moe.experts import OptimizerConfig, make_expert  # noqa: E402
from moe.server import ExpertServer  # noqa: E402
from peer.p2p.identity import Identity  # noqa: E402
from peer.p2p.net import RealNetwork  # noqa: E402
from peer.p2p.rpc import RPCNode  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uids", nargs="+", required=True)
    parser.add_argument("--kind", default="ffn")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="expert i is initialised with seed + i")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dht-peer", default=None, help="host:port of a DHT peer to join (default: no DHT)")
    parser.add_argument("--new-dht", action="store_true", help="start a new DHT (this peer is its first node)")
    parser.add_argument("--declare-ttl", type=float, default=30.0)
    parser.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--max-batch-size", type=int, default=4096)
    parser.add_argument("--threads-per-device", type=int, default=1, help="batches computed at once per device")
    parser.add_argument("--inline-threshold", type=float, default=1e-4,
                        help="batches predicted to compute faster than this (seconds) run on the event loop")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    experts = [
        make_expert(uid, args.kind, args.hidden, seed=args.seed + i,
                    optimizer=OptimizerConfig(args.optimizer, lr=args.lr))
        for i, uid in enumerate(args.uids)
    ]
    network = RealNetwork()
    identity = Identity.generate()
    async with RPCNode(identity, network) as rpc:
        address = await rpc.listen("127.0.0.1", 0)
        server = ExpertServer(experts, max_batch_size=args.max_batch_size, declare_ttl=args.declare_ttl,
                              inline_threshold=args.inline_threshold, threads_per_device=args.threads_per_device)
        use_dht = args.new_dht or args.dht_peer is not None
        initial = []
        if args.dht_peer:
            host, port = args.dht_peer.rsplit(":", 1)
            initial = [(host, int(port))]
        if use_dht:
            async with DHTNode.open("127.0.0.1", address[1], initial, identity=identity, network=network) as dht:
                await run_server(server, rpc, dht, address)
        else:
            await run_server(server, rpc, None, address)


async def run_server(server: ExpertServer, rpc: RPCNode, dht, address) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run, rpc, dht)
        print(json.dumps({"address": list(address), "peer_id": rpc.peer_id.hex()}), flush=True)
        await trio.sleep(math.inf)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    try:
        trio.run(serve, args)
    except* KeyboardInterrupt:  # Ctrl-C: stop quietly (trio may wrap it in a group)
        pass


if __name__ == "__main__":
    main()
