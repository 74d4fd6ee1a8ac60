"""Typed MoE errors. Those an expert server sends are `peer.p2p.rpc.RemoteError` subclasses registered with their
wire code, so a caller catches `ExpertNotFound` or `BadExpertInput` exactly as the server raised it (carrying
the peer, address and method like every RPC error), and can tell "this expert is gone" (try another) from "my
request was wrong" (a bug to report) from "the server broke" (avoid it for a while)."""

from __future__ import annotations

from peer.p2p.rpc import RemoteError


class ExpertNotFound(RemoteError, code="moe.expert_not_found"):
    """The server does not host an expert with that uid (it moved, expired, or never existed)."""


class BadExpertInput(RemoteError, code="moe.bad_input"):
    """The request does not fit the expert's schema: wrong tensor count, shape or dtype, NaN or infinite values,
    a batch larger than the server accepts, or malformed arguments. Only that request fails."""


class ExpertFailed(RemoteError, code="moe.expert_failed"):
    """The expert's module raised while computing the batch this request was part of."""


class ServerShuttingDown(RemoteError, code="moe.server_shutting_down"):
    """The server stopped before it computed this request; the expert may be back later or elsewhere."""


class NotAllowed(RemoteError, code="moe.not_allowed"):
    """The server does not accept this call from the calling peer: its operator lists who may train its experts
    (`peer join --trainers FILE`) or call their forward (`--forward-from FILE`), and the caller's PeerID (proved
    by the RPC handshake) is not on that list. Nothing was computed and the expert's weights are unchanged."""


class CheckpointError(Exception):
    """A checkpoint in the server's directory cannot be loaded into the expert of the same uid (wrong kind or
    size, or a damaged file). Raised at start-up: serving fresh weights silently would lose training."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


# ------------------------------------------------------------------------------ client side (moe/mixture.py)


class BadExpertOutput(Exception):
    """An expert's answer does not fit what was asked (wrong count, shape or dtype, NaN): the expert is treated
    as failed and avoided for a while, like one that did not answer."""

    def __init__(self, uid: str, message: str):
        super().__init__(f"expert {uid}: {message}")
        self.uid = uid
        self.message = message


class NotEnoughExperts(RuntimeError):
    """Some samples got fewer than the required number of expert answers (`k_min` in forward, `backward_k_min` in
    backward). Says how many answered and which experts failed, and why, so a training loop can log one line and
    skip the step or wait for the swarm."""

    def __init__(self, *, stage: str, needed: int, answered: int, samples_short: int, samples: int,
                 failures: dict[str, str]):
        self.stage, self.needed, self.answered = stage, needed, answered
        self.samples_short, self.samples, self.failures = samples_short, samples, failures
        shown = "; ".join(f"{uid}: {why}" for uid, why in list(failures.items())[:8])
        more = f" (+{len(failures) - 8} more)" if len(failures) > 8 else ""
        super().__init__(
            f"{stage}: {samples_short} of {samples} samples got fewer than {needed} expert answers (worst: "
            f"{answered}); {len(failures)} experts failed" + (f": {shown}{more}" if failures else "")
        )
