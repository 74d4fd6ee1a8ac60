"""`peer join` / `peer status` as users run them: separate processes on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

from peer.testing.peer_processes import run_peer, start_daemon


@pytest.fixture
def daemons():
    started = []
    yield started
    for process in started:
        process.kill()


def test_help_and_version():
    result = run_peer("--help")
    assert result.returncode == 0 and "join" in result.stdout and "status" in result.stdout
    assert run_peer("--version").stdout.startswith("swarmd ")


@pytest.mark.parametrize("args, message", [
    (["join", "--port", "abc"], "not a port number"),
    (["join", "--experts", "ffn.[0:x]"], "--experts"),
    (["join", "--expert-kind", "nonexistent", "--experts", "ffn.[0:2]"], "--expert-kind"),
    (["join", "--initial-peers", "nocolon"], "HOST:PORT"),
    (["join", "--config", "/nonexistent/swarmd.toml"], "cannot read config file"),
    (["join", "--initial-peers", "127.0.0.1:9"], "bootstrap failed"),
    (["status", "--initial-peers", "127.0.0.1:9"], "bootstrap failed"),
    (["frobnicate"], "invalid choice"),
    (["join", "--budget", "requests_per_pear=5"], "NAME one of connections_per_peer"),
    (["join", "--budget", "requests_per_peer=lots"], "'lots' is not a number"),
    (["join", "--budget", "requests_per_peer=5000"], "requests limit per peer (5000)"),
])
def test_bad_input_gives_one_line_error_and_nonzero_exit(args, message):
    result = run_peer(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("peer: error:") and message in lines[0]
    assert "Traceback" not in result.stderr


def test_port_in_use_is_one_line(daemons):
    first, _, address = start_daemon("--port", "0")
    daemons.append(first)
    port = address.rsplit(":", 1)[1]
    result = run_peer("join", "--port", port)
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_config_file_values_apply_and_flags_win(tmp_path, daemons):
    config = tmp_path / "peer.toml"
    config.write_text('experts = "ffn.[0:3]"\nhidden-dim = 32\nport = 1\n')
    process, _, address = start_daemon("--config", str(config), "--port", "0")
    daemons.append(process)
    assert not address.endswith(":1")  # the flag won
    assert "serving 3 experts" in "\n".join(process.lines)


def test_status_json_lists_peers_and_their_experts(daemons):
    first, first_id, first_address = start_daemon("--experts", "ffn.[0:2]", "--hidden-dim", "32",
                                                  "--budget", "connections_per_peer=7", "requests_total=900")
    daemons.append(first)
    second, second_id, _ = start_daemon("--initial-peers", first_address, "--experts", "ffn.[2:4]",
                                        "--hidden-dim", "32")
    daemons.append(second)
    deadline = time.monotonic() + 30
    while True:
        result = run_peer("status", "--initial-peers", first_address, "--json")
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)
        if status["peers_reachable"] == 2 or time.monotonic() > deadline:
            break
    assert {peer["peer_id"] for peer in status["peers"]} == {first_id, second_id}
    assert [e["uid"] for e in status["experts"]["ffn"]] == ["ffn.0", "ffn.1", "ffn.2", "ffn.3"]
    # use against each limit (issue 40): the first daemon holds connections (the second's, the status caller's)
    budgets = next(peer for peer in status["peers"] if peer["peer_id"] == first_id)["budgets"]
    assert budgets["connections"]["held"] >= 1 and budgets["connections"]["limit_per_peer"] == 7  # --budget
    assert budgets["requests"]["limit"] == 900
    assert {"handshakes", "requests", "message_bytes"} <= set(budgets)
    human = run_peer("status", "--initial-peers", first_address)
    assert "2 reachable" in human.stdout and "ffn: 4 experts on 2 peers" in human.stdout
    assert f"  {first_id[:12]}: fullest: " in human.stdout and "refused: " in human.stdout, human.stdout


def test_sigterm_checkpoints_exits_zero_and_restart_resumes_identity_and_weights(tmp_path):
    args = ["--experts", "ffn.[0:2]", "--hidden-dim", "16", "--identity", str(tmp_path / "id.key"),
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    process, peer_id, _ = start_daemon(*args)
    try:
        process.signal(signal.SIGTERM)
        # a hang guard, not a speed check: on a machine 7x oversubscribed a clean exit once took over 10 s
        assert process.wait(timeout=120) == 0
    finally:
        process.kill()
    saved = torch.load(tmp_path / "ckpt" / "ffn.0.pt", weights_only=True)
    restarted, restarted_id, _ = start_daemon(*args)
    try:
        assert restarted_id == peer_id
        assert "serving 2 experts: ffn.0, ffn.1" in "\n".join(restarted.lines)
        restarted.signal(signal.SIGTERM)
        assert restarted.wait(timeout=120) == 0
    finally:
        restarted.kill()
    reloaded = torch.load(tmp_path / "ckpt" / "ffn.0.pt", weights_only=True)
    for name, tensor in saved["model"].items():
        assert torch.equal(tensor, reloaded["model"][name]), name


def _one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("peer: error:")
    return lines[0]


def test_an_unwritable_checkpoint_dir_is_refused_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory under a regular file cannot be made, even by root
    result = run_peer("join", "--experts", "ffn.[0:1]", "--hidden-dim", "8", "--checkpoint-dir",
                      str(blocker / "ckpt"), timeout=60)
    assert result.returncode == 1
    line = _one_line(result)
    assert f"checkpoint directory {blocker / 'ckpt'} is not writable" in line


def test_a_checkpoint_that_fails_at_shutdown_exits_nonzero_and_says_where(tmp_path):
    ckpt = tmp_path / "ckpt"
    process, _, _ = start_daemon("--experts", "ffn.[0:2]", "--hidden-dim", "8", "--checkpoint-dir", str(ckpt))
    try:
        ckpt.rename(tmp_path / "moved")
        ckpt.write_text("now a file: the final checkpoint cannot be written")
        process.signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 1
        stderr = process.process.stderr.read()
    finally:
        process.kill()
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("peer: error:") and "final checkpoint failed" in last
    assert str(ckpt / "ffn.") in last


def test_an_identity_file_others_can_read_is_refused_with_the_fix(tmp_path):
    from peer.p2p.identity import Identity

    key = tmp_path / "id.key"
    Identity.generate().save(key)
    key.chmod(0o644)
    result = run_peer("join", "--identity", str(key))
    assert result.returncode == 1
    line = _one_line(result)
    assert str(key) in line and f"chmod 600 {key}" in line
    key.chmod(0o600)
    process, _, _ = start_daemon("--identity", str(key))
    process.kill()
