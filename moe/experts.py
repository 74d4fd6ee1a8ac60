"""Experts: torch modules with their own optimizer and LR schedule, built from named kinds.

A server operator names a kind (`ffn`, `transformer`, or a custom one as an import path "package.module:factory")
and a hidden size; `make_expert` builds the module, its schema, optimizer and schedule. `Expert.forward` and
`Expert.backward` are the two synchronous operations the runtime runs on whole batches in worker threads:
forward without autograd state, and backward by recomputing the forward with autograd, then applying one optimizer
step: the expert learns from every backward batch it serves.

`Expert.forward_keeping` is the forward of a caller that will come back for the backward: it records the autograd
graph and returns it as a `KeptForward`, which `backward(..., kept=)` uses instead of recomputing the forward (a
third of a small expert's training compute). A kept graph is only valid while the weights it saw are unchanged:
once the expert has taken an optimizer step since (another caller's backward), the backward recomputes, exactly
as without it. Who holds kept graphs, and for how long, is `moe.kept`'s business.
"""

from __future__ import annotations

import copy
import importlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.optim.adam import adam as functional_adam
from torch.optim.lr_scheduler import LambdaLR

from moe.schema import SchemaError, TensorSpec, dtype_name, specs_to_wire

ModuleFactory = Callable[..., nn.Module]  # (hidden_dim, **options) -> nn.Module
SpecsFactory = Callable[..., list[TensorSpec]]  # (hidden_dim, **options) -> specs


class UnknownExpertKind(LookupError):
    """The kind name is neither registered nor an importable "package.module:factory" path."""


@dataclass(frozen=True)
class ExpertKind:
    """How to build one kind of expert.

    `inputs` gives the input schema; `outputs` may be None, in which case it is inferred by running the built
    module once on a zero batch (convenient for custom kinds, whose outputs follow from their inputs).
    `inner_width`: `build` takes `inner=N`, so `NAME@N` names this kind with inner width N (the FFN blocks
    `moe.swarmify` replaces); other kinds refuse `@N` rather than ignore it.
    """

    name: str
    build: ModuleFactory
    inputs: SpecsFactory
    outputs: SpecsFactory | None = None
    inner_width: bool = False


# ------------------------------------------------------------------------------------------------ built-in kinds


