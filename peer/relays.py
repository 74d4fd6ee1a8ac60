"""A daemon's part in relaying: a public peer offers the relay service (`--relay-limit`, `--relay-rate`,
`--relay-total-rate`, `--no-relay`); a private one keeps reservations with 2 relays found in the peer directory
and announces the relayed address instead of its own.

Why the announced address is the one thing that changes: every place a daemon publishes where it is reached (its
directory entry, expert declarations, averaging declarations, state announcements) reads the RPC node's announced
address, and every dialer goes through `RPCNode.call`, which understands relayed addresses. So a private peer
setting `rpc.announce` to `relay:...` is reached through its relays everywhere, and a new relay set (one died and
was replaced) is published by the next round of each.

Every daemon (and reachable trainer) upgrades the circuits it dials or accepts by hole punching
(`enable_punching`); `Relaying.stats()` counts direct, upgraded and relayed connections (`connections`).

Trainers (`peer.client.Swarm` with a `reachability`) take part the same way (`serve_reachable`): a trainer that
listens is checked like a daemon, and a private one holds reservations and announces its relayed address, so its
averaging declarations and state announcements carry it and two private trainers can average with each other.
A trainer never offers the relay service (it comes and goes with its training run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from dht.client import DHTClient
from dht.node import DHTNode
from peer.directory import list_peers
from peer.p2p.addresses import announced_address
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.punch import UPGRADE_TIMEOUT, UPGRADE_WINDOW, HolePuncher
from peer.p2p.relay import is_relayed
from peer.p2p.relay_service import RelayReservations, RelayService
from peer.p2p.rpc import RPCNode
from peer.reachability import Reachability, check_reachability, fixed

logger = logging.getLogger(__name__)

RELAYS_WANTED = 2
FIRST_RESERVATION_TIMEOUT = 10.0  # seconds a private daemon waits for its first relay before it goes on without


async def relay_candidates(dht: DHTClient, own: PeerID) -> list[tuple[PeerID, Address]]:
    """Public peers of the directory that say they relay (their summary's `relay`), reached directly."""
    candidates = []
    for entry in await list_peers(dht):
        if entry.summary.get("relay") is True and entry.peer_id != own.hex() and not is_relayed(entry.address):
            candidates.append((PeerID.from_hex(entry.peer_id), entry.address))
    return candidates


@dataclass
class Relaying:
    """What a daemon runs for relays: the service (public) or the reservations (private), or neither."""

    service: RelayService | None = None
    reservations: RelayReservations | None = None
    puncher: HolePuncher | None = None  # upgrades this node's circuits, both ways (`enable_punching`)

    def stats(self) -> dict[str, Any] | None:
        connections = {"connections": self.puncher.stats()} if self.puncher is not None else {}
        if self.service is not None:
            return {"role": "relay", **self.service.stats(), **connections}
        if self.reservations is not None:
            return {"role": "relayed", "relays": [peer.hex() for peer in self.reservations.relays],
                    "rtt_ms": {peer.hex(): round(rtt * 1000, 2) for peer, rtt in self.reservations.rtts.items()},
                    **self.reservations.stats, **connections}
        return {"role": "none", **connections} if connections else None


def enable_punching(rpc: RPCNode) -> HolePuncher:
    """Every circuit `rpc` dials is first offered a hole punch (`peer.p2p.punch`): on success its calls go over
    the direct connection and the circuit closes, otherwise they go through the relay as before."""
    puncher = HolePuncher(rpc, timeout=UPGRADE_TIMEOUT, min_window=UPGRADE_WINDOW)
    rpc.upgrade_circuit = puncher.upgrade
    return puncher


async def run_relaying(rpc: RPCNode, dht: DHTClient, reachability: Reachability, *, limit: int,
                       rate_mb_s: float, total_rate_mb_s: float, offer: bool,
                       task_status: trio.TaskStatus[Relaying] = trio.TASK_STATUS_IGNORED) -> None:
    """Run until cancelled; `started` with the `Relaying` once a public peer's service runs, or once a private
    peer holds its first reservation (or gave up waiting for one: it keeps trying in the background)."""
    puncher = enable_punching(rpc)
    relaying = Relaying(puncher=puncher)
    async with trio.open_nursery() as nursery:
        if reachability.status == "public":
            if offer:
                relaying.service = RelayService(rpc, limit=limit, rate=rate_mb_s * 1e6,
                                                total_rate=total_rate_mb_s * 1e6)
                await nursery.start(relaying.service.run)
            task_status.started(relaying)
            return
        direct = rpc.announced_address
        # connections opened so far (the dial-back check's) told their remotes the direct address in their
        # handshakes: they would keep using it, and nobody can reach it
        rpc.close_connections("this peer is private: reached through relays from now on")

        def changed(address: Address | None) -> None:
            rpc.announce = address if address is not None else direct
            reachability.how = "relay" if address is not None else "none"
            logger.info("reached through %s", f"relays: {address[0]}" if address else "no relay (none found yet)")

        async def candidates() -> list[tuple[PeerID, Address]]:
            return await relay_candidates(dht, rpc.peer_id)

        relaying.reservations = RelayReservations(rpc, candidates, on_change=changed, want=RELAYS_WANTED)
        relaying.reservations.answer_punch = puncher.answer
        nursery.start_soon(relaying.reservations.run)
        with trio.move_on_after(FIRST_RESERVATION_TIMEOUT):
            await relaying.reservations.wait_reserved()
        if not relaying.reservations.relays:
            logger.warning("private, and no relay took a reservation within %.0f s: unreachable until one does",
                           FIRST_RESERVATION_TIMEOUT)
        task_status.started(relaying)


@dataclass
class Reached:
    """How a trainer is reached (`serve_reachable`): the check's outcome and its reservations (private)."""

    reachability: Reachability
    relaying: Relaying

    def stats(self) -> dict[str, Any]:
        return {"reachability": self.reachability.stats(), "relay": self.relaying.stats()}


async def serve_reachable(rpc: RPCNode, dht: DHTNode, host: str, initial_peers: list[Address], mode: str, *,
                          task_status: trio.TaskStatus[Reached] = trio.TASK_STATUS_IGNORED) -> None:
    """A client peer (a trainer) made reachable: listen on `host` at the DHT's port (TCP and UDP share it, so a
    dial-back on either reaches it), find out whether it is `public` or `private` (`mode` auto: dial-backs by
    the initial peers; public / private: as given), and keep relay reservations while private. `started` with
    the `Reached` once the announced address is final for now (a private peer: relayed, or direct after
    `FIRST_RESERVATION_TIMEOUT` without a relay); runs until cancelled."""
    port = dht.address[1]
    try:
        await rpc.listen(host, port)
    except OSError:  # the TCP port of that number is taken: any port (a UDP dial-back then fails: private)
        await rpc.listen(host, 0)
    if rpc.announce is None and rpc.address is not None:
        rpc.announce = await announced_address(host, rpc.address[1], initial_peers, dht.observed_address)
    if mode == "auto":
        reachability = await check_reachability(rpc, initial_peers)
    else:
        reachability = fixed(mode)
    async with trio.open_nursery() as nursery:
        relaying = await nursery.start(lambda task_status: run_relaying(
            rpc, dht, reachability, limit=1, rate_mb_s=1.0, total_rate_mb_s=1.0, offer=False,
            task_status=task_status))
        task_status.started(Reached(reachability, relaying))
        await trio.sleep_forever()  # the reservations (private) run in the nursery; a public peer has none
