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

See docs/testbed.md for how the testbed is built and how accurate it is.
"""
