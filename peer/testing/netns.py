"""A closed test network of separate hosts on one machine: one network namespace per host, veth pairs into a
bridge that lives in its own hub namespace (so nothing touches the machine's real interfaces, and the bridge has
no route or NAT anywhere), `tc tbf` to cap each host's bandwidth. Created and removed by the tests themselves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

SUBNET = "10.213.0"


def netns_available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) is not installed"
    probe = f"swprobe{uuid.uuid4().hex[:6]}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return False, f"cannot create a network namespace: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    bridge_port: str

    def command(self, *args: str) -> list[str]:
        """`args` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]


class HostNetwork:
    def __init__(self, tag: str | None = None):
        self.tag = tag or uuid.uuid4().hex[:5]
        self.hub = f"sw{self.tag}hub"
        self.hosts: list[Host] = []
        self._created: list[str] = []

    def __enter__(self) -> "HostNetwork":
        _run("ip", "netns", "add", self.hub)
        self._created.append(self.hub)
        self._hub("ip", "link", "add", "br0", "type", "bridge")
        self._hub("ip", "link", "set", "br0", "up")
        self._hub("ip", "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc_info: object) -> None:
        for namespace in reversed(self._created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._created.clear()

    def _hub(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.hub, *args)

    def add_host(self, name: str, *, bandwidth_mbit: int | None = 200) -> Host:
        index = len(self.hosts) + 1
        namespace = f"sw{self.tag}h{index}"
        inner, outer = f"v{self.tag}h{index}i", f"v{self.tag}h{index}o"
        _run("ip", "netns", "add", namespace)
        self._created.append(namespace)
        _run("ip", "link", "add", inner, "netns", namespace, "type", "veth", "peer", "name", outer,
             "netns", self.hub)
        address = f"{SUBNET}.{index + 1}"
        host = Host(name, namespace, address, outer)
        exec_in = ["ip", "netns", "exec", namespace]
        _run(*exec_in, "ip", "link", "set", "lo", "up")
        _run(*exec_in, "ip", "addr", "add", f"{address}/24", "dev", inner)
        _run(*exec_in, "ip", "link", "set", inner, "up")
        self._hub("ip", "link", "set", outer, "master", "br0")
        self._hub("ip", "link", "set", outer, "up")
        if bandwidth_mbit:
            _run(*exec_in, "tc", "qdisc", "add", "dev", inner, "root", "tbf", "rate", f"{bandwidth_mbit}mbit",
                 "burst", "256kb", "latency", "50ms")
        self.hosts.append(host)
        return host

    def cut(self, host: Host) -> None:
        """Partition: the host loses its link to the bridge (its processes keep running)."""
        self._hub("ip", "link", "set", host.bridge_port, "down")

    def restore(self, host: Host) -> None:
        self._hub("ip", "link", "set", host.bridge_port, "up")


# ---------------------------------------------------------------------------------------------------- behind NAT

INTERNET = "10.77.0"  # the closed "internet" bridge; home LANs are 192.168.(10 + router index).0/24


def nat_available() -> tuple[bool, str]:
    """Whether `NatInternet` can be built here: namespaces (see `netns_available`) and iptables with conntrack."""
    available, why = netns_available()
    if not available:
        return available, why
    if shutil.which("iptables") is None:
        return False, "iptables is not installed"
    probe = f"swnat{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", probe)
        result = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-A", "POSTROUTING",
                                 "-o", "lo", "-j", "MASQUERADE"], capture_output=True, text=True)
        if result.returncode != 0:
            return False, f"iptables cannot MASQUERADE in a namespace: {result.stderr.strip()}"
        result = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-A", "FORWARD", "-m", "conntrack",
                                 "--ctstate", "NEW"], capture_output=True, text=True)
        if result.returncode != 0:
            return False, f"iptables has no conntrack match: {result.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


