"""Harnesses that tests and benchmarks import (as `trio.testing` is for trio): nothing in the product imports them.

- `peer.testing.wan`: `WanTestbed`, a closed emulated WAN of network namespaces with per-host bandwidth, delay,
  jitter and loss (`PROFILES`), and `Churn`, a schedule of signals and spawns applied to named processes;
- `peer.testing.delay_stage`: the user-space delay/loss stage the testbed runs inside its "internet" namespace;
- `peer.testing.probe`: small RTT, throughput and loss probes run inside the testbed's hosts.

See docs/testbed.md for how the testbed is built and how accurate it is.
"""
