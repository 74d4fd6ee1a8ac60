"""DiLoCo's outer state and how local parameters relate to it: outer parameters, outer optimizer, pseudo-gradient
buffers, error feedback, and the fragments of Streaming DiLoCo.

Why its own object: this is what every member of a round must hold bit-identically (and what a trainer that
catches up downloads), and the arithmetic between it and the trainer's local parameters has to be exact in
every mode (blocking or overlapped, one fragment or several). Keeping it apart from the rounds (`averaging.
rounds`) and from the training-thread driver (`averaging.diloco`) lets each be read on its own.

Fragments (Streaming DiLoCo, Douillard et al. 2025): the parameters are split into F contiguous fragments of
about equal size; outer round r synchronises fragment r mod F only, so each round sends 1/F of the bytes and a
fragment is synchronised every F rounds. With F = 1 this is plain DiLoCo.

Overlap (one round delayed): for each fragment, local = outer - pending - fresh, where `pending` is the
contribution in flight (not applied yet) and `fresh` the progress not contributed yet. `anchor` is where the
local parameters stand when `fresh` is zero (outer - pending), so `fresh = anchor - local` at any time:
- at the end of a phase, the fragment due contributes `fresh` (it becomes `pending`; anchor <- local);
- once its round is applied, the fragment is rebased onto the new outer parameters: local <- outer - fresh,
  anchor <- outer (pending is now inside the outer parameters).
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from averaging.collaborative import initialize_optimizer_state, state_tensors
from averaging.state_hash import state_digest
from peer.p2p import wire

__all__ = ["ErrorFeedback", "OuterState", "nesterov_sgd", "split_fragments"]


def nesterov_sgd(params: list[torch.Tensor], lr: float = 0.7, momentum: float = 0.9) -> torch.optim.Optimizer:
    """The default outer optimizer of DiLoCo; with `momentum` 0, plain SGD (SparseLoCo's outer step, where the
    error feedback accumulates what momentum would)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


def default_outer(compression: wire.Compression) -> tuple[float, float]:
    """(learning rate, momentum) of the default outer SGD for `compression`. Dense codecs: DiLoCo's Nesterov (0.7,
    0.9). Top-k codecs: SparseLoCo's plain step (1.0, 0.0), since the error feedback already carries 98% of each
    round forward as a momentum would, and Nesterov on top of it overshoots: on the digits task with 4 trainers
    and 12 outer steps, top-k + 2 bits reached 0.68-0.78 held-out accuracy with Nesterov against 0.91 this way
    (dense int8: 0.81-0.91)."""
    if wire.Compression(compression) in (wire.Compression.TOPK2, wire.Compression.TOPK8):
        return 1.0, 0.0
    return 0.7, 0.9


