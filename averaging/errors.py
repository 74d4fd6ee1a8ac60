"""Typed errors of the averaging package: each one says which peer and which operation it is about.

Shared by the all-reduce, state download and matchmaking modules (matchmaking appends its own classes here).
`LocalViolation` / `RemoteViolation` are raised by the sans-I/O cores (`allreduce_core`, `assembly`):
they tell a driver bug from a misbehaving peer. (Not named `*ProtocolError`: those are the connection
protocol's, `peer.p2p.rpc_protocol`, which has nothing to do with these.) The wire classes at the end are what a
handler answers.
"""

from __future__ import annotations

from typing import Sequence

from peer.p2p.identity import PeerID
from peer.p2p.rpc import BadRequest, RemoteError


class AveragingError(Exception):
    """Base of every averaging error. `peer` is the other side (None when no single peer is to blame),
    `operation` a short name such as "allreduce.push" or "state.download"."""

    def __init__(self, message: str, *, peer: PeerID | None = None, operation: str | None = None):
        super().__init__(message)
        self.peer = peer
        self.operation = operation

    def __str__(self) -> str:
        text = super().__str__()
        where = []
        if self.operation:
            where.append(self.operation)
        if self.peer is not None:
            where.append(f"peer {PeerID(bytes(self.peer)).short()}")
        return f"{text} ({', '.join(where)})" if where else text


class LocalViolation(AveragingError):
    """OUR side asked a protocol core for something the protocol forbids in its current state (commit before the
    data is in, finalize before everyone committed, answer a join that is still pending): a bug in the driver,
    never the remote's fault, so nobody is excluded for it. (The split follows h11: which side broke the
    protocol decides who is blamed.)"""


class RemoteViolation(AveragingError):
    """The OTHER side sent something the protocol forbids (wrong chunk, size, dtype, weight, duplicate, out of
    order, malformed reply). The core rejects the message; the driver counts that peer as failed for the round
    and, on the reducer side, answers it with `BadChunk`."""


class GroupMismatch(AveragingError):
    """The local tensors or group description do not fit the round (no reducer, wrong shapes, not a member)."""


class StateDownloadFailed(AveragingError):
    """No peer could provide its state (all asked peers failed, refused, or sent inconsistent data). `failures`:
    what went wrong with each source tried (`StateSourceError`s), when known."""

    def __init__(self, message: str, *, peer: PeerID | None = None, operation: str | None = None,
                 failures: Sequence[AveragingError] = ()):
        super().__init__(message, peer=peer, operation=operation)
        self.failures = list(failures)


class StateSourceError(AveragingError):
    """One source of a state download failed (unreachable, busy, too slow, refused): the download goes on from
    the others."""


class StateHashMismatch(StateSourceError):
    """The source's state is not the one asked for (another hash than the agreed one, or than the chosen
    holders'): not a lie, it may be at another step; the download does not use it."""


class StateModelMismatch(StateHashMismatch):
    """The source holds another model (other tensor count, shapes or dtypes): no step of it will ever fit ours.
    Logged once per peer (averaging.schema.MISMATCHES), not at every download that meets it."""


class StateSourceCorrupt(StateSourceError):
    """The source sent bytes that do not match their digest, or a manifest whose root is not the hash of its own
    blocks: it is dropped for the rest of the download."""


# ------------------------------------------------------------------------------------------ errors on the wire
# What an all-reduce handler answers to one caller; registered so the caller gets these exact classes.


class SenderExcluded(RemoteError, code="averaging.excluded"):
    """The reducer already counts the caller as failed for this round (it was too slow or reported lost); the
    caller keeps its local values for that part and does not blame the reducer."""


class RoundNotFound(RemoteError, code="averaging.no_round"):
    """The callee is not (or no longer) running the round named in the call."""


class BadChunk(BadRequest, code="averaging.bad_chunk"):
    """A message that does not fit the round: not a member, another partition, wrong chunk, size or dtype."""
