"""Bytes per second of every testbed host, from the kernel's interface counters, sampled every 100 ms.

Why these counters: a trainer's own byte counts say what its all-reduce encoded, not when the bytes crossed the
link; a peak rate (fragments, bursts) needs the link's view over time. The counters are the ones under
`/sys/class/net/<dev>/statistics/` of the host's interface; they are read from `/proc/<pid>/net/dev` of one
process inside the testbed's internet namespace (its delay stage), where the veth `h<i>` faces host i: its
rx_bytes are what host i sent (after its uplink shaper), its tx_bytes what host i received. One read covers every
host, from this process, with no `ip netns exec` per sample: forking ten readers a second per host would load
the very cores the scenario measures.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


def read_counters(path: str) -> dict[str, tuple[int, int]]:
    """{device: (rx_bytes, tx_bytes)} from a `/proc/<pid>/net/dev` file."""
    counters = {}
    with open(path) as file:
        for line in file.readlines()[2:]:
            name, _, values = line.partition(":")
            fields = values.split()
            if len(fields) >= 9:
                counters[name.strip()] = (int(fields[0]), int(fields[8]))
    return counters


@dataclass
class Series:
    """One device's samples: (monotonic seconds, rx_bytes, tx_bytes)."""

    samples: list[tuple[float, int, int]] = field(default_factory=list)

    def peak_rate(self, column: int, window: float = 1.0) -> float:
        """The largest mean bytes/s over any `window` seconds between two samples (column 1: rx, 2: tx)."""
        best, begin = 0.0, 0
        for end in range(len(self.samples)):
            # begin: the latest sample at least `window` seconds before `end`
            while begin + 1 <= end and self.samples[end][0] - self.samples[begin + 1][0] >= window:
                begin += 1
            span = self.samples[end][0] - self.samples[begin][0]
            if span >= window:
                best = max(best, (self.samples[end][column] - self.samples[begin][column]) / span)
        return best

    def total(self, column: int) -> int:
        return int(self.samples[-1][column] - self.samples[0][column]) if self.samples else 0


class InterfaceMeter:
    """Samples `/proc/<pid>/net/dev` every `interval` seconds in a thread until `stop()`; `series[device]`."""

    def __init__(self, pid: int, *, interval: float = 0.1):
        self.path = f"/proc/{pid}/net/dev"
        self.interval = interval
        self.series: dict[str, Series] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="interface-meter", daemon=True)

    def start(self) -> InterfaceMeter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                counters = read_counters(self.path)
            except OSError:  # the namespace's process is gone: the testbed is closing
                return
            now = time.monotonic()
            for device, (rx, tx) in counters.items():
                self.series.setdefault(device, Series()).samples.append((now, rx, tx))
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def peak_sent(self, device: str, window: float = 1.0) -> float:
        """Peak bytes/s the host behind `device` sent (the veth's rx side), over `window`-second windows."""
        series = self.series.get(device)
        return series.peak_rate(1, window) if series else 0.0

    def peak_received(self, device: str, window: float = 1.0) -> float:
        series = self.series.get(device)
        return series.peak_rate(2, window) if series else 0.0
