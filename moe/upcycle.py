"""Upcycling and export: writing a dense block's weights into served experts, and reading them back, over
authenticated RPCs.

Why an RPC and an allow list: `moe.swarmify(..., upcycle=True)` starts every expert of a layer from the dense
FFN block it replaces, so the swarmified model computes at step 0 exactly what the dense one did. Overwriting
an expert's weights is the most powerful thing a peer can ask of a daemon (one bad write ruins the expert for
every trainer), so a daemon accepts it only from the PeerIDs its operator lists (`peer join
--accept-weights-from PEER_ID`); every RPC caller's PeerID is authenticated by the handshake, so the check is
on who the caller is, not on what it claims. A daemon with an empty list refuses every write.

The write goes through the runtime's `exclusive` slot (no batch of that expert runs meanwhile), replaces the
module's weights and clears the optimizer's state (its moments belong to the old weights).

Reading (`moe.read_weights`, the inverse, used by `moe.export.deswarmify`) is answered to the peers allowed to
train the experts (`peer join --trainers FILE`, anyone who completed the handshake without one) and to those
allowed to write them: whoever may change the weights through backward passes learns them anyway, and nobody else
gets a volunteer's trained weights. The copy is taken through the same `exclusive` slot, so it is one step's
consistent state, never a half-applied optimizer step.
"""

from __future__ import annotations

import abc
from typing import Any, Iterable, Mapping, Sequence

import torch

from moe.errors import BadExpertInput, BadExpertOutput, ExpertNotFound, NotAllowed
from moe.experts import Expert
from moe.server import ExpertServer
from peer.p2p.identity import PeerID
from peer.p2p.rpc import CallContext, RemoteError, RPCNode

WRITE_WEIGHTS = "moe.write_weights"
READ_WEIGHTS = "moe.read_weights"


class WeightsRefused(RemoteError, code="moe.weights_refused"):
    """The daemon does not accept expert weights from the calling peer (not in its --accept-weights-from)."""


class _WeightService(abc.ABC):
    """What the write and the read side share: the expert server, the peers its operator lets write weights
    (`--accept-weights-from`, as hex PeerIDs), a count of refused calls, the one RPC method `register` installs,
    and finding the expert a call names. Subclasses set `method` and answer it in `_handle`."""

    method: str

    def __init__(self, server: ExpertServer, accept_from: Iterable[str]):
        self.server = server
        self.accept_from = {PeerID.from_hex(p).hex() if not isinstance(p, PeerID) else p.hex() for p in accept_from}
        self.refused = 0

    def register(self, rpc: RPCNode) -> None:
        rpc.register(self.method, self._handle)

    @abc.abstractmethod
    async def _handle(self, context: CallContext, args: Any) -> dict[str, Any]:
        """Answer one call of `method`."""

    def _expert(self, uid: str) -> Expert:
        """The expert `uid` names on this server; ExpertNotFound for the caller when there is none."""
        expert = self.server.experts.get(uid)
        if expert is None:
            raise ExpertNotFound(f"no expert {uid[:100]!r} on this server")
        return expert


class WeightWriter(_WeightService):
    """The server side: `moe.write_weights {uid, state: {name: tensor}}` from an allowed peer replaces that
    expert's weights. `register(rpc)` once the expert server runs (the daemon does it)."""

    method = WRITE_WEIGHTS

    def __init__(self, server: ExpertServer, accept_from: Iterable[str]):
        super().__init__(server, accept_from)
        self.written = 0

    async def _handle(self, context: CallContext, args: Any) -> dict[str, Any]:
        caller = context.peer_id.hex()
        if caller not in self.accept_from:
            self.refused += 1
            raise WeightsRefused(f"peer {caller} may not write expert weights here (not in --accept-weights-from)")
        if not (isinstance(args, dict) and isinstance(args.get("uid"), str) and isinstance(args.get("state"), dict)):
            raise BadExpertInput("expected arguments {'uid': str, 'state': {name: tensor}}")
        expert = self._expert(args["uid"])
        state = _checked_state(expert, args["state"])
        await self.server.runtime.exclusive(expert.uid, lambda e: _load(e, state))
        self.written += 1
        return {"uid": expert.uid, "tensors": len(state)}


