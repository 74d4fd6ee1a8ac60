"""A minimal expert-server peer in its own process, for tests and benchmarks that SIGKILL servers.

    python -m peer.testing.expert_server_process --uids ffn.0 ffn.1 --hidden 256 [--dht-peer 127.0.0.1:PORT]

Runs an RPC node on 127.0.0.1 (a free port), a DHT node on the same port (a new DHT, or joining --dht-peer) and
an ExpertServer declaring its experts there. Prints one JSON line once it serves:
`{"address": [host, port], "peer_id": hex}`, then serves until killed.

With `--phase-hooks` (tests only) the process also reads commands on stdin, so a test can SIGKILL it at an exact
moment of its work instead of guessing with sleeps: the line `hold forward` (or `hold backward`) is answered with
`{"armed": "forward"}`; the next computation of that phase then prints `{"entered": "forward", "uid": uid}` and
blocks until the process dies, so a kill sent after that line is known to land inside that computation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from typing import Any

import torch
import trio

from dht import DHTNode
from moe.experts import OptimizerConfig, make_expert
from moe.server import ExpertServer
from peer.p2p.identity import Identity
from peer.p2p.net import Address, RealNetwork
from peer.p2p.rpc import RPCNode


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
    parser.add_argument("--phase-hooks", action="store_true",
                        help="tests: accept `hold forward|backward` on stdin (see the module docstring)")
    return parser.parse_args(argv)


class PhaseHooks:
    """Test-only observation point: wraps each expert's forward and backward so that a test can learn, through
    stdout, that the server is inside a computation of a given phase, and kill it right there. The armed
    computation never returns (nothing else in the process matters once the test has seen the line)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: set[str] = set()

    def listen(self) -> None:
        """Read `hold PHASE` commands from stdin in a daemon thread (the event loop may be blocked by an armed
        computation running inline, so the reader must not depend on it)."""
        threading.Thread(target=self._read_commands, name="phase-hooks", daemon=True).start()

    def _read_commands(self) -> None:
        for line in sys.stdin:
            words = line.split()
            if len(words) == 2 and words[0] == "hold" and words[1] in ("forward", "backward"):
                with self._lock:
                    self._armed.add(words[1])
                print(json.dumps({"armed": words[1]}), flush=True)

    def wrap(self, expert: Any) -> None:
        # forward: with or without a graph kept for the backward; backward: getting the graph to backpropagate
        # through (the kept one or a recomputed one), which both the single-expert backward and a batched call's
        # `Expert.backward_many` go through for each expert
        forward, keeping, graph = expert.forward, expert.forward_keeping, expert._graph

        def held_forward(inputs: Any) -> Any:
            self._maybe_hold("forward", expert.uid)
            return forward(inputs)

        def held_keeping(inputs: Any) -> Any:
            self._maybe_hold("forward", expert.uid)
            return keeping(inputs)

        def held_graph(inputs: Any, kept: Any) -> Any:
            self._maybe_hold("backward", expert.uid)
            return graph(inputs, kept)

        expert.forward, expert.forward_keeping, expert._graph = held_forward, held_keeping, held_graph

    def _maybe_hold(self, phase: str, uid: str) -> None:
        with self._lock:
            if phase not in self._armed:
                return
            self._armed.discard(phase)
        print(json.dumps({"entered": phase, "uid": uid}), flush=True)
        threading.Event().wait()  # until SIGKILL


async def serve(args: argparse.Namespace) -> None:
    experts = [
        make_expert(uid, args.kind, args.hidden, seed=args.seed + i,
                    optimizer=OptimizerConfig(args.optimizer, lr=args.lr))
        for i, uid in enumerate(args.uids)
    ]
    if args.phase_hooks:
        hooks = PhaseHooks()
        for expert in experts:
            hooks.wrap(expert)
        hooks.listen()
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


async def run_server(server: ExpertServer, rpc: RPCNode, dht: DHTNode | None, address: Address) -> None:
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
