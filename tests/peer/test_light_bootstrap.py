"""`peer join --no-experts` (issue 38): a light bootstrap that serves no experts, never loads torch and holds at
most 80 MB, through which a daemon with experts and a trainer join the swarm. Separate processes on 127.0.0.1."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import pytest

from peer.events import JoinWatcher
from peer.testing.peer_processes import PeerProcess, ProcessGroup, run_peer, start_daemon

LIGHT_RSS_MB = 80  # the bound


def rss_mb(pid: int) -> float:
    """Resident memory of a running process (VmRSS of /proc/PID/status), in MB (2^20 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def torch_files(pid: int) -> list[str]:
    """The files of torch mapped into a running process (libtorch*, torch/_C...): none unless it imported torch."""
    paths = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}
    return sorted(path for path in paths if "torch" in Path(path).parts or "libtorch" in path)


def swarm_status(address: str, until: Callable[[dict], bool], timeout: float = 120.0) -> dict:
    """`peer status --json` through `address`, asked again until `until(status)` holds (bounded by `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        result = run_peer("status", "--initial-peers", address, "--json", timeout=60)
        status = json.loads(result.stdout) if result.returncode in (0, 1) and result.stdout.strip() else None
        if status is not None and until(status):
            return status
        assert time.monotonic() < deadline, f"status never as expected: {result.stdout}{result.stderr}"


@pytest.mark.slow  # three processes, two of them loading torch: 25 s on 2 busy cores, 70 s with 2 more spinning
def test_a_no_experts_daemon_is_a_light_bootstrap_for_daemons_and_trainers(processes: ProcessGroup):
    light, light_id, light_address = start_daemon("--no-experts", "--host", "127.0.0.1")
    processes.add(light)
    watcher = JoinWatcher()
    for line in light.lines:
        watcher.feed(line)
    joined = watcher.joined
    assert joined is not None and joined.experts == [] and joined.pattern is None and joined.hidden_dim is None
    assert any("serving no experts" in line for line in light.lines), light.lines

    full, full_id, _ = start_daemon("--initial-peers", light_address, "--experts", "ffn.[0:4]", "--hidden-dim", "16",
                                    "--threads", "1", timeout=120, capture_stderr=False)
    processes.add(full)

    # the light one serves nothing, knows the full one (its routing table, the directory), and shows its experts
    def both_known(status: dict) -> bool:
        peers = {peer["peer_id"]: peer for peer in status["peers"]}
        return (set(peers) == {light_id, full_id} and status["peers_reachable"] == 2
                and (peers[light_id]["dht_table_size"] or 0) >= 1)

    status = swarm_status(light_address, both_known)
    peers = {peer["peer_id"]: peer for peer in status["peers"]}
    assert peers[light_id]["experts"] == [] and peers[light_id]["expert_kind"] is None
    assert peers[full_id]["experts"] == ["ffn.0", "ffn.1", "ffn.2", "ffn.3"]
    assert [item["peer_id"] for item in status["experts"]["ffn"]] == [full_id] * 4

    # a trainer given nothing but the light bootstrap finds the full one's experts and trains on them
    trainer = PeerProcess(["train", "--initial-peers", light_address, "--steps", "4", "--batch-size", "8",
                           "--target-batch-size", "16", "--k-best", "2", "--log-every", "1", "--threads", "1"])
    processes.add(trainer)
    result = json.loads(trainer.read_until(r'^\{"event": "result"', timeout=240).string)
    assert trainer.wait(timeout=60) == 0, trainer.stderr_tail()
    assert result["steps"] == 4 and not result["local_experts"] and "accuracy" in result, result

    # after all that the light process still holds no torch and little memory
    assert light.poll() is None, light.stderr_tail()
    assert torch_files(light.pid) == []
    rss = rss_mb(light.pid)
    assert rss <= LIGHT_RSS_MB, f"light bootstrap RSS {rss:.1f} MB > {LIGHT_RSS_MB} MB"
