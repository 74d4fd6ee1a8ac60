"""Profile of the expert call path: where a batch-1 remote forward and the 4-client throughput run spend their CPU.

The server runs in its own process (peer/testing/expert_server_process.py), the client (`peer.client.Swarm`,
`RemoteExpert`) in this one. Both are sampled with py-spy (`--py-spy PATH`, sampling every thread, idle frames
left out) when it is given, otherwise only the client is profiled with cProfile (its calling thread). Printed:
the top functions by own time on each side, and the share of samples spent in each of our modules.

(a) batch1: 1 expert ffn h256, 1 client, forward only, batch 1, for `--seconds`.
(b) throughput: 4 experts ffn h256, 4 client threads, batch 64, forward + backward, for `--seconds`.

The last line is one JSON object: calls/s, samples/s and the top items of each profile.

Usage: python benchmarks/profile_moe.py [--py-spy /path/to/py-spy] [--seconds 6] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from moe.remote_expert import RemoteExpert  # noqa: E402
from peer.client import Swarm  # noqa: E402
from peer.testing.peer_processes import ExpertServerProcess  # noqa: E402


def _summarise_raw(path: str, top: int) -> dict:
    """Own-time and per-module shares from py-spy's raw (collapsed stacks) output."""
    own: collections.Counter[str] = collections.Counter()
    modules: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as file:
        for line in file:
            stack, _, count_text = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            count = int(count_text)
            total += count
            frames = stack.split(";")
            own[_short(frames[-1])] += count
            seen = set()
            for frame in frames:
                module = _module(frame)
                if module and module not in seen:
                    seen.add(module)
                    modules[module] += count
    return {
        "samples": total,
        "top_own": [(name, round(100 * n / max(1, total), 1)) for name, n in own.most_common(top)],
        "modules": [(name, round(100 * n / max(1, total), 1)) for name, n in modules.most_common(top)],
    }


