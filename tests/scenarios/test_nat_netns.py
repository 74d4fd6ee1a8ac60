"""Peers behind real NAT routers (peer/testing/netns.py `NatInternet`: network namespaces, iptables MASQUERADE, a DROP
policy for everything unsolicited from outside, conntrack ESTABLISHED,RELATED only, capped uplinks).

`peer join --reachability auto` with default flags behind a router finds itself private and joins the swarm
through the public bootstrap; a public host finds itself public; the routers never let an unsolicited inbound
connection in; and hole punching (peer/p2p/punch.py) over a plain byte relay on a public host gives the two
peers behind the two routers a direct, authenticated connection. Skipped, with the reason, without root,
iproute2 or iptables.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.p2p.identity import Identity
from peer.testing.netns import NatInternet, nat_available
from peer.testing.peer_processes import ChildProcess, PeerProcess

AVAILABLE, WHY_NOT = nat_available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)]
PORT = 31337
RELAY_PORT = 31400
PUNCH = [sys.executable, "-m", "tests.nat_punch_process"]  # -m: this checkout's packages


def join(host, *args: str) -> tuple[PeerProcess, str]:
    process = PeerProcess(["join", *args], prefix=host.command())
    try:
        reachability = process.read_until(r"^reachability: (.*)$", timeout=120).group(1)
        process.read_until(r"^others join with", timeout=60)
    except BaseException:
        process.kill()
        raise
    return process, reachability


def unsolicited_connect(net: NatInternet, source, address: str, port: int) -> bool:
    """Whether a TCP connect from `source` to address:port gets through within 3 s."""
    probe = ("import socket,sys\ns=socket.socket();s.settimeout(3)\n"
             "try:\n s.connect((sys.argv[1],int(sys.argv[2])));print('connected')\nexcept OSError:print('failed')")
    result = net.run(source, [sys.executable, "-c", probe, address, str(port)], timeout=30)
    return result.stdout.strip() == "connected"


def test_the_closed_internet_has_no_way_out_and_is_removed_even_after_a_failure():
    with pytest.raises(RuntimeError, match="the test failed"), NatInternet() as net:
        public = net.add_public("public")
        router = net.add_router("home", uplink_mbit=10)
        inside = net.add_behind(router, "inside")
        namespaces = {net.hub, public.namespace, router.namespace, inside.namespace}
        for host in (public, router):  # no default route anywhere but behind a router, toward it
            assert "default" not in net.run(host, ["ip", "route"]).stdout
        assert net.run(inside, ["ip", "route"]).stdout.startswith(f"default via {router.lan_prefix}.1")
        assert "tbf" in net.run(router, ["tc", "qdisc", "show", "dev", "wan"]).stdout
        assert router.counters()["inbound_new_accepted"] == 0
        raise RuntimeError("the test failed")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not namespaces & {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.slow
def test_behind_masquerade_routers_peers_join_as_private_and_punch_a_direct_connection():
    processes: list[ChildProcess] = []
    with NatInternet() as net:
        boot_host, second_host = net.add_public("bootstrap"), net.add_public("volunteer")
        routers = [net.add_router("home1", uplink_mbit=50), net.add_router("home2", uplink_mbit=50)]
        inside = [net.add_behind(routers[0], "private-volunteer"), net.add_behind(routers[1], "private-peer")]
        bootstrap = f"{boot_host.address}:{PORT}"
        try:
            boot, boot_reach = join(boot_host, "--port", str(PORT), "--experts", "ffn.[0:4]", "--hidden-dim", "64")
            processes.append(boot)
            public, public_reach = join(second_host, "--initial-peers", bootstrap, "--port", str(PORT),
                                        "--experts", "ffn.[4:8]", "--hidden-dim", "64")
            processes.append(public)
            private, private_reach = join(inside[0], "--initial-peers", bootstrap, "--port", str(PORT),
                                          "--experts", "ffn.[8:12]", "--hidden-dim", "64")
            processes.append(private)
            assert public_reach.startswith("public"), public_reach
            assert private_reach.startswith("private"), private_reach
            assert "bootstrap failed" not in "\n".join(private.lines)

            # listening on all interfaces it announces what the bootstrap observes, its router's mapping: the
            # dial-backs then reach the router, which drops them
            before = routers[1].counters()
            wildcard = PeerProcess(["join", "--initial-peers", bootstrap, "--host", "0.0.0.0", "--port", str(PORT),
                                    "--experts", "ffn.[12:16]", "--hidden-dim", "64"], prefix=inside[1].command())
            processes.append(wildcard)
            announced = wildcard.read_until(r"^peer [0-9a-f]{40} listening on (\S+)$", timeout=120).group(1)
            assert wildcard.read_until(r"^reachability: (.*)$", timeout=60).group(1).startswith("private")
            assert announced == f"{routers[1].address}:{PORT}"  # MASQUERADE kept the UDP port
            assert routers[1].counters()["inbound_dropped"] > before["inbound_dropped"]
            wildcard.kill()

            # the routers drop what nobody inside asked for: a connect to the router's address from outside
            before = routers[0].counters()
            assert not unsolicited_connect(net, boot_host, routers[0].address, PORT)
            after = routers[0].counters()
            assert after["inbound_dropped"] > before["inbound_dropped"]

            # hole punching through both routers, the side channel spliced by a byte relay on a public host
            relay = ChildProcess([*PUNCH, "relay", str(RELAY_PORT)], prefix=second_host.command())
            processes.append(relay)
            relay.read_until(r'"event": "relay"', timeout=60)
            relay_address = f"{second_host.address}:{RELAY_PORT}"
            punchers = [ChildProcess([*PUNCH, "punch", relay_address, mine, theirs], prefix=host.command())
                        for host, mine, theirs in ((inside[0], "nat-a", "nat-b"), (inside[1], "nat-b", "nat-a"))]
            processes.extend(punchers)
            outcomes = [json.loads(p.read_until(r'"event": "punch"', timeout=120).string) for p in punchers]
            for outcome, router in zip(outcomes, routers):
                assert outcome["ok"], outcomes
                assert outcome["observed"][0] == router.address  # the relay saw the router's address
                assert outcome["stats"]["upgraded"] == 1
            # each reached the other's router directly (not the relay), authenticated to the expected peer
            assert outcomes[0]["remote"] == outcomes[1]["observed"] and outcomes[1]["remote"] == outcomes[0]["observed"]
            assert outcomes[0]["peer"] == Identity.from_seed(b"nat-b").peer_id.hex()
            assert outcomes[1]["peer"] == Identity.from_seed(b"nat-a").peer_id.hex()

            for router in routers:
                counters = router.counters()
                assert counters["inbound_new_accepted"] == 0, (router.name, counters)
                assert counters["inbound_accepted"] > 0, (router.name, counters)  # replies did come back in
        finally:
            for process in processes:
                process.kill()
