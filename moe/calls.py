"""The one call path to an expert server, shared by `RemoteExpert` (one expert) and `MixtureClient` (many).

Why one module: the method names, the codec negotiation, what counts as a failed call and how a reply is checked
used to live twice, and the two copies drifted (one accepted NaN outputs, the other did not). Here:
- `INFO`, `FORWARD`, `BACKWARD`, `FORWARD_BATCH`, `BACKWARD_BATCH` are the method names; `moe.server` registers
  its handlers under the same names;
- `info`, `forward`, `backward` are the calls to one expert, each returning a checked reply; `forward_packed`
  and `backward_packed` carry several experts of one server in one RPC (a mixture layer sends one per server per
  layer call: the fixed cost of a call is paid once per server instead of once per expert), packed: ONE tensor
  per input holds all the experts' rows one after the other (`uids` and `rows` say whose rows are where), and
  the reply is one tensor per output, checked as a whole (one shape check, one finiteness pass; only a reply
  that fails it is looked at expert by expert), with the failures of single experts listed beside it.
  `forward_batch` / `backward_batch` are the same calls for callers holding one tensor list per expert;
  `call_expert` is the RPC under them all;
  a failed call raises one of `CALL_FAILURES`, the one list of what "the call failed" means (callers that
  tolerate failures catch exactly these, and let bugs through);
- `reply_tensors` checks a reply: untrusted input from another peer, so the count, the shapes and finiteness are
  checked (a NaN or infinite value is a failed call: mixing it in would poison the caller's training);
- `peer_unreachable` says whether a failure condemns the whole peer (nothing of it can be reached) or only
  the expert that answered badly.

Kept forwards: a forward with `keep=True` asks the server to keep its graph for the backward (`moe.kept`); the
reply carries one token per expert (0: not kept), and the backward sends them back (`kept=`), so the server does
not recompute the forward. A token the server no longer holds costs a recomputation, never a failure.

The packed wire form (method `moe.forward_batch` / `moe.backward_batch`):
    request  {"uids": [str], "rows": [int], "inputs": [tensor], "keep": bool}           (forward)
             {"uids": [str], "rows": [int], "inputs": [tensor], "grad_outputs": [tensor], "kept": [int]}
    reply    {"outputs" | "grad_inputs": [tensor], "errors": [[position, code, text]], "kept": [int]}
where every tensor has sum(rows) rows; a failed expert's rows in the reply are zeros. Servers still answer the
per-expert form `{"experts": [{"uid", "inputs", ...}]}` of earlier versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Required, Sequence, TypedDict, Union, Unpack

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
    finite: bool = True,
) -> list[torch.Tensor]:
    """The tensors under `key` of an expert's reply, checked: a list of tensors (`count` of them when given),
    each with `rows` rows, or exactly `shapes`, floating point with `floating`, all finite with `finite`. Raises
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
        if finite and (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
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


class ForwardOptions(TypedDict, total=False):
    """The keywords `forward` passes on to `forward_keeping` (defaults and meaning there): named once, so the
    two calls cannot drift apart as `forward` grows a check."""

    timeout: Required[float]
    compression: wire.Compression
    count: int | None
    shapes: Sequence[tuple[int, ...]] | None
    floating: bool


async def forward(rpc: RPCNode, address: Address, peer_id: PeerID | None, uid: str, inputs: Sequence[torch.Tensor],
                  **options: Unpack[ForwardOptions]) -> list[torch.Tensor]:
    """The expert's outputs for a batch, checked (`reply_tensors`: one row per input row, finite; `count`,
    `shapes` and `floating` when the caller knows more)."""
    return (await forward_keeping(rpc, address, peer_id, uid, inputs, keep=False, **options))[0]


async def forward_keeping(
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
    keep: bool = True,
) -> tuple[list[torch.Tensor], int]:
    """`forward`, asking the server to keep the graph for the backward (see the module doc): the outputs and the
    token to give `backward` (0 when nothing was kept)."""
    args: dict[str, Any] = {"uid": uid, "inputs": list(inputs)}
    if keep:
        args["keep"] = True
    reply = await call_expert(rpc, address, peer_id, FORWARD, args, timeout=timeout, compression=compression)
    rows = int(inputs[0].shape[0]) if inputs and inputs[0].ndim else None
    outputs = reply_tensors(reply, "outputs", uid, count=count, rows=rows, shapes=shapes, floating=floating)
    token = reply.get("kept", 0) if keep else 0
    return outputs, token if isinstance(token, int) and not isinstance(token, bool) else 0


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
    kept: int = 0,
) -> list[torch.Tensor]:
    """The gradients of the expert's inputs (the server applies its optimizer step on the way), checked: one
    finite floating tensor per input, of the input's shape. `kept`: the token of the forward, when kept."""
    args: dict[str, Any] = {"uid": uid, "inputs": list(inputs), "grad_outputs": list(grad_outputs)}
    if kept:
        args["kept"] = kept
    reply = await call_expert(rpc, address, peer_id, BACKWARD, args, timeout=timeout, compression=compression)
    return reply_tensors(reply, "grad_inputs", uid, shapes=[tuple(x.shape) for x in inputs], floating=True)


