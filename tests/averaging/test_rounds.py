"""The outer rounds' trio driver (averaging/rounds.py) between trainers on the in-memory network (mock clock):
what a trainer waiting for the outer step a round would produce hears when that round produced nothing."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from averaging.quorum import Offer, QuorumPolicy, Start, coordinator_order
from averaging.rounds import Holding, RoundService
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.p2p.rpc import BadRequest
from peer.testing.sim_peers import start_peers

RUN = "rounds-test"


async def _services(count: int, memory: MemoryNetwork, nursery: trio.Nursery,
                    opened: list | None = None) -> tuple[list, list[RoundService]]:
    """`count` trainers holding outer step 3, expecting nobody; they record the openings they are told of in
    `opened` and answer that they come."""
    peers = await start_peers(nursery, count, memory=memory, prefix="r", with_dht=False,
                              identity_for=lambda name, seed: Identity.from_seed(name.encode() * 4))
    services = []
    for index, peer in enumerate(peers):
        def on_open(step: int, closes_in: float, index: int = index) -> bool:
            if opened is not None:
                opened.append((index, step))
            return True

        service = RoundService(peer.rpc, RUN, QuorumPolicy(), holding=lambda: Holding(3, "h" * 8, ()),
                               expected=lambda step: {}, on_open=on_open, address=lambda peer=peer: peer.address)
        services.append(await nursery.start(service.serve))
    return peers, services


async def _start_alone(service: RoundService, address) -> Start:
    """`service` offers its own contribution to round 3, which it coordinates with nobody else expected (nor
    told of)."""
    reply = await service.join(service.me, {"run": RUN, "step": 3, "base": 3, "samples": 10, "hash": "h" * 8,
                                            "address": list(address)})
    assert "start" in reply, reply
    start = service.rounds[3].core.start
    assert start is not None and start.peers == [service.me]
    return start


async def _waiter_on_a_lone_round(nursery: trio.Nursery) -> tuple[RoundService, RoundService, list]:
    """Two trainers: the coordinator has started round 3 alone (`_start_alone`), the waiter has not joined it;
    returns (coordinator, waiter, the [(peer id, address)] of the coordinator that `await_step` asks)."""
    peers, (coordinator, waiter) = await _services(2, MemoryNetwork(latency=0.01, seed=1), nursery)
    await _start_alone(coordinator, peers[0].address)
    return coordinator, waiter, [(coordinator.me, peers[0].address)]


async def test_a_waiter_hears_at_once_that_the_round_it_waits_on_produced_nothing(autojump_clock):
    async with trio.open_nursery() as nursery:
        coordinator, waiter, coordinators = await _waiter_on_a_lone_round(nursery)
        began = trio.current_time()
        answered: list[float] = []

        async def wait() -> None:
            holding = await waiter.await_step(4, coordinators, deadline=began + 60)
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


async def test_a_waiter_hears_at_once_from_the_lone_member_of_a_round_another_coordinated(autojump_clock):
    """The end of a run: a coordinator that is finishing starts round 3 with one member (itself not in it); that
    member applies nothing, and a trainer told to catch up to outer step 4 from it must hear so at once."""
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, (member, waiter) = await _services(2, memory, nursery)
        began = trio.current_time()
        answered: list[float] = []

        async def wait() -> None:
            assert await waiter.await_step(4, [(member.me, peers[0].address)], deadline=began + 60) is None
            answered.append(trio.current_time() - began)

        nursery.start_soon(wait)
        await trio.sleep(0.5)
        assert not answered and 3 not in member.rounds  # it did not coordinate round 3
        member.alone_in(3)
        await trio.sleep(0.5)
        assert answered and answered[0] < 1.0  # not the deadline, 60 s away
        nursery.cancel_scope.cancel()


async def test_a_round_whose_lone_member_applied_nothing_is_started_again_for_the_next_offer(autojump_clock):
    """A coordinator that was catching up started round 3 with one member, not itself; the member, with others
    live, applied nothing. The next offerer must get a round, not "late" for a step nobody will hold (a whole
    churn run stalled at one outer step that way)."""
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, (coordinator, member, offerer) = await _services(3, memory, nursery)

        def offer(service: RoundService, peer) -> dict:
            return {"run": RUN, "step": 3, "base": 3, "samples": 10, "hash": "h" * 8, "address": list(peer.address),
                    "insist": True}

        first = await coordinator.join(member.me, offer(member, peers[1]))
        assert "start" in first and coordinator.rounds[3].core.start.peers == [member.me]
        member.alone_in(3)  # `DiLoCoOptimizer._average`: alone while others are live, nothing applied
        again = await coordinator.join(offerer.me, offer(offerer, peers[2]))
        assert "late" not in again, again
        assert coordinator.rounds[3].core.start is None or offerer.me in coordinator.rounds[3].core.start.peers
        nursery.cancel_scope.cancel()


async def test_a_round_whose_lone_member_holds_the_next_step_is_late_for_the_next_offer(autojump_clock):
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 3, memory=memory, prefix="r", with_dht=False,
                                  identity_for=lambda name, seed: Identity.from_seed(name.encode() * 4))
        services = []
        for index, peer in enumerate(peers):
            step = 4 if index == 1 else 3  # the member applied the round alone (nobody else was live for it)
            service = RoundService(peer.rpc, RUN, QuorumPolicy(), holding=lambda step=step: Holding(step, "h" * 8, ()),
                                   expected=lambda step: {}, on_open=lambda step, closes_in: True,
                                   address=lambda peer=peer: peer.address)
            services.append(await nursery.start(service.serve))
        coordinator, member, offerer = services
        args = {"run": RUN, "step": 3, "base": 3, "samples": 10, "hash": "h" * 8, "insist": True}
        assert "start" in await coordinator.join(member.me, {**args, "address": list(peers[1].address)})
        assert "late" in await coordinator.join(offerer.me, {**args, "address": list(peers[2].address)})
        nursery.cancel_scope.cancel()


async def test_a_waiter_of_a_round_that_did_not_fail_waits_for_its_outer_step(autojump_clock):
    async with trio.open_nursery() as nursery:
        coordinator, waiter, coordinators = await _waiter_on_a_lone_round(nursery)
        began = trio.current_time()
        assert await waiter.await_step(4, coordinators, deadline=began + 10) is None
        assert trio.current_time() - began >= 10  # nothing said it would not come: asked until the deadline
        nursery.cancel_scope.cancel()


def _roles(peers: list, services: list[RoundService]) -> tuple[int, int]:
    """(index of round 3's coordinator by rank, index of the other)."""
    first = coordinator_order(RUN, 3, [s.me for s in services])[0]
    index = [s.me for s in services].index(first)
    return index, 1 - index


async def test_a_joiner_that_registered_its_intent_is_told_when_the_window_opens(autojump_clock):
    memory = MemoryNetwork(latency=0.01, seed=1)
    opened: list = []
    async with trio.open_nursery() as nursery:
        peers, services = await _services(2, memory, nursery, opened)
        c, j = _roles(peers, services)
        coordinator, joiner = services[c], services[j]
        joiner.note(coordinator.me, peers[c].address)
        offer = Offer(joiner.me, 3, 0, "h" * 8, peers[j].address)
        assert await joiner.intend(3, offer, timeout=10)
        round_ = coordinator.rounds[3]
        assert joiner.me in round_.core.expected and joiner.me not in round_.core.offers  # expected, not ready
        # the coordinator's own contribution opens the window: the joiner is told, and says it comes
        reply = await coordinator.join(coordinator.me, {"run": RUN, "step": 3, "base": 3, "samples": 10,
                                                        "hash": "h" * 8, "address": list(peers[c].address)})
        assert "queued" in reply
        await trio.sleep(0.5)
        assert opened == [(j, 3)]
        assert round_.core.start is None  # waiting for the joiner, who is coming
        nursery.cancel_scope.cancel()


async def test_an_intent_for_a_round_that_started_is_not_taken(autojump_clock):
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, services = await _services(2, memory, nursery)
        c, j = _roles(peers, services)
        coordinator, joiner = services[c], services[j]
        await _start_alone(coordinator, peers[c].address)
        joiner.note(coordinator.me, peers[c].address)
        offer = Offer(joiner.me, 3, 0, "h" * 8, peers[j].address)
        assert not await joiner.intend(3, offer, timeout=10)  # late: it offers its contribution later instead
        nursery.cancel_scope.cancel()


async def test_an_offers_chain_reaches_the_core_and_a_malformed_one_is_refused(autojump_clock):
    """The (outer step, hash) pairs that vouch for trainers behind on a chain travel with the offer; a chain that
    is not a short list of pairs is the sender's protocol error, refused before it reaches the round."""
    async with trio.open_nursery() as nursery:
        peers, services = await _services(1, MemoryNetwork(), nursery)
        service = services[0]
        args = {"run": RUN, "step": 3, "base": 3, "samples": 10, "hash": "h" * 8, "address": list(peers[0].address)}
        for chain in ([[2]], [[2, 5]], "x", [[1, "a"]] * 65):
            with pytest.raises(BadRequest, match="bad chain"):
                await service.join(service.me, {**args, "chain": chain})
        await service.join(service.me, {**args, "chain": [[2, "g" * 8], [3, "h" * 8]]})
        offer, _ = service.rounds[3].core.offers[service.me]
        assert offer.chain == ((2, "g" * 8), (3, "h" * 8))
        nursery.cancel_scope.cancel()


async def test_an_offer_to_my_own_round_gives_up_at_its_deadline(autojump_clock):
    """`enter` bounds its offers to other coordinators by their RPC deadlines; an offer to its own round is
    answered without the network, and its long poll returns queued again at each poll limit: it polled past the
    deadline for as long as the round did not start (a round only offers from behind are ready for never starts;
    here, one that waits for a trainer that intends to come, up to `max_wait`)."""
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, services = await _services(2, memory, nursery)
        c, j = _roles(peers, services)
        coordinator, joiner = services[c], services[j]
        joiner.note(coordinator.me, peers[c].address)
        assert await joiner.intend(3, Offer(joiner.me, 3, 0, "h" * 8, peers[j].address), timeout=10)
        began = trio.current_time()
        verdict = await coordinator.enter(3, Offer(coordinator.me, 3, 10, "h" * 8, peers[c].address),
                                          deadline=began + 5.0)
        assert verdict is None and trio.current_time() - began <= 5.0 + 0.1
        assert coordinator.rounds[3].core.start is None  # the round itself still waits (max_wait is 30 s)
        nursery.cancel_scope.cancel()


async def _three_expecting_each_other(memory: MemoryNetwork, nursery: trio.Nursery
                                     ) -> tuple[list, list[bytes], list[RoundService]]:
    """Three trainers holding outer step 3, each knowing and expecting the two others: (peers, ids, services)."""
    peers = await start_peers(nursery, 3, memory=memory, prefix="r", with_dht=False,
                              identity_for=lambda name, seed: Identity.from_seed(name.encode() * 4))
    ids = [bytes(p.rpc.peer_id) for p in peers]
    everyone = {ids[i]: peers[i].address for i in range(3)}
    services = []
    for index, peer in enumerate(peers):
        service = RoundService(
            peer.rpc, RUN, QuorumPolicy(), holding=lambda: Holding(3, "h" * 8, ()),
            expected=lambda step, me=ids[index]: {p: a for p, a in everyone.items() if p != me},
            on_open=lambda step, closes_in: True, address=lambda peer=peer: peer.address)
        services.append(await nursery.start(service.serve))
        for other, address in everyone.items():
            if other != ids[index]:
                service.note(other, address)
    return peers, ids, services


async def _offers_at(peers: list, ids: list[bytes], services: list[RoundService], at: dict[int, float],
                     within: float) -> dict[int, object]:
    """Trainer `i` offers its contribution to round 3 at (virtual) time `at[i]`, each with `within` seconds to get a
    verdict; returns the verdicts once every offer is answered."""
    verdicts: dict[int, object] = {}

    async def offer(index: int, when: float) -> None:
        await trio.sleep(when)
        verdicts[index] = await services[index].enter(
            3, Offer(ids[index], 3, 10, "h" * 8, peers[index].address), deadline=trio.current_time() + within)

    async with trio.open_nursery() as offers:
        for index, when in at.items():
            offers.start_soon(offer, index, when)
    return verdicts


async def test_an_offer_held_by_a_frozen_candidate_goes_to_the_coordinator_that_opened_the_round(autojump_clock):
    """Round 3's best-ranked candidate is frozen. The second offers at t=0, gives up on it after `ack_timeout`
    (2 s) and coordinates, its window opening at its own offer; the third offered at t=0.5, to the frozen one
    first. Told that the window opened, its offer goes there at once, instead of a whole ack timeout later (in the
    WAN scenario that arrival, 0.9 s after the opening, overran a 0.6 s window)."""
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, ids, services = await _three_expecting_each_other(memory, nursery)
        frozen, coordinator, third = (ids.index(p) for p in coordinator_order(RUN, 3, ids))
        memory.freeze(peers[frozen].name)
        with trio.fail_after(20):  # both offers answered
            verdicts = await _offers_at(peers, ids, services, {coordinator: 0.0, third: 0.5}, within=20)
        start = verdicts[third]
        assert isinstance(start, Start) and start == verdicts[coordinator]
        assert start.peers == sorted([ids[coordinator], ids[third]])
        member = start.member(ids[third])
        assert member is not None and member.offset < 0.2, start  # 0.5 s (its own ack timeout) without the news
        # its call to the frozen one was given up, not failed: the verdict carried the coordinator's finding, so
        # its next offers go to the frozen one last (a round whose order puts it first again does not wait on it)
        assert services[third].suspected(ids[frozen]) and not services[third].suspected(ids[coordinator])
        nursery.cancel_scope.cancel()


async def test_an_offer_the_second_candidate_answers_after_probing_the_frozen_first_is_taken_not_split(
        autojump_clock):
    """Round 3's best-ranked candidate is frozen. The third-ranked trainer offers first: the frozen one holds it an
    ack timeout, then the second-ranked one, still computing, gets it naming the frozen one as skipped and probes
    that one (another ack timeout) before it answers. The offer waits for that answer: in the WAN scenario the
    caller gave up at its own ack timeout, coordinated the round itself, and the two coordinators each waited
    `max_wait` (30 s) for the other, then averaged alone (two states for one outer step)."""
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, ids, services = await _three_expecting_each_other(memory, nursery)
        frozen, second, third = (ids.index(p) for p in coordinator_order(RUN, 3, ids))
        memory.freeze(peers[frozen].name)
        began = trio.current_time()
        # the second's own offer reaches it while it probes for the third
        verdicts = await _offers_at(peers, ids, services, {third: 0.0, second: 0.1}, within=60)
        start = verdicts[third]
        assert isinstance(start, Start) and start == verdicts[second], verdicts
        assert start.peers == sorted([ids[second], ids[third]])
        assert trio.current_time() - began < 10.0  # not max_wait
        nursery.cancel_scope.cancel()


async def test_a_verdicts_suspects_count_only_when_ranked_before_its_coordinator(autojump_clock):
    """A coordinator's suspects (`RoundService._suspects`) reorder the next rounds' candidates, so a member takes
    only those the coordinator could have probed: ranked before it in that round. A lying coordinator cannot push
    the trainers ranked after it down the order; malformed entries and the member itself are skipped."""
    async with trio.open_nursery() as nursery:
        peers, services = await _services(3, MemoryNetwork(latency=0.01, seed=1), nursery)
        ids = [bytes(p.rpc.peer_id) for p in peers]
        first, coordinator, last = (ids.index(p) for p in coordinator_order(RUN, 5, ids))
        client = services[last].client
        client._take_suspects([ids[first], ids[last], "not a peer id", 7], ids[coordinator], 5)
        assert services[last].suspected(ids[first]) and not services[last].suspected(ids[last])
        client = services[first].client
        client._take_suspects([ids[last]], ids[coordinator], 5)  # ranked after the coordinator: not taken
        assert not services[first].suspected(ids[last])
        nursery.cancel_scope.cancel()


async def test_an_offer_waiting_on_probes_joins_at_once_when_the_round_starts_meanwhile(autojump_clock):
    """Round 3's best-ranked candidate is frozen. The third offers at t=0: the frozen one holds it an ack timeout
    (2 s), then the second gets it naming the frozen one as skipped and probes that one (2 s more). Meanwhile
    the second's own offer (t=1) gave up on the frozen one at t=3 and started the round. The probing offer joins
    that round at once instead of at the end of the probe: in the WAN scenario a round waited 1.6 s past its
    0.6 s window for that member, its quorum."""
    memory = MemoryNetwork(latency=0.01, seed=1)
    async with trio.open_nursery() as nursery:
        peers, ids, services = await _three_expecting_each_other(memory, nursery)
        frozen, second, third = (ids.index(p) for p in coordinator_order(RUN, 3, ids))
        memory.freeze(peers[frozen].name)
        verdicts = await _offers_at(peers, ids, services, {third: 0.0, second: 1.0}, within=60)
        start = verdicts[third]
        assert isinstance(start, Start) and start == verdicts[second], verdicts
        assert start.peers == sorted([ids[second], ids[third]])
        member = start.member(ids[third])
        assert member is not None and member.offset < 0.2, start  # 1 s (the rest of the probe) before
        nursery.cancel_scope.cancel()
