"""`peer train --task lm`: a byte-level decoder-only transformer whose FFN blocks are served by the swarm.

The model: byte embedding + learned positions -> `layers` pre-norm blocks (causal self-attention, then a
mixture-of-experts FFN) -> a head tied to the embedding, over 256 byte values. Layer `i`'s FFN is a
`RemoteMixtureOfExperts` over the grid prefix `PREFIX.i` (every token is routed on its own), so the daemons
serve the family `PREFIX.[0:layers].[0:N]` with the `ffn` expert kind (e.g. `peer join --experts
'lm.[0:2].[0:4]'`); the trainer reads prefix, grid and hidden size from the swarm like the digits task does,
and the grid's first dimension is the number of layers. All layers share one blacklist, so a dead daemon found
by layer 0 costs layer 1 nothing.

The corpus is the Python standard library's source (`peer.corpus`): training windows are drawn at random from
the training files, the held-out figure is bits per byte (cross-entropy in bits) on fixed windows of the
held-out files, evaluated before training (`bpb_start`) and after (`bpb`). The run ends with a short sample
continuation of a held-out prompt (`sample`, also printed on stderr). `--local-experts` builds the identical
model with the experts in this process (each an `ffn` expert, trained at the daemons' learning rate).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Sequence

import torch
from torch import nn

from dht.client import SwarmHandle
from moe.errors import NotEnoughExperts
from moe.experts import make_expert
from moe.mixture import RemoteMixtureOfExperts
from peer.corpus import Corpus, WindowStream, evaluation_windows, load_corpus
from peer.p2p.wire import Compression
from peer.tasks import GridTask, LocalMixtureOfExperts, discover_swarm_experts, expert_settings, grid_uids, run_seed

LOCAL_DEFAULTS = {"hidden_dim": 64, "expert_prefix": "lm", "grid_size": "2x12"}
EVAL_WINDOWS = 128  # held-out windows of --seq-len bytes: 8192 predicted bytes at the default length
SAMPLE_PROMPT_BYTES = 48
SAMPLE_BYTES = 96
SAMPLE_TEMPERATURE = 0.7
START_ATTEMPTS = 20  # tries of the starting evaluation (about 15 s with the pauses)


def _heads(hidden_dim: int) -> int:
    for heads in (4, 2):
        if hidden_dim % heads == 0:
            return heads
    return 1


class Block(nn.Module):
    """Pre-norm transformer block; `ffn` maps [tokens, hidden] -> [tokens, hidden] (a mixture of experts)."""

    def __init__(self, hidden_dim: int, ffn: nn.Module):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden_dim)
        self.attn = nn.MultiheadAttention(hidden_dim, _heads(hidden_dim), batch_first=True)
        self.ln2 = nn.LayerNorm(hidden_dim)
        self.ffn = ffn

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        f = self.ln2(h)
        batch, length, width = f.shape
        out: torch.Tensor = h + self.ffn(f.reshape(batch * length, width)).reshape(batch, length, width)
        return out


class ByteLM(nn.Module):
    """Bytes [B, T] -> next-byte logits [B, T, 256]."""

    def __init__(self, hidden_dim: int, seq_len: int, ffns: Sequence[nn.Module]):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(256, hidden_dim)
        self.pos = nn.Embedding(seq_len, hidden_dim)
        self.blocks = nn.ModuleList(Block(hidden_dim, ffn) for ffn in ffns)
        self.ln_f = nn.LayerNorm(hidden_dim)
        # small embeddings: the head is tied to them, and unit-variance ones would start at ~50 bits per byte
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        if length > self.seq_len:
            raise ValueError(f"at most {self.seq_len} bytes of context, got {length}")
        h = self.embed(idx) + self.pos(torch.arange(length, device=idx.device))
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=idx.device), diagonal=1)
        for block in self.blocks:
            h = block(h, mask)
        logits: torch.Tensor = self.ln_f(h) @ self.embed.weight.t()  # tied head
        return logits

    def remote_mixtures(self) -> list[Any]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, RemoteMixtureOfExperts)]

    def local_expert_modules(self) -> nn.ModuleList:
        experts = nn.ModuleList()
        for block in self.blocks:
            if isinstance(block.ffn, LocalMixtureOfExperts):
                experts.extend(block.ffn.experts)
        return experts


def layer_grid(grid: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """(layers, per-layer grid) of an LM expert family grid such as (2, 12)."""
    if len(grid) < 2:
        raise ValueError(f"an LM expert grid is LAYERSxN (e.g. 2x12: lm.[0:2].[0:12]), got {'x'.join(map(str, grid))}")
    return grid[0], tuple(grid[1:])


def build_lm(args: argparse.Namespace, swarm: SwarmHandle | None) -> ByteLM:
    """The model of `args` (hidden size, prefix, grid, seq length); the same initial weights for every trainer
    of a run (seeded by the run id)."""
    hidden_dim, prefix, grid = expert_settings(args)
    layers, per_layer = layer_grid(grid)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run_seed(args.run_id))
        ffns: list[nn.Module] = []
        if swarm is None:
            uids = grid_uids(prefix, (layers, *per_layer))  # layer-major: layer i's grid is one contiguous run
            per = len(uids) // layers
            for layer in range(layers):
                experts = [make_expert(uid, "ffn", hidden_dim, seed=run_seed(uid)).module
                           for uid in uids[layer * per:(layer + 1) * per]]
                ffns.append(LocalMixtureOfExperts(hidden_dim, per_layer, experts, args.k_best))
        else:
            from moe.mixture import ExpertBlacklist, RemoteMixtureOfExperts

            blacklist = ExpertBlacklist()
            for layer in range(layers):
                ffns.append(RemoteMixtureOfExperts(
                    hidden_dim, per_layer, f"{prefix}.{layer}", k_best=args.k_best, k_min=1,
                    timeout_after_k_min=args.expert_grace, forward_timeout=args.expert_timeout,
                    backward_timeout=args.expert_timeout, swarm=swarm, blacklist=blacklist,
                    compression=Compression[args.expert_compression.upper()]))
        return ByteLM(hidden_dim, args.seq_len, ffns)


def bits_per_byte(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 32) -> tuple[float, float]:
    """(bits per byte, next-byte accuracy) of `model` on windows x -> y."""
    was_training = model.training
    model.train(False)
    total, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            logits = model(x[start:start + batch_size])
            target = y[start:start + batch_size]
            total += nn.functional.cross_entropy(logits.reshape(-1, 256), target.reshape(-1), reduction="sum").item()
            correct += int((logits.argmax(-1) == target).sum().item())
    model.train(was_training)
    return total / y.numel() / math.log(2), correct / y.numel()


def generate(model: ByteLM, prompt: bytes, length: int, *, temperature: float = SAMPLE_TEMPERATURE,
             seed: int = 0) -> bytes:
    """Sample `length` bytes after `prompt` (the last `seq_len` bytes are the context), from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    context = list(prompt)
    was_training = model.training
    model.train(False)
    with torch.no_grad():
        for _ in range(length):
            idx = torch.tensor([context[-model.seq_len:]], dtype=torch.long)
            logits = model(idx)[0, -1] / max(temperature, 1e-6)
            context.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).item()))
    model.train(was_training)
    return bytes(context[len(prompt):])