class WeightReader(_WeightService):
    """The server side of export: `moe.read_weights {uid}` -> `{uid, kind, hidden_dim, steps, state}` for a peer
    that may train the experts (the server's `trainers` policy) or write them (`accept_from`); NotAllowed
    otherwise. `register(rpc)` once the expert server runs (the daemon does it, beside the WeightWriter)."""

    method = READ_WEIGHTS

    def __init__(self, server: ExpertServer, accept_from: Iterable[str] = ()):
        super().__init__(server, accept_from)
        self.read = 0

    async def _handle(self, context: CallContext, args: Any) -> dict[str, Any]:
        if not (self.server.trainers.allows(context) or context.peer_id.hex() in self.accept_from):
            self.refused += 1
            raise NotAllowed(f"peer {context.peer_id.hex()} may not read expert weights here (not in "
                             f"{self.server.trainers.source})")
        if not (isinstance(args, dict) and isinstance(args.get("uid"), str)):
            raise BadExpertInput("expected arguments {'uid': str}")
        expert = self._expert(args["uid"])
        state, steps = await self.server.runtime.exclusive(expert.uid, _snapshot)
        self.read += 1
        return {"uid": expert.uid, "kind": expert.kind, "hidden_dim": expert.hidden_dim, "steps": steps,
                "state": state}


def _snapshot(expert: Expert) -> tuple[dict[str, torch.Tensor], int]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in expert.module.state_dict().items()}, \
        expert.steps


def _checked_state(expert: Expert, state: Mapping[Any, Any]) -> dict[str, torch.Tensor]:
    own = expert.module.state_dict()
    if set(state) != set(own):
        raise BadExpertInput(f"{expert.uid}: expected tensors {sorted(own)}, got {sorted(map(str, state))}")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(own[name].shape):
            raise BadExpertInput(f"{expert.uid}: {name} must be a tensor of shape {tuple(own[name].shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise BadExpertInput(f"{expert.uid}: {name} holds NaN or infinite values")
    return dict(state)


def _load(expert: Expert, state: dict[str, torch.Tensor]) -> None:
    expert.module.load_state_dict(state)
    expert.optimizer.state.clear()


async def write_weights(rpc: RPCNode, experts: Sequence[tuple[str, Any]], state: Mapping[str, torch.Tensor], *,
                        timeout: float) -> int:
    """Write `state` into every expert of `experts` ((uid, ExpertLocation) pairs), one after the other; returns how
    many were written. The first refusal or failure raises as the RPC raised it (a half-upcycled layer would not
    compute the dense block, so the caller must not go on)."""
    for uid, location in experts:
        await rpc.call(location.address, WRITE_WEIGHTS, {"uid": uid, "state": dict(state)}, timeout=timeout,
                       peer_id=PeerID.from_hex(location.peer_id_hex))
    return len(experts)


async def read_weights(rpc: RPCNode, uid: str, location: Any, *, timeout: float) -> dict[str, Any]:
    """The current weights of expert `uid` served at `location` (an ExpertLocation): `{uid, kind, hidden_dim,
    steps, state: {name: tensor}}`, checked (every tensor finite; the reply names the uid asked). Raises the RPC's
    errors (NotAllowed when this peer may not train the expert) and BadExpertOutput for a malformed reply."""
    reply = await rpc.call(location.address, READ_WEIGHTS, {"uid": uid}, timeout=timeout,
                           peer_id=PeerID.from_hex(location.peer_id_hex))
    state = reply.get("state") if isinstance(reply, dict) else None
    if not isinstance(state, dict) or reply.get("uid") != uid or not state:
        raise BadExpertOutput(uid, "expected {'uid': uid, 'state': {name: tensor}} from moe.read_weights")
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise BadExpertOutput(uid, "moe.read_weights: state must map names to tensors")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise BadExpertOutput(uid, f"moe.read_weights: {name} holds NaN or infinite values")
    return dict(reply)
