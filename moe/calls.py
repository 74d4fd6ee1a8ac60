"""The one call path to an expert server, shared by `RemoteExpert` (one expert) and `MixtureClient` (many).

Why one module: the method names, the codec negotiation, what counts as a failed call and how a reply is checked
used to live twice, and the two copies drifted (one accepted NaN outputs, the other did not). Here:
- `INFO`, `FORWARD`, `BACKWARD`, `FORWARD_BATCH`, `BACKWARD_BATCH` are the method names; `moe.server` registers
  its handlers under the same names;
- `info`, `forward`, `backward` are the calls to one expert, each returning a checked reply; `forward_batch` and
  `backward_batch` carry several experts of one server in one RPC (a mixture layer sends one per server per
  step: the fixed cost of a call, ~0.3 ms of Python on each side, is paid once per server instead of once per
  expert) and return one checked answer or one failure per expert; `call_expert` is the RPC under them all;
  a failed call raises one of `CALL_FAILURES`, the one list of what "the call failed" means (callers that
  tolerate failures catch exactly these, and let bugs through);
- `reply_tensors` checks a reply: untrusted input from another peer, so the count, the shapes and finiteness are
  checked (a NaN or infinite value is a failed call: mixing it in would poison the caller's training);
- `peer_unreachable` says whether a failure condemns the whole peer (nothing of it can be reached) or only
  the expert that answered badly.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch

from moe.errors import BadExpertOutput
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import ConnectionFailed, RPCError, RPCNode
from peer.p2p.rpc_protocol import remote_error

INFO = "moe.info"
FORWARD = "moe.forward"
BACKWARD = "moe.backward"
FORWARD_BATCH = "moe.forward_batch"
BACKWARD_BATCH = "moe.backward_batch"
METHODS = (INFO, FORWARD, BACKWARD, FORWARD_BATCH, BACKWARD_BATCH)

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


# One expert's share of a batched call: its checked tensors, or why that expert alone failed (one of CALL_FAILURES).
ExpertAnswer = Union[list[torch.Tensor], Exception]


async def forward_batch(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    requests: Sequence[tuple[str, Sequence[torch.Tensor]]],
    *,
    timeout: float,
    compression: wire.Compression = wire.Compression.NONE,
    out_shape: Sequence[int] | None = None,
) -> list[ExpertAnswer]:
    """Several experts of one server in one RPC: `requests` are (uid, inputs) pairs, distinct uids. Returns, in
    the same order, each expert's outputs (checked: one finite floating tensor of `[rows, *out_shape]`, or of
    `rows` rows without `out_shape`) or the failure of that expert alone. Raises one of `CALL_FAILURES` when
    the whole call failed (the server is unreachable, too slow, or answered something unreadable)."""
    entries = [{"uid": uid, "inputs": list(inputs)} for uid, inputs in requests]

    def check(entry: Any, uid: str, sent: dict[str, Any]) -> list[torch.Tensor]:
        rows = int(sent["inputs"][0].shape[0])
        shapes = [(rows, *out_shape)] if out_shape is not None else None
        return reply_tensors(entry, "outputs", uid, count=1, rows=rows, shapes=shapes, floating=True)

    return await _batch_call(rpc, address, peer_id, FORWARD_BATCH, entries, check, timeout=timeout,
                             compression=compression)


async def backward_batch(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    requests: Sequence[tuple[str, Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    *,
    timeout: float,
    compression: wire.Compression = wire.Compression.NONE,
) -> list[ExpertAnswer]:
    """The backward of several experts of one server in one RPC: `requests` are (uid, inputs, grad_outputs),
    distinct uids. Returns each expert's input gradients (checked like `backward`'s) or its failure; raises one
    of `CALL_FAILURES` when the whole call failed. Each expert applies its optimizer step on the way."""
    entries = [{"uid": uid, "inputs": list(inputs), "grad_outputs": list(grads)} for uid, inputs, grads in requests]

    def check(entry: Any, uid: str, sent: dict[str, Any]) -> list[torch.Tensor]:
        shapes = [tuple(x.shape) for x in sent["inputs"]]
        return reply_tensors(entry, "grad_inputs", uid, shapes=shapes, floating=True)

    return await _batch_call(rpc, address, peer_id, BACKWARD_BATCH, entries, check, timeout=timeout,
                             compression=compression)


async def _batch_call(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    method: str,
    entries: list[dict[str, Any]],
    check: Callable[[Any, str, dict[str, Any]], list[torch.Tensor]],
    *,
    timeout: float,
    compression: wire.Compression,
) -> list[ExpertAnswer]:
    """The RPC under `forward_batch` / `backward_batch`. The reply is `{"results": [...]}`, one entry per
    request: the expert's tensors, or `{"error": [code, text]}` for a typed error of that expert alone (it
    arrives as the same class a single call would raise, e.g. ExpertNotFound)."""
    uids = [entry["uid"] for entry in entries]
    if len(set(uids)) != len(uids):
        raise ValueError(f"{method}: each expert at most once per call, got {uids}")
    reply = await call_expert(rpc, address, peer_id, method, {"experts": entries}, timeout=timeout,
                              compression=compression)
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list) or len(results) != len(entries):
        raise BadExpertOutput(",".join(uids), f"expected {{'results': [...]}} with {len(entries)} entries")
    answers: list[ExpertAnswer] = []
    for uid, sent, entry in zip(uids, entries, results):
        error = entry.get("error") if isinstance(entry, dict) else None
        if error is not None:
            if (not isinstance(error, list) or len(error) != 2 or not isinstance(error[0], str)
                    or not isinstance(error[1], str)):
                answers.append(BadExpertOutput(uid, "malformed error entry"))
            else:
                answers.append(remote_error(error[0], error[1], peer=peer_id, address=address, method=method))
            continue
        try:
            answers.append(check(entry, uid, sent))
        except BadExpertOutput as bad:
            answers.append(bad)
    return answers


def peer_unreachable(error: BaseException) -> bool:
    """True when the failure says nothing of this peer can be reached (avoid all its experts), False when only
    this expert failed (it answered with an error, too late, or badly)."""
    return isinstance(error, ConnectionFailed)


__all__ = [
    "BACKWARD", "BACKWARD_BATCH", "CALL_FAILURES", "ExpertAnswer", "FORWARD", "FORWARD_BATCH", "INFO", "METHODS",
    "backward", "backward_batch", "call_expert", "forward", "forward_batch", "info", "peer_unreachable",
    "reply_tensors",
]