def _printable(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class LMTask(GridTask):
    """The `--task lm` hooks `peer.train.run_training` calls (see `peer.train.DigitsTask` for the other task)."""

    name = "lm"
    local_defaults = LOCAL_DEFAULTS

    def __init__(self, args: argparse.Namespace):
        self.corpus: Corpus = load_corpus()
        self.eval_x, self.eval_y = evaluation_windows(self.corpus.held_out, args.seq_len, EVAL_WINDOWS)
        self.bpb_start: float | None = None

    def discover(self, args: argparse.Namespace, swarm: SwarmHandle) -> argparse.Namespace:
        """Prefix, grid and hidden size from the swarm (the `lm` family unless --expert-prefix names another)."""
        wanted = argparse.Namespace(**vars(args))
        if wanted.expert_prefix is None:
            wanted.expert_prefix = LOCAL_DEFAULTS["expert_prefix"]
        return discover_swarm_experts(wanted, swarm)

    def batches(self, args: argparse.Namespace) -> WindowStream:
        return WindowStream(self.corpus.train, args.seq_len, args.batch_size, seed=args.seed)

    def build_model(self, args: argparse.Namespace, swarm: SwarmHandle | None) -> ByteLM:
        return build_lm(args, swarm)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        return loss, float((logits.argmax(-1) == y).float().mean().item())

    def before_training(self, model: nn.Module) -> None:
        """The starting held-out figure. On a swarm whose experts are still being declared (daemons starting up)
        it is tried again for a bounded time, then left out rather than holding the run back."""
        for attempt in range(START_ATTEMPTS):
            try:
                self.bpb_start, _ = bits_per_byte(model, self.eval_x, self.eval_y)
                return
            except NotEnoughExperts:
                time.sleep(min(1.0, 0.05 * 2 ** attempt))

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        """Held-out figures (raises NotEnoughExperts when the swarm is gone)."""
        bpb, accuracy = bits_per_byte(model, self.eval_x, self.eval_y)
        return {"accuracy": accuracy, "loss": bpb * math.log(2), "bpb": bpb, "bpb_start": self.bpb_start}

    def finish(self, model: nn.Module) -> dict[str, Any]:
        """The sample continuation of a held-out prompt (printed on stderr for people, returned for the result)."""
        assert isinstance(model, ByteLM)
        held_out = self.corpus.held_out
        start = held_out.numel() // 3
        prompt = held_out[start:start + SAMPLE_PROMPT_BYTES].numpy().tobytes()
        sample = generate(model, prompt, SAMPLE_BYTES)
        print(f"peer train: sample continuation of a held-out prompt:\n--- prompt ---\n{_printable(prompt)}\n"
              f"--- continuation ---\n{_printable(sample)}\n---", file=sys.stderr, flush=True)
        return {"prompt": _printable(prompt), "sample": _printable(sample), **self.corpus.describe()}
