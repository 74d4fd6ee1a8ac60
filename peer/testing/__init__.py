"""Harnesses that tests and benchmarks import (as `trio.testing` is for trio): nothing in the product imports them.

- `peer.testing.wan`: `WanTestbed`, a closed emulated WAN of network namespaces with per-host bandwidth, delay,
  jitter and loss (`PROFILES`), and `Churn`, a schedule of signals and spawns applied to named processes;
- `peer.testing.delay_stage`: the user-space delay/loss stage the testbed runs inside its "internet" namespace;
- `peer.testing.probe`: small RTT, throughput and loss probes run inside the testbed's hosts;
- `peer.testing.scenario`: a DiLoCo swarm of real daemons and `peer train` processes on the testbed under a churn
  schedule in outer steps (kills, freezes, joins, a slow trainer), and `peer.testing.scenario_report`, what it
  measured (goodput, bytes, rounds, agreement per outer step, RTTs per round); `peer.testing.bandwidth` and
  `peer.testing.lines` are its interface-counter meter and JSON-line reader; `peer.testing.trainer` is
  `peer train` with test hooks.

The harnesses of the test suite that the benchmarks use too:

- `peer.testing.peer_processes`: peers in child processes (`ChildProcess`, `PeerProcess`, `start_daemon`,
  `ExpertServerProcess`, `ProcessGroup`...), started from the repository root and always cleaned up;
  `peer.testing.expert_server_process` is the minimal expert server that `ExpertServerProcess` runs;
- `peer.testing.sim_peers`: simulated peers (an RPC node and a DHT node each) in one trio run, on the in-memory
  network or on 127.0.0.1, each killable at an exact moment;
- `peer.testing.netns`: separate hosts in network namespaces (`HostNetwork`) and NAT routers (`NatInternet`);
- `peer.testing.hand_rolled`: a hand-rolled RPC client that breaks the protocol on purpose after a real handshake.

The tests themselves mirror the code: tests/p2p, tests/dht, tests/moe, tests/averaging, tests/peer, and
tests/scenarios for runs of several processes, network namespaces or containers.

See docs/testbed.md for how the testbed is built and how accurate it is.
"""
