"""The one harness for peers in child processes (end-to-end tests and benchmarks): start them, read what they
print, signal or kill them, and always clean them up.

- `ChildProcess`: any command of ours, run from the repository root; its stdout is pumped into a queue by a
  thread (a chatty child never blocks on a full pipe, and reads are bounded by a timeout).
- `PeerProcess`: `python -m peer.cli ARGS`; `start_daemon` starts `peer join` and waits until it is reachable.
- `ExpertServerProcess`: `python -m peer.testing.expert_server_process`, a minimal expert server that prints one
  JSON line once it serves; `ProcessGroup` kills every process it started at the end (the `server_processes` fixture).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from peer.events import Joined, JoinWatcher

PEER = [sys.executable, "-m", "peer.cli"]
ROOT = Path(__file__).resolve().parents[2]
EXPERT_SERVER = [sys.executable, "-m", "peer.testing.expert_server_process"]


class ChildProcess:
    def __init__(self, command: Sequence[str], *, env: dict[str, str] | None = None,
                 prefix: Sequence[str] | None = None, capture_stderr: bool = True, stdin: bool = False):
        """`prefix` runs the command through another one, e.g. `ip netns exec NAME` for a test host. Without
        `capture_stderr` the child writes its stderr to ours (for children that log a lot and are never asked
        why they failed). `stdin`: the test talks to the child with `send_line`."""
        self.command = list(command)
        self.process = subprocess.Popen(
            [*(prefix or []), *self.command], stdout=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None,
            stderr=subprocess.PIPE if capture_stderr else None, text=True, cwd=ROOT,
            env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def send_line(self, line: str) -> None:
        assert self.process.stdin is not None, "started without stdin=True"
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def read_line(self, timeout: float) -> str | None:
        """The next stdout line, or None when the child closed stdout or nothing came within `timeout`."""
        try:
            line = self._queue.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if line is not None:
            self.lines.append(line)
        return line

    def read_until(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Read stdout lines until one matches `pattern` (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while (line := self.read_line(deadline - time.monotonic())) is not None:
            match = regex.search(line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} from {' '.join(self.command)}; got {self.lines}; "
                             f"stderr: {self.stderr_tail()}")

    def read_json(self, timeout: float = 60.0) -> dict[str, Any]:
        """The first stdout line that is a JSON object (bounded by `timeout`)."""
        match = self.read_until(r"^\{.*\}$", timeout)
        found: dict[str, Any] = json.loads(match.group(0))
        return found

    def stderr_tail(self) -> str:
        if self.process.stderr is None:
            return "(not captured)"
        if self.process.poll() is None:
            return "(still running)"
        return self.process.stderr.read()[-2000:]

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`; returns the exit status."""
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        for pipe in (self.process.stdin, self.process.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


class PeerProcess(ChildProcess):
    """`python -m peer.cli ARGS`."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, prefix: list[str] | None = None,
                 capture_stderr: bool = True):
        self.args = args
        super().__init__([*PEER, *args], env=env, prefix=prefix, capture_stderr=capture_stderr)


def loopback_join(args: tuple[str, ...] | list[str]) -> list[str]:
    """`peer join` arguments that listen on 127.0.0.1 unless they say where: without --host a new swarm's daemon
    listens on all interfaces, and tests never bind the machine's real interfaces (tests/peer/test_defaults.py tests
    that default inside a network namespace)."""
    return [*args] if "--host" in args else [*args, "--host", "127.0.0.1"]


def start_daemon(*args: str, timeout: float = 60.0, capture_stderr: bool = True) -> tuple[PeerProcess, str, str]:
    """Start `peer join ARGS` (on 127.0.0.1 unless ARGS say --host); returns the process, its PeerID and its
    HOST:PORT once it is reachable."""
    process = PeerProcess(["join", *loopback_join(args)], capture_stderr=capture_stderr)
    try:
        joined = read_joined(process, timeout)
    except BaseException:
        process.kill()  # never leave a half-started daemon behind
        raise
    return process, joined.peer_id, joined.address


def read_joined(process: ChildProcess, timeout: float = 60.0) -> Joined:
    """Read a `peer join`'s stdout until its `joined` event (peer/events.py): the daemon is up and reachable."""
    deadline = time.monotonic() + timeout
    watcher = JoinWatcher()
    while (line := process.read_line(deadline - time.monotonic())) is not None:
        joined = watcher.feed(line)
        if joined is not None:
            return joined
    raise AssertionError(f"{' '.join(process.command)} did not join within {timeout} s; got {process.lines}; "
                         f"stderr: {process.stderr_tail()}")