class FeedForward(nn.Module):
    """Linear(h, 4h) -> GELU -> Linear(4h, h): the position-wise block of a transformer."""

    def __init__(self, hidden_dim: int, expansion: int = 4):
        super().__init__()
        self.up = nn.Linear(hidden_dim, expansion * hidden_dim)
        self.down = nn.Linear(expansion * hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(nn.functional.gelu(self.up(x)))
        return out


class DeepFeedForward(nn.Sequential):
    """Linear(h,4h)-LN-ReLU-Linear(4h,4h)-LN-ReLU-Linear(4h,h): the same layer stack as hivemind's `ffn` expert,
    so benchmarks against hivemind compare equal amounts of compute."""

    def __init__(self, hidden_dim: int):
        wide = 4 * hidden_dim
        super().__init__(
            nn.Linear(hidden_dim, wide), nn.LayerNorm(wide), nn.ReLU(),
            nn.Linear(wide, wide), nn.LayerNorm(wide), nn.ReLU(),
            nn.Linear(wide, hidden_dim),
        )


class DenseFFN(nn.Module):
    """Linear(h, inner) -> activation -> Linear(inner, h): the FFN block of torch's transformer layers (relu or
    exact gelu) and of GPT-2 (tanh-approximated gelu); `moe.swarmify` copies a dense block's weights into it."""

    ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "relu": nn.functional.relu,
        "gelu": nn.functional.gelu,
        "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    }

    def __init__(self, hidden_dim: int, inner: int | None = None, activation: str = "relu"):
        super().__init__()
        self.activation = activation
        self.up = nn.Linear(hidden_dim, inner or 4 * hidden_dim)
        self.down = nn.Linear(inner or 4 * hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.ACTIVATIONS[self.activation](self.up(x)))
        return out


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) without biases: LLaMA's MLP block."""

    def __init__(self, hidden_dim: int, inner: int | None = None):
        super().__init__()
        width = inner or 4 * hidden_dim
        self.gate = nn.Linear(hidden_dim, width, bias=False)
        self.up = nn.Linear(hidden_dim, width, bias=False)
        self.down = nn.Linear(width, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        return out


def _default_heads(hidden_dim: int) -> int:
    for heads in (max(1, hidden_dim // 64), 8, 4, 2):
        if hidden_dim % heads == 0:
            return heads
    return 1


def _build_transformer(hidden_dim: int, *, seq_len: int = 16, heads: int | None = None, **_: Any) -> nn.Module:
    # dropout 0: the server recomputes the forward for backward, and random masks would make that recomputation
    # differ from the forward the caller saw
    return nn.TransformerEncoderLayer(
        d_model=hidden_dim,
        nhead=heads or _default_heads(hidden_dim),
        dim_feedforward=4 * hidden_dim,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=True,
    )


def _vector_specs(hidden_dim: int, **_: Any) -> list[TensorSpec]:
    return [TensorSpec((hidden_dim,), torch.float32)]


def _sequence_specs(hidden_dim: int, *, seq_len: int = 16, **_: Any) -> list[TensorSpec]:
    return [TensorSpec((seq_len, hidden_dim), torch.float32)]


_REGISTRY: dict[str, ExpertKind] = {}
_REGISTRY_LOCK = threading.Lock()


def register_expert_kind(kind: ExpertKind, *, replace: bool = False) -> None:
    with _REGISTRY_LOCK:
        if kind.name in _REGISTRY and not replace:
            raise ValueError(f"expert kind {kind.name!r} is already registered")
        _REGISTRY[kind.name] = kind


def registered_kinds() -> list[str]:
    return sorted(_REGISTRY)


register_expert_kind(ExpertKind("ffn", lambda h, **o: FeedForward(h), _vector_specs, _vector_specs))
register_expert_kind(ExpertKind("deep_ffn", lambda h, **o: DeepFeedForward(h), _vector_specs, _vector_specs))
register_expert_kind(ExpertKind("transformer", _build_transformer, _sequence_specs, _sequence_specs))
# the FFN blocks `moe.swarmify` replaces; `KIND@N` sets the inner width (default 4 x hidden), e.g. relu_ffn@2048
register_expert_kind(ExpertKind("relu_ffn", lambda h, inner=None, **o: DenseFFN(h, inner, "relu"),
                                _vector_specs, _vector_specs, inner_width=True))
register_expert_kind(ExpertKind("gelu_ffn", lambda h, inner=None, **o: DenseFFN(h, inner, "gelu"),
                                _vector_specs, _vector_specs, inner_width=True))
register_expert_kind(ExpertKind("gpt2_ffn", lambda h, inner=None, **o: DenseFFN(h, inner, "gelu_tanh"),
                                _vector_specs, _vector_specs, inner_width=True))
register_expert_kind(ExpertKind("swiglu", lambda h, inner=None, **o: SwiGLU(h, inner), _vector_specs, _vector_specs,
                                inner_width=True))


def get_expert_kind(name: str) -> ExpertKind:
    """A registered kind, or a custom one given as "package.module:attribute".

    The attribute is either an `ExpertKind` or a plain factory `(hidden_dim, **options) -> nn.Module`, which then
    takes one float32 input of shape (batch, hidden_dim) and has its outputs inferred.
    """
    kind = _REGISTRY.get(name)
    if kind is not None:
        return kind
    base_name, at, width = name.partition("@")
    if at and ":" not in name:  # KIND@N: a registered kind with inner width N
        base = _REGISTRY.get(base_name)
        if base is None or not base.inner_width or not width.isdigit() or int(width) < 1:
            widths = ", ".join(k for k in registered_kinds() if _REGISTRY[k].inner_width)
            raise UnknownExpertKind(f"unknown expert kind {name!r} (KIND@N takes a kind with an inner width "
                                    f"({widths}) and a positive width N)")
        build = base.build
        kind = ExpertKind(name, lambda h, **o: build(h, inner=int(width), **o), base.inputs, base.outputs)
        with _REGISTRY_LOCK:
            return _REGISTRY.setdefault(name, kind)
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise UnknownExpertKind(f"unknown expert kind {name!r} (registered: {', '.join(registered_kinds())})")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise UnknownExpertKind(f"cannot import expert kind {name!r}: {error}") from error
    if isinstance(target, ExpertKind):
        kind = ExpertKind(name, target.build, target.inputs, target.outputs)
    elif callable(target):
        kind = ExpertKind(name, target, _vector_specs, None)
    else:
        raise UnknownExpertKind(f"{name!r} is neither an ExpertKind nor a callable")
    with _REGISTRY_LOCK:
        return _REGISTRY.setdefault(name, kind)


# ------------------------------------------------------------------------------------------------ optimization


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and LR schedule each expert gets: linear warmup over `warmup_steps`, then constant, or a
    linear decay to zero at `total_steps` when it is set."""

    name: str = "adam"  # sgd | adam | adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    total_steps: int | None = None
    clip_grad_norm: float | None = None
    # fused kernels: one pass over all parameters, ~10x faster than the default on CPU for a small expert, which
    # matters because every backward request pays for a step. None: use them where torch supports them.
    fused: bool | None = None

    def build(self, parameters: Iterable[nn.Parameter]) -> tuple[torch.optim.Optimizer, LambdaLR]:
        params = list(parameters)
        name = self.name.lower()
        fused = self.fused
        if fused is None:
            fused = bool(params) and all(
                p.device.type in ("cpu", "cuda") and p.dtype in _FUSED_DTYPES for p in params
            )
        common: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if fused:
            common["fused"] = True
        if name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(params, momentum=self.momentum, **common)
        elif name == "adam":
            optimizer = torch.optim.Adam(params, betas=self.betas, **common)
        elif name == "adamw":
            optimizer = torch.optim.AdamW(params, betas=self.betas, **common)
        else:
            raise ValueError(f"unknown optimizer {self.name!r} (sgd, adam, adamw)")
        return optimizer, LambdaLR(optimizer, self.lr_factor)

    def lr_factor(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is not None:
            span = max(1, self.total_steps - self.warmup_steps)
            return max(0.0, 1.0 - (step - self.warmup_steps) / span)
        return 1.0


# ------------------------------------------------------------------------------------------------ experts


@dataclass
class Expert:
    """One served expert. Not thread-safe: the runtime runs at most one batch of an expert at a time."""

    uid: str
    kind: str
    hidden_dim: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    options: dict[str, Any] = field(default_factory=dict)
    clip_grad_norm: float | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    steps: int = 0  # optimizer steps applied (one per backward batch)
    skipped_steps: int = 0  # backward batches whose gradients were not finite (no step taken)
    clipped_steps: int = 0  # steps whose gradients were scaled down to clip_grad_norm

    def info(self, max_batch_size: int) -> dict[str, Any]:
        """The `moe.info` reply: what a caller needs to build inputs and expect outputs."""
        return {
            "uid": self.uid,
            "kind": self.kind,
            "hidden_dim": self.hidden_dim,
            "max_batch_size": max_batch_size,
            "inputs": specs_to_wire(self.inputs),
            "outputs": specs_to_wire(self.outputs),
        }

    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.inference_mode():
            outputs = self.module(*(x.to(self.device, non_blocking=True) for x in inputs))
            return [y.to("cpu").contiguous() for y in _as_list(outputs)]

    def forward_keeping(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], "KeptForward"]:
        """The forward with its autograd graph kept for the backward (see the module doc): the outputs, equal to
        `forward`'s, and the graph, whose `nbytes` counts the activations it holds."""
        saved = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if not isinstance(tensor, nn.Parameter):  # the weights are held anyway
                saved[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            leaves, outputs = self._forward_graph(inputs)
        replies = [y.detach().to("cpu").contiguous() for y in outputs]
        rows = int(inputs[0].shape[0]) if inputs and inputs[0].ndim else 0
        return replies, KeptForward(leaves, outputs, self.steps, rows, saved[0])

    def backward(self, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                 kept: "KeptForward | None" = None) -> list[torch.Tensor]:
        """Gradients w.r.t. the inputs of the forward, the `kept` one when it is still valid (`KeptForward.take`),
        else recomputed here; then one optimizer step on the expert."""
        leaves, outputs = self._graph(inputs, kept)
        with torch.enable_grad():
            torch.autograd.backward(outputs, [g.to(self.device) for g in grad_outputs])
        grad_inputs = self._grad_inputs(leaves)
        if self._gradients_finite():
            self.optimizer.step()
            self._stepped()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_inputs

    @staticmethod
    def backward_many(
        experts: Sequence["Expert"], requests: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
        kept: Sequence["KeptForward | None"] | None = None,
    ) -> list[list[torch.Tensor] | Exception]:
        """`backward` of several distinct experts (one batch each, `(inputs, grad_outputs)`), with the same
        gradients, steps and skips as calling `backward` on each, but one autograd pass over all of them and one
        fused optimizer kernel per group of experts with equal Adam settings. Returns each expert's input
        gradients, or the exception its own computation raised (the others are unaffected).

        Why: a daemon serving many small experts gets one backward call carrying several of them per trainer
        step; per expert, the autograd engine's start-up and the optimizer's Python wrapper cost more than the
        arithmetic (hidden 64: 6 experts 2.9 ms one by one, about 2 ms together)."""
        outcomes: list[list[torch.Tensor] | Exception | None] = [None] * len(experts)
        live: list[int] = []
        recomputed: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for index, (expert, (inputs, grad_outputs)) in enumerate(zip(experts, requests)):
            try:
                leaves, expert_outputs = expert._graph(inputs, kept[index] if kept is not None else None)
                expert_grads = [g.to(expert.device) for g in grad_outputs]
                if len(expert_grads) != len(expert_outputs) or any(
                        g.shape != y.shape for g, y in zip(expert_grads, expert_outputs)):
                    raise ValueError(f"{len(expert_grads)} gradients of shapes {[tuple(g.shape) for g in expert_grads]}"
                                     f" for outputs of shapes {[tuple(y.shape) for y in expert_outputs]}")
            except Exception as error:  # that expert's module failed: its request alone
                outcomes[index] = error
                continue
            live.append(index)
            recomputed[index] = (leaves, expert_outputs)
            outputs.extend(expert_outputs)
            grads.extend(expert_grads)
        try:
            with torch.enable_grad():
                torch.autograd.backward(outputs, grads)
        except Exception:  # some expert's graph failed: drop the partial gradients, find out whose one by one
            for index in live:
                experts[index].optimizer.zero_grad(set_to_none=True)
            for index in live:
                try:
                    outcomes[index] = experts[index].backward(*requests[index])
                except Exception as error:
                    outcomes[index] = error
            return [outcome if outcome is not None else RuntimeError("no outcome") for outcome in outcomes]
        for index in live:
            outcomes[index] = experts[index]._grad_inputs(recomputed[index][0])
        Expert._step_many([experts[index] for index in live], outcomes, live)
        return [outcome if outcome is not None else RuntimeError("no outcome") for outcome in outcomes]

    @staticmethod
    def _step_many(experts: Sequence["Expert"], outcomes: list[Any], positions: Sequence[int]) -> None:
        """The optimizer steps of `backward_many`: skip experts whose gradients are not finite and clip the others'
        (one fused norm pass over all of them), then one fused kernel per group of experts whose fused Adam(W)
        settings agree (elementwise per tensor, so the same values as stepping each), `optimizer.step` for the
        rest. An expert whose step raised gets that error as its outcome."""
        grads = [[p.grad for p in e.module.parameters() if p.grad is not None] for e in experts]
        norms = Expert._gradient_norms(grads)
        stepping: list[tuple[int, Expert]] = []
        for position, expert, expert_grads, norm in zip(positions, experts, grads, norms):
            if expert._bounded(expert_grads, norm):
                stepping.append((position, expert))
            else:
                expert.skipped_steps += 1
        groups: dict[Any, list[tuple[int, Expert]]] = {}
        for position, expert in stepping:
            key = expert._fused_adam_key()
            if key is None:
                groups[("alone", position)] = [(position, expert)]
            else:
                groups.setdefault(key, []).append((position, expert))
        for key, members in groups.items():
            try:
                if key[0] == "alone" or len(members) == 1:
                    for _, expert in members:
                        expert.optimizer.step()
                else:
                    Expert._fused_adam_step([expert for _, expert in members])
                for _, expert in members:
                    expert._stepped()
            except Exception as error:  # the optimizer itself failed: those experts' requests
                for position, _ in members:
                    outcomes[position] = error
        for expert in experts:
            expert.optimizer.zero_grad(set_to_none=True)

    def _graph(self, inputs: Sequence[torch.Tensor], kept: "KeptForward | None"
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The graph to backpropagate through: the kept forward's when it is still valid, else recomputed."""
        graph = kept.take(self.steps, inputs) if kept is not None else None
        return graph if graph is not None else self._recompute(inputs)

    def _recompute(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The backward's recomputation of the forward (no graph kept, or a stale one)."""
        return self._forward_graph(inputs)

    def _forward_graph(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forward with autograd: the input leaves and the outputs to backpropagate from."""
        with torch.enable_grad():
            leaves = [x.to(self.device).detach().requires_grad_(x.is_floating_point()) for x in inputs]
            return leaves, _as_list(self.module(*leaves))

    @staticmethod
    def _grad_inputs(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).detach().to("cpu").contiguous()
                for leaf in leaves]

    def _gradients_finite(self) -> bool:
        """Whether this batch's parameter gradients are finite, clipping them to `clip_grad_norm` when configured
        (see `_bounded`)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return self._bounded(grads, Expert._gradient_norms([grads])[0])

    @staticmethod
    def _gradient_norms(grads: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        """The global L2 norm of each list of gradients: one fused norm pass over all of them, one sync."""
        flat = [g for group in grads for g in group]
        if not flat:
            return [0.0] * len(grads)
        # float64 for the squares summed over tensors: per-tensor norms near float32's range must clip, not overflow
        squares = torch.stack([n.double() for n in torch._foreach_norm(flat)]) ** 2
        sums = torch.stack([part.sum() for part in torch.split(squares, [len(group) for group in grads])])
        return [float(value) for value in sums.sqrt().tolist()]

    def _bounded(self, grads: Sequence[torch.Tensor], norm: float) -> bool:
        """Whether the step may be taken: the gradients are finite (finite inputs can still overflow into inf/NaN
        gradients; one such step would ruin the expert for every caller, so it is skipped), and, with
        `clip_grad_norm`, they are scaled down to that norm when above it: whatever a caller sends, one step
        moves the expert by at most what a gradient of that norm would. Scaling only when above the bound costs
        nothing in the usual case (`clip_grad_norm_` rescales every gradient every time, ~10x the norm's cost
        for a small expert); the values are those of `clip_grad_norm_`."""
        if not math.isfinite(norm):
            return False
        if self.clip_grad_norm is not None and norm > self.clip_grad_norm:
            torch._foreach_mul_(list(grads), self.clip_grad_norm / (norm + 1e-6))
            self.clipped_steps += 1
        return True

    def _stepped(self) -> None:
        self.scheduler.step()
        self.steps += 1

    def _fused_adam_key(self) -> tuple[Any, ...] | None:
        """What must agree for several experts' steps to be one fused Adam(W) kernel call, or None when this
        optimizer's `step` does more than that kernel (other optimizers, hooks, amsgrad, a first step that still
        has to create the state...)."""
        optimizer = self.optimizer
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or len(optimizer.param_groups) != 1:
            return None
        if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None)
                is not None or torch_optimizer._global_optimizer_pre_hooks
                or torch_optimizer._global_optimizer_post_hooks):
            return None
        group = optimizer.param_groups[0]
        if (not group.get("fused") or group.get("amsgrad") or group.get("maximize") or group.get("capturable")
                or group.get("differentiable") or isinstance(group["lr"], torch.Tensor)
                or any(isinstance(beta, torch.Tensor) for beta in group["betas"])):
            return None
        for p in group["params"]:
            state = optimizer.state.get(p)
            if p.grad is None or p.is_complex() or not state or "step" not in state:
                return None
        return ("adam", group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"],
                bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)))

    @staticmethod
    def _fused_adam_step(experts: Sequence["Expert"]) -> None:
        """One `torch.optim.adam.adam(fused=True)` call over the parameters of experts sharing a `_fused_adam_key`:
        what each one's `Adam.step` would do, with the lists concatenated."""
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        for expert in experts:
            optimizer = expert.optimizer
            for p in optimizer.param_groups[0]["params"]:
                state = optimizer.state[p]
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
        group = experts[0].optimizer.param_groups[0]
        with torch.no_grad():
            functional_adam(
                params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None, capturable=False,
                differentiable=False, fused=True, grad_scale=None, found_inf=None, has_complex=False,
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay",
                                                      type(experts[0].optimizer) is torch.optim.AdamW)),
                amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def state_dict(self) -> dict[str, Any]:
        """Everything a restarted server needs to continue where this one stopped (weights_only-loadable).

        A deep copy: the caller may write it to disk while the expert keeps training."""
        return copy.deepcopy({
            "uid": self.uid,
            "kind": self.kind,
            "hidden_dim": self.hidden_dim,
            "steps": self.steps,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        })

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind or state.get("hidden_dim") != self.hidden_dim:
            raise ValueError(
                f"checkpoint of {state.get('uid')!r} is a {state.get('kind')!r} expert with hidden_dim "
                f"{state.get('hidden_dim')}, not {self.kind!r} with {self.hidden_dim}"
            )
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state.get("steps", 0))


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class KeptForward:
    """A forward's autograd graph, kept for its backward (`Expert.forward_keeping`). Used at most once: `take`
    hands the graph over and drops this object's references, so the activations are freed with the backward;
    `release` drops them without a backward (the caller never came back). `nbytes` counts the activations
    (tensors saved for the backward, the weights excluded) and the outputs."""

    __slots__ = ("leaves", "outputs", "steps", "rows", "nbytes")

    def __init__(self, leaves: list[torch.Tensor], outputs: list[torch.Tensor], steps: int, rows: int,
                 saved_nbytes: int):
        self.leaves: list[torch.Tensor] | None = leaves
        self.outputs: list[torch.Tensor] | None = outputs
        self.steps = steps
        self.rows = rows
        self.nbytes = saved_nbytes + sum(y.numel() * y.element_size() for y in outputs)

    def take(self, steps: int, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The graph, if the expert has not stepped since (`steps` unchanged: the weights it saved are the ones the
        backward would recompute with) and it covers as many rows as `inputs`; None otherwise. Released either way."""
        leaves, outputs = self.leaves, self.outputs
        self.release()
        if leaves is None or outputs is None or steps != self.steps:
            return None
        if not inputs or inputs[0].ndim == 0 or int(inputs[0].shape[0]) != self.rows:
            return None
        return leaves, outputs

    def release(self) -> None:
        self.leaves = self.outputs = None

    @property
    def held(self) -> bool:
        return self.outputs is not None


def _as_list(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)) and all(isinstance(y, torch.Tensor) for y in outputs):
        return list(outputs)
    raise TypeError(f"an expert must return a tensor or a tuple of tensors, got {type(outputs).__name__}")


def make_expert(
    uid: str,
    kind: str,
    hidden_dim: int,
    *,
    optimizer: OptimizerConfig = OptimizerConfig(),
    options: Mapping[str, Any] | None = None,
    seed: int | None = None,
    device: str | torch.device = "cpu",
) -> Expert:
    """Build an expert; `seed` makes its initial weights reproducible without touching the global RNG."""
    if hidden_dim < 1:
        raise ValueError(f"hidden_dim must be positive, got {hidden_dim}")
    spec = get_expert_kind(kind)
    opts = dict(options or {})
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        module = spec.build(hidden_dim, **opts)
    if not isinstance(module, nn.Module):
        raise TypeError(f"expert kind {kind!r} built a {type(module).__name__}, not an nn.Module")
    module.to(device)
    inputs = list(spec.inputs(hidden_dim, **opts))
    if spec.outputs is not None:
        outputs = list(spec.outputs(hidden_dim, **opts))
    else:
        with torch.inference_mode():
            sample = _as_list(module(*(s.empty(2, device) for s in inputs)))
        outputs = [TensorSpec(tuple(y.shape[1:]), y.dtype) for y in sample]
    for tensor_spec in (*inputs, *outputs):
        dtype_name(tensor_spec.dtype)  # raises SchemaError for dtypes the wire cannot describe
    opt, scheduler = optimizer.build(module.parameters())
    return Expert(
        uid=uid, kind=kind, hidden_dim=hidden_dim, module=module, optimizer=opt, scheduler=scheduler,
        inputs=inputs, outputs=outputs, options=opts, clip_grad_norm=optimizer.clip_grad_norm, device=device,
    )


__all__ = [
    "DeepFeedForward", "DenseFFN", "Expert", "ExpertKind", "FeedForward", "KeptForward", "OptimizerConfig",
    "SchemaError", "SwiGLU", "UnknownExpertKind", "get_expert_kind", "make_expert", "register_expert_kind",
    "registered_kinds",
]
