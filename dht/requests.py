"""`Requester`: one request to one peer and its reply, and what the answer -- or the silence -- says about that peer.

Every request the node sends goes through `Requester.request`, because the bookkeeping an answer or a timeout
implies must never be skipped: the peer's RTT estimate (which paces lookups), its failure count (after
`failures_to_evict` unanswered requests it leaves the routing table, and a table emptied that way means the node
is cut off), a contact that answered again (healing), and the routing-table entry of a server that answered
(dht/policy.py `Contacts.answered`: a bucket-head check, a welcome). The `swarmd_hello` capability probe is here
too: it is a request whose silence means "stock peer" rather than a failure.

Replies reach their waiting request through `deliver`, called by the receive loop (dht/receiver.py); a reply is
matched by msg id *and* address (dht/protocol.py).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import trio
from kademlia.node import Node

from dht import protocol as proto
from dht.background import BackgroundTasks
from dht.config import DHTConfig
from dht.errors import RequestTimeout
from dht.peers import PeerBook
from dht.policy import Admission, Contacts
from dht.routing import RoutingTable
from peer.p2p.net import Address, UDPEndpoint


@dataclass
class _Waiter:
    event: trio.Event
    result: Any = None
    answered: bool = False


class Requester:
    """Sends the node's requests over its endpoint and keeps each peer's standing up to date with the outcome.

    `on_cut_off(reason)` is called when a failure evicted the routing table's last contact; `welcome(node)` when a
    server new to the table should be handed the records it ought to hold (dht/replication.py)."""

    def __init__(self, peer_id: bytes, endpoint: UDPEndpoint, protocol: proto.DatagramProtocol, *,
                 client_mode: bool, config: DHTConfig, table: RoutingTable, peers: PeerBook, contacts: Contacts,
                 tasks: BackgroundTasks, rng: random.Random, healing: Counter[str],
                 on_cut_off: Callable[[str], None], welcome: Callable[[Node], None]):
        self.peer_id = peer_id
        self.client_mode = client_mode  # said in our swarmd_hello; a promoted node (become_server) clears it
        self._endpoint = endpoint
        self._protocol = protocol
        self._config = config
        self._table = table
        self._peers = peers
        self._contacts = contacts
        self._tasks = tasks
        self._rng = rng  # the node's (seeded in simulations: failure backoffs stay reproducible)
        self._healing = healing
        self._on_cut_off = on_cut_off
        self._welcome = welcome
        self._waiters: dict[bytes, _Waiter] = {}
        self._probes: dict[Address, trio.Event] = {}  # swarmd_hello in flight, per address

    def deliver(self, reply: proto.Reply) -> None:
        """A reply came in (the receive loop): wake the request waiting for it, if any still is."""
        waiter = self._waiters.get(reply.msg_id)
        if waiter is not None:
            waiter.result, waiter.answered = reply.result, True
            waiter.event.set()

    async def request(self, address: Address, name: str, args: list[Any], node_id: bytes | None = None,
                      timeout: float | None = None) -> Any:
        """Send one request and wait for its reply (matched by msg id and address); RequestTimeout after
        `timeout` (default: the hard timeout). A reply refreshes the peer's RTT and its routing-table entry."""
        msg_id, datagram = self._protocol.request(address, name, args)
        waiter = _Waiter(trio.Event())
        self._waiters[msg_id] = waiter
        sent_at = trio.current_time()
        try:
            await self._endpoint.sendto(datagram, address)
            with trio.move_on_after(self._config.max_timeout if timeout is None else timeout):
                await waiter.event.wait()
        finally:
            self._waiters.pop(msg_id, None)
            self._protocol.forget(msg_id)
        if not waiter.answered:
            if self._peers.record_failure(address, trio.current_time(), self._rng.random()) and node_id is not None:
                if self._table.remove(node_id):
                    self._healing["evictions"] += 1
                    if not len(self._table):
                        self._on_cut_off("every contact in the routing table stopped answering")
            raise RequestTimeout(f"{name} to {address[0]}:{address[1]} got no answer", operation=name,
                                 peer=address)
        self._peers.observe_rtt(address, trio.current_time() - sent_at)
        if name == "ping" and isinstance(waiter.result, bytes) and len(waiter.result) == proto.NODE_ID_BYTES:
            node_id = waiter.result
        if self._peers.record_answer(address, trio.current_time(), node_id):
            self._healing["contacts_restored"] += 1
        if node_id is not None:
            self._admit(self._contacts.answered(node_id, address, trio.current_time()))
        return waiter.result

    async def ping_all(self, addresses: list[Address], timeout: float,
                       node_ids: dict[Address, bytes] | None = None) -> list[Address]:
        """Ping every address at once; returns those that answered (each answering server enters the table).
        With a known node id a failure counts against that contact (it may be evicted)."""
        answered: list[Address] = []

        async def ping(address: Address) -> None:
            try:
                await self.request(address, "ping", [self.peer_id], timeout=timeout,
                                   node_id=(node_ids or {}).get(address))
                answered.append(address)
            except RequestTimeout:
                pass

        async with trio.open_nursery() as nursery:
            for address in addresses:
                nursery.start_soon(ping, address)
        return answered

    # ------------------------------------------------------------------------------------- the routing table

    def _admit(self, admission: Admission) -> None:
        """Execute what a server's arrival in the table asks for: a bucket-head check, a welcome."""
        if admission.check_head is not None:
            self._tasks.spawn(self._check_head, admission.check_head)
        if admission.welcome is not None:
            self._welcome(admission.welcome)

    async def _check_head(self, head: Node) -> None:
        """A full bucket met a newcomer: ping its least recently seen contact; after repeated failures it is
        evicted (in `request`) and the freshest replacement takes its place."""
        try:
            for _ in range(self._config.failures_to_evict):
                try:
                    await self.request((head.ip, head.port), "ping", [self.peer_id], node_id=head.id)
                    return
                except RequestTimeout:
                    continue
        finally:
            self._contacts.head_check_done(head.id)

    # ------------------------------------------------------------------------------------ capability probes

    async def probe(self, address: Address) -> bool:
        """Does the peer speak the swarmd extensions? Learned once per address."""
        if self._contacts.needs_probe(address):
            done = self._probes.get(address)
            if done is None:
                done = await self._start_probe(address)
            await done.wait()
        return bool(self._peers.get(address).swarmd)

    async def _start_probe(self, address: Address) -> trio.Event:
        """Send a `swarmd_hello` now and collect its answer in the background; the event fires when the
        peer's capability is known (an answer) or assumed stock (silence for a short, RTT-derived time)."""
        done = trio.Event()
        self._probes[address] = done
        msg_id, datagram = self._protocol.request(address, "swarmd_hello",
                                                  [self.peer_id, {"client": self.client_mode}])
        waiter = _Waiter(trio.Event())
        self._waiters[msg_id] = waiter
        try:
            await self._endpoint.sendto(datagram, address)
        except BaseException:
            self._waiters.pop(msg_id, None)
            self._protocol.forget(msg_id)
            self._probes.pop(address, None)
            done.set()
            raise
        self._tasks.spawn(self._finish_probe, address, msg_id, waiter, trio.current_time(), done)
        return done

    async def _finish_probe(self, address: Address, msg_id: bytes, waiter: _Waiter, sent_at: float,
                            done: trio.Event) -> None:
        try:
            wait = self._contacts.probe_wait(address, self._config.probe_timeout, self._config.max_timeout)
            with trio.move_on_after(wait):
                await waiter.event.wait()
        finally:
            self._waiters.pop(msg_id, None)
            self._protocol.forget(msg_id)
            if self._probes.get(address) is done:
                del self._probes[address]
            done.set()
        if waiter.answered:
            self._peers.observe_rtt(address, trio.current_time() - sent_at)
            self._contacts.learn_hello(address, waiter.result)
        else:
            self._contacts.probe_silent(address)
