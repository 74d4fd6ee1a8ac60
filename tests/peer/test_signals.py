"""Signals and terminal output, as users meet them: Ctrl-C on `peer swarm up`, SIGTERM / SIGINT on `peer train`
(also when a script started it in the background with SIGINT ignored), and the progress bar sharing a terminal
with the JSON lines.

The launcher's own logic (who gets which signal, grace periods, the summary, when `--kill-one-at` fires) is
tested in-process against scripted stand-ins for `peer join` / `peer train`; the real processes are tested too
(`peer train` alone is fast with `--local-experts`; whole swarms are marked slow).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import trio

from peer import train
from peer.swarm import SwarmLauncher
from peer.testing.peer_processes import PEER, ROOT, start_daemon
from peer.topology import Topology

# ------------------------------------------------------------------------------------ scripted stand-ins

# Run as `FAKE join ...` or `FAKE train ...` in place of `python -m peer.cli`. A volunteer prints what `peer
# join` prints and exits 0 on SIGTERM/SIGINT. A trainer says it is starting, then prints progress lines until
# --steps; on SIGINT/SIGTERM it writes an interrupted result and exits 128 + N, like `peer train`. With
# FAKE_TRAINER_IGNORES_SIGNALS it ignores them (a trainer stuck past its grace period).
FAKE_PEER = textwrap.dedent('''
    import json, os, signal, sys, time

    role, args = sys.argv[1], sys.argv[2:]
    stop = []
    signal.signal(signal.SIGINT, lambda n, f: stop.append(n))
    signal.signal(signal.SIGTERM, lambda n, f: stop.append(n))
    print(f"pid {os.getpid()} pgid {os.getpgid(0)}", file=sys.stderr, flush=True)
    if role == "join":
        port = 40000 + os.getpid() % 20000
        print(f"peer {os.getpid():040x} listening on 127.0.0.1:{port}", flush=True)
        first = int(args[args.index("--experts") + 1].split("[")[1].split(":")[0])
        print("serving 4 experts: " + ", ".join(f"ffn.{first + i}" for i in range(4)), flush=True)
        print(f"others join with: peer join --initial-peers 127.0.0.1:{port}", flush=True)
        experts = [f"ffn.{first + i}" for i in range(4)]
        print(json.dumps({"event": "joined", "v": 1, "peer_id": f"{os.getpid():040x}",
                          "address": f"127.0.0.1:{port}", "reachability": "public", "reached": "direct",
                          "experts": experts, "pattern": None, "hidden_dim": None, "expert_kind": None,
                          "metrics": None, "join_command": f"peer join --initial-peers 127.0.0.1:{port}"}),
              flush=True)
        while not stop:
            time.sleep(0.01)
        sys.exit(0)
    if os.environ.get("FAKE_TRAINER_IGNORES_SIGNALS"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    steps = int(args[args.index("--steps") + 1])
    print("looking for experts", flush=True)
    time.sleep(float(os.environ.get("FAKE_TRAINER_STARTUP_S", "0.3")))  # the start-up --kill-one-at must skip
    step = 0
    while step < steps and not stop:
        time.sleep(0.02)
        step += 1
        print(json.dumps({"event": "progress", "step": step, "steps": steps, "loss": 1.0, "accuracy": 0.5,
                          "samples_per_s": 100.0, "experts_alive": 8, "failed_calls": 0, "step_s": 0.02}),
              flush=True)
    print(json.dumps({"event": "result", "accuracy": 0.9, "steps": step, "steps_planned": steps,
                      "interrupted": bool(stop), "samples_per_s": 100.0}), flush=True)
    sys.exit(128 + stop[0] if stop else 0)
''')


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    """An executable the launcher can use as its `python`: `FAKE -m peer.cli ROLE ARGS` runs the stand-in."""
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    wrapper = tmp_path / "fake-python"
    wrapper.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{script}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


class _Screen(io.StringIO):
    """A launcher output that says it is a terminal, so the live view is redrawn at every refresh."""

    def isatty(self) -> bool:
        return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _wait_for(condition, timeout: float = 60.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


def _launch(fake_python: str, tmp_path: Path, *, out: io.StringIO, interrupt: int | None = None,
            **options) -> tuple[SwarmLauncher, dict]:
    topology = Topology(volunteers=options.pop("volunteers", 2), trainers=2, steps=options.pop("steps", 100_000))
    launcher = SwarmLauncher(topology, log_dir=tmp_path / "logs", out=out, python=fake_python, refresh_s=0.05,
                             **options)
    results: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                results["summary"] = await launcher.run()

            nursery.start_soon(run)
            if interrupt is not None:
                await _wait_for(lambda: all(m.progress for m in launcher.members if m.role == "trainer")
                                and len(launcher.members) == 4)
                os.kill(os.getpid(), interrupt)

    trio.run(main)
    return launcher, results["summary"]


def test_a_signal_stops_every_process_trainers_report_and_the_summary_is_printed(fake_python, tmp_path):
    out = io.StringIO()
    launcher, summary = _launch(fake_python, tmp_path, out=out, interrupt=signal.SIGINT)
    assert launcher.exit_code() == 130 and summary["interrupted"] == "SIGINT"
    assert not summary["all_trainers_finished"]
    for trainer in summary["trainers"]:
        # the trainers got the launcher's SIGINT, once, and reported before they exited
        assert trainer["stopped_with"] == "SIGINT" and trainer["exit_code"] == 130, trainer
        assert trainer["interrupted"] and trainer["reported"] and not trainer["force_killed"]
        assert trainer["accuracy"] == 0.9 and trainer["steps"] >= 1
    volunteers = [m for m in launcher.members if m.role == "volunteer"]
    assert all(m.stopped_with == "SIGTERM" and m.exit_code == 0 for m in volunteers)
    assert summary["leftover_processes"] == 0
    assert not any(_alive(pid) for pid in summary["pids"].values())
    text = out.getvalue()
    assert "summary:" in text and "interrupted at step" in text and "stopped by SIGINT" in text
    assert json.loads(text.strip().splitlines()[-1]) == summary
    # every child ran in its own process group: a terminal's Ctrl-C reaches only the launcher
    for member in launcher.members:
        pid, pgid = re.search(r"pid (\d+) pgid (\d+)", member.log_path.read_text()).groups()
        assert pid == pgid and int(pid) == member.process.pid


def test_a_trainer_that_does_not_stop_is_killed_after_its_grace_period(fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRAINER_IGNORES_SIGNALS", "1")
    launcher, summary = _launch(fake_python, tmp_path, out=io.StringIO(), interrupt=signal.SIGTERM,
                                trainer_grace_s=0.5)
    assert launcher.exit_code() == 143
    for trainer in summary["trainers"]:
        assert trainer["force_killed"] and trainer["exit_code"] == -signal.SIGKILL, trainer
    assert not any(_alive(pid) for pid in summary["pids"].values())


def test_trainers_that_finish_exit_zero_and_kill_one_at_counts_from_training_progress(fake_python, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("FAKE_TRAINER_STARTUP_S", "1.0")
    screen = _Screen()
    launcher, summary = _launch(fake_python, tmp_path, out=screen, volunteers=3, steps=60, kill_one_at=0.3)
    assert launcher.exit_code() == 0 and summary["all_trainers_finished"] and summary["interrupted"] is None
    assert summary["daemons_killed"] == 1
    victim = next(m for m in launcher.members if m.killed_at is not None)
    assert victim.killed_at >= launcher.training_at + 0.3  # not counted from the start-up
    text = screen.getvalue()
    before, after = text.split("*** SIGKILLed", 1)
    # the live view showed the trainers training both before and after the kill
    running = r" +running +(\[[#-]+\] )?step"  # a trainer's row: state, its progress bar, its step
    assert re.search(rf"trainer-1{running} \d+/60", before) and re.search(rf"trainer-2{running}", before)
    assert re.search(r"volunteer-2 .*KILLED", after) and re.search(rf"trainer-1{running} \d+/60", after)
    assert all(t["exit_code"] == 0 and not t["interrupted"] for t in summary["trainers"])


# ------------------------------------------------------------------------------------ peer train


def _start_trainer(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([*PEER, "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **popen)


def _signal_after_progress(process: subprocess.Popen, signum: int, timeout: float = 120) -> tuple[int, list, str]:
    """Wait for the first progress line, send `signum`, and return (exit status, stdout JSON lines, stderr)."""
    timer = threading.Timer(timeout, process.kill)  # a bound, not synchronisation: the test fails if it fires
    timer.start()
    try:
        lines = []
        for line in process.stdout:
            lines.append(json.loads(line))
            if lines[-1]["event"] == "progress":
                break
        process.send_signal(signum)
        rest, err = process.communicate(timeout=timeout)
        lines += [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
        return process.returncode, lines, err
    finally:
        timer.cancel()
        if process.poll() is None:
            process.kill()
            process.communicate()


LONG_LOCAL_RUN = ("--local-experts", "--steps", "100000000", "--log-every", "20")


def test_peer_train_on_sigterm_finishes_the_step_reports_interrupted_and_exits_143():
    status, lines, err = _signal_after_progress(_start_trainer(*LONG_LOCAL_RUN), signal.SIGTERM)
    assert status == 143, err
    result = lines[-1]
    assert result["event"] == "result" and result["interrupted"] is True and result["signal"] == "SIGTERM"
    assert result["steps"] >= 20 and result["steps_planned"] == 100000000 and 0 <= result["accuracy"] <= 1
    assert "Traceback" not in err and "SIGTERM received" in err


def test_peer_train_started_with_sigint_ignored_still_stops_on_sigint():
    # what a non-interactive shell does to a background job (`peer train ... &` in a script)
    process = _start_trainer(*LONG_LOCAL_RUN, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    status, lines, err = _signal_after_progress(process, signal.SIGINT)
    assert status == 130, err
    assert lines[-1]["event"] == "result" and lines[-1]["interrupted"] is True and lines[-1]["signal"] == "SIGINT"
    assert "Traceback" not in err


def test_peer_train_in_a_background_job_of_a_script_stops_on_sigint(tmp_path):
    out = tmp_path / "train.out"
    command = " ".join([*PEER, "train", *LONG_LOCAL_RUN])
    script = subprocess.Popen(["sh", "-c", f"{command} > {out} 2>&1 & echo $!; wait $!; echo status $?"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        pid = int(script.stdout.readline())
        deadline = time.monotonic() + 120
        while '"event": "progress"' not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline and script.poll() is None, out.read_text()
            time.sleep(0.05)
        os.kill(pid, signal.SIGINT)
        tail, _ = script.communicate(timeout=120)
    finally:
        if script.poll() is None:
            script.kill()
    assert tail.strip() == "status 130"
    result = json.loads(out.read_text().strip().splitlines()[-1])
    assert result["event"] == "result" and result["interrupted"] is True


@pytest.mark.slow
@pytest.mark.parametrize("hang", [False, True], ids=["daemon-up", "daemon-stopped"])
def test_peer_train_on_a_swarm_reports_when_sigtermed(hang):
    """With `hang`, the daemon is SIGSTOPped first: the step in progress is stuck in expert calls, and the
    signal still ends the run once those calls time out (--expert-timeout), not never."""
    daemon, _, address = start_daemon("--experts", "ffn.[0:4]", "--hidden-dim", "64", "--threads", "1")
    try:
        process = _start_trainer("--initial-peers", address, "--grid-size", "4", "--steps", "100000",
                                 "--log-every", "5", "--run-id", "signals", "--expert-timeout", "1",
                                 "--max-failed-steps", "1000")
        if hang:
            first = process.stdout.readline()
            daemon.signal(signal.SIGSTOP)
            process.send_signal(signal.SIGTERM)
            rest, err = process.communicate(timeout=240)
            status, lines = process.returncode, [json.loads(line) for line in [first, *rest.splitlines()]]
        else:
            status, lines, err = _signal_after_progress(process, signal.SIGTERM, timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
        daemon.signal(signal.SIGCONT)
        daemon.kill()
    assert status == 143, err
    result = lines[-1]
    assert result["event"] == "result" and result["interrupted"] is True and result["steps"] >= 5
    assert "failed_expert_calls" in result and "Traceback" not in err
    if hang:  # nothing answers the held-out evaluation either: the result says so instead of going missing
        assert result["accuracy"] is None and "evaluation_error" in result


def test_a_stop_request_ends_the_run_after_the_current_step_with_an_interrupted_result(capsys):
    stop = train.StopSignal()
    args = train.build_parser().parse_args(["--local-experts", "--steps", "1000", "--log-every", "10"])
    result = train.run_training(args, lambda line: stop.request(signal.SIGTERM) if line["step"] == 30 else None,
                                stop=stop)
    assert result["steps"] == 30 and result["steps_planned"] == 1000 and result["interrupted"] is True
    assert stop.exit_code() == 143
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1] == result
    progress = lines[:-1]
    assert [p["step"] for p in progress] == [10, 20, 30]
    assert all("epoch" not in p for p in progress)  # no collective epochs without a swarm
    assert all(p["failed_calls"] == 0 and p["step_s"] > 0 and p["time"].endswith("+00:00") for p in progress)
    assert [p["elapsed_s"] for p in progress] == sorted(p["elapsed_s"] for p in progress)


# ------------------------------------------------------------------------------------ one terminal


def _render(data: str) -> list[str]:
    """What a terminal shows: carriage return to column 0, ESC[K erases to the end of the line."""
    screen, line, column = [], [], 0
    index = 0
    while index < len(data):
        char = data[index]
        if data.startswith("\x1b[K", index):
            del line[column:]
            index += 3
            continue
        index += 1
        if char == "\r":
            column = 0
        elif char == "\n":
            screen.append("".join(line))
            line, column = [], 0
        else:
            if column < len(line):
                line[column] = char
            else:
                line.append(char)
            column += 1
    if line:
        screen.append("".join(line))
    return screen


def test_on_one_terminal_json_lines_never_share_a_line_with_the_progress_bar():
    master, slave = os.openpty()
    stdout = open(os.dup(slave), "w")
    stderr = open(os.dup(slave), "w")
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO once every copy of the slave is closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    original = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = stdout, stderr
    try:
        args = train.build_parser().parse_args(["--local-experts", "--steps", "60", "--log-every", "20"])
        train.run_training(args)
    finally:
        sys.stdout, sys.stderr = original
        stdout.close()
        stderr.close()
    reader.join(timeout=30)
    os.close(master)
    screen = [line for line in _render(b"".join(chunks).decode()) if line]
    json_lines = [line for line in screen if "{" in line]
    assert len(json_lines) == 4  # three progress lines and the result
    for line in json_lines:
        assert line.startswith("{") and json.loads(line), line  # nothing of the bar before it
    bars = [line for line in screen if line.startswith("[")]
    assert bars and bars[-1].startswith("[" + "#" * 24 + "] 60/60")
    assert all(line.startswith(("{", "[")) for line in screen), screen


# ------------------------------------------------------------------------------------ the real swarm


def _processes_in_session(session_id: int) -> list[str]:
    listing = subprocess.run(["ps", "-e", "-o", "sid=,pid=,stat=,args="], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines()
            if line.split() and line.split()[0] == str(session_id) and "Z" not in line.split()[2]]


@pytest.mark.slow
def test_ctrl_c_on_swarm_up_prints_the_summary_exits_130_and_leaves_no_process(tmp_path):
    launcher = subprocess.Popen(
        [*PEER, "swarm", "up", "--volunteers", "1", "--trainers", "1", "--steps", "1000000",
         "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        trainer_log = tmp_path / "trainer-1.log"
        deadline = time.monotonic() + 300
        while '"event": "progress"' not in (trainer_log.read_text() if trainer_log.exists() else ""):
            assert time.monotonic() < deadline and launcher.poll() is None, "the trainer never trained"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "summary:" in out and "interrupted at step" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] == "SIGINT" and summary["leftover_processes"] == 0
    (trainer,) = summary["trainers"]
    assert trainer["exit_code"] == 130 and trainer["reported"] and trainer["steps"] >= 1, trainer
    result = json.loads(trainer_log.read_text().strip().splitlines()[-1])
    assert result["event"] == "result" and result["interrupted"] is True
    assert set(summary["pids"]) == {"bootstrap", "trainer-1"}
    assert not any(_alive(pid) for pid in summary["pids"].values())
    assert _processes_in_session(launcher.pid) == []
