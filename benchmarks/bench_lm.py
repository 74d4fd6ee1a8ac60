"""The language model on the swarm vs the same model trained locally, and against gzip (issue 14 Targets).

The `peer train --task lm` model (byte-level transformer, every layer's FFN a mixture of `ffn` experts over the
grid `lm.[0:LAYERS].[0:N]`), the same steps, batch size, seed, run id (so the same initial trainer weights) and
held-out windows, trained twice:
- local: the experts in this process (`peer train --task lm --local-experts`);
- swarm: the experts served by `peer join` daemons (separate processes on 127.0.0.1, each serving its slice of
  every layer's grid), the trainer a client of the swarm with its CollaborativeOptimizer, alone in its run, with
  `--average parameters` as `peer swarm up --task lm` runs it: its own layers take an Adam step every batch like
  the local run's, and a collective epoch (`--target-batch-size`, 512 samples) ends only every 64 steps (with
  the epoch ending every step, the optimizer's per-epoch work costs ~0.15 s a step here, more than the model).
Then a profile of swarm steps (the same model, timed phase by phase: forward, backward, optimizer, and the
mixtures' own counters: expert calls per layer per step and the seconds inside them), and gzip -9 on the whole
held-out text (`gzip_bpb`: compressed bits per byte). With `--long-steps N` a longer local run (N steps of
`--long-batch-size`) is compared with gzip: `long_bpb` < `gzip_bpb` is the target. The model sees at most
`--seq-len` bytes of context and the held-out windows start cold; gzip sees each file's whole history.

With `--in-flight N` (default 4) the swarm run is repeated with N `--steps-in-flight` (`peer.steps`): its held-out
figure and its training time against the sequential swarm run's (`in_flight_bpb`, `in_flight_time_ratio`).

With `--expert-compression CODEC` (default int8; none skips it) the sequential swarm run is repeated with the
expert calls' activations and gradients in that codec: the expert calls' tensor bytes per token, exact over
compressed (`expert_bytes_ratio`, target >= 4 with 8 bits), and its held-out figure against the exact run's
(`compressed_bpb`, `compressed_bpb_gap`: relative, target within 2%), on daemons started afresh with the
identities of the exact run's (so their experts start from the same weights): the other swarm runs meet experts
already trained.

Ends with one JSON line: `swarm_bpb`, `local_bpb`, `bpb_gap`, `time_ratio` (swarm / local training seconds),
`gzip_bpb`, `long_bpb`, the profile and the settings. Targets: bpb within 2%, time ratio <= 1.5, long_bpb below
gzip_bpb.

    .venv/bin/python benchmarks/bench_lm.py [--steps 150] [--batch-size 8] [--daemons 2] [--long-steps 0]

The defaults are `make run`'s shape (150 steps of 8, hidden 64, 2 layers x 12 experts, k_best 2): its
`local_bpb` is the figure `peer swarm up --task lm` quotes (`peer.swarm.LM_LOCAL_REFERENCE`).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from peer import train  # noqa: E402
from peer.corpus import WindowStream, load_corpus  # noqa: E402
from peer.testing.peer_processes import PeerProcess, start_daemon_chain, stop_all  # noqa: E402

PREFIX = "lm"


IDENTITIES = Path(tempfile.mkdtemp(prefix="bench-lm-"))


def start_daemons(count: int, layers: int, per_layer: int, hidden_dim: int) -> tuple[list[PeerProcess], str]:
    """`peer join` processes each serving its slice of every layer's grid; returns them and the bootstrap. Each
    daemon index keeps its identity across calls (a key file in IDENTITIES), so its experts start from the same
    weights every time (a daemon seeds them from its peer id)."""
    per = -(-per_layer // count)
    slices = [["--experts", f"{PREFIX}.[0:{layers}].[{index * per}:{min(per_layer, (index + 1) * per)}]",
               "--hidden-dim", str(hidden_dim), "--log-level", "warning",
               "--identity", str(IDENTITIES / f"daemon-{index}.key")] for index in range(count)]
    return start_daemon_chain(slices, timeout=120.0)


def run(options: list[str]) -> dict[str, Any]:
    """One `peer train` run in this process, its JSON lines and sample swallowed; returns the result line."""
    args = train.build_parser().parse_args(options)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return train.run_training(args)


def gzip_bpb(data: bytes) -> float:
    """Bits per byte of gzip -9 (zlib level 9, the gzip container included) on `data`."""
    return 8 * len(gzip.compress(data, compresslevel=9)) / len(data)


def profile_swarm_steps(options: list[str], bootstrap: str, steps: int) -> dict[str, Any]:
    """Where a swarm step's time goes: the LM built as `peer train` builds it on the swarm, `steps` steps timed
    by phase (the optimizer is a plain Adam here: the collaborative optimizer's share is the result's
    train_seconds minus this), and the mixtures' counters per layer per step."""
    from peer.client import Swarm
    from peer.lm import build_lm

    args = train.build_parser().parse_args(options + ["--initial-peers", bootstrap])
    torch.manual_seed(args.seed)
    corpus = load_corpus()
    batches = WindowStream(corpus.train, args.seq_len, args.batch_size, seed=args.seed)
    with Swarm(initial_peers=[bootstrap], host="127.0.0.1") as swarm:
        model = build_lm(args, swarm)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        mixtures = model.remote_mixtures()
        phases = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
        for step in range(steps + 1):
            if step == 1:  # the first step warms up connections and the servers: not counted
                phases = dict.fromkeys(phases, 0.0)
                for mixture in mixtures:
                    mixture.client.stats.update(dict.fromkeys(mixture.client.stats, 0))
            x, y = batches.next()
            t0 = time.perf_counter()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            phases["forward_s"] += t1 - t0
            phases["backward_s"] += t2 - t1
            phases["optimizer_s"] += t3 - t2
        per_layer = []
        for layer, mixture in enumerate(mixtures):
            stats = mixture.client.stats
            per_layer.append({
                "layer": layer,
                "forward_calls_per_step": round(stats["forward_calls"] / steps, 2),
                "backward_calls_per_step": round(stats["backward_calls"] / steps, 2),
                "forward_ms_per_step": round(1000 * stats["forward_seconds"] / steps, 2),
                "backward_ms_per_step": round(1000 * stats["backward_seconds"] / steps, 2),
                "search_ms_per_step": round(1000 * stats["search_seconds"] / steps, 2),
            })
    step_s = sum(phases.values()) / steps
    return {"steps": steps, "step_ms": round(1000 * step_s, 2),
            **{key.replace("_s", "_ms_per_step"): round(1000 * value / steps, 2) for key, value in phases.items()},
            "layers": per_layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts-per-layer", type=int, default=12)
    parser.add_argument("--k-best", type=int, default=2)
    parser.add_argument("--daemons", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-batch-size", type=int, default=512, help="the swarm trainer's collective epoch")
    parser.add_argument("--profile-steps", type=int, default=20, help="swarm steps timed phase by phase (0: none)")
    parser.add_argument("--long-steps", type=int, default=0,
                        help="steps of a longer local run compared with gzip (0: skip it)")
    parser.add_argument("--long-batch-size", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=4,
                        help="a second swarm run with this many --steps-in-flight, beside the sequential one "
                             "(1: skip it)")
    parser.add_argument("--expert-compression", default="int8", choices=["none", "float16", "uint8", "int8"],
                        help="a third swarm run with this codec on the expert calls (none: skip it)")
    options = parser.parse_args()

    grid = f"{options.layers}x{options.experts_per_layer}"
    common = ["--task", "lm", "--steps", str(options.steps), "--batch-size", str(options.batch_size),
              "--seq-len", str(options.seq_len), "--hidden-dim", str(options.hidden_dim), "--expert-prefix", PREFIX,
              "--grid-size", grid, "--k-best", str(options.k_best), "--log-every", str(options.steps),
              "--run-id", "bench-lm", "--seed", str(options.seed)]
    load = os.getloadavg()
    print(f"lm: {options.steps} steps of {options.batch_size} x {options.seq_len} bytes, hidden "
          f"{options.hidden_dim}, {options.layers} layers x {options.experts_per_layer} ffn experts, k_best "
          f"{options.k_best}, seed {options.seed}; load average {load[0]:.1f} on {os.cpu_count()} cores")

    corpus = load_corpus()
    held_out = corpus.held_out.numpy().tobytes()
    gzip_figure = gzip_bpb(held_out)
    print(f"gzip -9 on the held-out text ({len(held_out):,} bytes, {len(corpus.held_out_files)} files): "
          f"{gzip_figure:.3f} bits per byte")

    local = run(common + ["--local-experts"])
    print(f"local : held-out {local['bpb']:.3f} bits per byte (from {local['bpb_start']:.3f}), "
          f"training {local['train_seconds']:.2f} s")

    daemons, bootstrap = start_daemons(options.daemons, options.layers, options.experts_per_layer,
                                       options.hidden_dim)
    try:
        on_swarm = ["--initial-peers", bootstrap, "--average", "parameters", "--target-batch-size",
                    str(options.target_batch_size)]
        swarm = run(common + on_swarm + ["--steps-in-flight", "1"])
        in_flight = (run(common + on_swarm + ["--steps-in-flight", str(options.in_flight)])
                     if options.in_flight > 1 else None)
        profile = (profile_swarm_steps(common, bootstrap, options.profile_steps)
                   if options.profile_steps > 0 else None)
    finally:
        stop_all(daemons)
    compressed = None
    if options.expert_compression != "none":  # on fresh daemons (seeded experts): as untrained as the exact run's
        daemons, bootstrap = start_daemons(options.daemons, options.layers, options.experts_per_layer,
                                           options.hidden_dim)
        try:
            on_swarm[on_swarm.index("--initial-peers") + 1] = bootstrap
            compressed = run(common + on_swarm + ["--steps-in-flight", "1", "--expert-compression",
                                                  options.expert_compression])
        finally:
            stop_all(daemons)
    print(f"swarm : held-out {swarm['bpb']:.3f} bits per byte (from {swarm['bpb_start']:.3f}), "
          f"training {swarm['train_seconds']:.2f} s on {options.daemons} daemons, "
          f"{swarm.get('failed_expert_calls', 0)} failed expert calls, {swarm['failed_steps']} failed steps")
    if in_flight is not None:
        print(f"swarm with {options.in_flight} steps in flight: held-out {in_flight['bpb']:.3f} bits per byte, "
              f"training {in_flight['train_seconds']:.2f} s ({in_flight['train_seconds'] / swarm['train_seconds']:.2f}"
              f" of the sequential swarm run's), {in_flight['failed_steps']} failed steps")
    tokens = options.steps * options.batch_size * options.seq_len
    bytes_ratio = compressed_gap = None
    if compressed is not None:
        bytes_ratio = swarm["expert_tensor_bytes"] / compressed["expert_tensor_bytes"]  # same tokens in both
        compressed_gap = (compressed["bpb"] - swarm["bpb"]) / swarm["bpb"]
        print(f"swarm with --expert-compression {options.expert_compression}: held-out {compressed['bpb']:.3f} bits "
              f"per byte ({100 * compressed_gap:+.2f}% of the exact run's, target within 2%), expert-call tensor "
              f"bytes per token {compressed['expert_tensor_bytes'] / tokens:.0f} against "
              f"{swarm['expert_tensor_bytes'] / tokens:.0f} exact ({bytes_ratio:.2f}x fewer, target >= 4), "
              f"training {compressed['train_seconds']:.2f} s, {compressed['failed_steps']} failed steps")
    ratio = swarm["train_seconds"] / local["train_seconds"]
    gap = (swarm["bpb"] - local["bpb"]) / local["bpb"]
    print(f"time ratio swarm/local {ratio:.2f} (target <= 1.5); bpb gap {100 * gap:+.2f}% (target within 2%)")
    if profile is not None:
        print(f"profile of {profile['steps']} swarm steps: {profile['step_ms']:.1f} ms a step (forward "
              f"{profile['forward_ms_per_step']:.1f}, backward {profile['backward_ms_per_step']:.1f}, "
              f"optimizer {profile['optimizer_ms_per_step']:.1f}); local: "
              f"{1000 * local['train_seconds'] / options.steps:.1f} ms a step")
        for layer in profile["layers"]:
            print(f"  layer {layer['layer']}: {layer['forward_calls_per_step']} forward and "
                  f"{layer['backward_calls_per_step']} backward expert calls a step, "
                  f"{layer['forward_ms_per_step']} + {layer['backward_ms_per_step']} ms in them "
                  f"({layer['search_ms_per_step']} ms choosing experts)")

    long: dict[str, Any] | None = None
    if options.long_steps > 0:
        long_options = [*common, "--local-experts"]
        long_options[long_options.index("--steps") + 1] = str(options.long_steps)
        long_options[long_options.index("--batch-size") + 1] = str(options.long_batch_size)
        long = run(long_options)
        verdict = "below" if long["bpb"] < gzip_figure else "not below"
        print(f"long  : {options.long_steps} local steps of {options.long_batch_size}: held-out "
              f"{long['bpb']:.3f} bits per byte in {long['train_seconds']:.0f} s, {verdict} gzip's {gzip_figure:.3f}")

    print(json.dumps({
        "swarm_bpb": round(swarm["bpb"], 4), "local_bpb": round(local["bpb"], 4), "bpb_gap": round(gap, 4),
        "time_ratio": round(ratio, 3), "gzip_bpb": round(gzip_figure, 4),
        "long_bpb": None if long is None else round(long["bpb"], 4),
        "long_steps": options.long_steps if long else 0, "long_batch_size": options.long_batch_size,
        "swarm_bpb_start": round(swarm["bpb_start"], 4), "local_bpb_start": round(local["bpb_start"], 4),
        "swarm_train_s": round(swarm["train_seconds"], 3), "local_train_s": round(local["train_seconds"], 3),
        "swarm_failed_steps": swarm["failed_steps"], "profile": profile,
        "in_flight": options.in_flight if in_flight else 1,
        "in_flight_bpb": None if in_flight is None else round(in_flight["bpb"], 4),
        "in_flight_time_ratio": None if in_flight is None else round(
            in_flight["train_seconds"] / swarm["train_seconds"], 3),
        "in_flight_failed_steps": None if in_flight is None else in_flight["failed_steps"],
        "expert_compression": options.expert_compression,
        "expert_bytes_ratio": None if bytes_ratio is None else round(bytes_ratio, 3),
        "compressed_bpb": None if compressed is None else round(compressed["bpb"], 4),
        "compressed_bpb_gap": None if compressed_gap is None else round(compressed_gap, 4),
        "expert_bytes_per_token": round(swarm["expert_tensor_bytes"] / tokens, 1),
        "steps": options.steps, "batch_size": options.batch_size, "seq_len": options.seq_len,
        "hidden_dim": options.hidden_dim, "layers": options.layers, "experts_per_layer": options.experts_per_layer,
        "k_best": options.k_best, "daemons": options.daemons, "target_batch_size": options.target_batch_size,
        "load_average": round(load[0], 2),
    }))


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(IDENTITIES, ignore_errors=True)
