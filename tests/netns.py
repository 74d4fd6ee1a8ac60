"""A closed test network of separate hosts on one machine: one network namespace per host, veth pairs into a
bridge that lives in its own hub namespace (so nothing touches the machine's real interfaces, and the bridge has
no route or NAT anywhere), `tc tbf` to cap each host's bandwidth. Created and removed by the tests themselves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

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
