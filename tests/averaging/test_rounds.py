"""The outer rounds' trio driver (averaging/rounds.py) between trainers on the in-memory network (mock clock):
what a trainer waiting for the outer step a round would produce hears when that round produced nothing."""

from __future__ import annotations

import trio
import trio.testing

from averaging.quorum import QuorumPolicy, Start
from averaging.rounds import Holding, RoundService
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from tests.sim_peers import start_peers

RUN = "rounds-test"


async def _services(count: int, memory: MemoryNetwork, nursery: trio.Nursery) -> tuple[list, list[RoundService]]:
    peers = await start_peers(nursery, count, memory=memory, prefix="r", with_dht=False,
                              identity_for=lambda name, seed: Identity.from_seed(name.encode() * 4))
    services = []
    for peer in peers:
        service = RoundService(peer.rpc, RUN, QuorumPolicy(), holding=lambda: Holding(3, "h" * 8, ()),
                               expected=lambda step: {}, on_open=lambda step, closes_in: False,
                               address=lambda peer=peer: peer.address)
        services.append(await nursery.start(service.serve))
    return peers, services


async def _start_alone(service: RoundService, address) -> Start:
    """`service` offers its own contribution to round 3, which it coordinates with nobody else expected."""
    reply = await service.join(service.me, {"run": RUN, "step": 3, "base": 3, "samples": 10, "hash": "h" * 8,
                                            "address": list(address)})
    assert "start" in reply, reply
    start = service.rounds[3].core.start
    assert start is not None and start.peers == [service.me]
    return start


async def test_a_waiter_hears_at_once_that_the_round_it_waits_on_produced_nothing(autojump_clock):
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, (coordinator, waiter) = await _services(2, memory, nursery)
        await _start_alone(coordinator, peers[0].address)
        began = trio.current_time()
        answered: list[float] = []

        async def wait() -> None:
            holding = await waiter.await_step(4, [(coordinator.me, peers[0].address)], deadline=began + 60)
            assert holding is None
            answered.append(trio.current_time() - began)

        nursery.start_soon(wait)
        await trio.sleep(0.5)  # the long poll is waiting at the coordinator
        assert not answered
        coordinator.round_failed(3)  # its lone member applied nothing
        await trio.sleep(0.5)
        assert answered and answered[0] < 1.0  # not the deadline, 60 s away
        # a later waiter is answered at once too, until the round is started again
        began = trio.current_time()
        await wait()
        assert answered[1] < 0.1
        nursery.cancel_scope.cancel()


async def test_a_waiter_of_a_round_that_did_not_fail_waits_for_its_outer_step(autojump_clock):
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, (coordinator, waiter) = await _services(2, memory, nursery)
        await _start_alone(coordinator, peers[0].address)
        began = trio.current_time()
        assert await waiter.await_step(4, [(coordinator.me, peers[0].address)], deadline=began + 10) is None
        assert trio.current_time() - began >= 10  # nothing said it would not come: asked until the deadline
        nursery.cancel_scope.cancel()
