"""peer/p2p/addresses.py: the one set of rules for where a peer listens and what it announces."""

from __future__ import annotations

import socket

import trio

from peer.p2p.addresses import (
    ROUTE_PROBE,
    announced_address,
    interface_addresses,
    local_host_towards,
    pick_free_port,
)
from peer.p2p.net import Address


def test_a_specific_host_is_announced_as_it_is_without_asking_anyone():
    asked: list[list[Address]] = []

    async def observe(peers: list[Address]) -> Address | None:
        asked.append(peers)
        return ("203.0.113.9", 1)

    assert trio.run(announced_address, "10.1.2.3", 4000, [("10.1.2.4", 5)], observe) == ("10.1.2.3", 4000)
    assert asked == []


def test_a_wildcard_host_announces_what_the_initial_peers_observe_with_its_own_port():
    async def observe(peers: list[Address]) -> Address | None:
        assert peers == [("127.0.0.1", 5)]
        return ("203.0.113.9", 61000)  # the NAT's port is not ours: the listening port is announced

    assert trio.run(announced_address, "0.0.0.0", 4000, [("127.0.0.1", 5)], observe) == ("203.0.113.9", 4000)


def test_without_an_observation_the_route_toward_the_peers_decides_and_never_loopback_when_avoidable():
    async def nobody(peers: list[Address]) -> Address | None:
        return None

    interfaces = interface_addresses()
    for peers in ([("127.0.0.1", 5)], []):  # a peer that did not answer; a new swarm (it asks nobody)
        towards = local_host_towards(peers[0] if peers else ROUTE_PROBE)
        expected = interfaces[0] if towards.startswith("127.") and interfaces else towards
        assert trio.run(announced_address, "0.0.0.0", 4000, peers, nobody) == (expected, 4000)


def test_a_picked_port_is_free_for_tcp_and_udp():
    port = pick_free_port("127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", port))
        udp.bind(("127.0.0.1", port))
