"""Averaging benchmark (issue 5 targets): every peer is a separate process on 127.0.0.1.

(a) 4 peers average 25M float32 (100 MB) each, no compression: all-reduce round time vs the bandwidth bound
    2*(N-1)/N*size/B, where B is the raw loopback socket throughput measured here, in this run.
(b) 8 peers, groups of 4, 2.37M float32 (9.5 MB) each, 20 rounds with default settings: fraction of steps in full
    groups, fraction of steps that succeed, median step time (matchmaking + all-reduce).
(c) the same with one peer SIGKILLed in the middle of the run (figures over the surviving peers).
(d) the 8-peer run of (b) twice, with `--aggregation mean` and `centered_clip` (issue 15): `robust_overhead` =
    median centered_clip all-reduce round time / median mean round time (target <= 1.5).

Peers step back to back, as a training loop calling `averager.step()` between batches would. The last line of
output is one JSON object.

    .venv/bin/python benchmarks/bench_averaging.py [--rounds 20] [--parts abc] [--skip-100mb]

`--parts` picks the scenarios (e.g. `--parts b` runs only the 8-peer one; the default runs a, b and c, add d
for the robust aggregation's overhead). `BENCH_PROFILE=DIR` writes a cProfile
of every peer process to DIR/peerN.prof (cProfile costs time: figures from such a run are not comparable);
`BENCH_DEBUG_DIR=DIR` writes each peer's averaging debug log there. Every step also reports the CPU seconds its
process spent (`cpu_s`), which with the loopback rate tells how close to the machine's floor a round is.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------ worker process


def worker_main(args: argparse.Namespace) -> None:
    """One peer: RPC + DHT on 127.0.0.1, an Averager over one tensor; prints one JSON line per step."""
    sys.path.insert(0, ROOT)
    import torch
    import trio

    from averaging.averager import Averager
    from dht import DHTNode
    from peer.p2p.identity import Identity
    from peer.p2p.net import RealNetwork
    from peer.p2p.rpc import RPCNode

    torch.set_num_threads(1)
    if os.environ.get("BENCH_DEBUG_DIR"):
        import logging
        logging.basicConfig(filename=os.path.join(os.environ["BENCH_DEBUG_DIR"], f"peer{args.index}.log"),
                            level=logging.DEBUG, format="%(created).3f %(name)s %(message)s")
        for name in ("dht", "peer"):
            logging.getLogger(name).setLevel(logging.WARNING)

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async def run() -> None:
        network = RealNetwork()
        identity = Identity.generate()
        initial = [(args.bootstrap.split(":")[0], int(args.bootstrap.split(":")[1]))] if args.bootstrap else []
        async with RPCNode(identity, network) as rpc:
            _, port = await rpc.listen("127.0.0.1", 0)
            async with DHTNode.open("127.0.0.1", port, initial, identity=identity, network=network) as dht:
                tensor = torch.full((args.numel,), float(args.index), dtype=torch.float32)
                options = {"target_group_size": args.group, "aggregation": args.aggregation}
                averager = Averager(rpc, dht, [tensor], prefix=args.prefix, **options)
                async with averager:
                    emit({"ready": True, "address": f"127.0.0.1:{port}"})
                    line = await trio.to_thread.run_sync(sys.stdin.readline)
                    start_at = float(line.split()[1])
                    stop = trio.Event()

                    async def wait_for_stop() -> None:
                        await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                        stop.set()

                    await trio.sleep(max(0.0, start_at - time.time()))
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(wait_for_stop)
                        # keep stepping past our own count until every peer has its rounds (as a training loop
                        # would), so a peer that fell one round behind still finds a group for its last rounds
                        round_index = 0
                        while not stop.is_set():
                            t0 = time.perf_counter()
                            cpu0 = time.process_time()
                            result = await averager.step()
                            emit({"round": round_index, "step_s": time.perf_counter() - t0,
                                  "cpu_s": time.process_time() - cpu0,
                                  "matchmaking_s": result.matchmaking_seconds,
                                  "allreduce_s": result.allreduce_seconds, "group_size": result.group_size,
                                  "group": result.group.group_id.hex()[:8] if result.group is not None else None,
                                  "finished": result.finished, "reason": result.reason,
                                  "failed": len(result.failed_peers)})
                            round_index += 1
                            if round_index == args.rounds:
                                emit({"done": True, "value": float(tensor[0])})
                        nursery.cancel_scope.cancel()

    if os.environ.get("BENCH_PROFILE"):
        import cProfile
        profiler = cProfile.Profile()
        try:
            profiler.runcall(trio.run, run)
        finally:
            profiler.dump_stats(os.path.join(os.environ["BENCH_PROFILE"], f"peer{args.index}.prof"))
    else:
        trio.run(run)


# ------------------------------------------------------------------------------------------------ orchestration


class Peer:
    def __init__(self, index: int, numel: int, rounds: int, group: int, prefix: str, bootstrap: str | None,
                 aggregation: str = "mean"):
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--index", str(index), "--numel",
                   str(numel), "--rounds", str(rounds), "--group", str(group), "--prefix", prefix,
                   "--aggregation", aggregation]
        if bootstrap:
            command += ["--bootstrap", bootstrap]
        self.index = index
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.steps: list[dict] = []
        self.done: dict | None = None
        self.killed = False
        self.ready = threading.Event()
        self.address: str | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("ready"):
                self.address = message["address"]
                self.ready.set()
            elif "round" in message:
                self.steps.append(message)
            elif message.get("done"):
                self.done = message

    def send(self, text: str) -> None:
        try:
            self.process.stdin.write(text + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def kill(self) -> None:
        self.killed = True
        self.process.send_signal(signal.SIGKILL)

    def close(self) -> None:
        self.send("leave")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_swarm(count: int, numel: int, rounds: int, group: int, prefix: str, *, kill_after: int | None = None,
              aggregation: str = "mean") -> list[Peer]:
    """Start `count` peers, start them stepping together, optionally SIGKILL one after `kill_after` rounds."""
    first = Peer(0, numel, rounds, group, prefix, None, aggregation)
    if not first.ready.wait(60):
        raise RuntimeError("the first peer did not start")
    peers = [first] + [Peer(i, numel, rounds, group, prefix, first.address, aggregation)
                       for i in range(1, count)]
    for peer in peers:
        if not peer.ready.wait(120):
            raise RuntimeError(f"peer {peer.index} did not start")
    start_at = time.time() + 1.0
    for peer in peers:
        peer.send(f"go {start_at}")
    victim = peers[count // 2] if kill_after is not None else None
    deadline = time.time() + 60 + rounds * 30
    while time.time() < deadline:
        if victim is not None and not victim.killed and min(len(p.steps) for p in peers) >= kill_after:
            victim.kill()
        if all(p.done is not None or p.killed for p in peers):
            break
        time.sleep(0.05)
    for peer in peers:
        if not peer.killed:
            peer.close()
        else:
            peer.process.wait()
    for peer in peers:
        del peer.steps[rounds:]
    return peers


def summarize(peers: list[Peer], group: int) -> dict:
    steps = [s for p in peers if not p.killed for s in p.steps]
    return {
        "steps": len(steps),
        "median_step_s": statistics.median(s["step_s"] for s in steps) if steps else float("nan"),
        "p90_step_s": sorted(s["step_s"] for s in steps)[int(0.9 * (len(steps) - 1))] if steps else float("nan"),
        "median_matchmaking_s": statistics.median(s["matchmaking_s"] for s in steps) if steps else float("nan"),
        "median_allreduce_s": statistics.median(s["allreduce_s"] for s in steps) if steps else float("nan"),
        "full_group_fraction": sum(s["group_size"] == group for s in steps) / max(1, len(steps)),
        "success_fraction": sum(bool(s["finished"]) for s in steps) / max(1, len(steps)),
        "reasons": sorted({s["reason"] for s in steps if not s["finished"]}),
        "group_sizes": dict(sorted(collections.Counter(s["group_size"] for s in steps).items())),
        # peers start at 0..7: a spread near 0 after the run means the groups mixed the whole swarm
        "final_spread": (lambda v: max(v) - min(v) if v else float("nan"))(
            [p.done["value"] for p in peers if not p.killed and p.done]),
    }


# ------------------------------------------------------------------------------------------------ raw bandwidth


def loopback_throughput(total_bytes: int = 1 << 30, chunk: int = 64 << 20) -> float:
    """Bytes/s of one plain TCP stream over 127.0.0.1 (sender and receiver threads, large buffers)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    received = [0]

    def receive() -> None:
        connection, _ = listener.accept()
        buffer = bytearray(chunk)
        view = memoryview(buffer)
        with connection:
            while received[0] < total_bytes:
                n = connection.recv_into(view)
                if not n:
                    break
                received[0] += n

    thread = threading.Thread(target=receive)
    thread.start()
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (chunk >> 20))
    with socket.create_connection(listener.getsockname()) as sender:
        started = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            sender.sendall(payload)
            sent += len(payload)
        thread.join()
        elapsed = time.perf_counter() - started
    listener.close()
    return received[0] / elapsed


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--numel", type=int, default=2_370_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prefix", default="bench")
    parser.add_argument("--bootstrap", default=None)
    parser.add_argument("--aggregation", default="mean", choices=["mean", "centered_clip", "trimmed_mean"])
    parser.add_argument("--skip-100mb", action="store_true")
    parser.add_argument("--parts", default="abc", help="which scenarios to run: any of a, b, c, d")
    args = parser.parse_args()
    if args.skip_100mb:
        args.parts = args.parts.replace("a", "")
    if args.worker:
        worker_main(args)
        return

    figures: dict = {}
    if "a" in args.parts:
        bandwidth = loopback_throughput()
        size = 25_000_000 * 4
        bound = 2 * (4 - 1) / 4 * size / bandwidth
        peers = run_swarm(4, 25_000_000, 3, 4, "bench100")
        rounds = [s["allreduce_s"] for p in peers for s in p.steps if s["finished"]]
        round_s = statistics.median(rounds) if rounds else float("nan")
        cpu = [s["cpu_s"] for p in peers for s in p.steps if s["finished"]]
        cpu_s = statistics.median(cpu) if cpu else float("nan")
        print(f"(a) raw loopback TCP: {bandwidth / 1e9:.2f} GB/s; 4 peers x 100 MB: all-reduce round "
              f"{round_s:.3f} s (median of {len(rounds)}, all {sorted(round(r, 3) for r in rounds)}), bound "
              f"{bound:.3f} s, ratio {round_s / bound:.2f}; CPU per step and process {cpu_s:.3f} s "
              f"({os.cpu_count()} cores)")
        figures.update(round_s_100mb=round(round_s, 4), bound_s_100mb=round(bound, 4),
                       round_ratio_to_bound_100mb=round(round_s / bound, 3),
                       loopback_gbps=round(bandwidth / 1e9, 3), cpu_s_per_step_100mb=round(cpu_s, 4))

    if "b" in args.parts:
        run_b(args, figures)
    if "c" in args.parts:
        run_c(args, figures)
    if "d" in args.parts:
        run_d(args, figures)
    if "median_step_s_8peers" in figures and "median_step_s_8peers_one_killed" in figures:
        # the cost of a SIGKILLed member, relative to the healthy run measured minutes earlier on this machine
        figures["one_killed_ratio_to_healthy"] = round(
            figures["median_step_s_8peers_one_killed"] / figures["median_step_s_8peers"], 3)
    print(json.dumps(figures))


