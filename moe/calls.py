"""The one call path to an expert server, shared by `RemoteExpert` (one expert) and `MixtureClient` (many).

Why one module: the method names, the codec negotiation, what counts as a failed call and how a reply is checked
used to live twice, and the two copies drifted (one accepted NaN outputs, the other did not). Here:
- `INFO`, `FORWARD`, `BACKWARD` are the method names; `moe.server` registers its handlers under the same names;
- `info`, `forward`, `backward` are the three calls, each returning a checked reply; `call_expert` is the RPC
  under them; a failed call raises one of `CALL_FAILURES`, the one list of what "the call
  failed" means (callers that tolerate failures catch exactly these, and let bugs through);
- `reply_tensors` checks a reply: untrusted input from another peer, so the count, the shapes and finiteness are
  checked (a NaN or infinite value is a failed call: mixing it in would poison the caller's training);
- `peer_unreachable` says whether a failure condemns the whole peer (nothing of it can be reached) or only
  the expert that answered badly.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from moe.errors import BadExpertOutput
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import ConnectionFailed, RPCError, RPCNode

INFO = "moe.info"
FORWARD = "moe.forward"
BACKWARD = "moe.backward"
METHODS = (INFO, FORWARD, BACKWARD)

# What a failed expert call raises: the RPC layer's errors (timeouts, refused connections, replies that do not
# decode, the server's typed errors such as moe.errors.ExpertNotFound), answers that do not fit the request
# (BadExpertOutput), and requests the wire cannot carry (WireError, e.g. a batch over the message size limit).
CALL_FAILURES: tuple[type[Exception], ...] = (RPCError, BadExpertOutput, wire.WireError)


async def call_expert(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    method: str,
    args: dict[str, Any],
    *,
    timeout: float,
    compression: wire.Compression = wire.Compression.NONE,
) -> Any:
    """One RPC to an expert server. With compression, the server is asked to answer with the same codec (tensors
    travel compressed both ways). Raises one of `CALL_FAILURES`; check the reply with `reply_tensors`."""
    if method not in METHODS:
        raise ValueError(f"{method!r} is not an expert server method ({', '.join(METHODS)})")
    if compression != wire.Compression.NONE and method != INFO:
        args = {**args, "compression": int(compression)}
    return await rpc.call(address, method, args, timeout=timeout, peer_id=peer_id, compression=compression)


def reply_tensors(
    reply: Any,
    key: str,
    uid: str,
    *,
    count: int | None = None,
    rows: int | None = None,
    shapes: Sequence[tuple[int, ...]] | None = None,
    floating: bool = False,
) -> list[torch.Tensor]:
    """The tensors under `key` of an expert's reply, checked: a list of tensors (`count` of them when given),
    each with `rows` rows, or exactly `shapes`, all finite, floating point with `floating`. Raises
    BadExpertOutput naming the expert and what is wrong."""
    values = reply.get(key) if isinstance(reply, dict) else None
    if not isinstance(values, list) or not all(isinstance(t, torch.Tensor) for t in values):
        raise BadExpertOutput(uid, f"expected {{{key!r}: [tensor, ...]}}")
    if shapes is not None:
        count = len(shapes)
    if count is not None and len(values) != count:
        raise BadExpertOutput(uid, f"{len(values)} {key}, expected {count}")
    for index, tensor in enumerate(values):
        shape = tuple(tensor.shape)
        if shapes is not None and shape != tuple(shapes[index]):
            raise BadExpertOutput(uid, f"{key}[{index}] shape {shape}, expected {tuple(shapes[index])}")
        if rows is not None and (tensor.ndim < 1 or shape[0] != rows):
            raise BadExpertOutput(uid, f"{key}[{index}] shape {shape} for {rows} samples")
        if floating and not tensor.is_floating_point():
            raise BadExpertOutput(uid, f"{key}[{index}] is {tensor.dtype}, expected floating point values")
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
            raise BadExpertOutput(uid, f"{key}[{index}] holds NaN or infinite values")
    return values


async def info(
    rpc: RPCNode, address: Address, peer_id: PeerID | None, uid: str, *, timeout: float
) -> dict[str, Any]:
    """The expert's `moe.info` reply (kind, hidden_dim, max_batch_size, input and output schemas)."""
    reply = await call_expert(rpc, address, peer_id, INFO, {"uid": uid}, timeout=timeout)
    if not isinstance(reply, dict):
        raise BadExpertOutput(uid, f"expected a dict as {INFO} reply, got {type(reply).__name__}")
    return reply


async def forward(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    uid: str,
    inputs: Sequence[torch.Tensor],
    *,
    timeout: float,
    compression: wire.Compression = wire.Compression.NONE,
    count: int | None = None,
    shapes: Sequence[tuple[int, ...]] | None = None,
    floating: bool = False,
) -> list[torch.Tensor]:
    """The expert's outputs for a batch, checked (`reply_tensors`: one row per input row, finite; `count`,
    `shapes` and `floating` when the caller knows more)."""
    reply = await call_expert(rpc, address, peer_id, FORWARD, {"uid": uid, "inputs": list(inputs)},
                              timeout=timeout, compression=compression)
    rows = int(inputs[0].shape[0]) if inputs and inputs[0].ndim else None
    return reply_tensors(reply, "outputs", uid, count=count, rows=rows, shapes=shapes, floating=floating)


async def backward(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    uid: str,
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    *,
    timeout: float,
    compression: wire.Compression = wire.Compression.NONE,
) -> list[torch.Tensor]:
    """The gradients of the expert's inputs (the server applies its optimizer step on the way), checked: one
    finite floating tensor per input, of the input's shape."""
    args = {"uid": uid, "inputs": list(inputs), "grad_outputs": list(grad_outputs)}
    reply = await call_expert(rpc, address, peer_id, BACKWARD, args, timeout=timeout, compression=compression)
    return reply_tensors(reply, "grad_inputs", uid, shapes=[tuple(x.shape) for x in inputs], floating=True)


def peer_unreachable(error: BaseException) -> bool:
    """True when the failure says nothing of this peer can be reached (avoid all its experts), False when only
    this expert failed (it answered with an error, too late, or badly)."""
    return isinstance(error, ConnectionFailed)


__all__ = [
    "BACKWARD", "CALL_FAILURES", "FORWARD", "INFO", "METHODS", "backward", "call_expert", "forward", "info",
    "peer_unreachable", "reply_tensors",
]
