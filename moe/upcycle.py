"""Upcycling: writing a dense block's weights into served experts, over an authenticated RPC.

Why an RPC and an allow list: `moe.swarmify(..., upcycle=True)` starts every expert of a layer from the dense
FFN block it replaces, so the swarmified model computes at step 0 exactly what the dense one did. Overwriting
an expert's weights is the most powerful thing a peer can ask of a daemon (one bad write ruins the expert for
every trainer), so a daemon accepts it only from the PeerIDs its operator lists (`peer join
--accept-weights-from PEER_ID`); every RPC caller's PeerID is authenticated by the handshake, so the check is
on who the caller is, not on what it claims. A daemon with an empty list refuses every write.

The write goes through the runtime's `exclusive` slot (no batch of that expert runs meanwhile), replaces the
module's weights and clears the optimizer's state (its moments belong to the old weights).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from moe.errors import BadExpertInput, ExpertNotFound
from moe.experts import Expert
from moe.server import ExpertServer
from peer.p2p.identity import PeerID
from peer.p2p.rpc import CallContext, RemoteError, RPCNode, register_error_code

WRITE_WEIGHTS = "moe.write_weights"


class WeightsRefused(RemoteError):
    """The daemon does not accept expert weights from the calling peer (not in its --accept-weights-from)."""

    code = "moe.weights_refused"


register_error_code(WeightsRefused.code, WeightsRefused)


class WeightWriter:
    """The server side: `moe.write_weights {uid, state: {name: tensor}}` from an allowed peer replaces that
    expert's weights. `register(rpc)` once the expert server runs (the daemon does it)."""

    def __init__(self, server: ExpertServer, accept_from: Iterable[str]):
        self.server = server
        self.accept_from = {PeerID.from_hex(p).hex() if not isinstance(p, PeerID) else p.hex() for p in accept_from}
        self.written = 0
        self.refused = 0

    def register(self, rpc: RPCNode) -> None:
        rpc.register(WRITE_WEIGHTS, self._handle)

    async def _handle(self, context: CallContext, args: Any) -> dict[str, Any]:
        caller = context.peer_id.hex()
        if caller not in self.accept_from:
            self.refused += 1
            raise WeightsRefused(f"peer {caller} may not write expert weights here (not in --accept-weights-from)")
        if not (isinstance(args, dict) and isinstance(args.get("uid"), str) and isinstance(args.get("state"), dict)):
            raise BadExpertInput("expected arguments {'uid': str, 'state': {name: tensor}}")
        expert = self.server.experts.get(args["uid"])
        if expert is None:
            raise ExpertNotFound(f"no expert {args['uid'][:100]!r} on this server")
        state = _checked_state(expert, args["state"])
        await self.server.runtime.exclusive(expert.uid, lambda e: _load(e, state))
        self.written += 1
        return {"uid": expert.uid, "tensors": len(state)}


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
