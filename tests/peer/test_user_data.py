"""`peer train --data` beyond tensor files, and `--model hf:FOLDER` (peer/user_model.py), each trained in-process:
a JSONL classification (numeric rows, and text with labels), a `PACKAGE.MODULE:FACTORY` returning a torch
Dataset, and a tiny Hugging Face GPT-2 built from a local config folder (no hub) on text; bad inputs are one
line naming the option, the file and the line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from peer.train import main
from peer.user_model import CausalLMLogits, ModelSpec, UserModelError, build_user_model, load_data

MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    def classifier():
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

    class TextClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.EmbeddingBag(256, 32)
            self.head = nn.Linear(32, 2)

        def forward(self, idx):
            return self.head(self.embed(idx))

    def text_classifier():
        return TextClassifier()

    class Pairs(torch.utils.data.Dataset):
        def __init__(self):
            generator = torch.Generator().manual_seed(1)
            self.x = torch.randn(400, 8, generator=generator)
            self.y = (self.x @ torch.randn(8, 3, generator=generator)).argmax(1)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, index):
            return self.x[index], self.y[index]

    def dataset():
        return Pairs()

    def not_a_dataset():
        return 7
""")


@pytest.fixture
def user_module(importable):
    return importable("userdata", MODULE)


def _result(capsys) -> dict:
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["event"] == "result"
    return lines[-1]


def test_a_jsonl_classification_trains(user_module, capsys):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(600, 8, generator=generator)
    y = (x @ torch.randn(8, 3, generator=generator)).argmax(1)
    path = user_module / "rows.jsonl"
    path.write_text("".join(json.dumps({"x": row.tolist(), "y": int(label)}) + "\n" for row, label in zip(x, y)))
    assert main(["--model", "userdata:classifier", "--data", str(path), "--steps", "150", "--lr", "0.01"]) == 0
    result = _result(capsys)
    assert result["accuracy"] > 0.8 and result["steps"] == 150


def test_text_with_labels_in_jsonl_is_classified_from_its_bytes(user_module, capsys):
    words = {0: ["apple", "pear", "plum", "fig"], 1: ["seven", "nine", "three", "ten"]}
    generator = torch.Generator().manual_seed(0)
    rows = []
    for index in range(400):
        label = index % 2
        picks = torch.randint(0, 4, (3,), generator=generator).tolist()
        rows.append({"text": " ".join(words[label][p] for p in picks), "label": label})
    path = user_module / "texts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")  # a blank line is skipped
    data = load_data(path, seq_len=24)
    assert data.x_train.dtype == torch.long and data.x_train.shape[1] == 24
    assert main(["--model", "userdata:text_classifier", "--data", str(path), "--seq-len", "24", "--steps", "120",
                 "--lr", "0.02"]) == 0
    assert _result(capsys)["accuracy"] > 0.9


def test_a_dataset_factory_is_data(user_module, capsys):
    data = load_data(Path("userdata:dataset"))  # not a file: PACKAGE.MODULE:FACTORY
    assert len(data.x_train) + len(data.x_test) == 400 and data.classification
    assert main(["--model", "userdata:classifier", "--data", "userdata:dataset", "--steps", "150",
                 "--lr", "0.01"]) == 0
    assert _result(capsys)["accuracy"] > 0.7


@pytest.mark.parametrize("content, message", [
    ('{"x": [1, 2], "y": 0}\nnot json\n', "line 2:"),
    ('{"x": [1, 2], "y": 0}\n{"z": 1}\n', 'line 2: needs "x" and "y", or "text" and "label"'),
    ('{"x": [1, 2], "y": 0}\n{"x": [1], "y": 1}\n', "the rows do not make one tensor"),
])
def test_bad_jsonl_is_one_line_naming_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserModelError, match="--data .*bad.jsonl") as caught:
        load_data(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_factory_that_gives_no_dataset_is_one_line(user_module):
    for text, message in (("userdata:not_a_dataset", "its dataset cannot be used"),
                          ("nosuchmodule:make", "no module named 'nosuchmodule'")):
        with pytest.raises(UserModelError, match=message):
            load_data(Path(text))


def test_a_hugging_face_causal_lm_from_a_local_config_trains_on_text(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tiny-gpt2"
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    config.save_pretrained(folder)
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    model, loss_fn = build_user_model(ModelSpec.parse(f"hf:{folder}"), seed=0)
    assert isinstance(model, CausalLMLogits) and loss_fn is None
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
    assert main(["--model", f"hf:{folder}", "--data", str(text), "--seq-len", "32", "--steps", "60",
                 "--batch-size", "8", "--lr", "0.003", "--log-every", "20"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    progress = [line for line in lines if line["event"] == "progress"]
    assert progress[-1]["loss"] < 0.7 * progress[0]["loss"]
    model.model.save_pretrained(tmp_path / "trained")  # a save_pretrained folder (safetensors) loads its weights
    again, _ = build_user_model(ModelSpec.parse(f"hf:{tmp_path / 'trained'}"), seed=1)
    for (name, mine), theirs in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_hf_folders_that_cannot_be_used_are_one_line(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="names no folder"):
        ModelSpec.parse("hf:")
    with pytest.raises(UserModelError, match="holds no config.json"):
        build_user_model(ModelSpec.parse(f"hf:{tmp_path}"), seed=0)
    import transformers

    transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=8, n_layer=1, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UserModelError, match="vocabulary of 100 cannot hold the 256 byte values"):
        build_user_model(ModelSpec.parse(f"hf:{tmp_path}"), seed=0)
