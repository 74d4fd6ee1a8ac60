"""The language-model corpus: the source of the Python standard library that runs `peer`.

Why this corpus: every machine that runs the project already has it (nothing is downloaded), it is real text of
a useful size (about 13 MB of non-test modules), and byte-level modelling needs no tokenizer.

The split into training and held-out files is a fixed rule on each file's path relative to the stdlib root (a
hash, not a random draw), so every run and every machine of one Python version sees the same split, and a file
never moves between the two sides when files are added or removed elsewhere. Test modules (`test/`, `tests/`,
`idle_test/`, `test_*.py`) and installed packages (`site-packages`) are left out: the tests are mostly
generated-looking data, and site-packages differs between machines.
"""

from __future__ import annotations

import gzip
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HELD_OUT_PER_MILLE = 50  # 5% of the files, chosen by the hash of their relative path
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """The fixed split rule: the first 4 bytes of sha256(relative path), modulo 1000, below HELD_OUT_PER_MILLE."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELD_OUT_PER_MILLE


def corpus_files(root: Path | None = None) -> list[str]:
    """The non-test `.py` modules under the stdlib root, as sorted relative POSIX paths."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if any(part in _SKIP_DIRS for part in relative.parts[:-1]) or relative.name.startswith("test_"):
            continue
        if path.is_file():
            files.append(relative.as_posix())
    return sorted(files)


@dataclass(frozen=True)
class Corpus:
    """Training and held-out bytes (each the concatenation of its files, in path order)."""

    root: Path
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    train: torch.Tensor  # uint8 [N]
    held_out: torch.Tensor  # uint8 [M]

    def describe(self) -> dict[str, int]:
        return {"train_files": len(self.train_files), "train_bytes": int(self.train.numel()),
                "held_out_files": len(self.held_out_files), "held_out_bytes": int(self.held_out.numel())}


def _concatenate(root: Path, files: list[str]) -> torch.Tensor:
    data = b"".join((root / name).read_bytes() for name in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def load_corpus(root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    files = corpus_files(root)
    train = [f for f in files if not is_held_out(f)]
    held_out = [f for f in files if is_held_out(f)]
    if not train or not held_out:
        raise ValueError(f"the standard library at {root} has too few modules for a training/held-out split")
    return Corpus(root, tuple(train), tuple(held_out), _concatenate(root, train), _concatenate(root, held_out))


def gzip_bits_per_byte(data: torch.Tensor) -> float:
    """gzip -9's compressed size of `data`, in bits per input byte: the reference a byte model should beat."""
    raw = data.numpy().tobytes()
    return 8.0 * len(gzip.compress(raw, compresslevel=9)) / max(1, len(raw))


class WindowStream:
    """Random training windows of `seq_len + 1` bytes (inputs and next-byte targets), from a seeded generator."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if data.numel() <= seq_len + 1:
            raise ValueError(f"{data.numel()} bytes are too few for windows of {seq_len + 1}")
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        windows = torch.stack([self.data[s:s + self.seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]


def evaluation_windows(data: torch.Tensor, seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` windows spread evenly over the held-out bytes: the same bytes for every run, so figures compare."""
    last = data.numel() - seq_len - 1
    starts = torch.linspace(0, last, count).long().tolist()
    windows = torch.stack([data[s:s + seq_len + 1] for s in starts]).long()
    return windows[:, :-1], windows[:, 1:]
