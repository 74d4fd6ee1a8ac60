"""Training on the swarm vs the same model trained locally (issue 6 Targets).

The same digits model (`peer/train.py`: Linear -> mixture of `ffn` experts -> Linear), the same steps, batch
size, seeds and held-out set, trained twice:
- local: the experts in this process (`peer train --local-experts`);
- swarm: the experts served by `peer join` daemons (separate processes on 127.0.0.1), the trainer a client of the
  swarm with its CollaborativeOptimizer (alone in its run, `--target-batch-size` = `--batch-size`, so it applies
  one update per step like the local run).
Prints both held-out accuracies and training wall times; ends with one JSON line holding `swarm_accuracy`,
`local_accuracy`, `time_ratio` (swarm / local training seconds). Targets: accuracy within 1 point, ratio <= 1.5
at hidden 64 and <= 1.0 at hidden 512. Local and swarm runs alternate seed by seed (the daemons already up), so
load changes on a shared machine hit both alike.

    .venv/bin/python benchmarks/bench_train.py [--steps 300] [--hidden-dim 64] [--daemons 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer import train  # noqa: E402
from peer.testing.peer_processes import PeerProcess, start_daemon_chain, stop_all  # noqa: E402


def start_daemons(count: int, grid: int, hidden_dim: int, threads: int | None = None
                  ) -> tuple[list[PeerProcess], str]:
    """`peer join` processes serving ffn.[0:grid] split between them (`--threads` torch threads each when
    given); returns them and the bootstrap address."""
    per = -(-grid // count)
    slices = []
    for index in range(count):
        first, last = index * per, min(grid, (index + 1) * per)
        args = ["--experts", f"ffn.[{first}:{last}]", "--hidden-dim", str(hidden_dim), "--log-level", "warning"]
        slices.append(args + (["--threads", str(threads)] if threads is not None else []))
    return start_daemon_chain(slices, timeout=60.0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(options: list[str], daemons: list[PeerProcess] = ()) -> dict:
    """One `peer train` run in this process, its JSON lines swallowed; returns the result line, with
    `cpu_seconds`: the CPU time this process and `daemons` used during the run (a figure the machine's load
    barely changes, unlike wall time)."""
    args = train.build_parser().parse_args(options)
    started = time.process_time() + sum(cpu_seconds(d.pid) for d in daemons)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train.run_training(args)
    result["cpu_seconds"] = time.process_time() + sum(cpu_seconds(d.pid) for d in daemons) - started
    return result


def summarize(runs: list[dict]) -> dict:
    return {"accuracy": sum(r["accuracy"] for r in runs) / len(runs),
            "accuracies": [r["accuracy"] for r in runs],
            "train_seconds": sum(r["train_seconds"] for r in runs) / len(runs),
            "cpu_seconds": sum(r["cpu_seconds"] for r in runs) / len(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--grid", type=int, default=12)
    parser.add_argument("--k-best", type=int, default=4)
    parser.add_argument("--daemons", type=int, default=2)
    parser.add_argument("--daemon-threads", type=int, default=None,
                        help="torch threads per daemon (`peer join --threads`; default: torch's own choice)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each, with seeds 0..N-1 (batch order); accuracies and times are averaged")
    options = parser.parse_args()

    common = ["--steps", str(options.steps), "--batch-size", str(options.batch_size), "--hidden-dim",
              str(options.hidden_dim), "--grid-size", str(options.grid), "--k-best", str(options.k_best),
              "--log-every", str(options.steps)]
    print(f"digits, {options.steps} steps of {options.batch_size}, hidden {options.hidden_dim}, "
          f"{options.grid} ffn experts, k_best {options.k_best}, {options.repeats} seeds")

    # The daemons start first and local and swarm runs alternate, seed by seed, so that a change in the machine's
    # load (shared cores) hits both alike; idle daemons cost the local runs nothing measurable.
    daemons, bootstrap = start_daemons(options.daemons, options.grid, options.hidden_dim, options.daemon_threads)
    local_runs, swarm_runs = [], []
    try:
        for seed in range(options.repeats):
            local_runs.append(run(common + ["--local-experts", "--run-id", "bench-local", "--seed", str(seed)]))
            swarm_runs.append(run(common + ["--initial-peers", bootstrap, "--run-id", f"bench-swarm-{seed}",
                                            "--target-batch-size", str(options.batch_size), "--seed", str(seed)],
                                  daemons))
    finally:
        stop_all(daemons)
    local = summarize(local_runs)
    print(f"local : held-out accuracy {local['accuracy']:.4f} (runs: {local['accuracies']}), "
          f"training {local['train_seconds']:.2f} s per run")
    swarm = summarize(swarm_runs)
    failed_calls = sum(r.get("failed_expert_calls", 0) for r in swarm_runs)
    failed_steps = sum(r["failed_steps"] for r in swarm_runs)
    print(f"swarm : held-out accuracy {swarm['accuracy']:.4f} (runs: {swarm['accuracies']}), "
          f"training {swarm['train_seconds']:.2f} s per run on {options.daemons} daemons, "
          f"{failed_calls} failed expert calls, {failed_steps} failed steps")
    print(f"CPU per run (trainer + daemons): swarm {swarm['cpu_seconds']:.2f} s, local {local['cpu_seconds']:.2f} s")
    ratio = swarm["train_seconds"] / local["train_seconds"]
    pair_ratios = [s["train_seconds"] / r["train_seconds"] for s, r in zip(swarm_runs, local_runs)]
    gap = abs(swarm["accuracy"] - local["accuracy"])
    print(f"time ratio swarm/local {ratio:.2f} (target <= 1.5); accuracy gap {100 * gap:.2f} points "
          f"(target <= 1)")
    print(json.dumps({
        "swarm_accuracy": round(swarm["accuracy"], 4), "local_accuracy": round(local["accuracy"], 4),
        "time_ratio": round(ratio, 3), "time_ratios_per_seed": [round(r, 3) for r in pair_ratios],
        "accuracy_gap_points": round(100 * gap, 2), "swarm_train_s": round(swarm["train_seconds"], 3),
        "local_train_s": round(local["train_seconds"], 3),
        "swarm_cpu_s": round(swarm["cpu_seconds"], 3), "local_cpu_s": round(local["cpu_seconds"], 3),
        "cpu_ratio": round(swarm["cpu_seconds"] / local["cpu_seconds"], 3),
        "seeds": options.repeats, "steps": options.steps,
        "batch_size": options.batch_size,
        "hidden_dim": options.hidden_dim, "daemons": options.daemons,
    }))


if __name__ == "__main__":
    main()