def start_daemon_chain(slices: Sequence[Sequence[str]], *, timeout: float = 60.0
                       ) -> tuple[list[PeerProcess], str]:
    """One `peer join ARGS` per entry of `slices`, each after the first joining through the first; returns the
    processes and the bootstrap address. A failed start stops the ones already running."""
    processes: list[PeerProcess] = []
    bootstrap: str | None = None
    try:
        for args in slices:
            extra = ["--initial-peers", bootstrap] if bootstrap else []
            process, _, address = start_daemon(*args, *extra, timeout=timeout, capture_stderr=False)
            processes.append(process)
            bootstrap = bootstrap or address
    except BaseException:
        stop_all(processes)
        raise
    assert bootstrap is not None, "no daemon to start"
    return processes, bootstrap


def stop_all(processes: Sequence[ChildProcess], timeout: float = 15.0) -> None:
    """SIGTERM every process at once, then wait for each (they checkpoint and exit in parallel)."""
    for process in processes:
        process.signal(signal.SIGTERM)
    for process in processes:
        process.stop(timeout=timeout)


def run_peer(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`peer ARGS`; a `join` listens on 127.0.0.1 unless ARGS say --host (see `loopback_join`)."""
    if args and args[0] == "join":
        args = ("join", *loopback_join(args[1:]))
    return subprocess.run([*PEER, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


class ExpertServerProcess(ChildProcess):
    """An expert server in its own process (`python -m peer.testing.expert_server_process --uids UIDS ARGS`).
    `wait_ready` reads its JSON line: then `address` and `peer_id` (hex) say where it serves."""

    def __init__(self, uids: Sequence[str], *args: str, phase_hooks: bool = False):
        """`phase_hooks`: the process takes `hold forward|backward` lines on stdin (see `PhaseKill`)."""
        self.uids = list(uids)
        self.address: tuple[str, int] | None = None
        self.peer_id: str | None = None
        extra = ["--phase-hooks"] if phase_hooks else []
        super().__init__([*EXPERT_SERVER, "--uids", *uids, *args, *extra], capture_stderr=False, stdin=phase_hooks)

    def wait_ready(self, timeout: float = 120.0) -> "ExpertServerProcess":
        try:
            info = self.read_json(timeout)
        except AssertionError:
            self.kill()
            raise RuntimeError(f"expert server process did not start (exit code {self.poll()})") from None
        self.address, self.peer_id = (info["address"][0], int(info["address"][1])), info["peer_id"]
        return self


class PhaseKill:
    """An expert server process (started with `phase_hooks=True`, ready) armed to be SIGKILLed inside its next
    computation of `phase` ("forward" or "backward"; see peer/testing/expert_server_process.py --phase-hooks).
    Returns once the process confirmed the arming, so whatever the test does next meets the armed server.
    `entered` is set (and `uid` names the expert) just before the SIGKILL, so a caller that saw the server die sees
    it set; `killed` once the process is reaped. The kill comes from a watcher thread, so it lands while the
    caller of that computation is still waiting for the answer."""

    def __init__(self, process: ExpertServerProcess, phase: str, timeout: float = 60.0):
        self.process = process
        self.phase = phase
        self.uid: str | None = None
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.killed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"kill-in-{phase}", daemon=True)
        self._watcher.start()
        process.send_line(f"hold {phase}")
        if not self.armed.wait(timeout):
            process.kill()
            raise RuntimeError(f"expert server process did not confirm `hold {phase}` (exit code {process.poll()})")

    def _watch(self) -> None:
        while (line := self.process.read_line(3600.0)) is not None:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("armed") == self.phase:
                self.armed.set()
            elif event.get("entered") == self.phase:
                self.uid = event["uid"]
                self.entered.set()  # before the kill: whoever sees the server die can already see this
                self.process.kill()
                self.killed.set()
                return


class ProcessGroup:
    """Processes that must not outlive a test: `close()` kills whatever is still running."""

    def __init__(self) -> None:
        self.processes: list[ChildProcess] = []

    def add(self, process: ChildProcess) -> ChildProcess:
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            process.kill()
