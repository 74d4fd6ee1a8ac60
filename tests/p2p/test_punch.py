"""Hole punching (peer/p2p/punch.py): the sans-I/O coordinator on its own, then the trio driver between two
simulated NATs (peer/p2p/net.py) over a side channel spliced by a byte relay: through two MASQUERADE routers the
punch gives a direct connection authenticated to the right peer; through a symmetric NAT it fails with
`PunchFailed` and the counters say the circuit stayed.
"""

from __future__ import annotations

import functools
import itertools

import msgpack
import pytest
import trio

from peer.p2p.handshake import Role
from peer.p2p.identity import Identity
from peer.p2p.net import MemoryNetwork
from peer.p2p.punch import (
    NONCE_BYTES,
    HolePuncher,
    PunchCoordinator,
    PunchFailed,
    PunchProtocolError,
)
from peer.p2p.rpc import RPCNode
from peer.p2p.rpc_protocol import LocalProtocolError
from tests.nat_punch_process import splice_in_pairs

A, B = Identity.from_seed(b"punch-a"), Identity.from_seed(b"punch-b")
LOW, HIGH = sorted([A, B], key=lambda identity: bytes(identity.peer_id))


def counting_nonces():
    counter = itertools.count(1)
    return lambda n: bytes([next(counter)]) * n


def pair(now: float = 0.0):
    initiator = PunchCoordinator(LOW.peer_id, HIGH.peer_id, ("ra", 5000), now=now, nonce_source=counting_nonces())
    responder = PunchCoordinator(HIGH.peer_id, LOW.peer_id, ("rb", 6000), now=now, nonce_source=counting_nonces())
    return initiator, responder


def test_the_exchange_times_both_dials_to_meet_half_a_round_trip_after_the_sync():
    initiator, responder = pair()
    assert initiator.role is Role.INITIATOR and responder.role is Role.RESPONDER
    assert responder.data_to_send() == b""  # the responder waits for the initiator's CONNECT
    assert responder.receive_data(initiator.data_to_send(), now=0.05) == []
    (dial,) = initiator.receive_data(responder.data_to_send(), now=0.10)  # round trip: 0.1 s
    assert dial.address == ("rb", 6000) and dial.at == pytest.approx(0.15)
    assert dial.until == pytest.approx(0.15 + 2.0)  # at least the minimum window
    (answer,) = responder.receive_data(initiator.data_to_send(), now=0.15)  # the SYNC lands as the initiator dials
    assert answer.address == ("ra", 5000) and answer.at == pytest.approx(0.15)
    assert initiator.state == responder.state == "dialing"
    initiator.succeeded()
    assert initiator.state == "done"
    with pytest.raises(LocalProtocolError):
        initiator.expire(10.0)


def test_messages_split_at_any_byte_give_the_same_outcome():
    initiator, responder = pair()
    connect = initiator.data_to_send()
    for byte in connect[:-1]:
        assert responder.receive_data(bytes([byte]), now=0.0) == []
    assert responder.data_to_send() == b""
    responder.receive_data(connect[-1:], now=0.0)
    assert responder.data_to_send()


def test_a_stale_sync_a_malformed_message_and_an_oversized_one_are_the_remote_s_fault():
    initiator, responder = pair()
    responder.receive_data(initiator.data_to_send(), now=0.0)
    responder.data_to_send()
    forged = msgpack.packb({"t": "sync", "nonce": b"\x00" * NONCE_BYTES})
    with pytest.raises(PunchProtocolError, match="nonce"):
        responder.receive_data(len(forged).to_bytes(2, "big") + forged, now=0.1)
    assert responder.state == "failed"

    _, fresh = pair()
    junk = msgpack.packb([1, 2, 3])
    with pytest.raises(PunchProtocolError, match="map"):
        fresh.receive_data(len(junk).to_bytes(2, "big") + junk, now=0.0)
    _, fresh = pair()
    with pytest.raises(PunchProtocolError, match="bytes"):
        fresh.receive_data(b"\xff\xff", now=0.0)
    _, fresh = pair()
    bad_address = msgpack.packb({"t": "connect", "v": 1, "addr": ["x", 70000], "nonce": b"n" * NONCE_BYTES})
    with pytest.raises(PunchProtocolError, match="address"):
        fresh.receive_data(len(bad_address).to_bytes(2, "big") + bad_address, now=0.0)


def test_a_punch_without_an_answer_expires_with_the_peer_and_the_operation():
    initiator, _ = pair()
    error = initiator.expire(10.0)
    assert isinstance(error, PunchFailed) and error.peer == HIGH.peer_id and error.method == "punch"
    assert "no answer on the side channel" in str(error)
    with pytest.raises(LocalProtocolError):
        PunchCoordinator(A.peer_id, A.peer_id, ("x", 1), now=0.0)


# --------------------------------------------------------------------------------------------- the driver


async def byte_relay(network: MemoryNetwork, nursery: trio.Nursery) -> list:
    """A public host that splices the first two connections it gets (the side channel a circuit would be) and
    records where each came from: the NAT mappings the punchers are told as their observed addresses."""
    seen: list = []
    waiting: list = []

    async def handler(stream) -> None:
        seen.append(stream.remote_address)
        await splice_in_pairs(waiting, stream)

    await nursery.start(network.host("relay").serve_tcp, handler, "relay", 7000)
    return seen


