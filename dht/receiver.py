"""`Receiver`: the node's receive loop -- every datagram that reaches its UDP endpoint goes through here.

Why a loop of its own: what comes in is hostile until proven otherwise, and the order of the checks is what keeps
a flood cheap. A request datagram is first charged to its source IP on its first byte, before any decoding
(policy.IPRequestLimit); then `protocol.DatagramProtocol` decodes and checks it (a drop is counted by reason);
a reply wakes the request waiting for it (dht/requests.py); a request is charged to its source address
(peers.PeerBook) and answered by the sans-I/O `Server`. A sender the routing table does not hold is pinged back
before it may enter it (policy.Contacts.heard_request): an id nobody answers for never gets in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Callable

import trio

from dht import protocol as proto
from dht.background import BackgroundTasks
from dht.config import DHTConfig
from dht.errors import RequestTimeout
from dht.peers import PeerBook
from dht.policy import Contacts, IPRequestLimit
from dht.requests import Requester
from dht.server import NO_REPLY, Server
from peer.p2p.net import Address, UDPEndpoint


@dataclass(eq=False)
class Receiver:
    """Reads datagrams until the endpoint closes (or the node's nursery is cancelled) and dispatches them."""

    peer_id: bytes
    endpoint: UDPEndpoint
    protocol: proto.DatagramProtocol
    _: KW_ONLY
    config: InitVar[DHTConfig]
    clock: Callable[[], float]  # the DHT clock, for the expirations of stored records
    peers: PeerBook
    contacts: Contacts
    server: Server
    requester: Requester
    tasks: BackgroundTasks
    dropped: Counter[str]
    _ip_limit: IPRequestLimit = field(init=False)

    def __post_init__(self, config: DHTConfig) -> None:
        self._ip_limit = IPRequestLimit(config.ip_requests_per_second, config.ip_request_burst)

    async def run(self) -> None:
        """The receive loop; returns when the endpoint is closed."""
        while True:
            try:
                data, address = await self.endpoint.recvfrom()
            except (trio.ClosedResourceError, OSError):
                return
            try:
                await self._handle_datagram(data, address)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            except Exception:
                # Whatever a datagram triggers, the node keeps serving; the bug shows up as a counter.
                self.dropped["handler_error"] += 1

    async def _handle_datagram(self, data: bytes, address: Address) -> None:
        if data[:1] == b"\x00" and not self._ip_limit.allow(address[0], trio.current_time()):
            self.dropped["ip_rate_limited"] += 1  # refused before decoding: see policy.IPRequestLimit
            return
        event = self.protocol.receive(data, address)
        if isinstance(event, proto.Dropped):
            self.dropped[event.reason] += 1
            return
        if isinstance(event, proto.Reply):
            self.requester.deliver(event)
            return
        if not self.peers.allow_request(address, trio.current_time()):
            self.dropped["rate_limited"] += 1
            return
        outcome = self.server.handle(event, self.clock(), trio.current_time())
        if outcome.verify is not None:
            self.tasks.spawn(self._verify, outcome.verify)
        if outcome.reply is NO_REPLY:
            return
        await self.endpoint.sendto(self.protocol.reply(event, outcome.reply), address)

    async def _verify(self, address: Address) -> None:
        """Ping back a sender the table does not hold (policy.Contacts.heard_request): if it answers, the id in
        its answer enters the table (in `Requester.request`)."""
        answered = False
        try:
            await self.requester.request(address, "ping", [self.peer_id])
            answered = True
        except RequestTimeout:
            pass
        finally:
            self.contacts.verification_done(address, answered, trio.current_time())
