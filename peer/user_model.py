"""`peer train --model PACKAGE.MODULE:FACTORY --data PATH`: your model and your data, no training loop to write.

The factory is a function you write; it returns a `torch.nn.Module`, or `(module, loss_fn)` where
`loss_fn(output, y)` returns a scalar tensor. `peer train` imports it (the current directory first, then
PYTHONPATH), calls it with the keyword arguments of a `[model]` table of --config (if any) under a seed derived
from the run id, so every trainer of the run starts from the same weights, and trains it with the algorithm
chosen (`--algorithm diloco` or `collaborative`): the swarm carries only the averaging, every parameter is local.

`--model hf:FOLDER` is a Hugging Face causal LM from a local folder: the weights of a `save_pretrained` folder
(safetensors), or a fresh model from the folder's `config.json` alone; nothing is fetched from the hub. It sees
bytes as tokens (its vocabulary must hold 256) and is trained on text `--data` like any byte-level LM.

`--data` is a local file or folder, or a factory:
- a `.pt` file (loaded with `weights_only=True`) or a `.safetensors` file holding tensors `x` and `y` (one sample
  per row): integer `y` is classified (cross-entropy, accuracy reported), float `y` regressed (mean squared error);
- a `.jsonl` file, one sample per line: `{"x": [numbers...], "y": label or number(s)}`, or
  `{"text": "...", "label": N}` (the text's UTF-8 bytes, cut or zero-padded to `--seq-len`, are the input); then
  as for tensors;
- `PACKAGE.MODULE:FACTORY`, a function returning a map-style torch `Dataset` of `(x, y)` pairs (stacked into
  tensors once, then as for tensors);
- a text file, or a folder of `.txt` files: byte-level language modelling on random windows of `--seq-len` bytes
  (the model maps bytes `[B, T]` to logits `[B, T, V]`; cross-entropy on the next byte).
A fixed 10% of the samples (of the bytes, for text) is held out, the same for every trainer of every run, so the
held-out loss of the result line compares across trainers.

Why a separate task object: `peer.train.run_training` drives tasks through one set of hooks (data, model, loss,
held-out evaluation); the digits and LM tasks have experts on the swarm, this one has none.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from peer.corpus import WindowStream, evaluation_windows
from peer.options import HF_PREFIX, ModelSpec
from peer.tasks import BatchStream, run_seed

HELD_OUT_FRACTION = 0.1
SPLIT_SEED = 20240607  # the held-out rows are the same for every trainer of every run
EVAL_WINDOWS = 128
EVAL_BATCH = 256

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def _first_line(error: BaseException) -> str:
    """`Type: first line of the message`: what a one-line error quotes of an exception raised by the user's code
    or a library (their messages may run over many lines)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class UserModelError(ValueError):
    """--model or --data cannot be used; the message is one line naming the option and what is wrong."""


def load_factory(spec: ModelSpec) -> Callable[..., Any]:
    """Import the factory; UserModelError (one line) when the module or the name is missing or broken."""
    if spec.factory.startswith(HF_PREFIX):
        folder = Path(spec.factory[len(HF_PREFIX):])
        if not (folder / "config.json").is_file():
            raise UserModelError(f"--model {spec}: {folder} holds no config.json (a save_pretrained folder, or "
                                 f"one with a config.json to build a fresh model from)")
        return functools.partial(hf_causal_lm, folder)
    return import_function(spec.factory, "--model")