async def _rpc(identity: Identity, network, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with RPCNode(identity, network) as rpc:
        task_status.started(rpc)
        await trio.sleep_forever()


async def _punch_between(kind_b: str, *, wrong_peer: bool = False):
    network = MemoryNetwork(latency=0.02, seed=3)
    network.add_nat("ra", "masquerade")
    network.add_nat("rb", kind_b)
    host_a, host_b = network.host("a", behind="ra"), network.host("b", behind="rb")
    outcomes: dict = {}
    async with trio.open_nursery() as nursery:
        seen = await byte_relay(network, nursery)
        rpc_a = await nursery.start(_rpc, A, host_a)
        rpc_b = await nursery.start(_rpc, B, host_b)
        side_a = await host_a.connect_tcp(("relay", 7000))
        side_b = await host_b.connect_tcp(("relay", 7000))
        punchers = {"a": HolePuncher(rpc_a), "b": HolePuncher(rpc_b)}
        expected = {"a": Identity.from_seed(b"someone else").peer_id if wrong_peer else B.peer_id,
                    "b": A.peer_id}

        async def one(name, side, observed) -> None:
            try:
                outcomes[name] = await punchers[name].punch(side, observed, expected[name])
            except PunchFailed as error:
                outcomes[name] = error

        async with trio.open_nursery() as punching:
            punching.start_soon(one, "a", side_a, seen[0])
            punching.start_soon(one, "b", side_b, seen[1])
        nursery.cancel_scope.cancel()
    return outcomes, punchers, seen


async def test_punching_between_two_masquerade_nats_gives_an_authenticated_direct_connection(autojump_clock):
    outcomes, punchers, seen = await _punch_between("masquerade")
    a, b = outcomes["a"], outcomes["b"]
    assert a.handshake.peer_id == B.peer_id and b.handshake.peer_id == A.peer_id
    assert a.handshake.keys.send == b.handshake.keys.receive  # one connection: the same session keys
    assert a.address == seen[1] and b.address == seen[0]  # straight to the other's mapping, not the relay
    assert a.stream.remote_address == seen[1] and b.stream.remote_address == seen[0]
    for puncher in punchers.values():
        assert puncher.stats() == {"direct": 0, "upgraded": 1, "relayed": 0, "punch_attempts": 1,
                                   "punch_failures": 0}


async def test_punching_through_a_symmetric_nat_fails_cleanly_and_the_circuit_stays(autojump_clock):
    outcomes, punchers, _ = await _punch_between("symmetric")
    for name, peer in (("a", B.peer_id), ("b", A.peer_id)):
        error = outcomes[name]
        assert isinstance(error, PunchFailed) and error.peer == peer and error.method == "punch"
        assert "no direct connection" in str(error)
        assert punchers[name].stats()["relayed"] == 1 and punchers[name].stats()["upgraded"] == 0


async def test_a_punched_connection_to_someone_else_is_refused(autojump_clock):
    outcomes, punchers, _ = await _punch_between("masquerade", wrong_peer=True)
    assert isinstance(outcomes["a"], PunchFailed)  # the other end proved another identity
    assert punchers["a"].stats()["relayed"] == 1


# --------------------------------------------------------------------------------------------- real sockets


async def _loopback_relay(nursery: trio.Nursery):
    """`byte_relay` on 127.0.0.1 with real sockets: records each connection's peer address, splices two."""
    seen: list = []
    waiting: list = []

    async def handler(stream) -> None:
        seen.append(tuple(stream.socket.getpeername()[:2]))
        await splice_in_pairs(waiting, stream)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[:2], seen


async def _real_punch():
    """Two punchers on 127.0.0.1 (no NAT: a successful simultaneous open needs routers that drop rather than
    reset early SYNs, tests/scenarios/test_nat_netns.py has them), their side channels through `_loopback_relay`."""
    from peer.p2p.net import RealNetwork

    network = RealNetwork()
    outcomes: dict = {}
    async with trio.open_nursery() as nursery:
        relay, seen = await _loopback_relay(nursery)
        rpcs = {"a": await nursery.start(_rpc, A, network), "b": await nursery.start(_rpc, B, network)}
        sides = {}
        for name in ("a", "b"):
            sides[name] = await network.connect_tcp(relay)  # a plain connect: its port is not shareable
            with trio.fail_after(10):
                while len(seen) < len(sides):
                    await trio.sleep(0.01)
        observed = {"a": seen[0], "b": seen[1]}
        expected = {"a": B.peer_id, "b": A.peer_id}

        async def one(name) -> None:
            try:
                outcomes[name] = await HolePuncher(rpcs[name], timeout=20, min_window=10).punch(
                    sides[name], observed[name], expected[name])
            except PunchFailed as error:
                outcomes[name] = error

        with trio.fail_after(60):
            async with trio.open_nursery() as punching:
                punching.start_soon(one, "a")
                punching.start_soon(one, "b")
        nursery.cancel_scope.cancel()
    return outcomes, observed


async def test_on_real_sockets_a_side_channel_port_that_cannot_be_shared_fails_at_once():
    outcomes, _ = await _real_punch()
    for error in outcomes.values():
        assert isinstance(error, PunchFailed) and "cannot connect from port" in str(error)


async def test_a_simulated_punch_is_deterministic(autojump_clock):
    runs = []
    for _ in range(2):
        started = trio.current_time()
        outcomes, _, seen = await _punch_between("masquerade")
        runs.append((seen, outcomes["a"].address, outcomes["b"].stream.local_address,
                     trio.current_time() - started))
    assert runs[0][:3] == runs[1][:3]  # the same mappings, ports and addresses
    assert runs[0][3] == pytest.approx(runs[1][3], abs=1e-9)  # and the same virtual duration
