"""Bootstrap benchmark: start time and memory of a light daemon (`peer join --no-experts`) against a normal one.

Why: issue 38 asks for a light bootstrap, `peer join --no-experts`, that imports no torch, starts in at most 1 s and
holds at most 80 MB RSS, where a normal daemon loads torch (about 355 MB) and serves 4 experts.

Setup, on loopback: each run starts `python -m peer.cli join --host 127.0.0.1` as a new swarm, once with
`--no-experts` ("light") and once without ("full", 4 experts of ffn.[0:12], hidden 64), one after the other,
alternating which goes first, so both see the same machine load.

Figures (median over --repeats runs of each):
  start_s: from spawning the process to reading its `joined` event (the daemon listens, is in the DHT and says
  how to join it): interpreter start, imports, identity, sockets, experts;
  rss_mb: VmRSS (MB, 2^20 bytes) --settle seconds after the joined event; peak_rss_mb: VmHWM then;
  torch: whether any torch library is mapped into the process (never, for the light one).
The last line of output is one JSON object.

Usage: python benchmarks/bench_bootstrap.py [--repeats 3] [--settle 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from peer.testing.peer_processes import PeerProcess, read_joined  # noqa: E402

KINDS = {"light": ["--no-experts"], "full": []}


def _proc_status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def _torch_mapped(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any("libtorch" in line or "/torch/" in line for line in maps.splitlines())


def measure(kind: str, settle: float) -> dict[str, Any]:
    """One daemon of `kind`: started, measured, stopped."""
    started = time.perf_counter()
    process = PeerProcess(["join", "--host", "127.0.0.1", *KINDS[kind]])
    try:
        read_joined(process, timeout=300)
        start_s = time.perf_counter() - started
        time.sleep(settle)
        pid = process.pid
        return {"start_s": start_s, "rss_mb": _proc_status_mb(pid, "VmRSS"),
                "peak_rss_mb": _proc_status_mb(pid, "VmHWM"), "torch": _torch_mapped(pid)}
    finally:
        process.stop(timeout=60)  # SIGTERM, then SIGKILL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each daemon (median reported)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after joining before reading RSS")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for repeat in range(args.repeats):
        order = list(KINDS) if repeat % 2 == 0 else list(reversed(KINDS))
        for kind in order:
            run = measure(kind, args.settle)
            runs[kind].append(run)
            print(f"{kind:5}: started in {run['start_s']:.2f} s, RSS {run['rss_mb']:.1f} MB "
                  f"(peak {run['peak_rss_mb']:.1f} MB), torch {'loaded' if run['torch'] else 'not loaded'}",
                  flush=True)
    result: dict[str, Any] = {}
    for kind, measured in runs.items():
        result[f"{kind}_start_s"] = round(statistics.median(r["start_s"] for r in measured), 3)
        result[f"{kind}_rss_mb"] = round(statistics.median(r["rss_mb"] for r in measured), 1)
        result[f"{kind}_peak_rss_mb"] = round(statistics.median(r["peak_rss_mb"] for r in measured), 1)
        result[f"{kind}_torch"] = any(r["torch"] for r in measured)
    result.update(repeats=args.repeats, settle_s=args.settle, cpus=os.cpu_count(),
                  load_1min=round(os.getloadavg()[0], 2))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
