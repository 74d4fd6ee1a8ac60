"""Where a peer listens and which address it announces: the one set of rules every peer follows (a `peer join`
daemon, a trainer's `Swarm`, a new swarm's bootstrap peer, a listening optimizer).

- `default_listen_host`: a daemon without --host listens on the interface toward its initial peers (a swarm on
  loopback stays on loopback, a LAN peer on its LAN address), or on all interfaces when it starts a new swarm.
- `client_host`: a client peer binds loopback for a loopback swarm, all interfaces otherwise.
- `local_host_towards`: the local address the routing table picks toward an address (no packet is sent).
- `announced_address`: what to announce when none was given (what the initial peers observe, else the route out).
- `pick_free_port`: one port number free for both TCP and UDP (the RPC node and the DHT node share it).

Why here, in the foundation: every layer above needs these answers (the daemon, the trainer's client, relaying,
and the averaging optimizers that listen for their partners), and they are about sockets, not about any feature.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from typing import Awaitable, Callable, Sequence

from peer.p2p.net import Address

WILDCARDS = ("0.0.0.0", "", "::")
ROUTE_PROBE: Address = ("192.0.2.1", 9)  # TEST-NET-1: only asks the routing table which interface leads out

Observe = Callable[[list[Address]], Awaitable[Address | None]]
"""Asks peers which address this node's datagrams come from (the DHT's `stun`: `DHTNode.observed_address`)."""


def local_host_towards(address: Address) -> str:
    """The local IP address this machine uses to reach `address` (no packet is sent; 127.0.0.1 when there is no
    route): the address to listen on and announce so that peers on the same path can connect back."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address[0], int(address[1])))
            host: str = probe.getsockname()[0]
            return host
        except OSError:
            return "127.0.0.1"


def default_listen_host(initial_peers: Sequence[Address]) -> str:
    """Where a daemon listens without --host: the interface toward its first initial peer, or all interfaces when
    it starts a new swarm (others will come from anywhere)."""
    return local_host_towards(initial_peers[0]) if initial_peers else "0.0.0.0"


def client_host(initial_peers: Sequence[Address]) -> str:
    """The local host a client peer binds: a loopback swarm is reached from loopback, anything else from all
    interfaces (a client serves nothing, so binding them all exposes nothing)."""
    return "127.0.0.1" if all(host.startswith("127.") for host, _ in initial_peers) else "0.0.0.0"


async def announced_address(host: str, port: int, initial_peers: list[Address], observe: Observe) -> Address:
    """The address to announce when none was given: a specific listen host is announced as it is; for a wildcard
    host, what the initial peers observe (`observe`), else the interface toward them or toward the internet, else
    (no route out: a closed network) the first interface address. The port is the listening one."""
    if host not in WILDCARDS:
        return (host, port)
    observed = await observe(initial_peers) if initial_peers else None
    if observed is not None:
        return (observed[0], port)
    towards = local_host_towards(initial_peers[0] if initial_peers else ROUTE_PROBE)
    if towards.startswith("127."):
        towards = next(iter(interface_addresses()), towards)
    return (towards, port)


def interface_addresses() -> list[str]:
    """This machine's non-loopback IPv4 interface addresses (Linux: SIOCGIFADDR per interface). A bootstrap peer
    on a network without a default route has no other way to learn the address others use."""
    addresses = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                address = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
            except OSError:
                continue  # an interface without an IPv4 address
            if not address.startswith("127."):
                addresses.append(address)
    return addresses


def pick_free_port(host: str) -> int:
    """A port free for both TCP and UDP on `host` (the DHT and the RPC share the number). OSError when 20 tries
    found none."""
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port: int = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
                return port
    raise OSError(f"no port free for both TCP and UDP on {host}")


__all__ = ["ROUTE_PROBE", "WILDCARDS", "Observe", "announced_address", "client_host", "default_listen_host",
           "interface_addresses", "local_host_towards", "pick_free_port"]
