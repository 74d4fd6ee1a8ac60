"""Peers of another model under my matchmaking key: named once, with what differs (`avg.mm.schema`).

Why a module of its own: this is not matchmaking proper (peers with another schema are simply never grouped,
`Assembly.offer` and the view reader see to that); it is telling the operator why. Each side sees the other's
declaration, asks it for its tensor list once and logs the first difference, so both print one line instead of a
line per round with two hashes nobody can read.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from averaging.assembly import Declaration
from averaging.schema import MISMATCHES, difference
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.rpc import CallContext, RPCError, RPCNode

logger = logging.getLogger("averaging.matchmaking")  # all of matchmaking logs under the driver's name

SCHEMA_METHOD = "avg.mm.schema"  # -> {"schema": [[name, shape, dtype], ...]}: what a peer of another model asks
SCHEMA_TIMEOUT = 3.0


class ForeignSchemas:
    """Names each peer that declares another model once. `description` is `averaging.schema.describe` of my
    tensors, served to such peers; `nursery` (optional) runs the questions, without it only the hashes are named."""

    def __init__(self, rpc: RPCNode, schema: bytes, description: list[list[Any]] | None,
                 nursery: trio.Nursery | None):
        self.rpc = rpc
        self.schema = schema
        self.description = description
        self.nursery = nursery
        self._foreign: set[PeerID] = set()  # peers declaring another schema, already looked into

    async def handle(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        """The `avg.mm.schema` handler: my tensor list, for a peer of another model to say what differs."""
        return {"schema": self.description}

    def notice(self, declaration: Declaration) -> None:
        """A peer under my key declares another model: say so once, naming what differs. Both sides do this
        (each sees the other's declaration), so both print one line; they never group (the schema check)."""
        self.notice_peer(declaration.peer_id, declaration.address, declaration.schema.hex())

    def notice_peer(self, peer: PeerID, address: Address | None, schema: str, where: str = "matchmaking") -> None:
        """The same for a peer known some other way (`schema`: its hash as hex, e.g. from a DiLoCo trainer's
        progress record); `where` names the operation that met it in the line."""
        if peer in self._foreign:
            return
        self._foreign.add(peer)
        if self.nursery is not None and address is not None and self.description is not None:
            self.nursery.start_soon(self._explain, peer, address, schema, where)
        else:
            MISMATCHES.report(bytes(peer), f"model schema {schema} there, {self.schema.hex()} here",
                              logger, f"{where}: peer {peer.short()}")

    async def _explain(self, peer: PeerID, address: Address, schema: str, where: str) -> None:
        differs = f"model schema {schema} there, {self.schema.hex()} here"
        try:
            answer = await self.rpc.call(address, SCHEMA_METHOD, {}, timeout=SCHEMA_TIMEOUT, peer_id=peer)
            theirs = answer.get("schema") if isinstance(answer, dict) else None
            if isinstance(theirs, list) and all(isinstance(t, list) and len(t) == 3 for t in theirs):
                differs = difference(self.description or [], theirs) or differs
        except RPCError as error:  # an older peer, or gone: the hashes are all there is to say
            logger.debug("%s: asking %s for its schema failed: %s", where, peer.short(), error)
        finally:  # also when the owner closes meanwhile: the mismatch is known, and a run's end must find it
            MISMATCHES.report(bytes(peer), differs, logger, f"{where}: peer {peer.short()}")
