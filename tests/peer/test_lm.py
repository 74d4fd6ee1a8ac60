"""The language-model task: a deterministic corpus split, and training through a swarm that loses a daemon."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.corpus import corpus_files, is_held_out, load_corpus
from peer.testing.peer_processes import ROOT, start_daemon_chain, stop_all
from peer.topology import Topology


def _split_in_a_fresh_process() -> dict:
    code = ("import json; from peer.corpus import load_corpus; c = load_corpus(); "
            "print(json.dumps({'held_out': list(c.held_out_files), **c.describe()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return json.loads(out)


def test_the_corpus_split_is_the_same_on_two_runs_and_leaves_tests_out():
    first, second = _split_in_a_fresh_process(), _split_in_a_fresh_process()
    assert first == second
    corpus = load_corpus()
    assert list(corpus.held_out_files) == first["held_out"] and corpus.describe()["train_bytes"] == first["train_bytes"]
    assert first["held_out_files"] > 0 and first["train_bytes"] > 10 * first["held_out_bytes"] > 0
    files = corpus_files()
    assert not any(f.startswith("test/") or "/tests/" in f or f.rsplit("/", 1)[-1].startswith("test_") for f in files)
    assert all(is_held_out(f) for f in first["held_out"]) and not any(is_held_out(f) for f in corpus.train_files)


def test_lm_topology_serves_every_layer_from_every_volunteer():
    topology = Topology(task="lm", volunteers=3, experts_per_volunteer=4)
    patterns = [topology.volunteer_args(i, host="h", port=1, bootstrap="b:1")[6] for i in range(3)]
    assert patterns == ["lm.[0:2].[0:4]", "lm.[0:2].[4:8]", "lm.[0:2].[8:12]"]
    args = topology.trainer_args(0, bootstrap="b:1")
    assert args[args.index("--grid-size") + 1] == "2x12" and args[args.index("--task") + 1] == "lm"
    assert args[args.index("--average") + 1] == "parameters"  # the trainers' own layers learn every step
    assert "--average" not in Topology().trainer_args(0, bootstrap="b:1")  # digits: as before


@pytest.mark.slow
def test_the_lm_trains_through_a_sigkilled_daemon_and_held_out_bpb_falls_by_one(tmp_path):
    """`peer swarm up --task lm` with one volunteer SIGKILLed mid-run: every trainer finishes, held-out bits per
    byte fall by at least 1.0 from the start (about 8: the untrained model guesses uniformly)."""
    result = subprocess.run(
        [sys.executable, "-m", "peer.cli", "swarm", "up", "--task", "lm", "--volunteers", "3", "--trainers", "2",
         "--steps", "150", "--batch-size", "8", "--target-batch-size", "512", "--kill-one-at", "5",
         "--log-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-3000:]
    assert summary["daemons_killed"] == 1 and summary["all_trainers_finished"]
    for log in tmp_path.glob("trainer-*.log"):
        final = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
        assert final["task"] == "lm" and final["failed_steps"] < final["steps"]
        assert final["bpb_start"] - final["bpb"] >= 1.0, final
        assert final["sample"]


def test_the_lm_summary_quotes_the_local_figure_for_a_run_of_its_shape_and_the_sample(tmp_path):
    """`peer swarm up --task lm` with the shape `make run` uses: the summary gives the benchmark's local figure
    beside each trainer's bits per byte, and the prompt with its continuation; other shapes get no local figure."""
    import io

    from peer.swarm import LM_LOCAL_REFERENCE, Managed, SwarmLauncher, _progress_text

    shape = Topology(task="lm", steps=LM_LOCAL_REFERENCE["steps"], batch_size=LM_LOCAL_REFERENCE["batch_size"])
    for topology, expected in ((shape, LM_LOCAL_REFERENCE["bpb"]), (Topology(task="lm", steps=7), None),
                               (Topology(), None)):
        out = io.StringIO()
        launcher = SwarmLauncher(topology, kill_one_at=None, log_dir=tmp_path, out=out)
        trainer = Managed("trainer-1", "trainer", [], exit_code=0)
        trainer.result = {"bpb": 3.8, "bpb_start": 8.0, "prompt": "def f(x):", "sample": "\n    return x",
                          "steps": topology.steps, "steps_planned": topology.steps}
        launcher.members.append(trainer)
        summary = launcher.summary()
        assert summary["local_bpb_reference"] == expected
        launcher._print_summary(summary)
        text = out.getvalue()
        assert "held-out 3.800 bits per byte (from 8.000)" in text
        assert ("trained locally for as many steps" in text) == (expected is not None)
        assert "prompt:       'def f(x):'" in text and "continuation: '\\n    return x'" in text
    trainer.progress = {"step": 75, "steps": 150, "loss": 2.5}
    assert _progress_text(trainer).startswith("[########--------] step 75/150  loss 2.500")


@pytest.mark.slow
def test_the_lm_with_int8_expert_calls_stays_within_2_percent_of_the_exact_runs_bits_per_byte(tmp_path):
    """`peer train --task lm --expert-compression int8` (activations and gradients int8 both ways) against the same
    run exact, each on a fresh daemon with the same identity (so its experts start from the same weights):
    held-out bits per byte within 2% (relative), with about 3.9x fewer expert-call tensor bytes."""
    results = {}
    for codec in ("none", "int8"):
        daemons, bootstrap = start_daemon_chain([["--experts", "lm.[0:2].[0:12]", "--hidden-dim", "64", "--log-level",
                                                  "warning", "--identity", str(tmp_path / "daemon.key")]],
                                                timeout=120.0)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "peer.cli", "train", "--task", "lm", "--initial-peers", bootstrap,
                 "--expert-prefix", "lm", "--grid-size", "2x12", "--k-best", "2", "--average", "parameters",
                 "--steps", "150", "--batch-size", "8", "--target-batch-size", "512", "--log-every", "150",
                 "--run-id", f"lm-{codec}", "--expert-compression", codec],
                cwd=ROOT, capture_output=True, text=True, timeout=600)
        finally:
            stop_all(daemons)
        assert out.returncode == 0, out.stderr[-3000:]
        results[codec] = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    exact, int8 = results["none"], results["int8"]
    assert abs(int8["bpb"] - exact["bpb"]) <= 0.02 * exact["bpb"], (int8["bpb"], exact["bpb"])
    assert exact["expert_tensor_bytes"] == exact["expert_tensor_bytes_exact"]
    assert 3.8 <= exact["expert_tensor_bytes"] / int8["expert_tensor_bytes"] < 4.0