@dataclass
class Router:
    """A home router: a namespace with `wan` on the internet bridge (its public `address`) and a LAN bridge
    `lan` for the hosts behind it. It MASQUERADEs what leaves through `wan` and forwards or accepts from `wan`
    only packets of connections that started inside (conntrack ESTABLISHED,RELATED); every other inbound packet
    is dropped (and counted, `counters()`)."""

    name: str
    namespace: str
    address: str
    lan_prefix: str
    hosts: list["Host"]

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *args]

    def counters(self) -> dict[str, int]:
        """Packets from `wan` by fate: `inbound_new` (starting a connection from outside: all dropped),
        `inbound_accepted` (of connections started inside: replies, simultaneous opens), `inbound_dropped`
        (everything else from outside, unsolicited), for the forward path to the LAN and the router itself
        together; and `inbound_new_accepted`: packets that opened a connection from outside and still left
        onto the LAN (counted in mangle POSTROUTING, after every filter: what got through, whatever the rules
        say; must stay 0)."""
        totals = {"inbound_new": 0, "inbound_accepted": 0, "inbound_dropped": 0, "inbound_new_accepted": 0}
        for table, chain in (("filter", "FORWARD"), ("filter", "INPUT"), ("mangle", "POSTROUTING")):
            listing = subprocess.run(self.command("iptables", "-t", table, "-L", chain, "-v", "-x", "-n"),
                                     check=True, capture_output=True, text=True).stdout
            for line in listing.splitlines():
                fields = line.split()
                if len(fields) < 3 or not fields[0].isdigit():
                    continue
                packets = int(fields[0])
                if "swarmd:new-in" in line:
                    totals["inbound_new"] += packets
                elif "swarmd:accept-in" in line:
                    totals["inbound_accepted"] += packets
                elif "swarmd:drop-in" in line:
                    totals["inbound_dropped"] += packets
                elif "swarmd:new-accepted" in line:
                    totals["inbound_new_accepted"] += packets
        return totals


