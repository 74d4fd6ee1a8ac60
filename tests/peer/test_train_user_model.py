"""`peer train --model PACKAGE.MODULE:FACTORY --data PATH` (peer/user_model.py): a user's module written to
tmp_path trains on the user's data, alone (in-process, quick) and as two DiLoCo trainer processes on a small swarm
(slow) that end with the same hash and a lower loss; a bad --model gives one line and a non-zero exit."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from peer.testing.peer_processes import ChildProcess, PeerProcess, start_daemon
from peer.train import main
from peer.user_model import ModelSpec, UserModelError, build_user_model, load_data

MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    def classifier(hidden=32):
        return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    class ByteModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, 32)
            self.head = nn.Linear(32, 256)

        def forward(self, idx):
            return self.head(torch.relu(self.embed(idx)))

    def bytes_lm():
        return ByteModel()

    def with_loss():
        return nn.Linear(8, 1), lambda out, y: ((out.squeeze(-1) - y) ** 2).mean()

    def not_a_model():
        return 42
""")


@pytest.fixture
def user_module(importable):
    return importable("usermodels", MODULE)


def _classification(path, rows=600):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=generator)
    y = (x @ torch.randn(8, 3, generator=generator)).argmax(1)
    torch.save({"x": x, "y": y}, path)
    return path


def _lines(process: ChildProcess, timeout: float = 300.0) -> list[dict]:
    """Every JSON line of a trainer, up to its result line."""
    lines = []
    while not lines or lines[-1].get("event") != "result":
        lines.append(process.read_json(timeout))
    return lines


def test_user_classifier_trains_alone_and_its_loss_goes_down(user_module, capsys):
    data = _classification(user_module / "data.pt")
    assert main(["--model", "usermodels:classifier", "--data", str(data), "--steps", "150", "--log-every",
                 "10", "--lr", "0.01"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    progress = [line for line in lines if line["event"] == "progress"]
    result = lines[-1]
    assert result["task"] == "model" and result["model"] == "usermodels:classifier"
    assert progress[-1]["loss"] < 0.6 * progress[0]["loss"]
    assert result["accuracy"] > 0.8  # held out: 10% of the rows


def test_text_data_trains_a_byte_model_with_the_default_loss(user_module, capsys):
    text = user_module / "corpus"
    text.mkdir()
    (text / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    assert main(["--model", "usermodels:bytes_lm", "--data", str(text), "--steps", "80", "--seq-len", "16",
                 "--log-every", "10", "--lr", "0.01"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    progress = [line for line in lines if line["event"] == "progress"]
    assert progress[-1]["loss"] < 0.5 * progress[0]["loss"]
    assert lines[-1]["loss"] < 2.0 and lines[-1]["accuracy"] is not None


def test_factory_loss_and_float_targets(user_module, capsys):
    x = torch.randn(200, 8, generator=torch.Generator().manual_seed(1))
    torch.save({"x": x, "y": x.sum(1)}, user_module / "reg.pt")
    assert main(["--model", "usermodels:with_loss", "--data", str(user_module / "reg.pt"), "--steps", "30",
                 "--log-every", "10"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["accuracy"] is None and result["loss"] >= 0  # a regression has no accuracy to report


def test_same_seed_same_initial_weights(user_module):
    first, _ = build_user_model(ModelSpec("usermodels:classifier", {"hidden": 8}), seed=5)
    second, _ = build_user_model(ModelSpec("usermodels:classifier", {"hidden": 8}), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert first[0].out_features == 8  # the [model] table's keyword arguments reach the factory


@pytest.mark.parametrize("spec, message", [
    ("usermodels:missing", "usermodels has no function 'missing'"),
    ("nosuchmodule_xyz:build", "no module named 'nosuchmodule_xyz'"),
    ("usermodels:not_a_model", "returned int, not a torch.nn.Module"),
])
def test_unusable_factories_are_one_line_errors(user_module, spec, message):
    with pytest.raises(UserModelError, match=message):
        build_user_model(ModelSpec.parse(spec), seed=0)


def test_unusable_data_is_one_line_error(tmp_path):
    torch.save({"x": torch.zeros(3, 2)}, tmp_path / "bad.pt")
    with pytest.raises(UserModelError, match=r"needs tensors 'x' and 'y'"):
        load_data(tmp_path / "bad.pt")
    with pytest.raises(UserModelError, match="no such file"):
        load_data(tmp_path / "absent.pt")


def test_model_table_in_config(user_module, capsys):
    data = _classification(user_module / "data.pt", rows=100)
    config = user_module / "train.toml"
    config.write_text(f'data = "{data}"\nsteps = 5\n[model]\nfactory = "usermodels:classifier"\nhidden = 4\n')
    assert main(["--config", str(config), "--log-every", "5"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["model"] == "usermodels:classifier"


def test_bad_model_spec_exits_non_zero_with_one_line(tmp_path):
    data = _classification(tmp_path / "data.pt", rows=20)
    for spec, status in (("not-a-spec", 2), ("nosuchmodule_xyz:build", 1)):
        process = PeerProcess(["train", "--model", spec, "--data", str(data)])
        assert process.wait(60) == status
        errors = process.stderr_tail().strip().splitlines()
        assert len(errors) == 1 and "--model" in errors[0], errors


@pytest.mark.slow
def test_two_trainer_processes_train_a_user_model_on_user_data(user_module, processes):
    data = _classification(user_module / "data.pt")
    daemon, _, address = start_daemon("--hidden-dim", "16", "--num-experts", "1")
    processes.add(daemon)
    trainers = [processes.add(ChildProcess(
        [sys.executable, "-m", "peer.cli", "train", "--model", "usermodels:classifier", "--data", str(data),
         "--initial-peers", address, "--algorithm", "diloco", "--inner-steps", "20", "--steps", "100",
         "--start-with", "2", "--seed", str(seed), "--log-every", "10", "--lr", "0.01", "--run-id", "user-model"],
        env={"PYTHONPATH": str(user_module)})) for seed in range(2)]
    outputs = [_lines(t) for t in trainers]
    assert all(t.wait(60) == 0 for t in trainers), [t.stderr_tail() for t in trainers]
    results = [lines[-1] for lines in outputs]
    assert {r["outer_step"] for r in results} == {5}
    assert len({r["hash"] for r in results}) == 1
    for lines, result in zip(outputs, results):
        first = next(line for line in lines if line.get("event") == "progress")
        assert result["loss"] < 0.6 * first["loss"] and result["accuracy"] > 0.8


def test_a_run_that_never_averaged_because_of_another_model_fails():
    import logging

    from averaging.schema import MISMATCHES
    from peer.train import _never_averaged_for_mismatch

    log = logging.getLogger("test")
    MISMATCHES.report(b"\x02" * 20, "met by an earlier run in this process", log, "earlier")
    mark = MISMATCHES.mark()
    assert _never_averaged_for_mismatch({"group_sizes": {}}, mark) is None  # alone, nobody else: fine
    MISMATCHES.report(b"\x01" * 20, "0.weight: shape [48, 8] there, [32, 8] here", log, "matchmaking")
    line = _never_averaged_for_mismatch({"group_sizes": {}}, mark)
    assert line is not None and "[48, 8] there" in line and "010101" in line and "more peers" not in line
    assert _never_averaged_for_mismatch({"group_sizes": {2: 3}}, mark) is None  # it did average with someone
