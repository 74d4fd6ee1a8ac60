"""In-process daemons for tests: `run_daemon` runs one `peer.daemon.Daemon` as a trio task in its own cancel scope,
on 127.0.0.1 (real sockets) or on a host of an in-memory network, so a test starts several separate peers in one
trio run and kills any of them at an exact moment (tests/peer/test_relay_daemon.py, test_nat_trainers.py,
test_nat_upgrade.py); `average_together` runs one replica-averaging round on several daemons at once (test_daemon.py,
test_relay_daemon.py)."""

from __future__ import annotations

import dataclasses

import trio

from peer.daemon import Daemon, DaemonConfig


async def run_daemon(config: DaemonConfig, network=None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """One daemon in its own cancel scope: `started` with (daemon, scope); cancelling the scope kills it."""
    host = "127.0.0.1" if network is None else config.host  # tests never bind the real interfaces
    daemon = Daemon(dataclasses.replace(config, host=host), network=network.host(host) if network else None)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.run)
            task_status.started((daemon, scope))


async def average_together(daemons: list[Daemon], timeout: float) -> list:
    """One replica-averaging round (`replicas.average_once`) on every daemon at once, within `timeout` seconds;
    returns their results in the order they finished."""
    results = []

    async def average(daemon: Daemon) -> None:
        results.append(await daemon.replicas.average_once())

    with trio.fail_after(timeout):
        async with trio.open_nursery() as rounds:
            for daemon in daemons:
                rounds.start_soon(average, daemon)
    return results