def _short(frame: str) -> str:
    """`function (path/file.py:line)` -> `function (package/file.py)`."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    parts = where.split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


def _module(frame: str) -> str | None:
    """Our module a frame is in (e.g. `moe/server.py`), or the library (`trio`, `torch`, `msgpack`)."""
    where = frame.partition(" (")[2].rstrip(")").rsplit(":", 1)[0]
    for library in ("trio", "torch", "msgpack", "cryptography", "nacl"):
        if f"/{library}/" in where and ("site-packages" in where or "/.venv/" in where):
            return library
    parts = where.split("/")
    for package in ("moe", "peer", "dht", "averaging"):
        if package in parts[:-1]:
            return "/".join(parts[parts.index(package):])
    return None


def _spy(py_spy: str | None, pid: int, seconds: float, out: str) -> subprocess.Popen | None:
    if py_spy is None:
        return None
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "500",
                             "--format", "raw", "--output", out, "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _loop(fn, seconds: float) -> int:
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        fn()
        count += 1
    return count


def profile_batch1(py_spy: str | None, seconds: float, top: int, workdir: str) -> dict:
    server = ExpertServerProcess(["ffn.0"], "--hidden", "256", "--new-dht", "--torch-threads", "1",
                                 "--inline-threshold", "inf").wait_ready(180.0)
    try:
        with Swarm([server.address]) as swarm:
            expert = RemoteExpert("ffn.0", server.address, swarm, peer_id=server.peer_id)
            x = torch.randn(1, 256)
            with torch.no_grad():
                _loop(lambda: expert(x), 1.0)
                spies = [_spy(py_spy, server.process.pid, seconds, f"{workdir}/b1_server.txt"),
                         _spy(py_spy, os.getpid(), seconds, f"{workdir}/b1_client.txt")]
                profiler = cProfile.Profile() if py_spy is None else None
                if profiler:
                    profiler.enable()
                started = time.perf_counter()
                count = _loop(lambda: expert(x), seconds)
                elapsed = time.perf_counter() - started
                if profiler:
                    profiler.disable()
    finally:
        for spy in spies:
            if spy:
                spy.wait(30)
        server.kill()
    result = {"calls_per_s_batch1": round(count / elapsed, 1), "remote_forward_us": round(1e6 * elapsed / count, 1)}
    result.update(_profiles(py_spy, profiler, "b1", top, workdir))
    return result


def profile_throughput(py_spy: str | None, seconds: float, top: int, workdir: str) -> dict:
    cores = len(os.sched_getaffinity(0))
    uids = [f"ffn.{i}" for i in range(4)]
    server = ExpertServerProcess(uids, "--hidden", "256", "--new-dht", "--optimizer", "adam", "--torch-threads",
                                 "1", "--threads-per-device", str(cores)).wait_ready(180.0)
    counts = [0] * 4
    stop = threading.Event()
    try:
        with Swarm([server.address]) as swarm:
            experts = [RemoteExpert(uid, server.address, swarm, peer_id=server.peer_id) for uid in uids]
            inputs = [torch.randn(64, 256) for _ in range(4)]
            grads = [torch.randn(64, 256) for _ in range(4)]

            def client(i: int) -> None:
                while not stop.is_set():
                    x = inputs[i].requires_grad_()
                    experts[i](x).backward(grads[i])
                    x.grad = None
                    counts[i] += 1

            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(1.0)
            spies = [_spy(py_spy, server.process.pid, seconds, f"{workdir}/tp_server.txt"),
                     _spy(py_spy, os.getpid(), seconds, f"{workdir}/tp_client.txt")]
            before, started = sum(counts), time.perf_counter()
            time.sleep(seconds)
            done, elapsed = sum(counts) - before, time.perf_counter() - started
            stop.set()
            for thread in threads:
                thread.join(30)
    finally:
        for spy in spies:
            if spy:
                spy.wait(30)
        server.kill()
    result = {"samples_per_s_h256_b64": round(done * 64 / elapsed, 1)}
    if py_spy is not None:
        result.update(_profiles(py_spy, None, "tp", top, workdir))
    return result


def _profiles(py_spy: str | None, profiler: cProfile.Profile | None, tag: str, top: int, workdir: str) -> dict:
    if py_spy is not None:
        return {side: _summarise_raw(f"{workdir}/{tag}_{side}.txt", top) for side in ("server", "client")}
    assert profiler is not None
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    total = sum(value[2] for value in stats.stats.values()) or 1.0  # type: ignore[attr-defined]
    return {"client": {"top_own": [(f"{name} ({os.path.basename(path)})", round(100 * value[2] / total, 1))
                                   for (path, _, name), value in rows]}}


def _print(title: str, profile: dict) -> None:
    for side in ("client", "server"):
        if side not in profile:
            continue
        print(f"  {title} {side} ({profile[side].get('samples', '?')} samples), own time:")
        for name, share in profile[side]["top_own"]:
            print(f"    {share:5.1f}%  {name}")
        if "modules" in profile[side]:
            print("    by module (inclusive): " + ", ".join(f"{m} {s}%" for m, s in profile[side]["modules"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy", default=None, help="path of a py-spy binary (default: cProfile, client only)")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--skip", default="", help="batch1,throughput")
    args = parser.parse_args()
    if args.py_spy is not None and not (os.path.isfile(args.py_spy) and os.access(args.py_spy, os.X_OK)):
        parser.error(f"--py-spy {args.py_spy}: no executable there (pip install py-spy; then .venv/bin/py-spy)")
    skip = set(filter(None, args.skip.split(",")))
    result: dict = {}
    with tempfile.TemporaryDirectory() as workdir:
        if "batch1" not in skip:
            b1 = profile_batch1(args.py_spy, args.seconds, args.top, workdir)
            print(f"(a) batch-1 forward: {b1['calls_per_s_batch1']} calls/s ({b1['remote_forward_us']} us a call)")
            _print("batch1", b1)
            result["batch1"] = b1
        if "throughput" not in skip:
            tp = profile_throughput(args.py_spy, args.seconds, args.top, workdir)
            print(f"(b) 4 clients h256 b64 fwd+bwd: {tp['samples_per_s_h256_b64']} samples/s")
            _print("throughput", tp)
            result["throughput"] = tp
    result["calls_per_s_batch1"] = result.get("batch1", {}).get("calls_per_s_batch1")
    result["samples_per_s_h256_b64"] = result.get("throughput", {}).get("samples_per_s_h256_b64")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