# One expert's share of a batched call: its checked tensors, or why that expert alone failed (one of CALL_FAILURES).
ExpertAnswer = Union[list[torch.Tensor], Exception]


@dataclass(eq=False)
class PackedReply:
    """The checked reply of a packed call: `tensors`, each with the rows of all experts in request order (a
    failed expert's rows are zeros), the failures of single experts by position, and the kept-forward tokens
    (one per expert, 0 where nothing is kept; all 0 when none were asked for)."""

    tensors: list[torch.Tensor]
    errors: dict[int, Exception] = field(default_factory=dict)
    kept: list[int] = field(default_factory=list)


async def forward_packed(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    uids: Sequence[str],
    rows: Sequence[int],
    inputs: Sequence[torch.Tensor],
    *,
    timeout: float,
    compression: wire.Compression = wire.Compression.NONE,
    out_shape: Sequence[int] | None = None,
    keep: bool = False,
) -> PackedReply:
    """The forward of several experts of one server, packed (see the module doc): expert `uids[i]` computes
    `rows[i]` rows of `inputs`, taken in order. The reply is checked: one floating tensor of `[sum(rows),
    *out_shape]` (of sum(rows) rows without `out_shape`), finite except in the rows of experts that fail alone.
    Raises one of `CALL_FAILURES` when the whole call failed."""
    args: dict[str, Any] = {"uids": list(uids), "rows": [int(r) for r in rows], "inputs": list(inputs)}
    if keep:
        args["keep"] = True
    shape = None if out_shape is None else [(sum(args["rows"]), *out_shape)]
    return await _packed_call(rpc, address, peer_id, FORWARD_BATCH, args, "outputs", shape, timeout=timeout,
                              compression=compression, count=1 if out_shape is not None else None)


async def backward_packed(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    uids: Sequence[str],
    rows: Sequence[int],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    *,
    timeout: float,
    compression: wire.Compression = wire.Compression.NONE,
    kept: Sequence[int] | None = None,
) -> PackedReply:
    """The backward of several experts of one server, packed like `forward_packed`; `kept` are the tokens of
    their forwards (0 for none). The reply is checked: one finite floating tensor per input, of its shape. Each
    expert applies its optimizer step on the way."""
    args: dict[str, Any] = {"uids": list(uids), "rows": [int(r) for r in rows], "inputs": list(inputs),
                            "grad_outputs": list(grad_outputs)}
    if kept is not None and any(kept):
        args["kept"] = [int(token) for token in kept]
    return await _packed_call(rpc, address, peer_id, BACKWARD_BATCH, args, "grad_inputs",
                              [tuple(x.shape) for x in inputs], timeout=timeout, compression=compression)


async def _packed_call(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    method: str,
    args: dict[str, Any],
    key: str,
    shapes: Sequence[tuple[int, ...]] | None,
    *,
    timeout: float,
    compression: wire.Compression,
    count: int | None = None,
) -> PackedReply:
    uids, rows = args["uids"], args["rows"]
    if len(set(uids)) != len(uids):
        raise ValueError(f"{method}: each expert at most once per call, got {uids}")
    if len(rows) != len(uids) or not uids or min(rows) < 1:
        raise ValueError(f"{method}: one positive row count per expert, got {len(uids)} uids and rows {rows}")
    reply = await call_expert(rpc, address, peer_id, method, args, timeout=timeout, compression=compression)
    name = ",".join(uids)
    total = sum(rows)
    errors = _packed_errors(reply, len(uids), name, peer_id, address, method)
    if len(errors) == len(uids):  # every expert failed alone: there is nothing else to check
        return PackedReply([], errors, [0] * len(uids))
    try:
        tensors = reply_tensors(reply, key, name, count=count, rows=total, shapes=shapes, floating=True,
                                finite=False)
    except BadExpertOutput as bad:  # the reply does not fit the request: every expert of it answered badly
        return PackedReply([], {p: errors.get(p, BadExpertOutput(uid, bad.message)) for p, uid in enumerate(uids)},
                           [0] * len(uids))
    for tensor in tensors:  # one pass over the whole reply; only a reply that fails it is looked at per expert
        if not bool(torch.isfinite(tensor).all()):
            for position in _rows_not_finite(tensor, rows):
                errors.setdefault(position, BadExpertOutput(uids[position], f"{key} hold NaN or infinite values"))
    kept = reply.get("kept") if "keep" in args else None
    tokens = [int(t) for t in kept] if (isinstance(kept, list) and len(kept) == len(uids)
                                         and all(isinstance(t, int) for t in kept)) else [0] * len(uids)
    return PackedReply(tensors, errors, tokens)