def import_function(text: str, option: str) -> Callable[..., Any]:
    """The function PACKAGE.MODULE:NAME, imported from the current directory first, then PYTHONPATH; a
    UserModelError naming `option` when the module or the name is missing or broken."""
    module_name, _, name = text.partition(":")
    spec = text
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `peer` is a console script: its sys.path does not hold the cwd
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise UserModelError(f"{option} {spec}: no module named {error.name!r} (searched the current directory "
                             f"and PYTHONPATH)") from None
    except Exception as error:
        raise UserModelError(f"{option} {spec}: importing {module_name} failed: "
                             f"{type(error).__name__}: {error}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UserModelError(f"{option} {spec}: {module_name} has no function {name!r}")
    return factory  # type: ignore[no-any-return]


def build_user_model(spec: ModelSpec, seed: int) -> tuple[nn.Module, LossFn | None]:
    """(model, loss_fn or None) from the factory, called under `seed` (the same initial weights everywhere)."""
    factory = load_factory(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            made = factory(**spec.kwargs)
        except Exception as error:
            raise UserModelError(f"--model {spec}: the factory failed: {type(error).__name__}: {error}") from None
    loss_fn: LossFn | None = None
    if isinstance(made, tuple) and len(made) == 2:
        made, loss_fn = made
        if not callable(loss_fn):
            raise UserModelError(f"--model {spec}: the factory's second value is not a loss function")
    if not isinstance(made, nn.Module):
        raise UserModelError(f"--model {spec}: the factory returned {type(made).__name__}, not a torch.nn.Module "
                             f"(or a (module, loss_fn) pair)")
    if not any(p.requires_grad for p in made.parameters()):
        raise UserModelError(f"--model {spec}: the model has no trainable parameters")
    return made, loss_fn


class CausalLMLogits(nn.Module):
    """A Hugging Face causal LM as `peer train` drives a model: token ids `[B, T]` in, logits `[B, T, V]` out
    (its `forward` returns a ModelOutput). `model` is the HF model, whose `save_pretrained` exports it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits  # type: ignore[no-any-return]


def hf_causal_lm(folder: Path, **overrides: Any) -> CausalLMLogits:
    """A causal LM from a local folder (see the module doc): weights only from safetensors, never a pickle."""
    try:
        import transformers
    except ImportError:
        raise UserModelError(f"--model hf:{folder}: needs the transformers package (the 'hf' extra)") from None
    if (folder / "pytorch_model.bin").exists() and not any(folder.glob("*.safetensors")):
        raise UserModelError(f"--model hf:{folder}: its weights are a pickle (pytorch_model.bin); save them with "
                             f"save_pretrained(..., safe_serialization=True)")
    try:
        if any(folder.glob("*.safetensors")):
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **overrides)
        else:
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, **overrides)
            model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    except Exception as error:  # an unknown architecture, a broken config: one line naming the folder
        raise UserModelError(f"--model hf:{folder}: {_first_line(error)}") from None
    vocabulary = getattr(model.config, "vocab_size", 0) or 0
    if vocabulary < 256:
        raise UserModelError(f"--model hf:{folder}: a vocabulary of {vocabulary} cannot hold the 256 byte values "
                             f"peer train feeds it")
    return CausalLMLogits(model)


# ------------------------------------------------------------------------------------------------ data


@dataclass
class TensorData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def classification(self) -> bool:
        return not self.y_train.is_floating_point()


@dataclass
class TextData:
    train: torch.Tensor  # uint8 bytes
    held_out: torch.Tensor


def load_data(path: Path, seq_len: int = 64) -> TensorData | TextData:
    """The training and held-out data of --data (see the module doc); UserModelError for anything unusable."""
    if not path.exists():
        if _FACTORY.fullmatch(str(path)):
            return _tensors(path, _dataset(str(path)))
        raise UserModelError(f"--data {path}: no such file or folder (nor PACKAGE.MODULE:FACTORY)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise UserModelError(f"--data {path}: no .txt files in this folder")
        return _text(path, b"\n".join(p.read_bytes() for p in files))
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth", ".safetensors"):
        return _tensors(path, _read_tensors(path, suffix))
    if suffix == ".jsonl":
        return _tensors(path, _read_jsonl(path, seq_len))
    return _text(path, path.read_bytes())


_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def _dataset(text: str) -> dict[str, Any]:
    """x and y stacked from the (x, y) pairs of the map-style Dataset a `--data` factory returns."""
    factory = import_function(text, "--data")
    try:
        dataset = factory()
        count = len(dataset)
        pairs = [dataset[i] for i in range(count)]
        xs = [torch.as_tensor(pair[0]) for pair in pairs]
        ys = [torch.as_tensor(pair[1]) for pair in pairs]
        return {"x": torch.stack(xs), "y": torch.stack(ys)}
    except Exception as error:  # not a Dataset, items that are not (x, y), shapes that do not stack
        raise UserModelError(f"--data {text}: its dataset cannot be used: {_first_line(error)} (a map-style "
                             f"Dataset of (x, y) pairs of one shape is needed)") from None


def _read_jsonl(path: Path, seq_len: int) -> dict[str, Any]:
    """x and y from the lines of a JSONL file (see the module doc); a bad line is named by its number."""
    xs: list[Any] = []
    ys: list[Any] = []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if isinstance(row, dict) and "text" in row and "label" in row:
                    encoded = str(row["text"]).encode()[:seq_len]
                    xs.append(list(encoded) + [0] * (seq_len - len(encoded)))
                    ys.append(int(row["label"]))
                elif isinstance(row, dict) and "x" in row and "y" in row:
                    xs.append(row["x"])
                    ys.append(row["y"])
                else:
                    raise ValueError('needs "x" and "y", or "text" and "label"')
            except (ValueError, TypeError) as error:
                raise UserModelError(f"--data {path}: line {number}: {error}") from None
    try:
        texts = bool(xs) and all(isinstance(v, int) for v in xs[0]) and all(isinstance(y, int) for y in ys)
        x = torch.tensor(xs, dtype=torch.long if texts else torch.float32)
        y = torch.tensor(ys, dtype=torch.long if all(isinstance(v, int) for v in ys) else torch.float32)
    except (ValueError, TypeError) as error:  # ragged rows, strings among numbers
        raise UserModelError(f"--data {path}: the rows do not make one tensor: {error}") from None
    return {"x": x, "y": y}


def _read_tensors(path: Path, suffix: str) -> dict[str, Any]:
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            return dict(load_file(str(path)))
        loaded = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # pickled code, a truncated file: say which file and why, in one line
        raise UserModelError(f"--data {path}: cannot read it: {_first_line(error)}") from None
    if not isinstance(loaded, dict):
        raise UserModelError(f"--data {path}: holds {type(loaded).__name__}, not a dict of tensors x and y")
    return loaded


def _tensors(path: Path, loaded: dict[str, Any]) -> TensorData:
    x, y = loaded.get("x"), loaded.get("y")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise UserModelError(f"--data {path}: needs tensors 'x' and 'y', found {sorted(loaded)}")
    if len(x) != len(y) or len(x) < 2:
        raise UserModelError(f"--data {path}: x has {len(x)} rows and y {len(y)} (need the same number, >= 2)")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    held = max(1, int(round(len(x) * HELD_OUT_FRACTION)))
    train, test = order[held:], order[:held]
    return TensorData(x[train], y[train], x[test], y[test])


def _text(path: Path, data: bytes) -> TextData:
    if len(data) < 1000:
        raise UserModelError(f"--data {path}: {len(data)} bytes of text are too few to train on (at least 1000)")
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    cut = int(len(tensor) * (1 - HELD_OUT_FRACTION))
    return TextData(tensor[:cut].clone(), tensor[cut:].clone())


# ------------------------------------------------------------------------------------------------ the task


class UserTask:
    """The hooks `peer.train.run_training` calls for --model/--data (see `peer.train.DigitsTask`)."""

    name = "model"
    remote_experts = False  # the swarm only averages: every parameter is in this process

    def __init__(self, args: argparse.Namespace):
        if args.data is None:
            raise UserModelError("--model needs --data (a .pt/.safetensors file of x and y, or text)")
        self.spec: ModelSpec = args.model
        load_factory(self.spec)  # a bad --model fails before the data is read
        self.data = load_data(Path(args.data), args.seq_len)
        self.loss_fn: LossFn | None = None
        if isinstance(self.data, TextData):
            self.eval_x, self.eval_y = evaluation_windows(self.data.held_out, args.seq_len,
                                                          min(EVAL_WINDOWS, max(1, self.data.held_out.numel()
                                                                                - args.seq_len - 1)))

    def discover(self, args: argparse.Namespace, swarm: Any) -> argparse.Namespace:
        return args

    def batches(self, args: argparse.Namespace) -> WindowStream | BatchStream:
        if isinstance(self.data, TextData):
            return WindowStream(self.data.train, args.seq_len, args.batch_size, seed=args.seed)
        return BatchStream(self.data.x_train, self.data.y_train, args.batch_size, seed=args.seed)

    def build_model(self, args: argparse.Namespace, swarm: Any) -> nn.Module:
        model, self.loss_fn = build_user_model(self.spec, run_seed(args.run_id))
        return model

    def expert_uids(self, args: argparse.Namespace) -> list[str]:
        return []

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        output = model(x)
        if self.loss_fn is not None:
            return self.loss_fn(output, y), math.nan
        if isinstance(self.data, TextData) or not y.is_floating_point():
            logits = output.reshape(-1, output.shape[-1])
            loss = nn.functional.cross_entropy(logits, y.reshape(-1))
            return loss, float((logits.argmax(-1) == y.reshape(-1)).float().mean().item())
        return nn.functional.mse_loss(output.reshape(y.shape), y), math.nan

    def before_training(self, model: nn.Module) -> None:
        return None

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        """The held-out loss (and accuracy, where there are classes), in evaluation mode, without gradients."""
        if isinstance(self.data, TextData):
            x, y = self.eval_x, self.eval_y
        else:
            x, y = self.data.x_test, self.data.y_test
        was_training = model.training
        model.train(False)
        total, correct, accuracy_known = 0.0, 0.0, True
        with torch.no_grad():
            for start in range(0, len(x), EVAL_BATCH):
                loss, accuracy = self.loss(model, x[start:start + EVAL_BATCH], y[start:start + EVAL_BATCH])
                rows = len(x[start:start + EVAL_BATCH])
                total += float(loss.item()) * rows
                accuracy_known = accuracy_known and not math.isnan(accuracy)
                correct += 0.0 if math.isnan(accuracy) else accuracy * rows
        model.train(was_training)
        return {"loss": total / len(x), "accuracy": correct / len(x) if accuracy_known else None}

    def finish(self, model: nn.Module) -> dict[str, Any]:
        return {"model": str(self.spec)}
