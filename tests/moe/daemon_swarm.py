"""Daemons on 127.0.0.1 sockets for tests that drive a Swarm client against them (test_export.py,
test_swarmify.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import trio

from peer.daemon import Daemon, DaemonConfig
from peer.p2p.bridge import Bridge


@contextlib.contextmanager
def daemons(patterns: list[str], kind: str, hidden: int, *, accept: list[str] | None = None,
            **options: Any) -> Iterator[str]:
    """One daemon per pattern (each a separate peer on its own sockets, with any further DaemonConfig `options`),
    joined through the first; yields the bootstrap's HOST:PORT."""
    with Bridge.start() as bridge:
        address = None
        for index, pattern in enumerate(patterns):
            config = DaemonConfig(host="127.0.0.1", experts=pattern, expert_kind=kind, hidden_dim=hidden,
                                  initial_peers=[] if address is None else [address], seed=index * 100,
                                  accept_weights_from=list(accept or []), lr=1e-3, **options)
            daemon = Daemon(config)

            async def run(daemon: Daemon = daemon, task_status=trio.TASK_STATUS_IGNORED) -> None:
                await daemon.run(task_status=task_status)

            info = bridge.start_and_wait(run)
            address = address or info.address
        yield f"{address[0]}:{address[1]}"
