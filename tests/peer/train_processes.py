"""`peer train --algorithm diloco` trainer processes and the daemon they bootstrap from, for the tests that run
DiLoCo as separate processes (tests/peer/test_train_diloco.py, test_train_byzantine.py, test_train_sparse.py); built on
peer/testing/peer_processes.py, every process added to the test's `ProcessGroup` (which kills it at the end).

- `diloco_daemon`: a small `peer join` daemon; returns its address.
- `diloco_trainer`: a `peer train` process of the tiny model (`TRAINER`'s options) with `--start-with`; with
  `hooks`, run through the test entry point `peer.testing.trainer`.
- `train_result`: the trainer's final `result` line.
"""

from __future__ import annotations

import sys
from typing import Sequence

from peer.testing.peer_processes import ChildProcess, PeerProcess, ProcessGroup, start_daemon

TRAINER = ["--algorithm", "diloco", "--local-experts", "--hidden-dim", "16", "--grid-size", "2", "--batch-size",
           "16", "--threads", "1"]


def diloco_daemon(processes: ProcessGroup) -> str:
    daemon, _, address = start_daemon("--hidden-dim", "16", "--num-experts", "1")
    processes.add(daemon)
    return address


def diloco_trainer(processes: ProcessGroup, address: str, *args: str, start_with: int, hooks: Sequence[str] = ()
                   ) -> PeerProcess:
    """A `peer train` process; with `hooks` (options of `peer.testing.trainer`) through the test entry point.
    start_with: trainers started together begin together, however far apart a loaded machine brings them up."""
    train = ["train", "--initial-peers", address, *TRAINER, "--start-with", str(start_with), *args]
    if hooks:
        return processes.add(ChildProcess([sys.executable, "-m", "peer.testing.trainer", *hooks, "--", *train[1:]]))
    return processes.add(PeerProcess(train))


def train_result(process: PeerProcess, timeout: float = 300.0) -> dict:
    while True:
        line = process.read_json(timeout)
        if line.get("event") == "result":
            return line