def _packed_errors(reply: Any, count: int, name: str, peer_id: PeerID | None, address: Address,
                   method: str) -> dict[int, Exception]:
    """The failures of single experts in a packed reply: `[[position, code, text], ...]`, each arriving as the
    class a single call would raise (e.g. ExpertNotFound)."""
    listed = reply.get("errors", []) if isinstance(reply, dict) else None
    if not isinstance(listed, list):
        raise BadExpertOutput(name, "expected 'errors': [[position, code, text], ...]")
    errors: dict[int, Exception] = {}
    for entry in listed:
        if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], int)
                or not 0 <= entry[0] < count or not isinstance(entry[1], str) or not isinstance(entry[2], str)):
            raise BadExpertOutput(name, f"malformed error entry {str(entry)[:100]}")
        errors[entry[0]] = remote_error(entry[1], entry[2], peer=peer_id, address=address, method=method)
    return errors


def _rows_not_finite(tensor: torch.Tensor, rows: Sequence[int]) -> list[int]:
    """The positions of the experts whose rows of `tensor` hold a NaN or infinite value."""
    bad = ~torch.isfinite(tensor.reshape(tensor.shape[0], -1)).all(dim=1)
    owner = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
    return sorted(int(p) for p in torch.unique(owner[bad]))


def pack(tensors: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Per-expert tensor lists -> one tensor per position, the experts' rows one after the other."""
    return [torch.cat([group[i] for group in tensors]) if len(tensors) > 1 else tensors[0][i].contiguous()
            for i in range(len(tensors[0]))]


def unpack(reply: PackedReply, rows: Sequence[int]) -> list[ExpertAnswer]:
    """A packed reply -> each expert's tensors (views) or its failure."""
    pieces = [torch.split(tensor, list(rows)) for tensor in reply.tensors]
    return [reply.errors[p] if p in reply.errors else [piece[p] for piece in pieces] for p in range(len(rows))]


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
    """`forward_packed` for (uid, inputs) pairs (distinct uids, inputs of one shape per position): returns, in the
    same order, each expert's outputs or the failure of that expert alone. Raises one of `CALL_FAILURES` when
    the whole call failed (the server is unreachable, too slow, or answered something unreadable)."""
    rows = [int(inputs[0].shape[0]) for _, inputs in requests]
    reply = await forward_packed(rpc, address, peer_id, [uid for uid, _ in requests], rows,
                                 pack([inputs for _, inputs in requests]), timeout=timeout,
                                 compression=compression, out_shape=out_shape)
    return unpack(reply, rows)


async def backward_batch(
    rpc: RPCNode,
    address: Address,
    peer_id: PeerID | None,
    requests: Sequence[tuple[str, Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    *,
    timeout: float,
    compression: wire.Compression = wire.Compression.NONE,
) -> list[ExpertAnswer]:
    """`backward_packed` for (uid, inputs, grad_outputs) triples: returns each expert's input gradients or its
    failure; raises one of `CALL_FAILURES` when the whole call failed. Each expert applies its optimizer step."""
    rows = [int(inputs[0].shape[0]) for _, inputs, _ in requests]
    reply = await backward_packed(rpc, address, peer_id, [uid for uid, _, _ in requests], rows,
                                  pack([inputs for _, inputs, _ in requests]),
                                  pack([grads for _, _, grads in requests]), timeout=timeout,
                                  compression=compression)
    return unpack(reply, rows)


def peer_unreachable(error: BaseException) -> bool:
    """True when the failure says nothing of this peer can be reached (avoid all its experts), False when only
    this expert failed (it answered with an error, too late, or badly)."""
    return isinstance(error, ConnectionFailed)


__all__ = [
    "BACKWARD", "BACKWARD_BATCH", "CALL_FAILURES", "ExpertAnswer", "FORWARD", "FORWARD_BATCH", "INFO", "METHODS",
    "PackedReply", "backward", "backward_batch", "backward_packed", "call_expert", "forward", "forward_batch",
    "forward_keeping", "forward_packed", "info", "pack", "peer_unreachable", "reply_tensors", "unpack",
]
