"""Your weights back: `deswarmify(model, swarm)` turns a swarmified model into a plain one, and `save_safetensors`
writes it.

Why a copy with the daemons' weights: after `swarmify`, a model's FFN blocks live only on the volunteers'
daemons, which keep training them. Export reads every layer's expert through `moe.read_weights` (answered to the
peers allowed to train those experts, see `moe.upcycle`), rebuilds the dense block `swarmify` removed (kept on the
meta device: its structure, not its memory) and writes the expert's tensors into it, in the dense layout (GPT-2's
Conv1D stores them transposed). The result is a model of the original class whose `state_dict()` loads into a
fresh instance of the original architecture; the swarmified model is left as it was, so training can go on.

Exact when each layer has one expert (`swarmify(..., experts_per_layer=1)`): its gate then gives that expert the
whole weight, so the plain model computes what the swarm model did. A layer of several experts is a mixture no
single dense block computes; `merge="mean"` then writes the mean of the experts' weights (an approximation, the
usual start of a dense model distilled from upcycled experts), and without it export refuses with one line.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from typing import Any

import torch
import trio
from torch import nn

from dht.client import SwarmHandle
from moe.declare import get_prefix_entries
from moe.swarmify import SwarmFFN
from moe.upcycle import read_weights

MERGES = (None, "mean")


class ExportError(RuntimeError):
    """The swarm did not give back what an export needs (an expert not declared, not answering, refusing this
    peer); the message is one line naming the layer and the daemon."""


def swarm_layers(model: nn.Module) -> list[tuple[str, SwarmFFN]]:
    """The swarmified FFN blocks of `model`, as (module path, SwarmFFN), in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, SwarmFFN)]


async def _read_layer(swarm: SwarmHandle, prefix: str, experts: int, merge: str | None,
                      timeout: float) -> dict[str, torch.Tensor]:
    """The weights of the layer's expert (or the mean of its experts' with `merge="mean"`)."""
    with trio.move_on_after(timeout):
        entries = await get_prefix_entries(swarm.dht, prefix)
    if not entries:
        raise ExportError(f"export: no expert declared under {prefix} (are its daemons still up?)")
    if len(entries) < experts and merge is not None:
        raise ExportError(f"export: {len(entries)} of the {experts} experts under {prefix} are declared; a mean "
                          "over some of them is not the layer the swarm trained")
    states = []
    for uid, location in sorted(entries.values()):
        try:
            with trio.fail_after(timeout):
                reply = await read_weights(swarm.rpc, uid, location, timeout=timeout)
        except Exception as error:  # noqa: BLE001 (any failure of that call is this one line to the user)
            raise ExportError(f"export: peer {location.peer_id_hex[:12]} at {location.host}:{location.port} did not "
                              f"give the weights of {uid}: {type(error).__name__}: {error}") from error
        states.append(reply["state"])
    if len({frozenset(state) for state in states}) != 1:
        raise ExportError(f"export: the experts under {prefix} hold different tensors")
    return {name: torch.stack([state[name].float() for state in states]).mean(0) for name in states[0]}


def _restore(plain: nn.Module, path: str, ffn: SwarmFFN, state: dict[str, torch.Tensor],
             device: torch.device) -> None:
    """Put the dense block back where `ffn` stands in `plain` (a copy), holding `state`'s tensors."""
    dense = ffn.dense
    if dense is None or not ffn.weight_map:
        raise ExportError(f"export: {path} has no dense layout to export to (a SwarmFFN made outside swarmify)")
    if set(state) != set(ffn.weight_map):
        raise ExportError(f"export: {path}: the experts hold {sorted(state)}, the dense block needs "
                          f"{sorted(ffn.weight_map)}")
    dense = dense.to_empty(device=device)
    with torch.no_grad():
        for name, (target, transposed) in ffn.weight_map.items():
            parameter = dense.get_parameter(target)
            tensor = state[name].t() if transposed else state[name]
            if tuple(tensor.shape) != tuple(parameter.shape):
                raise ExportError(f"export: {path}: {name} is {tuple(tensor.shape)} on the daemon, the dense "
                                  f"block's {target} is {tuple(parameter.shape)}")
            parameter.copy_(tensor.to(parameter.dtype))
    parent_path, _, attribute = path.rpartition(".")
    parent = plain.get_submodule(parent_path) if parent_path else plain
    if attribute == "swarm_ffn":  # a torch transformer layer: linear1, linear2 and dropout were its attributes
        del parent._modules["swarm_ffn"]
        parent.__dict__.pop("_ff_block", None)
        for name, module in dense.named_children():
            setattr(parent, name, module)
        if "activation_relu_or_gelu" in dense.__dict__:
            parent.activation_relu_or_gelu = dense.__dict__["activation_relu_or_gelu"]
    else:  # a Hugging Face block: the dense MLP was `block.mlp`
        setattr(parent, attribute, dense)


def deswarmify(model: nn.Module, swarm: SwarmHandle, *, merge: str | None = None, timeout: float = 60.0,
               device: str | torch.device | None = None) -> nn.Module:
    """A plain copy of the swarmified `model`: every `SwarmFFN` replaced by the dense block it stood for, holding
    the served experts' current weights (read with `moe.read_weights`), so that its `state_dict()` loads into the
    original architecture (`GPT2LMHeadModel(config).load_state_dict(...)`). `model` itself is not changed.

    Layers of one expert export exactly; a layer of several experts needs `merge="mean"` (see the module doc).
    `device`: where the rebuilt blocks live (default: the device of the model's first parameter). Raises
    ExportError (one line) when an expert cannot be read, ValueError for a model with no swarmified layer or a
    layer of several experts without `merge`."""
    if merge not in MERGES:
        raise ValueError(f"merge is None or 'mean', not {merge!r}")
    layers = swarm_layers(model)
    if not layers:
        raise ValueError("deswarmify: the model has no swarmified layer (swarmify it first)")
    for path, ffn in layers:
        experts = math.prod(ffn.mixture.grid_size)
        if experts > 1 and merge is None:
            raise ValueError(f"deswarmify: {path} is a mixture of {experts} experts, which no single dense block "
                             "computes: swarmify with experts_per_layer=1 for an exact export, or pass merge='mean'")
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    states = [swarm.run(functools.partial(_read_layer, swarm, ffn.mixture.uid_prefix,
                                          math.prod(ffn.mixture.grid_size), merge, timeout))
              for _, ffn in layers]
    # the mixtures (and the swarm handle they hold) are not copied: the copy's SwarmFFNs are replaced below
    memo: dict[int, Any] = {id(ffn.mixture): nn.Identity() for _, ffn in layers}
    plain = copy.deepcopy(model, memo)
    for (path, _), state in zip(layers, states):
        copied = plain.get_submodule(path)
        assert isinstance(copied, SwarmFFN)
        _restore(plain, path, copied, state, torch.device(device))
    return plain


def save_safetensors(model: nn.Module, path: str | os.PathLike[str], metadata: dict[str, str] | None = None) -> None:
    """Save `model`'s weights as safetensors (tied tensors such as GPT-2's embedding and LM head once);
    `safetensors.torch.load_model(fresh_model, path)` loads them back."""
    from safetensors.torch import save_model

    save_model(model, os.fspath(path), metadata=metadata)


__all__ = ["ExportError", "deswarmify", "save_safetensors", "swarm_layers"]
