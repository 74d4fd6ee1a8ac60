"""DiLoCo vs synchronous data parallel (issue 13 Targets).

Four trainer processes train the digits model of `peer train --local-experts` (Linear -> mixture of `ffn`
experts -> Linear, every parameter in the trainer: what crosses the network is the trainers' own parameters),
all from the same initial parameters (seed 0), each on its own data order (seed = trainer index), with Adam
(lr 3e-3) as the local optimizer, for the same number of steps of the same batch size:
- sync: gradients averaged every step by the existing averager, all four trainers in every group (`SyncGradients`
  below: one model-sized vector per step, uncompressed), then the same Adam step everywhere;
- diloco: `DiLoCoOptimizer`, `inner_steps` 50, INT8 pseudo-gradients (with error feedback).
A `peer join` daemon is the DHT bootstrap only. The trainers are started, wait until all four are built, then
start together (a line on stdin), so a machine that brings processes up seconds apart does not skew the runs.

Part 1, on 127.0.0.1: held-out accuracy (`sync_metric`, `diloco_metric`) and bytes sent per trainer (the
all-reduce's encoded payloads: `bytes_ratio` = sync / diloco). Part 2, only where network namespaces can be
made (root + iproute2; `tests/netns.py`): each process on its own host with a 20 Mbit/s `tc tbf` uplink;
`wan_speedup` = sync seconds per step / diloco seconds per step (each over whole rounds: the baseline's per-step
time is constant, so it runs fewer steps than DiLoCo), `utilization` = compute time / wall time of DiLoCo with
`--overlap` (the optimizer's own clocks, mean over trainers). Ends with one JSON line.

    .venv/bin/python benchmarks/bench_diloco.py [--steps 100] [--hidden-dim 256] [--grid-size 4]
        [--wan-sync-steps 4] [--wan-steps 100] [--no-wan]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.peer_processes import ChildProcess, PeerProcess, start_daemon  # noqa: E402

TRAINERS = 4
PORT = 31337
RUN_ID = "bench-diloco"


# ------------------------------------------------------------------------------------------------ worker


def worker(options: argparse.Namespace) -> None:
    """One trainer: build, print `ready`, wait for `go` on stdin, train, print the result line."""
    import torch

    from averaging.collaborative import local_host_towards
    from averaging.diloco import DiLoCoOptimizer
    from peer import train
    from peer.client import Swarm, normalize_peers
    from peer.p2p.wire import Compression

    logging.basicConfig(level=logging.ERROR)
    args = train.build_parser().parse_args([
        "--local-experts", "--hidden-dim", str(options.hidden_dim), "--grid-size", str(options.grid_size),
        "--batch-size", str(options.batch_size), "--seed", str(options.index), "--threads", "1"])
    torch.set_num_threads(1)
    task = train.make_task(args)
    batches = task.batches(args)  # data order: seed = trainer index
    torch.manual_seed(0)
    model = task.build_model(args, None)  # the same initial parameters in every trainer
    base = torch.optim.Adam(model.parameters(), lr=3e-3)
    peers = normalize_peers([options.bootstrap])
    swarm = Swarm(initial_peers=peers, host=local_host_towards(peers[0]))
    optimizer: Any
    if options.mode == "sync":
        optimizer = SyncGradients(base, swarm, matchmaking_time=options.matchmaking_time)
    else:
        optimizer = DiLoCoOptimizer(
            base, swarm, RUN_ID, inner_steps=options.inner_steps, batch_size_per_step=options.batch_size,
            compression=Compression[options.compression.upper()], overlap=options.overlap, start_with=TRAINERS)
    averagers = [optimizer.averager]
    print(json.dumps({"event": "ready"}), flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    for _ in range(options.steps):
        x, y = batches.next()
        loss, _ = task.loss(model, x, y)
        loss.backward()
        optimizer.step(batch_size=len(x))
    train_seconds = time.monotonic() - started
    result = {"event": "result", "mode": options.mode, "train_seconds": round(train_seconds, 3),
              **task.evaluate(model),
              "bytes_sent": sum(a.counters["bytes_sent"] for a in averagers),
              "bytes_received": sum(a.counters["bytes_received"] for a in averagers)}
    if options.mode == "diloco":
        stats = optimizer.stats()
        result.update({k: stats[k] for k in ("outer_step", "hash", "utilization", "outer_waits", "group_sizes")})
    else:
        result.update(optimizer.stats())
    result["parameters"] = sum(p.numel() for p in model.parameters())
    print(json.dumps(result), flush=True)
    optimizer.close()
    swarm.close()


class SyncGradients:
    """The synchronous baseline: after every backward the four trainers average their gradients (weighted by
    samples) through the existing averager (`averaging.averager.Averager`, a group of all four: a step
    retries matchmaking until the group is complete), then Adam steps on the mean. Same parameters everywhere,
    one update per step. (`CollaborativeOptimizer` with a target of one step's samples does not do this on a
    loaded machine: trainers drift out of step and most epochs end in local updates or state downloads.)"""

    def __init__(self, optimizer: Any, swarm: Any, *, matchmaking_time: float, attempts: int = 10):
        import torch
        import trio

        from averaging.averager import Averager
        from averaging.collaborative import local_host_towards

        self.optimizer, self.swarm, self.attempts = optimizer, swarm, attempts
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.grads = [torch.zeros_like(p) for p in self.params]
        self.averager = Averager(swarm.rpc, swarm.dht, self.grads, prefix=f"{RUN_ID}.sync",
                                 names=[f"grad.{i}" for i in range(len(self.grads))], target_group_size=TRAINERS,
                                 min_group_size=TRAINERS, matchmaking_time=matchmaking_time,
                                 allreduce_timeout=300.0, serve_state=False)
        self.rounds = self.failed_attempts = 0
        host = local_host_towards(swarm.initial_peers[0])

        async def serve(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                if swarm.rpc.announced_address is None:
                    await swarm.rpc.listen(host, 0)
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.averager.serve)
                    task_status.started(scope)

        self._scope = swarm.bridge.start_and_wait(serve)

    def step(self, batch_size: int) -> None:
        import torch

        with torch.no_grad():
            for grad, p in zip(self.grads, self.params):
                grad.copy_(p.grad)
        for _ in range(self.attempts):
            result = self.swarm.run(self.averager.step, float(batch_size))
            if result.finished and result.group_size == TRAINERS:
                self.rounds += 1
                break
            self.failed_attempts += 1
        with torch.no_grad():
            for grad, p in zip(self.grads, self.params):
                p.grad.copy_(grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def stats(self) -> dict[str, Any]:
        return {"averaging_rounds": self.rounds, "failed_attempts": self.failed_attempts,
                "group_sizes": {TRAINERS: self.rounds}}

    def close(self) -> None:
        async def cancel() -> None:
            self._scope.cancel()

        self.swarm.bridge.run(cancel)


# ------------------------------------------------------------------------------------------------ driver


def run_mode(options: argparse.Namespace, mode: str, steps: int, bootstrap: str, *, overlap: bool = False,
             prefixes: list[list[str]] | None = None) -> list[dict[str, Any]]:
    """Four workers of `mode`, started together; their result lines."""
    workers = []
    try:
        for index in range(TRAINERS):
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode,
                       "--index", str(index), "--bootstrap", bootstrap, "--steps", str(steps),
                       "--hidden-dim", str(options.hidden_dim), "--grid-size", str(options.grid_size),
                       "--batch-size", str(options.batch_size), "--inner-steps", str(options.inner_steps),
                       "--compression", options.compression, "--matchmaking-time", str(options.matchmaking_time)]
            if overlap:
                command.append("--overlap")
            workers.append(ChildProcess(command, prefix=prefixes[index] if prefixes else None, stdin=True,
                                        capture_stderr=False))
        for process in workers:
            process.read_until(r'"event": "ready"', 300)
        for process in workers:
            process.send_line("go")
        results = []
        for process in workers:
            match = process.read_until(r'^\{"event": "result".*\}$', 1800)
            results.append(json.loads(match.group(0)))
        for process in workers:
            process.wait(60)
        return results
    finally:
        for process in workers:
            process.kill()


def summary(results: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    return {
        "accuracy": round(statistics.mean(r["accuracy"] for r in results), 4),
        "loss": round(statistics.mean(r["loss"] for r in results), 4),
        "bytes_sent": round(statistics.mean(r["bytes_sent"] for r in results)),
        "seconds": round(max(r["train_seconds"] for r in results), 2),
        "seconds_per_step": round(max(r["train_seconds"] for r in results) / steps, 4),
        "utilization": (round(statistics.mean(r["utilization"] for r in results), 4)
                        if all(r.get("utilization") is not None for r in results) else None),
        "outer_waits": sum(r.get("outer_waits", 0) for r in results),
        "hashes": len({r.get("hash") for r in results}),
        "group_sizes": results[0]["group_sizes"], "parameters": results[0]["parameters"],
        # sync: steps that ended in an averaged update (the others applied the local gradient, or downloaded)
        "averaging_rounds": [r.get("averaging_rounds") for r in results],
        "failed_attempts": [r.get("failed_attempts") for r in results],
    }


def wan_part(options: argparse.Namespace) -> dict[str, Any]:
    from tests.netns import HostNetwork, netns_available

    available, why_not = netns_available()
    if not available:
        return {"wan_skipped": why_not}
    with HostNetwork() as network:
        hub = network.add_host("bootstrap", bandwidth_mbit=options.uplink_mbit)
        hosts = [network.add_host(f"trainer-{i}", bandwidth_mbit=options.uplink_mbit) for i in range(TRAINERS)]
        daemon = PeerProcess(["join", "--host", hub.address, "--port", str(PORT), "--experts", "ffn.[0:1]",
                              "--hidden-dim", "16", "--threads", "1", "--announce", f"{hub.address}:{PORT}"],
                             prefix=hub.command(), capture_stderr=False)
        try:
            daemon.read_until(r"^others join with", 120)
            bootstrap = f"{hub.address}:{PORT}"
            prefixes = [host.command() for host in hosts]
            sync = summary(run_mode(options, "sync", options.wan_sync_steps, bootstrap, prefixes=prefixes),
                           options.wan_sync_steps)
            print("wan sync", json.dumps(sync), flush=True)
            diloco = summary(run_mode(options, "diloco", options.wan_steps, bootstrap, prefixes=prefixes),
                             options.wan_steps)
            print("wan diloco", json.dumps(diloco), flush=True)
            overlap = summary(run_mode(options, "diloco", options.wan_steps, bootstrap, overlap=True,
                                       prefixes=prefixes), options.wan_steps)
            print("wan diloco --overlap", json.dumps(overlap), flush=True)
        finally:
            daemon.kill()
    return {"wan_speedup": round(sync["seconds_per_step"] / diloco["seconds_per_step"], 2),
            "wan_sync_averaging_rounds": sync["averaging_rounds"],
            "utilization": overlap["utilization"], "wan_sync_s_per_step": sync["seconds_per_step"],
            "wan_diloco_s_per_step": diloco["seconds_per_step"],
            "wan_overlap_s_per_step": overlap["seconds_per_step"], "wan_overlap_outer_waits": overlap["outer_waits"],
            "uplink_mbit": options.uplink_mbit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of each trainer (part 1)")
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--grid-size", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--compression", default="int8", choices=["none", "float16", "int8"])
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--wan-sync-steps", type=int, default=4, help="steps of the baseline over the WAN")
    parser.add_argument("--wan-steps", type=int, default=100, help="steps of DiLoCo over the WAN")
    parser.add_argument("--uplink-mbit", type=int, default=20)
    parser.add_argument("--no-wan", action="store_true")
    # worker mode (the driver starts these)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["sync", "diloco"], help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options)
        return

    load = os.getloadavg()[0]
    daemon, _, bootstrap = start_daemon("--hidden-dim", "16", "--experts", "ffn.[0:1]", "--threads", "1",
                                        capture_stderr=False)
    try:
        sync = summary(run_mode(options, "sync", options.steps, bootstrap), options.steps)
        print("sync", json.dumps(sync), flush=True)
        diloco = summary(run_mode(options, "diloco", options.steps, bootstrap), options.steps)
        print("diloco", json.dumps(diloco), flush=True)
    finally:
        daemon.kill()
    figures: dict[str, Any] = {
        "diloco_metric": diloco["accuracy"], "sync_metric": sync["accuracy"],
        "metric_gap_relative": round(abs(diloco["accuracy"] - sync["accuracy"]) / sync["accuracy"], 4),
        "diloco_loss": diloco["loss"], "sync_loss": sync["loss"],
        "bytes_ratio": round(sync["bytes_sent"] / max(1, diloco["bytes_sent"]), 1),
        "sync_bytes_sent": sync["bytes_sent"], "diloco_bytes_sent": diloco["bytes_sent"],
        "diloco_hashes_agree": diloco["hashes"] == 1, "parameters": diloco["parameters"],
        "sync_averaging_rounds": sync["averaging_rounds"],
        "steps": options.steps, "batch_size": options.batch_size, "trainers": TRAINERS,
        "inner_steps": options.inner_steps, "compression": options.compression,
    }
    if not options.no_wan:
        figures.update(wan_part(options))
    else:
        figures["wan_skipped"] = "--no-wan"
    figures["load_1min"] = round(load, 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
