"""`swarmify(model, swarm, ...)`: replace the dense FFN blocks of a torch transformer with swarm mixture layers.

Why one call: a user with a working transformer should not rewrite it to train it on volunteers' experts. The
call finds the FFN block of every supported layer, gives layer `i` the grid prefix `PREFIX.i` (so one daemon
line, `--experts 'PREFIX.[0:L].[0:N]'`, serves every layer), checks that daemons serve every layer's grid with
a matching expert kind and hidden size, optionally copies the dense block's weights into every expert
("upcycling", `moe.upcycle`), and only then swaps the blocks, so a failed call leaves the model as it was.

Supported layers: `torch.nn.TransformerEncoderLayer` and `TransformerDecoderLayer` (relu or gelu), and, when
`transformers` is installed, Hugging Face GPT-2 blocks (`GPT2Block.mlp`) and LLaMA decoder layers
(`LlamaDecoderLayer.mlp`, SwiGLU). The expert kinds are `relu_ffn`, `gelu_ffn`, `gpt2_ffn` and `swiglu` with the
dense block's inner width (`KIND@N`, see `moe.experts`), so an upcycled expert computes exactly what the dense
block did.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import trio
from torch import nn

from dht.client import SwarmHandle
from moe import calls
from moe.declare import get_prefix_entries
from moe.mixture import ExpertBlacklist, RemoteMixtureOfExperts
from moe.specs import ExpertSpec, advertise_specs
from moe.upcycle import write_weights
from peer.p2p.identity import PeerID


class SwarmNotServing(RuntimeError):
    """Daemons do not serve what a swarmified model needs; the message is one line naming what to run."""


@dataclass
class _Site:
    """One dense FFN block found in the model: how to read its weights and how to put a mixture in its place."""

    path: str
    hidden_dim: int
    kind: str
    weights: Callable[[], dict[str, torch.Tensor]]  # the dense block as the expert module's state dict
    install: Callable[[RemoteMixtureOfExperts], None]  # put the mixture where the dense block was


# expert state name -> (the dense block's parameter path, whether the dense block stores it transposed)
WeightMap = dict[str, tuple[str, bool]]


class SwarmFFN(nn.Module):
    """A mixture of remote experts standing in for an FFN block: [..., hidden] -> [..., hidden], every token
    routed on its own; `dropout` is the dropout the dense block applied to its output.

    `dense` is the block it replaced, moved to the meta device (its structure without its memory) and kept out of
    the state dict, with `weight_map` saying where each expert tensor goes in it: `moe.export.deswarmify` rebuilds
    the plain model from them and the experts' weights read back from the daemons."""

    dense: nn.Module | None
    weight_map: WeightMap

    def __init__(self, mixture: RemoteMixtureOfExperts, dropout: nn.Module | None = None, *,
                 dense: nn.Module | None = None, weight_map: WeightMap | None = None):
        super().__init__()
        self.mixture = mixture
        self.dropout = dropout if dropout is not None else nn.Identity()
        # plain attributes (not submodules): neither in state_dict() nor in parameters()
        self.__dict__["dense"] = dense.to("meta") if dense is not None else None
        self.__dict__["weight_map"] = dict(weight_map or {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out: torch.Tensor = self.mixture(flat.float()).to(x.dtype).reshape(x.shape)
        return self.dropout(out)  # type: ignore[no-any-return]


def _child(module: nn.Module, name: str) -> nn.Module:
    """The submodule `name` of a block swarmify reads; a model whose block lacks it is not a supported layout
    (ValueError naming it), rather than an AttributeError deep in a weight copy."""
    child = getattr(module, name, None)
    if not isinstance(child, nn.Module):
        raise ValueError(f"swarmify: {type(module).__name__}.{name} is not a module; unsupported block layout")
    return child


def _linear(module: nn.Module, name: str) -> nn.Linear:
    child = _child(module, name)
    if not isinstance(child, nn.Linear):
        raise ValueError(f"swarmify: {type(module).__name__}.{name} is a {type(child).__name__}, not nn.Linear")
    return child


def _parameter(module: nn.Module, name: str) -> torch.Tensor:
    tensor = getattr(module, name, None)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"swarmify: {type(module).__name__}.{name} is not a tensor; unsupported block layout")
    return tensor


def _torch_layer_site(path: str, layer: nn.Module) -> _Site:
    if not isinstance(layer, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        raise TypeError(f"{path}: {type(layer).__name__} is not a torch transformer layer")
    torch_layer = layer  # narrowed for the closures below
    activation = getattr(layer, "activation", None)
    if activation in (nn.functional.relu,) or isinstance(activation, nn.ReLU):
        kind = "relu_ffn"
    elif activation in (nn.functional.gelu,) or isinstance(activation, nn.GELU):
        kind = "gelu_ffn"
    else:
        raise ValueError(f"{path}: activation {activation!r} has no matching expert kind (relu or gelu)")
    linear1, linear2 = _linear(layer, "linear1"), _linear(layer, "linear2")
    out_dropout = _child(layer, "dropout3" if isinstance(layer, nn.TransformerDecoderLayer) else "dropout2")

    def weights() -> dict[str, torch.Tensor]:
        return {"up.weight": linear1.weight, "up.bias": linear1.bias, "down.weight": linear2.weight,
                "down.bias": linear2.bias}

    def install(mixture: RemoteMixtureOfExperts) -> None:
        dense = nn.ModuleDict({name: getattr(torch_layer, name) for name in ("linear1", "linear2", "dropout")})
        for name in ("linear1", "linear2", "dropout"):
            delattr(torch_layer, name)
        if isinstance(torch_layer, nn.TransformerEncoderLayer):  # the decoder layer has no fused path
            dense.__dict__["activation_relu_or_gelu"] = torch_layer.activation_relu_or_gelu  # restored on export
            torch_layer.activation_relu_or_gelu = 0  # keeps torch's fused inference path (reads linear1) off
        # a submodule (so its gate is trained), called where the dense block was: both layer classes call
        # self._ff_block, and an instance attribute shadows the class's method
        swarm_ffn = SwarmFFN(mixture, out_dropout, dense=dense, weight_map={
            "up.weight": ("linear1.weight", False), "up.bias": ("linear1.bias", False),
            "down.weight": ("linear2.weight", False), "down.bias": ("linear2.bias", False)})
        torch_layer.add_module("swarm_ffn", swarm_ffn)
        torch_layer.__dict__["_ff_block"] = swarm_ffn

    return _Site(path, linear1.in_features, f"{kind}@{linear1.out_features}", weights, install)


def _gpt2_site(path: str, block: nn.Module) -> _Site:
    mlp = _child(block, "mlp")
    c_fc, c_proj = _child(mlp, "c_fc"), _child(mlp, "c_proj")  # transformers' Conv1D: weight [in, out]
    up_weight, up_bias = _parameter(c_fc, "weight"), _parameter(c_fc, "bias")
    down_weight, down_bias = _parameter(c_proj, "weight"), _parameter(c_proj, "bias")
    dropout = _child(mlp, "dropout")

    def weights() -> dict[str, torch.Tensor]:
        return {"up.weight": up_weight.t(), "up.bias": up_bias, "down.weight": down_weight.t(),
                "down.bias": down_bias}

    def install(mixture: RemoteMixtureOfExperts) -> None:
        block.mlp = SwarmFFN(mixture, dropout, dense=mlp, weight_map={
            "up.weight": ("c_fc.weight", True), "up.bias": ("c_fc.bias", False),
            "down.weight": ("c_proj.weight", True), "down.bias": ("c_proj.bias", False)})

    return _Site(path, up_weight.shape[0], f"gpt2_ffn@{up_weight.shape[1]}", weights, install)


def _llama_site(path: str, layer: nn.Module) -> _Site:
    mlp = _child(layer, "mlp")
    gate, up, down = _linear(mlp, "gate_proj"), _linear(mlp, "up_proj"), _linear(mlp, "down_proj")

    def weights() -> dict[str, torch.Tensor]:
        return {"gate.weight": gate.weight, "up.weight": up.weight, "down.weight": down.weight}

    def install(mixture: RemoteMixtureOfExperts) -> None:
        layer.mlp = SwarmFFN(mixture, dense=mlp, weight_map={
            "gate.weight": ("gate_proj.weight", False), "up.weight": ("up_proj.weight", False),
            "down.weight": ("down_proj.weight", False)})

    return _Site(path, gate.in_features, f"swiglu@{gate.out_features}", weights, install)


_Handler = tuple[type[nn.Module], Callable[[str, nn.Module], _Site]]


def _hf_classes() -> list[_Handler]:
    found: list[_Handler] = []
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    except ImportError:  # the optional extra `swarmd[hf]` is not installed: torch layers only
        return found
    found.append((GPT2Block, _gpt2_site))
    found.append((LlamaDecoderLayer, _llama_site))
    return found


def find_ffn_blocks(model: nn.Module) -> list[_Site]:
    """The dense FFN blocks `swarmify` would replace, in module order."""
    handlers: list[_Handler] = [
        (nn.TransformerEncoderLayer, _torch_layer_site), (nn.TransformerDecoderLayer, _torch_layer_site),
        *_hf_classes()]
    sites = []
    for path, module in model.named_modules():
        for cls, handler in handlers:
            if isinstance(module, cls) and not isinstance(getattr(module, "mlp", None), SwarmFFN) \
                    and "swarm_ffn" not in module._modules:
                sites.append(handler(path or "model", module))
                break
    return sites


def expert_specs(sites: Sequence[_Site], prefix: str, experts_per_layer: int) -> list[ExpertSpec]:
    """One spec per run of consecutive layers with the same kind and hidden size (usually one for a model)."""
    specs: list[ExpertSpec] = []
    for index, site in enumerate(sites):
        last = specs[-1] if specs else None
        if last is not None and last.kind == site.kind and last.hidden_dim == site.hidden_dim:
            specs[-1] = ExpertSpec(prefix, (*last.layers, index), experts_per_layer, site.kind, site.hidden_dim)
        else:
            specs.append(ExpertSpec(prefix, (index,), experts_per_layer, site.kind, site.hidden_dim))
    return specs


def _join_address(swarm: SwarmHandle) -> str:
    """HOST:PORT for the `peer join` line: the swarm's first initial peer, else where this trainer listens (it is
    its swarm's bootstrap), else a placeholder."""
    peers = getattr(swarm, "initial_peers", None)
    if peers:
        return f"{peers[0][0]}:{peers[0][1]}"
    address = swarm.rpc.announced_address
    return f"{address[0]}:{address[1]}" if address is not None else "HOST:PORT"


# what a daemon's failed `moe.info` answer raises (the call's own failures, or no answer in time)
_INFO_FAILURES: tuple[type[Exception], ...] = (trio.TooSlowError, *calls.CALL_FAILURES)


async def _check_served(swarm: SwarmHandle, specs: Sequence[ExpertSpec], k_min: int, wait: float,
                        timeout: float) -> dict[str, list[tuple[str, Any]]]:
    """Every layer's declared experts (uid -> location), once each layer has at least k_min of them and one of
    them answers `moe.info` with the spec's kind and hidden size; SwarmNotServing after `wait` seconds."""
    deadline = trio.current_time() + wait
    problem = ""
    while True:
        served: dict[str, list[tuple[str, Any]]] = {}
        problem = ""
        for spec in specs:
            for layer in spec.layers:
                layer_prefix = f"{spec.prefix}.{layer}."
                entries = await get_prefix_entries(swarm.dht, layer_prefix)
                if len(entries) < k_min:
                    problem = f"{len(entries)} experts declared under {layer_prefix} (need {k_min})"
                    break
                uid, location = next(iter(entries.values()))
                try:
                    with trio.fail_after(timeout):
                        info = await calls.info(swarm.rpc, location.address, PeerID.from_hex(location.peer_id_hex),
                                                uid, timeout=timeout)
                except _INFO_FAILURES as error:
                    problem = f"{uid} did not answer moe.info ({type(error).__name__})"
                    break
                if info.get("kind") != spec.kind or info.get("hidden_dim") != spec.hidden_dim:
                    problem = (f"{uid} is a {info.get('kind')} expert of hidden size {info.get('hidden_dim')}, "
                               f"not {spec.kind} of {spec.hidden_dim}")
                    break
                served[layer_prefix] = sorted(entries.values())
            if problem:
                break
        if not problem:
            return served
        if trio.current_time() >= deadline:
            machines = sum(len(spec.layers) for spec in specs)
            commands = "; ".join(spec.join_command(_join_address(swarm)) for spec in specs)
            raise SwarmNotServing(f"swarmify: {problem}: run on up to {machines} machine{'s' * (machines != 1)} "
                                  f"{commands}")
        await trio.sleep(0.5)


def swarmify(
    model: nn.Module,
    swarm: SwarmHandle,
    *,
    k_best: int,
    k_min: int = 1,
    prefix: str = "swarm",
    experts_per_layer: int = 4,
    upcycle: bool = False,
    wait: float = 10.0,
    forward_timeout: float = 10.0,
    backward_timeout: float = 10.0,
    timeout_after_k_min: float = 1.0,
    upcycle_timeout: float = 30.0,
    advertise: bool = True,
) -> list[ExpertSpec]:
    """Replace every supported dense FFN block of `model` (in place) with a `RemoteMixtureOfExperts` over the
    grid `prefix.i` (layer i, `experts_per_layer` experts); returns the specs daemons serve (their
    `join_command()` is the `peer join` line). Raises SwarmNotServing (one line naming what to run) when daemons
    do not serve every layer within `wait` seconds, ValueError when the model has no supported block. With
    `upcycle`, every expert is first written with the dense block's weights (the daemons must accept this
    swarm's peer: `peer join --accept-weights-from PEER_ID`), so the model computes what it did before.

    With `advertise` (the default) the specs are published in the DHT for as long as `swarm` runs
    (`moe.specs`): a plain `peer join --initial-peers X` then serves free uids of them with the right kind and
    sizes. `moe.export.deswarmify(model, swarm)` gives the weights back as a plain model."""
    sites = find_ffn_blocks(model)
    if not sites:
        raise ValueError("swarmify: no supported FFN block found (torch TransformerEncoderLayer/DecoderLayer, "
                         "Hugging Face GPT-2 or LLaMA blocks)")
    specs = expert_specs(sites, prefix, experts_per_layer)
    if advertise:  # first, so that daemons started while this call waits already serve what the model needs
        swarm.bridge.start_and_wait(functools.partial(advertise_specs, swarm.dht, specs))
    served = swarm.run(functools.partial(_check_served, swarm, specs, k_min, wait, forward_timeout))
    if upcycle:
        for index, site in enumerate(sites):
            state = {name: tensor.detach().to(torch.float32).contiguous().clone() for name, tensor in
                     site.weights().items()}
            swarm.run(functools.partial(write_weights, swarm.rpc, served[f"{prefix}.{index}."], state,
                                        timeout=upcycle_timeout))
    blacklist = ExpertBlacklist()  # shared: a dead daemon found by one layer is avoided by all
    for index, site in enumerate(sites):
        mixture = RemoteMixtureOfExperts(
            site.hidden_dim, (experts_per_layer,), f"{prefix}.{index}", k_best=k_best, k_min=k_min,
            timeout_after_k_min=timeout_after_k_min, forward_timeout=forward_timeout,
            backward_timeout=backward_timeout, swarm=swarm, blacklist=blacklist)
        site.install(mixture)
    return specs


__all__ = ["ExpertSpec", "SwarmFFN", "SwarmNotServing", "WeightMap", "expert_specs", "find_ffn_blocks", "swarmify"]