class ErrorFeedback:
    """Compress with `compression`, remembering what was lost so the next round sends it (error feedback).

    `compress(x)` returns what the receivers decode from `x + residual` and keeps the new residual. Since every
    round sends the residual of the one before, the sum of what was sent over n rounds differs from the sum of
    the inputs by exactly the last residual: for INT8 at most max|block| / 127 per element (the codec's bound,
    on the last round's input), independent of n. `indices` restricts a round to some tensors (a fragment)."""

    def __init__(self, tensors: list[torch.Tensor], compression: wire.Compression, enabled: bool = True):
        self.compression = wire.Compression(compression)
        self.enabled = enabled and self.compression != wire.Compression.NONE
        self.residuals = [torch.zeros_like(t) for t in tensors] if self.enabled else []
        self._pending: dict[int, torch.Tensor] = {}

    def compress(self, values: list[torch.Tensor], indices: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Replace `values[i]` (i in `indices`, default all) in place by what the codec delivers; the residual is
        kept until `commit()`."""
        if self.compression == wire.Compression.NONE:
            return values
        self._pending = {}
        for index in range(len(values)) if indices is None else indices:
            value = values[index]
            if self.enabled:
                value.add_(self.residuals[index])
            sent = wire.roundtrip(value, self.compression)
            if self.enabled:
                self._pending[index] = value - sent
            value.copy_(sent)
        return values

    def commit(self) -> None:
        """The compressed values were applied: their loss is what the next round adds."""
        for index, pending in self._pending.items():
            self.residuals[index].copy_(pending)
        self._pending = {}


def split_fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Tensor indices cut into `count` contiguous fragments of about equal total size (each holds at least one
    tensor, so there are fewer fragments when there are fewer tensors)."""
    count = max(1, min(count, len(sizes)))
    total = sum(sizes)
    fragments: list[list[int]] = [[]]
    seen = 0
    for index, size in enumerate(sizes):
        fragments_left = count - len(fragments)
        full = seen >= len(fragments) * total / count
        if fragments[-1] and fragments_left > 0 and (full or len(sizes) - index <= fragments_left):
            fragments.append([])
        fragments[-1].append(index)
        seen += size
    return fragments


class OuterState:
    """Outer parameters and optimizer state over `params` (the local parameters), with `pseudo` buffers that
    the all-reduce averages in place. `step` counts applied rounds; `hash` is `state_digest(tensors)`.

    Writes to the outer state happen under `lock` (the state server snapshots under it)."""

    def __init__(self, params: list[torch.Tensor],
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 compression: wire.Compression = wire.Compression.NONE, error_feedback: bool = True,
                 fragments: int = 1, scale: float = 1.0, lock: threading.Lock | None = None):
        self.params = params
        self.outer_params = [p.detach().clone() for p in params]
        self.optimizer = make_optimizer(self.outer_params)
        initialize_optimizer_state(self.optimizer)
        self.tensors = [t for _, t in state_tensors(self.optimizer)]  # what trainers that catch up download
        self.pseudo = [torch.zeros_like(p) for p in params]
        self.anchor = [p.detach().clone() for p in params]
        self.feedback = ErrorFeedback(self.pseudo, compression, error_feedback)
        self.fragments = split_fragments([p.numel() for p in params], fragments)
        self.scale = scale
        self.lock = lock or threading.Lock()
        self.step = 0
        self.hash = state_digest(self.tensors)
        self._stale: set[int] = set()  # fragments whose outer parameters moved since their last rebase (overlap)
        self._pending: dict[int, torch.Tensor] = {}  # overlap: the progress of the contribution in flight

    def fragment(self, step: int) -> list[int]:
        """The tensor indices round `step` synchronises."""
        return self.fragments[step % len(self.fragments)]

    # ------------------------------------------------------------------------------------------ contributions

    def from_outer(self, indices: Sequence[int]) -> None:
        """Blocking mode: pseudo = (outer - local) x scale on `indices`, compressed."""
        with torch.no_grad():
            for index in indices:
                self.pseudo[index].copy_(self.outer_params[index]).sub_(self.params[index].detach())
                self.pseudo[index].mul_(self.scale)
            self.feedback.compress(self.pseudo, indices)

    def from_progress(self, indices: Sequence[int]) -> None:
        """Overlap: first rebase the fragments whose rounds were applied, then pseudo = fresh progress x scale on
        `indices` (compressed), which becomes their pending contribution."""
        with torch.no_grad():
            self.rebase()
            self._pending = {}
            for index in indices:
                fresh = self.anchor[index] - self.params[index].detach()
                self.pseudo[index].copy_(fresh).mul_(self.scale)
                self.anchor[index].copy_(self.params[index].detach())
                self._pending[index] = fresh
            self.feedback.compress(self.pseudo, indices)

    def unapplied(self) -> None:
        """Overlap: the last contribution was not applied (its round was lost or skipped): its progress is fresh
        again, so the fragment's next contribution carries it (no work is lost)."""
        with torch.no_grad():
            for index, fresh in self._pending.items():
                self.anchor[index].add_(fresh)
        self._pending = {}

    def rebase(self, indices: Sequence[int] | None = None) -> None:
        """Overlap: local <- outer - fresh, anchor <- outer, on the fragments applied since their last rebase (or
        on `indices`)."""
        chosen = sorted(self._stale) if indices is None else list(indices)
        with torch.no_grad():
            for index in chosen:
                fresh = self.anchor[index] - self.params[index].detach()
                self.params[index].copy_(self.outer_params[index]).sub_(fresh)
                self.anchor[index].copy_(self.outer_params[index])
        self._stale.difference_update(chosen)

    def reset_local(self, indices: Sequence[int] | None = None) -> None:
        """Local <- outer (and anchor) on `indices` (default: everything): nothing fresh or pending is left."""
        chosen = range(len(self.params)) if indices is None else indices
        with torch.no_grad():
            for index in chosen:
                self.params[index].copy_(self.outer_params[index])
                self.anchor[index].copy_(self.outer_params[index])
                self._stale.discard(index)

    # ------------------------------------------------------------------------------------------ outer updates

    def apply(self, indices: Sequence[int]) -> None:
        """The outer optimizer steps on the averaged pseudo-gradient of `indices` (the others keep their values
        and their momentum); the step counter and the hash move on."""
        with self.lock, torch.no_grad():
            chosen = set(indices)
            for index, (outer, pseudo) in enumerate(zip(self.outer_params, self.pseudo)):
                outer.grad = pseudo.clone() if index in chosen else None
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.hash = state_digest(self.tensors)
        self.feedback.commit()
        self._stale.update(chosen)
        self._pending = {}

    def counted(self) -> None:
        """The last contribution was averaged into a round whose result I download rather than apply (I took part
        from an older outer state): what the codec dropped is carried forward and its progress is spent, as after
        `apply`, but no outer parameter moves here."""
        self.feedback.commit()
        self._pending = {}

    def replace(self, tensors: Sequence[torch.Tensor], step: int, hash_: str) -> None:
        """A downloaded outer state (already verified against `hash_`); every fragment must be rebased."""
        with self.lock:
            for target, source in zip(self.tensors, tensors):
                target.copy_(source)
            self.step = step
            self.hash = hash_
        self._stale.update(range(len(self.params)))
