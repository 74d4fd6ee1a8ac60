"""An emulated wide-area network on one machine: every host in its own network namespace, all of them joined
through one "internet" namespace that gives each host its access link's bandwidth, delay, jitter and loss.

Why: the swarm must train over home links (tens of Mbit/s, tens of ms, asymmetric) and across continents (high
RTT, some loss); a loopback or bridge test says nothing about that. The kernel here has no `sch_netem`, so the
delay comes from a user-space stage (`peer.testing.delay_stage`) and the bandwidth from `tc tbf`.

Topology (docs/testbed.md has the details and the measured accuracy):

    host i namespace                     internet namespace
    eth0 10.99.i.2/24 --- veth ---  h<i> 10.99.i.1/24 --+-- policy route (iif h<i>) --> TUN --> delay stage
      tbf: profile's up rate             tbf: profile's down rate (egress towards host i) <-- main table <-- TUN

A packet from host A to host B leaves A through A's `up` shaper, enters the internet namespace on h<A>, is routed
into the TUN by an `ip rule iif h<A>`, waits in the stage for the pair's delay (or is dropped), comes back out of
the TUN and is routed by the main table to h<B>, whose qdisc is B's `down` shaper. Pairs with no delay, jitter
and loss (two `lan` hosts) skip the stage with a more specific rule. The namespaces have no link to anything else:
nothing can reach the machine's real interfaces.

How two hosts' profiles compose: every host contributes half of its profile's one-way delay, jitter and loss to
each packet it sends and half to each packet it receives. Between hosts A and B, in either direction:

    one-way delay = (delay_A + delay_B) / 2         two `home` hosts: 25 ms one way, 50 ms RTT
    jitter        = ±(jitter_A + jitter_B) / 2      home-intercontinental: 50 ms one way, ±2.5 ms
    loss          = (loss_A + loss_B) / 2           lan-home: 12.5 ms one way, ±2.5 ms
    rate A -> B   = min(up_A, down_B)               home -> lan: 20 Mbit/s; lan -> home: 100 Mbit/s

so a swarm of one profile sees exactly that profile between any two of its hosts. Jitter is uniform; packets of
one (source, destination) pair are never reordered by it (a packet leaves no earlier than the one before it).

Rates are link rates as `tc` counts them (IP packet plus the 14-byte Ethernet header); with the testbed's
9000-byte MTU, TCP's goodput is 99.3% of the link rate. Every host uses BBR (`congestion`) and 32 MiB TCP buffer
limits: CUBIC cannot fill 100 Mbit/s at 150 ms RTT with 0.1% loss (docs/testbed.md has the figures).

    with WanTestbed(seed=1) as wan:
        a = wan.add_host("a", "home")
        b = wan.add_host("b", "intercontinental")
        server = wan.spawn(b, ["python3", "-m", "http.server", "8000"])
        wan.run(a, ["python3", "-c", f"import urllib.request; urllib.request.urlopen('http://{b.address}:8000/')"])

Everything (namespaces, the stage, every process in the namespaces) is removed on exit, also on an exception.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.testing.churn import Action, Churn

__all__ = ["PROFILES", "SWARMS", "Action", "Churn", "Link", "Profile", "WanHost", "WanTestbed", "available", "link",
           "swarm_profiles"]

SUBNET = "10.99"  # host i: 10.99.i.2, its gateway in the internet namespace 10.99.i.1
MTU = 9000  # jumbo frames: a sixth of the packets for the Python stage at a given rate (docs/testbed.md)
ETHERNET_HEADER = 14  # what tbf counts beyond the IP packet on a veth
BYPASS_TABLE_PREF, STAGE_TABLE_PREF, STAGE_TABLE = 500, 1000, 100
TCP_BUFFER_MAX = 32 * 1024 * 1024  # room for 2 x the bandwidth-delay product of 100 Mbit/s at 150 ms, with loss
CONGESTION = "bbr"  # reaches 100 Mbit/s at 150 ms RTT and 0.1% loss; CUBIC 39 (docs/testbed.md)
STAGE_NICE = -10  # the network must not starve when tests load every core; it only uses CPU per packet


@dataclass(frozen=True)
class Profile:
    """One host's access link. Rates in Mbit/s (None: no shaper), delay and jitter in ms (one way, between two
    hosts of this profile), loss a fraction per packet and direction."""

    name: str
    up_mbit: float | None
    down_mbit: float | None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0


PROFILES: dict[str, Profile] = {
    "lan": Profile("lan", up_mbit=1000, down_mbit=1000),
    "home": Profile("home", up_mbit=20, down_mbit=100, delay_ms=25, jitter_ms=5),
    "intercontinental": Profile("intercontinental", up_mbit=100, down_mbit=100, delay_ms=75, loss=0.001),
}

# swarms of several profiles: the hosts take these in turn
SWARMS: dict[str, tuple[str, ...]] = {"mixed": ("lan", "home", "intercontinental")}


def swarm_profiles(swarm: str, count: int) -> list[Profile]:
    """The profiles of `count` hosts of `swarm`: a profile name (every host has it) or a name in `SWARMS`."""
    names = SWARMS.get(swarm, (swarm,))
    return [PROFILES[names[index % len(names)]] for index in range(count)]


@dataclass(frozen=True)
class Link:
    """What packets from one host to another meet: seconds, seconds, a fraction, Mbit/s (None: uncapped)."""

    delay_s: float
    jitter_s: float
    loss: float
    rate_mbit: float | None

    @property
    def impaired(self) -> bool:
        """Whether packets must pass through the delay stage."""
        return bool(self.delay_s or self.jitter_s or self.loss)


def link(source: Profile, destination: Profile) -> Link:
    """The composition rule of the module docstring: half of each end's delay, jitter and loss; the sender's up
    rate and the receiver's down rate both apply, so the smaller one is the path's."""
    rates = [rate for rate in (source.up_mbit, destination.down_mbit) if rate]
    return Link(delay_s=(source.delay_ms + destination.delay_ms) / 2000,
                jitter_s=(source.jitter_ms + destination.jitter_ms) / 2000,
                loss=(source.loss + destination.loss) / 2,
                rate_mbit=min(rates) if rates else None)


@functools.cache
def available() -> tuple[bool, str]:
    """Whether a `WanTestbed` can be built here, and if not why: root, iproute2 (ip, tc), /dev/net/tun, and a
    namespace in which a tbf qdisc can be made and BBR chosen."""
    if os.geteuid() != 0:
        return False, "the WAN testbed needs root (network namespaces, TUN)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) is not installed"
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as error:
        return False, f"cannot open /dev/net/tun: {error}"
    probe = f"swwan{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        tbf = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "10mbit",
                              "burst", "32kb", "limit", "64kb"], capture_output=True, text=True)
        if tbf.returncode != 0:
            return False, f"tc cannot make a tbf qdisc: {tbf.stderr.strip()}"
        congestion = subprocess.run(["ip", "netns", "exec", probe, "sysctl", "-q", "-w",
                                     f"net.ipv4.tcp_congestion_control={CONGESTION}"], capture_output=True, text=True)
        if congestion.returncode != 0:  # a namespace may only pick what the machine allows
            return False, (f"cannot make {CONGESTION} a namespace's TCP congestion control ({congestion.stderr.strip()}"
                           f"; add it to the machine's net.ipv4.tcp_allowed_congestion_control)")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


@dataclass(frozen=True)
class WanHost:
    """A host of the testbed: its own namespace, one interface `eth0` at `address`."""

    name: str
    namespace: str
    address: str
    profile: Profile
    index: int

    @property
    def gateway_port(self) -> str:
        """Its veth's name in the internet namespace."""
        return f"h{self.index}"

    def command(self, *args: str) -> list[str]:
        """The argv that runs `args` inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]


def _run(*args: str, stdin: str | None = None) -> None:
    result = subprocess.run(args, input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}\n{stdin or ''}")


def _tbf(device: str, mbit: float, mtu: int, buffer_s: float) -> str:
    """A `tc -batch` line: token bucket at `mbit`. The bucket holds 2 ms of the rate (at least two full frames:
    the dequeue timer may fire a little late without losing rate), the queue `buffer_s` of it (a home router's
    buffer; TCP needs about a bandwidth-delay product of queue to keep a loss-based sender at the rate)."""
    rate = mbit * 1e6 / 8
    burst = max(2 * (mtu + ETHERNET_HEADER), int(rate * 0.002))
    limit = max(4 * burst, int(rate * buffer_s))
    return f"qdisc add dev {device} root tbf rate {int(mbit * 1e6)}bit burst {burst} limit {limit}\n"


class WanTestbed:
    """The emulated WAN (see the module docstring). `seed` fixes the stage's jitter and loss draws; `mtu` is every
    link's; `congestion` every host's TCP congestion control; `buffer_s` the queue of every shaper in seconds of
    its rate. Not thread-safe; one instance per test."""

    def __init__(self, *, seed: int = 0, mtu: int = MTU, congestion: str = CONGESTION, buffer_s: float = 0.1,
                 tag: str | None = None):
        self.seed, self.mtu, self.congestion, self.buffer_s = seed, mtu, congestion, buffer_s
        self.tag = tag or uuid.uuid4().hex[:6]
        self.internet = f"sw{self.tag}net"
        self.tun = "wan0"
        self.hosts: list[WanHost] = []
        self.stage: subprocess.Popen[bytes] | None = None
        self.final_stage_stats: dict[str, Any] | None = None
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._workdir: str | None = None
        self._stage_output = b""
        self._closed = False

    # ------------------------------------------------------------------------------------------------ lifetime

    def __enter__(self) -> WanTestbed:
        atexit.register(self.close)
        try:
            self._workdir = tempfile.mkdtemp(prefix=f"swarmd-wan-{self.tag}-")
            self._add_namespace(self.internet)
            _run("ip", "netns", "exec", self.internet, "sysctl", "-q", "-e", "-w", "net.ipv4.ip_forward=1",
                 "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
                 "net.ipv4.conf.all.send_redirects=0", "net.ipv4.conf.default.send_redirects=0",
                 "net.ipv6.conf.default.disable_ipv6=1", "net.ipv6.conf.all.disable_ipv6=1")
            _run("ip", "-n", self.internet, "link", "set", "lo", "up")
            self._start_stage()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the testbed's namespaces (spawned ones and their children), stop the stage
        (its last counters land in `final_stage_stats`), delete the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        for namespace in self._namespaces:
            if namespace != self.internet:
                self._kill_namespace(namespace)
        for process in self._processes:
            _reap(process)
        self._stop_stage()
        for namespace in reversed(self._namespaces):
            self._kill_namespace(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._namespaces.clear()
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def _add_namespace(self, namespace: str) -> None:
        _run("ip", "netns", "add", namespace)
        self._namespaces.append(namespace)

    @staticmethod
    def _kill_namespace(namespace: str) -> None:
        """SIGKILL whatever still runs in `namespace` (also what spawned processes started themselves)."""
        listing = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
        for pid in listing.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    # -------------------------------------------------------------------------------------------------- hosts

    def add_host(self, name: str, profile: str | Profile = "lan") -> WanHost:
        """A new host with `profile` (a name in `PROFILES` or a `Profile`), reachable from every other host."""
        if isinstance(profile, str):
            profile = PROFILES[profile]
        index = len(self.hosts) + 1
        if index > 254:
            raise ValueError("the testbed's addressing has room for 254 hosts")
        host = WanHost(name, f"sw{self.tag}h{index}", f"{SUBNET}.{index}.2", profile, index)
        gateway = f"{SUBNET}.{index}.1"
        try:
            self._add_namespace(host.namespace)
            _run("ip", "netns", "exec", host.namespace, "sysctl", "-q", "-w",
                 f"net.ipv4.tcp_congestion_control={self.congestion}",
                 f"net.ipv4.tcp_rmem=4096 131072 {TCP_BUFFER_MAX}", f"net.ipv4.tcp_wmem=4096 16384 {TCP_BUFFER_MAX}")
            _run("ip", "link", "add", "eth0", "netns", host.namespace, "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", host.gateway_port, "netns", self.internet, "mtu", str(self.mtu))
            _run("ip", "-n", host.namespace, "-batch", "-", stdin=(
                "link set lo up\n"
                f"addr add {host.address}/24 dev eth0\n"
                "link set eth0 up\n"
                f"route add default via {gateway}\n"))
            rules = (f"addr add {gateway}/24 dev {host.gateway_port}\n"
                     f"link set {host.gateway_port} up\n"
                     f"rule add iif {host.gateway_port} to {SUBNET}.0.0/16 lookup {STAGE_TABLE} "
                     f"pref {STAGE_TABLE_PREF}\n")
            bypass = f"lookup main pref {BYPASS_TABLE_PREF}"
            for other in self.hosts:  # pairs with nothing to emulate but rate skip the stage
                if not link(profile, other.profile).impaired:
                    rules += f"rule add iif {host.gateway_port} to {other.address} {bypass}\n"
                if not link(other.profile, profile).impaired:
                    rules += f"rule add iif {other.gateway_port} to {host.address} {bypass}\n"
            _run("ip", "-n", self.internet, "-batch", "-", stdin=rules)
            if profile.up_mbit:
                _run("tc", "-n", host.namespace, "-batch", "-",
                     stdin=_tbf("eth0", profile.up_mbit, self.mtu, self.buffer_s))
            if profile.down_mbit:
                _run("tc", "-n", self.internet, "-batch", "-",
                     stdin=_tbf(host.gateway_port, profile.down_mbit, self.mtu, self.buffer_s))
            self.hosts.append(host)
            self._configure_stage()
        except BaseException:
            self.close()
            raise
        return host

    def link(self, source: WanHost, destination: WanHost) -> Link:
        """What packets from `source` to `destination` meet."""
        return link(source.profile, destination.profile)

    def cut(self, host: WanHost) -> None:
        """Partition: `host` loses its link (its processes keep running); `restore` gives it back."""
        _run("ip", "-n", self.internet, "link", "set", host.gateway_port, "down")

    def restore(self, host: WanHost) -> None:
        _run("ip", "-n", self.internet, "link", "set", host.gateway_port, "up")

    # ---------------------------------------------------------------------------------------------- processes

    def spawn(self, host: WanHost, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `host`'s namespace (killed, with everything else there, when the testbed closes)."""
        process: subprocess.Popen[Any] = subprocess.Popen(host.command(*argv), **popen)
        self._processes.append(process)
        return process

    def run(self, host: WanHost, argv: list[str], *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside `host`'s namespace to completion (bounded by `timeout`), output captured as text."""
        return subprocess.run(host.command(*argv), capture_output=True, text=True, timeout=timeout)

    # -------------------------------------------------------------------------------------------------- stage

    def _stage_config(self) -> dict[str, Any]:
        pairs = []
        for source in self.hosts:
            for destination in self.hosts:
                path = self.link(source, destination)
                if source is not destination and path.impaired:
                    pairs.append([source.address, destination.address, path.delay_s, path.jitter_s, path.loss])
        return {"tun": self.tun, "seed": self.seed, "pairs": pairs, "nice": STAGE_NICE, "watch_stdin": True}

    def _config_path(self) -> str:
        assert self._workdir is not None
        return os.path.join(self._workdir, "stage.json")

    def _write_config(self) -> None:
        staging = self._config_path() + ".new"
        with open(staging, "w") as file:
            json.dump(self._stage_config(), file)
        os.replace(staging, self._config_path())

    def _start_stage(self) -> None:
        self._write_config()
        assert self._workdir is not None
        stderr = open(os.path.join(self._workdir, "stage.err"), "wb")
        with stderr:
            self.stage = subprocess.Popen(
                ["ip", "netns", "exec", self.internet, sys.executable, "-m", "peer.testing.delay_stage",
                 "@" + self._config_path()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=_PACKAGE_ROOT)
        self._expect_line("ready", timeout=20)
        _run("ip", "-n", self.internet, "-batch", "-", stdin=(
            f"link set {self.tun} mtu {self.mtu} txqueuelen 10000 up\n"
            f"route add default dev {self.tun} table {STAGE_TABLE}\n"
            # should the stage die, its TUN and the route above go: packets are then dropped, never delivered
            # unimpaired
            f"route add blackhole default table {STAGE_TABLE} metric 10\n"))

    def _configure_stage(self) -> None:
        assert self.stage is not None
        self._write_config()
        self.stage.send_signal(signal.SIGHUP)
        self._expect_line("reloaded", timeout=20)

    def _expect_line(self, expected: str, *, timeout: float) -> str:
        """The stage's next line, which must be `expected` (or, for "{", a JSON object)."""
        line = self._stage_line(timeout)
        if line.strip() != expected and not (expected == "{" and line.startswith("{")):
            raise RuntimeError(f"the delay stage said {line!r}, not {expected!r}; stderr: {self._stage_stderr()}")
        return line

    def _stage_line(self, timeout: float) -> str:
        """The stage's next line of output (raw reads: a buffered reader would hide lines from `select`)."""
        assert self.stage is not None and self.stage.stdout is not None
        fd = self.stage.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._stage_output:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                raise RuntimeError(f"the delay stage did not answer (exit status {self.stage.poll()}); "
                                   f"stderr: {self._stage_stderr()}")
            self._stage_output += chunk
        line, _, self._stage_output = self._stage_output.partition(b"\n")
        return line.decode()

    def _stage_stderr(self) -> str:
        assert self._workdir is not None
        return Path(self._workdir, "stage.err").read_text(errors="replace")[-2000:]

    @property
    def stage_pid(self) -> int | None:
        return self.stage.pid if self.stage else None

    def stage_stats(self) -> dict[str, Any]:
        """The stage's counters now: packets received, released, lost (by the loss draw), held; lateness
        (how long after its release time a packet was written: p50, p99, max, in seconds); its CPU seconds."""
        assert self.stage is not None
        self.stage.send_signal(signal.SIGUSR1)
        stats: dict[str, Any] = json.loads(self._expect_line("{", timeout=10))
        return stats

    def _stop_stage(self) -> None:
        stage, self.stage = self.stage, None
        if stage is None:
            return
        if stage.poll() is None:
            stage.send_signal(signal.SIGTERM)
        try:
            output, _ = stage.communicate(timeout=5)
            lines = [line for line in (self._stage_output + output).decode().splitlines() if line.startswith("{")]
            if lines:
                self.final_stage_stats = json.loads(lines[-1])
        except subprocess.TimeoutExpired:
            stage.kill()
            stage.wait()


def _reap(process: subprocess.Popen[Any]) -> None:
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds `peer`: `-m` finds it there
