"""Docs examples as users run them: each `<!-- example: NAME -->` block of a docs page saved as a script and run in
its own process (`Script`), two of them joined over 127.0.0.1 (`two_trainers`: the first starts the swarm and
prints `swarm at HOST:PORT`, the second joins it). Shared by tests/peer/test_docs_examples.py and
tests/peer/test_lightning.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = re.compile(r"<!-- example: (\w+) -->\n```python\n(.*?)```", re.S)
ADDRESS = re.compile(r"^swarm at (\S+:\d+)$", re.M)
TIMEOUT = 240.0


def examples(page: Path) -> dict[str, str]:
    """The examples of a docs page, by name."""
    return dict(EXAMPLE.findall(page.read_text()))


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


class Script:
    """One example (or `peer` command) in its own process; its output collected by a reader thread."""

    def __init__(self, argv: list[str], cwd: Path):
        self.process = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self.output = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output += line

    def wait_for(self, pattern: re.Pattern[str]) -> re.Match[str]:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            match = pattern.search(self.output)
            if match:
                return match
            if self.process.poll() is not None:
                self.reader.join(5)
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern.pattern!r} in the output:\n{self.output[-3000:]}")

    def finish(self) -> str:
        try:
            self.process.wait(TIMEOUT)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self.reader.join(5)
        assert self.process.returncode == 0, self.output[-3000:]
        return self.output

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def two_trainers(source: str, tmp_path: Path, apart: float = 0.0) -> tuple[str, str]:
    """An example's `source` run twice, the second joining the first `apart` seconds after it printed its
    address; the outputs of both (each must exit 0)."""
    script = tmp_path / "train.py"
    script.write_text(source)
    first = Script([sys.executable, str(script)], tmp_path)
    second = None
    try:
        address = first.wait_for(ADDRESS).group(1)
        time.sleep(apart)  # the scenario's own delay (a person starting late), not a wait for a condition
        second = Script([sys.executable, str(script), address], tmp_path)
        return first.finish(), second.finish()
    finally:
        first.stop()
        if second is not None:
            second.stop()