class NatInternet:
    """A closed internet on one machine: public hosts and home routers on one bridge (in a hub namespace, so it
    has no route to the machine's real interfaces), hosts behind each router on its own LAN. Everything is
    torn down on exit, also when building it or the test failed; processes started with `spawn` are killed
    first. Use:

        with NatInternet() as net:
            boot = net.add_public("boot")
            home = net.add_router("home1", uplink_mbit=20)
            volunteer = net.add_behind(home, "volunteer")
            process = net.spawn(volunteer, ["python", ...])   # or peer_processes with prefix=host.command()
            home.counters()
    """

    def __init__(self, tag: str | None = None):
        self.tag = tag or uuid.uuid4().hex[:4]
        self.hub = f"sw{self.tag}inet"
        self.public: list[Host] = []
        self.routers: list[Router] = []
        self._created: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._index = 0

    def __enter__(self) -> "NatInternet":
        with self._building(self.hub):
            self._in(self.hub, "ip", "link", "add", "br0", "type", "bridge")
            self._in(self.hub, "ip", "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._processes.clear()
        for namespace in reversed(self._created):  # deleting a namespace removes its veth ends too
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._created.clear()

    @contextmanager
    def _building(self, namespace: str) -> Iterator[None]:
        """Adds `namespace` (its loopback up; deleted with the network) for the block to set up: if adding it or
        the block fails, all that was built is torn down (nothing is left behind)."""
        try:
            _run("ip", "netns", "add", namespace)
            self._created.append(namespace)
            self._in(namespace, "ip", "link", "set", "lo", "up")
            yield
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _in(namespace: str, *args: str) -> None:
        _run("ip", "netns", "exec", namespace, *args)

    def _next(self) -> int:
        self._index += 1
        return self._index

    def _on_internet(self, namespace: str, device: str, address: str) -> str:
        """A veth from `namespace` (named `device` there) into the internet bridge; returns the bridge port."""
        outer = f"v{self.tag}{self._next()}o"
        _run("ip", "link", "add", device, "netns", namespace, "type", "veth", "peer", "name", outer,
             "netns", self.hub)
        self._in(namespace, "ip", "addr", "add", f"{address}/24", "dev", device)
        self._in(namespace, "ip", "link", "set", device, "up")
        self._in(self.hub, "ip", "link", "set", outer, "master", "br0")
        self._in(self.hub, "ip", "link", "set", outer, "up")
        return outer

    def add_public(self, name: str, *, bandwidth_mbit: int | None = None) -> Host:
        """A host with a public address on the internet bridge (reachable by everyone)."""
        namespace = f"sw{self.tag}p{len(self.public) + 1}"
        address = f"{INTERNET}.{len(self.public) + 2}"
        with self._building(namespace):
            port = self._on_internet(namespace, "eth0", address)
            if bandwidth_mbit:
                _tbf(namespace, "eth0", bandwidth_mbit)
        host = Host(name, namespace, address, port)
        self.public.append(host)
        return host

    def add_router(self, name: str, *, uplink_mbit: int | None = None) -> Router:
        """A MASQUERADE router with a DROP policy for anything unsolicited from outside; `uplink_mbit` caps
        what leaves its WAN side (`tc tbf`, a home uplink)."""
        index = len(self.routers) + 1
        namespace = f"sw{self.tag}r{index}"
        address = f"{INTERNET}.{200 + index}"
        lan_prefix = f"192.168.{10 + index}"
        with self._building(namespace):
            self._on_internet(namespace, "wan", address)
            self._in(namespace, "ip", "link", "add", "lan", "type", "bridge")
            self._in(namespace, "ip", "addr", "add", f"{lan_prefix}.1/24", "dev", "lan")
            self._in(namespace, "ip", "link", "set", "lan", "up")
            self._in(namespace, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            rules = [
                ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"],
                ["-P", "FORWARD", "DROP"],
                ["-P", "INPUT", "DROP"],
                ["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
                ["-A", "INPUT", "-i", "lan", "-j", "ACCEPT"],
                ["-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT"],
                ["-A", "FORWARD", "-i", "lan", "-o", "lan", "-j", "ACCEPT"],
            ]
            for chain in ("FORWARD", "INPUT"):
                rules += [
                    ["-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate", "NEW", "-m", "comment",
                     "--comment", "swarmd:new-in"],  # counts only
                    ["-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-m",
                     "comment", "--comment", "swarmd:accept-in", "-j", "ACCEPT"],
                    ["-A", chain, "-i", "wan", "-m", "comment", "--comment", "swarmd:drop-in", "-j", "DROP"],
                ]
            rules.append(["-t", "mangle", "-A", "POSTROUTING", "-o", "lan", "-m", "conntrack", "--ctstate", "NEW",
                          "-m", "conntrack", "--ctdir", "ORIGINAL", "!", "-s", f"{lan_prefix}.0/24", "-m", "comment",
                          "--comment", "swarmd:new-accepted"])
            for rule in rules:
                self._in(namespace, "iptables", *rule)
            if uplink_mbit:
                _tbf(namespace, "wan", uplink_mbit)
        router = Router(name, namespace, address, lan_prefix, [])
        self.routers.append(router)
        return router

    def add_behind(self, router: Router, name: str) -> Host:
        """A host on `router`'s LAN, its default route through the router (its only way out)."""
        index = len(router.hosts) + 1
        namespace = f"{router.namespace}h{index}"
        address = f"{router.lan_prefix}.{index + 1}"
        outer = f"v{self.tag}{self._next()}l"
        with self._building(namespace):
            _run("ip", "link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", outer,
                 "netns", router.namespace)
            self._in(namespace, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            self._in(namespace, "ip", "link", "set", "eth0", "up")
            self._in(namespace, "ip", "route", "add", "default", "via", f"{router.lan_prefix}.1")
            self._in(router.namespace, "ip", "link", "set", outer, "master", "lan")
            self._in(router.namespace, "ip", "link", "set", outer, "up")
        host = Host(name, namespace, address, outer)
        router.hosts.append(host)
        return host

    def spawn(self, host: Host | Router, command: list[str], **popen: object) -> subprocess.Popen[Any]:
        """Run `command` in `host`'s namespace as a child process (killed when the network is torn down)."""
        process: subprocess.Popen[Any] = subprocess.Popen(host.command(*command), **popen)  # type: ignore[call-overload]
        self._processes.append(process)
        return process

    def run(self, host: Host | Router, command: list[str], *,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `command` in `host`'s namespace to completion (bounded by `timeout`)."""
        return subprocess.run(host.command(*command), capture_output=True, text=True, timeout=timeout)


def _tbf(namespace: str, device: str, mbit: int) -> None:
    _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate",
         f"{mbit}mbit", "burst", "256kb", "latency", "50ms")
