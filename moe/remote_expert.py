"""`RemoteExpert`: one expert on another peer, used like a local `nn.Module` (autograd included).

Calls go through `moe.calls` (the one call path: method names, codec, reply checks). The forward sends the inputs
to the server (`moe.forward`) and returns its outputs; the backward sends the inputs again with the output
gradients (`moe.backward`): the server returns the input gradients and applies its optimizer step. A forward under
autograd asks the server to keep its graph (`moe.kept`: bounded, and freed after a while when no backward comes),
so the backward does not recompute the forward; one without autograd (`torch.no_grad()`) keeps nothing.

Calls cross from the caller's thread (a training loop, or autograd's backward) into the trio thread that owns
the RPC node through the bridge (`swarm.bridge.run`), one hop per call. There is no fault tolerance here: a
failure raises one of `moe.calls.CALL_FAILURES` (e.g. `moe.errors.ExpertNotFound`, or `BadExpertOutput` for a
NaN output); `RemoteMixtureOfExperts` is the layer that survives dead experts.
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable, TypeVar

import torch
from torch import nn

from dht.client import SwarmHandle
from moe import calls
from moe.declare import ExpertLocation
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.net import Address

T = TypeVar("T")


class RemoteExpert(nn.Module):
    """An expert served elsewhere. `swarm` is anything with `.bridge` (peer.p2p.bridge.Bridge) and `.rpc` (an
    RPCNode running in that bridge's trio thread), e.g. the trainer's `Swarm`."""

    def __init__(
        self,
        uid: str,
        address: Address | ExpertLocation,
        swarm: SwarmHandle,
        *,
        peer_id: PeerID | str | None = None,
        timeout: float = 30.0,
        compression: wire.Compression = wire.Compression.NONE,
    ):
        super().__init__()
        if isinstance(address, ExpertLocation):
            peer_id = peer_id if peer_id is not None else address.peer_id_hex
            address = address.address
        self.uid = uid
        self.address: Address = (str(address[0]), int(address[1]))
        self.peer_id = PeerID.from_hex(peer_id) if isinstance(peer_id, str) else peer_id
        self.swarm = swarm
        self.timeout = timeout
        self.compression = compression
        self._info: dict[str, Any] | None = None
        # autograd only calls backward when some input requires grad; this one always does, so the server
        # learns even when the caller's inputs are plain data
        self._dummy = torch.empty(0, requires_grad=True)

    def extra_repr(self) -> str:
        return f"uid={self.uid!r}, address={self.address[0]}:{self.address[1]}"

    def _run(self, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run one `moe.calls` call in the swarm's trio thread, from this synchronous one, through the bridge."""
        return self.swarm.bridge.run(functools.partial(call, self.swarm.rpc, self.address, self.peer_id, self.uid,
                                                       *args, timeout=self.timeout))

    @property
    def info(self) -> dict[str, Any]:
        """The expert's `moe.info` reply (kind, hidden_dim, max_batch_size, input and output schemas), cached."""
        if self._info is None:
            self._info = self._run(calls.info)
        return self._info

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # torch declares autograd.Function.apply without annotations
        outputs: tuple[torch.Tensor, ...] = _RemoteExpertFunction.apply(  # type: ignore[no-untyped-call]
            self._dummy, self, torch.is_grad_enabled(), *inputs)
        return outputs[0] if len(outputs) == 1 else outputs


class _RemoteExpertFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, expert: RemoteExpert, keep: bool,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sent = [x.detach().contiguous() for x in inputs]
        outputs, ctx.kept = expert._run(functools.partial(calls.forward_keeping, compression=expert.compression,
                                                          keep=keep), sent)
        ctx.expert = expert
        ctx.save_for_backward(*sent)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        expert: RemoteExpert = ctx.expert
        inputs = ctx.saved_tensors
        grads = [g.contiguous() for g in grad_outputs]
        grad_inputs = expert._run(functools.partial(calls.backward, compression=expert.compression, kept=ctx.kept),
                                  list(inputs), grads)
        wanted = ctx.needs_input_grad[3:]
        return (None, None, None, *(g if need else None for g, need in zip(grad_inputs, wanted)))


__all__ = ["RemoteExpert"]