def run_b(args: argparse.Namespace, figures: dict) -> None:
    peers = run_swarm(8, 2_370_000, args.rounds, 4, "bench8")
    summary = summarize(peers, 4)
    print(f"(b) 8 peers, groups of 4, 9.5 MB, {args.rounds} rounds: median step {summary['median_step_s']:.3f} s "
          f"(p90 {summary['p90_step_s']:.3f}; matchmaking {summary['median_matchmaking_s']:.3f}, all-reduce "
          f"{summary['median_allreduce_s']:.3f}), full groups {summary['full_group_fraction']:.1%}, "
          f"success {summary['success_fraction']:.1%} {summary['reasons'] or ''}; "
          f"group sizes {summary['group_sizes']}; spread of final values {summary['final_spread']:.2g} "
          f"(started 7 apart)")
    figures.update(median_step_s_8peers=round(summary["median_step_s"], 4),
                   full_group_fraction=round(summary["full_group_fraction"], 4),
                   step_success_fraction=round(summary["success_fraction"], 4))


def run_c(args: argparse.Namespace, figures: dict) -> None:
    peers = run_swarm(8, 2_370_000, args.rounds, 4, "bench8k", kill_after=args.rounds // 2)
    summary = summarize(peers, 4)
    print(f"(c) same, one peer SIGKILLed after {args.rounds // 2} rounds: median step of survivors "
          f"{summary['median_step_s']:.3f} s (p90 {summary['p90_step_s']:.3f}), success "
          f"{summary['success_fraction']:.1%} {summary['reasons'] or ''}; group sizes {summary['group_sizes']}")
    figures.update(median_step_s_8peers_one_killed=round(summary["median_step_s"], 4),
                   step_success_fraction_one_killed=round(summary["success_fraction"], 4))


def run_d(args: argparse.Namespace, figures: dict) -> None:
    """The robust aggregation's cost: the same 8-peer run with the mean and with CenteredClip, back to back."""
    rounds = {}
    for aggregation in ("mean", "centered_clip"):
        peers = run_swarm(8, 2_370_000, args.rounds, 4, f"bench8{aggregation[0]}", aggregation=aggregation)
        summary = summarize(peers, 4)
        rounds[aggregation] = summary["median_allreduce_s"]
        print(f"(d) 8 peers, groups of 4, 9.5 MB, {args.rounds} rounds, {aggregation}: median all-reduce "
              f"{summary['median_allreduce_s']:.3f} s, median step {summary['median_step_s']:.3f} s, success "
              f"{summary['success_fraction']:.1%}")
        figures[f"median_allreduce_s_8peers_{aggregation}"] = round(summary["median_allreduce_s"], 4)
    figures["robust_overhead"] = round(rounds["centered_clip"] / rounds["mean"], 3)


if __name__ == "__main__":
    main()
