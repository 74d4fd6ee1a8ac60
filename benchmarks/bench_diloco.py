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
made (root + iproute2; `peer/testing/netns.py`): each process on its own host with a 20 Mbit/s `tc tbf` uplink;
`wan_speedup` = sync seconds per step / diloco seconds per step (each over whole rounds: the baseline's per-step
time is constant, so it runs fewer steps than DiLoCo), `utilization` = compute time / wall time of DiLoCo with
`--overlap` (the optimizer's own clocks, mean over trainers).

Sparse (issue 35), beside the dense int8 run in the default run: the same four trainers with `--sparse` (topk2:
the largest `--density` of each chunk of 4096, 2-bit values, error feedback; `--exchange auto` picks the all-gather)
at `--sparse-inner-steps`. `bytes_ratio_sparse` = sync bytes / sparse bytes per trainer, `metric_gap_relative_sparse`
= |sparse - sync| / sync accuracy, `round_compression_sparse` = a float32 pseudo-gradient's bytes / its encoded
bytes (what one member's update costs per receiver). `robust_overhead_compressed`: the time of combining 8 members'
compressed updates of the model's size (`averaging.gather.combine`, after decoding them) with centered_clip / with
the mean (best of 3, in this process). `codec_s_per_100m`: topk2 encode + decode of a synthetic pseudo-gradient of
`--codec-elements` (bench_codecs.py's), per 100M elements. `--lm`: the same sync / sparse pair on the byte-level LM
(`--task lm`, `--lm-steps`): `bytes_ratio_sparse_lm`, `bpb_gap_relative_sparse_lm`. Ends with one JSON line.

    .venv/bin/python benchmarks/bench_diloco.py [--steps 100] [--hidden-dim 256] [--grid-size 4]
        [--wan-sync-steps 4] [--wan-steps 100] [--no-wan] [--sparse topk2] [--density 0.02]
        [--sparse-inner-steps 50] [--no-sparse] [--lm] [--lm-steps 200] [--codec-elements 20000000]
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

from peer.testing.peer_processes import ChildProcess, PeerProcess, start_daemon  # noqa: E402

TRAINERS = 4
CODECS = ["none", "float16", "int8", "int4", "int2", "topk2", "topk8"]
PORT = 31337
RUN_ID = "bench-diloco"


# ------------------------------------------------------------------------------------------------ worker


def worker(options: argparse.Namespace) -> None:
    """One trainer: build, print `ready`, wait for `go` on stdin, train, print the result line."""
    import torch

    from averaging.diloco import DiLoCoOptimizer
    from peer import train
    from peer.client import Swarm, normalize_peers
    from peer.p2p.addresses import local_host_towards
    from peer.p2p.wire import Compression, set_default_density

    logging.basicConfig(level=logging.ERROR)
    set_default_density(options.density)
    task_args = ["--task", "lm"] if options.task == "lm" else [
        "--hidden-dim", str(options.hidden_dim), "--grid-size", str(options.grid_size)]
    args = train.build_parser().parse_args([
        "--local-experts", *task_args, "--batch-size", str(options.batch_size), "--seed", str(options.index),
        "--threads", "1"])
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
    if options.mode == "diloco":  # the documented end of a DiLoCo run: agree on the final outer state
        optimizer.finish()
    train_seconds = time.monotonic() - started
    result = {"event": "result", "mode": options.mode, "train_seconds": round(train_seconds, 3),
              **task.evaluate(model),
              "bytes_sent": sum(a.counters["bytes_sent"] for a in averagers),
              "bytes_received": sum(a.counters["bytes_received"] for a in averagers)}
    if options.mode == "diloco":
        stats = optimizer.stats()
        result.update({k: stats[k] for k in ("outer_step", "hash", "utilization", "outer_waits", "group_sizes",
                                             "cut_short", "skipped_rounds", "state_loads")})
        # the optimizer's counters: the butterfly's (the averager's) and the all-gather's pushes together
        result.update({k: stats[k] for k in ("bytes_sent", "bytes_received")})
    else:
        result.update(optimizer.stats())
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["fp32_bytes"] = sum(4 * p.numel() for p in model.parameters())
    result["encoded_bytes"] = sum(wire_nbytes(p.detach(), Compression[options.compression.upper()])
                                  for p in model.parameters())
    print(json.dumps(result), flush=True)
    optimizer.close()
    swarm.close()


def wire_nbytes(tensor: Any, compression: Any) -> int:
    from peer.p2p import wire

    return wire.data_nbytes(tensor, compression)


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
        from peer.p2p.addresses import local_host_towards

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

        with torch.no_grad():  # a parameter this batch did not reach (the LM's) contributes zeros
            for grad, p in zip(self.grads, self.params):
                if p.grad is None:
                    grad.zero_()
                else:
                    grad.copy_(p.grad)
        for _ in range(self.attempts):
            result = self.swarm.run(self.averager.step, float(batch_size))
            if result.finished and result.group_size == TRAINERS:
                self.rounds += 1
                break
            self.failed_attempts += 1
        with torch.no_grad():
            for grad, p in zip(self.grads, self.params):
                p.grad = grad.clone()
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
             prefixes: list[list[str]] | None = None, compression: str | None = None, inner_steps: int | None = None,
             task: str = "digits") -> list[dict[str, Any]]:
    """Four workers of `mode`, started together; their result lines."""
    workers = []
    try:
        for index in range(TRAINERS):
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode,
                       "--index", str(index), "--bootstrap", bootstrap, "--steps", str(steps),
                       "--hidden-dim", str(options.hidden_dim), "--grid-size", str(options.grid_size),
                       "--batch-size", str(options.batch_size),
                       "--inner-steps", str(inner_steps or options.inner_steps),
                       "--compression", compression or options.compression, "--density", str(options.density),
                       "--task", task, "--matchmaking-time", str(options.matchmaking_time)]
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
        "bpb": (round(statistics.mean(r["bpb"] for r in results), 4) if all("bpb" in r for r in results) else None),
        "fp32_bytes": results[0]["fp32_bytes"], "encoded_bytes": results[0]["encoded_bytes"],
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
    from peer.testing.netns import HostNetwork, netns_available

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


def robust_overhead(parameters: int, members: int = 8, repeats: int = 3) -> dict[str, float]:
    """Seconds to decode and combine `members` topk2 updates of `parameters` elements with the mean and with
    centered_clip (best of `repeats`), as every member of an all-gather round does."""
    import torch

    from averaging.gather import combine
    from averaging.robust import Aggregation
    from benchmarks.bench_codecs import pseudo_gradient
    from peer.p2p import wire

    encoded = [wire.encode_bytes([wire.compressed(pseudo_gradient(parameters, seed=i), wire.Compression.TOPK2)])
               for i in range(members)]
    names = [bytes([i]) * 20 for i in range(members)]
    figures = {}
    for kind in ("mean", "centered_clip"):
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            contributions = [(n, wire.decode(bytearray(e))) for n, e in zip(names, encoded)]
            combine(contributions, {n: 1.0 for n in names}, Aggregation(kind), [torch.zeros(parameters)])
            best = min(best, time.perf_counter() - started)
        figures[kind] = best
    return figures


def sparse_figures(options: argparse.Namespace, sync: dict[str, Any], sparse: dict[str, Any], suffix: str,
                   metric: str) -> dict[str, Any]:
    gap_key = "metric_gap_relative" if metric == "accuracy" else "bpb_gap_relative"
    return {
        f"bytes_ratio_{suffix}": round(sync["bytes_sent"] / max(1, sparse["bytes_sent"]), 1),
        f"{gap_key}_{suffix}": round(abs(sparse[metric] - sync[metric]) / sync[metric], 4),
        f"{suffix}_{metric}": sparse[metric], f"{suffix}_bytes_sent": sparse["bytes_sent"],
        f"{suffix}_hashes_agree": sparse["hashes"] == 1, f"{suffix}_group_sizes": sparse["group_sizes"],
        f"round_compression_{suffix}": round(sparse["fp32_bytes"] / max(1, sparse["encoded_bytes"]), 1),
    }


def table(options: argparse.Namespace) -> None:
    """benchmarks/README.md's codec table: per codec, bytes per outer step and per trainer, the ratio to the sync
    run's bytes, held-out accuracy (or bpb with --task lm), and encode + decode seconds per MB of float32."""
    from benchmarks.bench_codecs import measure, pseudo_gradient

    sample = pseudo_gradient(options.codec_elements)
    daemon, _, bootstrap = start_daemon("--hidden-dim", "16", "--experts", "ffn.[0:1]", "--threads", "1",
                                        capture_stderr=False)
    rows = []
    try:
        sync = summary(run_mode(options, "sync", options.steps, bootstrap, task=options.task), options.steps)
        print("sync", json.dumps(sync), flush=True)
        for item in options.table.split(","):
            codec, _, inner = item.partition("@")
            inner_steps = int(inner) if inner else options.inner_steps
            run = summary(run_mode(options, "diloco", options.steps, bootstrap, compression=codec,
                                   inner_steps=inner_steps, task=options.task), options.steps)
            speed = measure(sample, codec, 2, options.density)
            row = {"codec": codec, "inner_steps": inner_steps, "accuracy": run["accuracy"], "bpb": run["bpb"],
                   "bytes_sent": run["bytes_sent"], "outer_steps": options.steps // inner_steps,
                   "bytes_per_outer_step": round(run["bytes_sent"] / max(1, options.steps // inner_steps)),
                   "bytes_ratio": round(sync["bytes_sent"] / max(1, run["bytes_sent"]), 1),
                   "codec_ratio": round(run["fp32_bytes"] / max(1, run["encoded_bytes"]), 1),
                   "codec_s_per_mb": round(speed["s_per_100m"] / 400, 5), "hashes_agree": run["hashes"] == 1,
                   "group_sizes": run["group_sizes"]}
            rows.append(row)
            print("row", json.dumps(row), flush=True)
    finally:
        daemon.kill()
    print(json.dumps({"task": options.task, "steps": options.steps, "sync_accuracy": sync["accuracy"],
                      "sync_bpb": sync["bpb"], "sync_bytes_sent": sync["bytes_sent"], "rows": rows,
                      "parameters": sync["parameters"], "load_1min": round(os.getloadavg()[0], 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of each trainer (part 1)")
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--grid-size", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--compression", default="int8", choices=CODECS)
    parser.add_argument("--sparse", default="topk2", choices=CODECS, help="the sparse codec run beside --compression")
    parser.add_argument("--density", type=float, default=0.02, help="top-k density (peer train --density)")
    parser.add_argument("--sparse-inner-steps", type=int, default=50)
    parser.add_argument("--no-sparse", action="store_true")
    parser.add_argument("--lm", action="store_true", help="also sync and sparse on --task lm (heavy)")
    parser.add_argument("--lm-steps", type=int, default=200)
    parser.add_argument("--codec-elements", type=int, default=20_000_000)
    parser.add_argument("--table", default=None, help="only the per-codec table: sync once, then DiLoCo with each "
                        "codec listed (CODEC or CODEC@INNER_STEPS, comma-separated), one JSON row each")
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
    parser.add_argument("--task", default="digits", choices=["digits", "lm"], help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options)
        return

    load = os.getloadavg()[0]
    if options.table:
        table(options)
        return
    daemon, _, bootstrap = start_daemon("--hidden-dim", "16", "--experts", "ffn.[0:1]", "--threads", "1",
                                        capture_stderr=False)
    try:
        sync = summary(run_mode(options, "sync", options.steps, bootstrap), options.steps)
        print("sync", json.dumps(sync), flush=True)
        diloco = summary(run_mode(options, "diloco", options.steps, bootstrap), options.steps)
        print("diloco", json.dumps(diloco), flush=True)
        sparse = None
        if not options.no_sparse:
            sparse = summary(run_mode(options, "diloco", options.steps, bootstrap, compression=options.sparse,
                                      inner_steps=options.sparse_inner_steps), options.steps)
            print("diloco", options.sparse, json.dumps(sparse), flush=True)
        lm: dict[str, Any] = {}
        if options.lm:
            lm_sync = summary(run_mode(options, "sync", options.lm_steps, bootstrap, task="lm"), options.lm_steps)
            print("lm sync", json.dumps(lm_sync), flush=True)
            lm_sparse = summary(run_mode(options, "diloco", options.lm_steps, bootstrap, compression=options.sparse,
                                         inner_steps=options.sparse_inner_steps, task="lm"), options.lm_steps)
            print("lm diloco", options.sparse, json.dumps(lm_sparse), flush=True)
            lm = sparse_figures(options, lm_sync, lm_sparse, "sparse_lm", "bpb")
            lm.update({"lm_sync_bpb": lm_sync["bpb"], "lm_steps": options.lm_steps})
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
    if sparse is not None:
        figures.update(sparse_figures(options, sync, sparse, "sparse", "accuracy"))
        figures.update({"sparse_codec": options.sparse, "density": options.density,
                        "sparse_inner_steps": options.sparse_inner_steps})
    figures.update(lm)
    overhead = robust_overhead(diloco["parameters"])
    figures["robust_overhead_compressed"] = round(overhead["centered_clip"] / overhead["mean"], 3)
    figures["combine_seconds"] = {k: round(v, 4) for k, v in overhead.items()}
    from benchmarks.bench_codecs import measure, pseudo_gradient

    codec = measure(pseudo_gradient(options.codec_elements), options.sparse, 2, options.density)
    figures["codec_s_per_100m"] = round(codec["s_per_100m"], 3)
    figures["codec_elements"] = options.codec_elements
    if not options.no_wan:
        figures.update(wan_part(options))
    else:
        figures["wan_skipped"] = "--no-wan"
    figures["load_1min"] = round(load, 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
