"""End to end with real processes: `peer swarm up` runs 3 `peer join` daemons and 2 `peer train` trainers on
127.0.0.1, one of them private (`--reachability private`: reached only through the others' relays), SIGKILLs a
public daemon mid-training (a relay of the private one), and must finish with accurate trainers that averaged with
each other and used the private volunteer's experts through a relay, and leave no process behind."""

from __future__ import annotations

import json
import subprocess

import pytest

from peer.testing.peer_processes import PEER, ROOT


def processes_in_session(session_id: int) -> list[str]:
    listing = subprocess.run(["ps", "-e", "-o", "sid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if line.split() and line.split()[0] == str(session_id)]


@pytest.mark.slow
def test_swarm_up_trains_through_a_killed_daemon_and_leaves_nothing_behind(tmp_path):
    launcher = subprocess.Popen([*PEER, "swarm", "up", "--kill-one-at", "8", "--log-dir", str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                start_new_session=True)
    try:
        out, err = launcher.communicate(timeout=900)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["daemons_killed"] == 1
    assert "KILLED" in out and "summary:" in out
    assert len(summary["trainers"]) == 2
    results = {}
    for trainer in summary["trainers"]:
        assert trainer["exit_code"] == 0 and trainer["accuracy"] >= 0.9, trainer
        lines = (tmp_path / f"{trainer['name']}.log").read_text().splitlines()
        results[trainer["name"]] = json.loads(next(line for line in reversed(lines) if '"event": "result"' in line))
    one, two = results["trainer-1"], results["trainer-2"]
    assert two["peer_id"] in one["peers_averaged_with"] and one["peer_id"] in two["peers_averaged_with"]
    # the private volunteer (the last one) outlived the kill, which hit a public relay of it, and served the
    # trainers' expert calls over circuits its relays spliced (upgraded by a hole punch, or left relayed)
    private = summary["volunteers"][-1]
    assert private["private"] and private["reachability"] == "private" and not private["killed"], private
    assert private["reached"] == "relay" and private["requests_served"] > 0, private
    assert private["connections"]["upgraded"] + private["connections"]["relayed"] >= 1, private
    killed = next(v for v in summary["volunteers"] if v["killed"])
    assert not killed["private"] and killed["name"] != "bootstrap", killed
    assert "volunteer-2 (private): reached through relays" in out
    assert processes_in_session(launcher.pid) == []
