"""Start real `peer` processes for end-to-end tests and always clean them up."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PEER = [sys.executable, "-m", "peer.cli"]
ROOT = Path(__file__).resolve().parent.parent


class PeerProcess:
    def __init__(self, args: list[str], *, env: dict | None = None, prefix: list[str] | None = None):
        """`prefix` runs the peer through another command, e.g. `ip netns exec NAME` for a test host."""
        self.args = args
        self.process = subprocess.Popen(
            [*(prefix or []), *PEER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def read_until(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """Read stdout lines until one matches `pattern` (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            match = regex.search(line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} from peer {' '.join(self.args)}; got {self.lines}; "
                             f"stderr: {self.stderr_tail()}")

    def stderr_tail(self) -> str:
        if self.process.poll() is None:
            return "(still running)"
        return self.process.stderr.read()[-2000:]

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process.stderr.close()


def start_daemon(*args: str, timeout: float = 60.0) -> tuple[PeerProcess, str, str]:
    """Start `peer join ARGS`; returns the process, its PeerID and its HOST:PORT once it is reachable."""
    process = PeerProcess(["join", *args])
    match = process.read_until(r"^peer ([0-9a-f]{40}) listening on (\S+)$", timeout)
    process.read_until(r"^others join with", timeout)
    return process, match.group(1), match.group(2)


def run_peer(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*PEER, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
