"""A child process's stdout read line by line by a thread: JSON objects become events, the rest is kept as text.

Why: a scenario follows several trainers at once and acts when one of them reports something (an outer step,
its result). Reading each pipe in its own thread means a chatty child never blocks on a full pipe, and one
shared `threading.Condition`, notified on every line, lets the runner wait for conditions instead of sleeping.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any


class LineReader:
    """Reads `process.stdout` (text mode) until it closes. `events`: every line that parses as a JSON object, in
    order, each with `_at` added (monotonic seconds when it was read); `text`: the last `keep_text` other lines.
    `on_event` runs in the reader thread for each event, under `condition`, before it is notified. Reading
    begins with `start()`."""

    def __init__(self, process: subprocess.Popen[str], condition: threading.Condition, *,
                 on_event: Callable[[dict[str, Any]], None] | None = None, keep_text: int = 50, name: str = ""):
        self.process = process
        self.condition = condition
        self.on_event = on_event
        self.events: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.keep_text = keep_text
        self.closed = False
        self._thread = threading.Thread(target=self._pump, name=f"lines-{name or process.pid}", daemon=True)

    def start(self) -> LineReader:
        self._thread.start()
        return self

    def _pump(self) -> None:
        assert self.process.stdout is not None
        try:
            for line in self.process.stdout:
                self._line(line.rstrip("\n"))
        except ValueError:  # the pipe was closed under us (the runner is shutting down)
            pass
        finally:
            with self.condition:
                self.closed = True
                self.condition.notify_all()

    def _line(self, line: str) -> None:
        event: Any = None
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                event = None
        with self.condition:
            if isinstance(event, dict):
                event["_at"] = time.monotonic()
                self.events.append(event)
                if self.on_event is not None:
                    self.on_event(event)
            else:
                self.text.append(line)
                del self.text[:-self.keep_text]
            self.condition.notify_all()

    def join(self, timeout: float) -> bool:
        """Wait until stdout closed (the process exited and everything it wrote was read)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
