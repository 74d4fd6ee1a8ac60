"""Is this peer reachable from the swarm? Up to 3 peers dial it back, on TCP (a fresh RPC connection and
handshake) and on UDP (a DHT `stun` from a fresh port), at the address it announces.

Why dial-backs and not a guess from the local address: behind a home router's MASQUERADE or a campus firewall a
peer can talk to everyone (its own connections are let through) while nobody can open one to it. Such a peer
must not sit in others' DHT routing tables or hold DHT records: every lookup through it would stall, and keys
it held would come and go with its NAT mappings (what hivemind users report of relayed peers, and why Petals lets
only directly reachable servers hold keys). So a daemon starts its DHT node in client mode and becomes a server
(`DHTNode.become_server`) only once the dial-backs succeed: a private peer is never in anyone's table.

The outcome is `public` when most of the asked peers that answered reached it on both TCP and UDP; `private`
otherwise. Nobody answering (a new swarm's first peer, or peers of a version without the method) is `public`
as before, marked unverified. `--reachability public|private` skips the check.

A helper dials only the address the caller announced in its own signed handshake, one dial-back per caller at a
time and `MAX_CONCURRENT` in all, so the method cannot be used to make a peer connect to arbitrary places fast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import trio

from dht.node import DHTNode
from peer.p2p.net import Address
from peer.p2p.rpc import CallContext, RemoteError, RPCError, RPCNode

logger = logging.getLogger(__name__)

DIAL_BACK_METHOD = "reach.dial_back"
MODES = ("auto", "public", "private")
HELPERS = 3  # peers asked to dial back
DIAL_TIMEOUT = 3.0  # seconds a helper tries each dial-back
MAX_CONCURRENT = 8  # dial-backs a helper runs at once


class DialBackRefused(RemoteError, code="reach.refused"):
    """The helper will not dial back now (the caller announced no address, or too many dial-backs run)."""


@dataclass
class Reachability:
    """What a peer found out: `status` public or private; `how` says how it is reached (`direct`, or `none`
    for a private peer until relays exist); `asked` / `tcp` / `udp` count the helpers and their successes."""

    status: str
    how: str
    source: str  # "dial-back", "--reachability", or "unverified" (nobody answered, or nobody to ask)
    asked: int = 0
    answered: int = 0
    tcp: int = 0
    udp: int = 0
    both: int = 0
    errors: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """The join line's words, e.g. `public, reached directly (dialed back by 2 of 2 peers)`."""
        reached = {"direct": "reached directly", "relay": "reached through relays, DHT client mode"}.get(
            self.how, "not reachable from outside: DHT client mode")
        if self.source == "dial-back":
            check = f"dialed back on TCP and UDP by {self.both} of {self.answered} peers"
        elif self.source == "unverified":
            check = "unverified: no peer answered a dial-back request" if self.asked else "unverified: a new swarm"
        else:
            check = "set by --reachability"
        return f"{self.status}, {reached} ({check})"

    def stats(self) -> dict[str, Any]:
        return {"status": self.status, "how": self.how, "source": self.source, "asked": self.asked,
                "answered": self.answered, "tcp_dial_backs": self.tcp, "udp_dial_backs": self.udp}


class DialBackService:
    """The helper's side: `reach.dial_back` dials the caller's announced address back on TCP and UDP."""

    def __init__(self, rpc: RPCNode, dht: DHTNode, *, timeout: float = DIAL_TIMEOUT):
        self.rpc, self.dht, self.timeout = rpc, dht, timeout
        self._busy: set[bytes] = set()

    def register(self) -> None:
        self.rpc.register(DIAL_BACK_METHOD, self.handle)

    async def handle(self, context: CallContext, args: Any) -> dict[str, bool]:
        address = context.address
        if address is None:
            raise DialBackRefused("no address announced in the handshake: nothing to dial back")
        if context.peer_id in self._busy or len(self._busy) >= MAX_CONCURRENT:
            raise DialBackRefused("a dial-back for this peer is running, or too many are")
        self._busy.add(context.peer_id)
        try:
            tcp = udp = False

            async def dial_tcp() -> None:
                nonlocal tcp
                try:
                    await self.rpc.probe(address, peer_id=context.peer_id, timeout=self.timeout)
                    tcp = True
                except RPCError as error:
                    logger.debug("TCP dial-back to %s:%s failed: %s", address[0], address[1], error)

            async def dial_udp() -> None:
                nonlocal udp
                udp = await self.dht.udp_dial_back(address, timeout=self.timeout)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(dial_tcp)
                nursery.start_soon(dial_udp)
            return {"tcp": tcp, "udp": udp}
        finally:
            self._busy.discard(context.peer_id)


async def check_reachability(rpc: RPCNode, helpers: Sequence[Address], *,
                             timeout: float = 2 * DIAL_TIMEOUT + 2.0) -> Reachability:
    """Ask up to `HELPERS` of `helpers` to dial this peer back at its announced address; see the module
    docstring for the rule."""
    asked = list(helpers)[:HELPERS]
    result = Reachability("public", "direct", "unverified", asked=len(asked))

    async def ask(address: Address) -> None:
        try:
            reply = await rpc.call(address, DIAL_BACK_METHOD, None, timeout=timeout)
        except RPCError as error:
            result.errors.append(str(error))
            return
        if isinstance(reply, dict):
            tcp, udp = reply.get("tcp") is True, reply.get("udp") is True
            result.answered += 1
            result.tcp += tcp
            result.udp += udp
            result.both += tcp and udp

    async with trio.open_nursery() as nursery:
        for address in asked:
            nursery.start_soon(ask, address)
    if result.answered:
        result.source = "dial-back"
        if 2 * result.both <= result.answered:
            result.status, result.how = "private", "none"
    return result


def fixed(mode: str) -> Reachability:
    """`--reachability public|private`: no check."""
    return Reachability(mode, "direct" if mode == "public" else "none", "--reachability")
