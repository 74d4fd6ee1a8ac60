"""Real processes: every `peer join` daemon, the bootstrap one included, is frozen (SIGSTOP) for 9 s in turn while
`peer train` runs, then continued (SIGCONT). A frozen process keeps its sockets but answers nothing, so peers
count failures against it; this used to drain the trainer's client-mode DHT table to nothing (3 -> 2 -> 1 -> 0),
after which it never found an expert again and died of `--max-failed-steps`.

Must hold: the trainer finishes with its result line, and within 10 s of the last SIGCONT a client-mode DHT node
that went through the same freezes (the trainer's kind, as `peer status` also uses) finds all 12 experts again.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from moe.declare import get_experts
from peer.client import Swarm
from peer.testing.peer_processes import PeerProcess, run_peer, start_daemon

FREEZE_SECONDS = 9.0
GAP_SECONDS = 2.0  # between one daemon's SIGCONT and the next one's SIGSTOP
HEALED_WITHIN = 10.0
# Enough steps that training outlasts the three freezes even on a fast machine (it runs up to ~100 steps/s).
STEPS = 4000
UIDS = [f"ffn.{i}" for i in range(12)]


def _found(swarm: Swarm) -> int:
    found = swarm.run(get_experts, swarm.dht, UIDS)
    return sum(location is not None for location in found.values())


@pytest.mark.slow
def test_training_survives_each_daemon_frozen_in_turn():
    processes: list[PeerProcess] = []
    try:
        first, _, bootstrap = start_daemon("--experts", "ffn.[0:4]", "--hidden-dim", "64")
        processes.append(first)
        for pattern in ("ffn.[4:8]", "ffn.[8:12]"):
            processes.append(start_daemon("--initial-peers", bootstrap, "--experts", pattern, "--hidden-dim", "64")[0])
        daemons = list(processes)
        trainer = PeerProcess(["train", "--initial-peers", bootstrap, "--grid-size", "12", "--hidden-dim", "64",
                               "--steps", str(STEPS), "--log-every", "10"])
        processes.append(trainer)
        trainer.read_until(r'"event": "progress"', timeout=180)

        with Swarm(initial_peers=[bootstrap]) as watcher:
            stop = threading.Event()

            def keep_reading() -> None:
                """Read all the time, as a trainer does: requests to a frozen daemon fail and count."""
                while not stop.is_set():
                    _found(watcher)
                    stop.wait(0.5)

            reader = threading.Thread(target=keep_reading, daemon=True)
            reader.start()
            try:
                for daemon in daemons:
                    daemon.signal(signal.SIGSTOP)
                    time.sleep(FREEZE_SECONDS)  # the scenario itself: how long the process stays frozen
                    daemon.signal(signal.SIGCONT)
                    if daemon is not daemons[-1]:
                        time.sleep(GAP_SECONDS)
                resumed = time.monotonic()
                assert trainer.process.poll() is None, (
                    f"the trainer ended before the freezes were over (raise STEPS): {trainer.lines[-3:]}")
                while (count := _found(watcher)) < len(UIDS):
                    assert time.monotonic() - resumed < HEALED_WITHIN, (
                        f"{count} of 12 experts found {HEALED_WITHIN} s after the last SIGCONT; "
                        f"client DHT: {watcher.dht.stats()}")
                    time.sleep(0.2)
            finally:
                stop.set()
                reader.join(timeout=30)
            stats = watcher.dht.stats()
            assert stats["contacts_restored"] >= 1, stats

        result = json.loads(trainer.read_until(r'"event": "result"', timeout=900).string)
        assert result["steps"] == STEPS
        assert trainer.wait(timeout=60) == 0, trainer.stderr_tail()

        status = run_peer("status", "--initial-peers", bootstrap, "--json", timeout=120)
        assert status.returncode == 0, status.stderr
        listed = json.loads(status.stdout)
        assert [e["uid"] for e in listed["experts"]["ffn"]] == sorted(UIDS)
        assert all(isinstance(peer["dht_rebootstraps"], int) for peer in listed["peers"]), listed["peers"]
    finally:
        for process in processes:
            process.kill()
