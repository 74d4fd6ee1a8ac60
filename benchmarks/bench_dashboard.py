"""Dashboard benchmark: what watching a 64-peer swarm costs the swarm per refresh, and the dashboard's memory.

64 daemons (one expert each, hidden size 8) run on 127.0.0.1, spread over `--processes` processes (8: one trio
loop for all 64 cannot keep up on a small machine); `peer dashboard` runs as its own process (as in production)
with `--refresh 2`. While it watches, this script samples the dashboard's resident
memory (VmRSS from /proc) every few seconds and, at the end, reads its /api/v1/state: the watcher counts what
each refresh sent (RPC calls through its RPC node, DHT datagrams through its network), divided by the peers
listed, averaged over the refreshes (`requests_per_peer_per_refresh`), and the number of refreshes done.
A second figure, counted at the daemons, checks it: the RPC calls they served over the same time (the
dashboard's `peer.status` calls: the daemons call nothing else of each other here), per peer per refresh.

Usage: python benchmarks/bench_dashboard.py [--peers 64] [--processes 8] [--seconds 120] [--refresh 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.daemon import Daemon, DaemonConfig  # noqa: E402
from peer.p2p.net import parse_address  # noqa: E402
from peer.testing.peer_processes import PEER, ChildProcess  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def fetch_state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/v1/state", timeout=30) as response:
        return json.loads(response.read())


async def host_daemons(args: argparse.Namespace) -> None:
    """Child mode (`--serve N`): run N daemons in this process, print `ready HOST:PORT` for the first once all
    are up, then every 2 s a line `served N` (RPC calls the N daemons served so far), until killed."""
    async with trio.open_nursery() as nursery:
        daemons: list[Daemon] = []
        for index in range(args.first, args.first + args.serve):
            peers = [parse_address(args.bootstrap)] if args.bootstrap else []
            if daemons:
                peers.append(daemons[-1].rpc.address)
            daemon = Daemon(DaemonConfig(host="127.0.0.1", experts=f"ffn.[{index}:{index + 1}]", hidden_dim=8,
                                         threads=1, initial_peers=peers))
            await nursery.start(daemon.run)
            daemons.append(daemon)
        address = daemons[0].rpc.address
        print(f"ready {address[0]}:{address[1]}", flush=True)
        while True:
            print(f"served {sum(daemon.rpc.stats['calls_served'] for daemon in daemons)}", flush=True)
            await trio.sleep(2)


def served(hosts: list[ChildProcess]) -> int:
    """The latest `served N` of every host process."""
    total = 0
    for host in hosts:
        last = None
        while (line := host.read_line(0.01)) is not None:
            if line.startswith("served "):
                last = int(line.split()[1])
        if last is None:
            last = int(next(line for line in reversed(host.lines) if line.startswith("served ")).split()[1])
        total += last
    return total


def run(args: argparse.Namespace) -> dict:
    me = [sys.executable, str(Path(__file__).resolve())]
    hosts: list[ChildProcess] = []
    per_host = -(-args.peers // args.processes)
    started = time.monotonic()
    try:
        bootstrap = None
        for first in range(0, args.peers, per_host):
            command = [*me, "--serve", str(min(per_host, args.peers - first)), "--first", str(first)]
            host = ChildProcess([*command, *(["--bootstrap", bootstrap] if bootstrap else [])],
                                capture_stderr=False)
            hosts.append(host)
            address = host.read_until(r"^ready (\S+)$", timeout=600).group(1)
            bootstrap = bootstrap or address
        print(f"{args.peers} daemons up in {args.processes} processes in {time.monotonic() - started:.1f} s",
              flush=True)
        dashboard = ChildProcess([*PEER, "dashboard", "--initial-peers", bootstrap, "--port", "0", "--refresh",
                                  str(args.refresh)], capture_stderr=False)
        url = dashboard.read_until(r"^dashboard at (http://\S+/)", timeout=120).group(1)
        deadline = time.monotonic() + 300
        while True:  # every peer listed and answering
            state = fetch_state(url)
            if sum(peer["state"] == "online" for peer in state["peers"]) >= args.peers:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(state['peers'])} peers on the dashboard after 300 s")
            time.sleep(1)
        first_state, served_before = state, served(hosts)
        samples = []
        watch_started = time.monotonic()
        while time.monotonic() - watch_started < args.seconds:
            samples.append(rss_mb(dashboard.pid))
            time.sleep(5)
        last = fetch_state(url)
        samples.append(rss_mb(dashboard.pid))
        watched = time.monotonic() - watch_started
        served_during = served(hosts) - served_before
    finally:
        for process in hosts:
            process.kill()
        if "dashboard" in locals():
            dashboard.kill()
    refreshes = last["swarm"]["refreshes"] - first_state["swarm"]["refreshes"]
    return {
        "peers": args.peers,
        "peers_online_at_end": sum(peer["state"] == "online" for peer in last["peers"]),
        "watched_s": round(watched, 1),
        "refresh_s": args.refresh,
        "refreshes": refreshes,
        # over the watched window only (the attach's DHT lookups are before it), and since attaching
        "requests_per_peer_per_refresh": round(
            (last["cost"]["rpc_calls"] - first_state["cost"]["rpc_calls"] + last["cost"]["dht_requests"]
             - first_state["cost"]["dht_requests"]) / max(1, refreshes * args.peers), 3),
        "requests_per_peer_per_refresh_since_attach": last["cost"]["per_peer_per_refresh"],
        "dht_requests_during_watch": last["cost"]["dht_requests"] - first_state["cost"]["dht_requests"],
        "rpc_calls_sent": last["cost"]["rpc_calls"],
        "dht_requests_sent": last["cost"]["dht_requests"],
        "status_calls_per_peer_per_refresh_at_daemons": round(served_during / max(1, refreshes * args.peers), 3),
        "rss_mb_start": round(samples[0], 1),
        "rss_mb_max": round(max(samples), 1),
        "rss_mb_end": round(samples[-1], 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--processes", type=int, default=8, help="processes the daemons are spread over")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--refresh", type=float, default=2.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # child mode: host this many daemons
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.serve:
        trio.run(host_daemons, options)
        sys.exit(0)
    result = run(options)
    print(f"watched {result['peers']} peers for {result['watched_s']} s ({result['refreshes']} refreshes): "
          f"{result['requests_per_peer_per_refresh']} requests per peer per refresh (at the dashboard), "
          f"{result['status_calls_per_peer_per_refresh_at_daemons']} status calls per peer per refresh (at the "
          f"daemons), RSS {result['rss_mb_start']} -> {result['rss_mb_end']} MB (max {result['rss_mb_max']})")
    print(json.dumps(result))
