"""The language-model task: a deterministic corpus split, and training through a swarm that loses a daemon."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.corpus import corpus_files, is_held_out, load_corpus
from peer.topology import Topology
from tests.peer_processes import ROOT


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
