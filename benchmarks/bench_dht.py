"""DHT benchmark: our trio Kademlia against the stock `kademlia` package, same workload, one run (issue 3).

Workload (issue 3 "Targets"), run once on each implementation:
  64 nodes on 127.0.0.1; 200 stores, then 200 gets, from random nodes, one operation at a time;
  then 16 nodes killed without warning (they stop answering) and 200 gets from random survivors;
  then 16 more killed (half of the 64) and 200 more gets.

Ours runs in this process under trio (a killed node's cancel scope is cancelled: its socket vanishes mid-flight,
nothing is said to anyone). The stock package is asyncio, so it runs in child processes of 8 nodes each
(`stock_kademlia_cluster.py`); killing = SIGKILL of whole processes. Both sides kill the same node indices and
replay the same plan of (node, key) operations, alternating operation by operation (ours, stock, ours, ...) so
that both meet the same load on a shared machine. Stock latencies are measured inside the stock process (the JSON-line
round trip to it is not counted); ours around each `await`. Failed or timed-out operations count as failures and
their elapsed time stays in the percentiles.

The stock package's post-kill gets mostly wait out its fixed 5 s request timeout (200 of them take ~16 minutes),
so by default only the first 50 of each post-kill phase run on the stock side (`--stock-after-kill-ops 0` runs all;
the JSON says how many ran). "cpu p50" is the CPU time this process spent per operation: all 64 of our nodes live
in it, so it is the whole swarm's work for one operation, and shows whether a latency is CPU-bound.

Disjoint paths (issue 15): after the "get" phase, while all 64 nodes run, two client-mode readers join ours (one
with `DHTConfig.disjoint_paths=1`, one with `--disjoint-paths`, default 4) and read the same keys alternately, one
get at a time: `single_get_p50_ms` against `disjoint_get_p50_ms` (target: at most 2x).

Prints a table, and its last line is one JSON object (keys named in issues 3 and 15).
Usage: python benchmarks/bench_dht.py [--quick] [--skip-stock] [--skip-ours] [--seed N]
Latencies are wall-clock: on a machine whose cores are busy with other work they grow with the CPU share this
process gets (our 64 nodes share one process; the stock ones are spread over 8), so read them with "cpu p50".
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer.p2p.identity import Identity  # noqa: E402
from peer.p2p.net import RealNetwork  # noqa: E402

PHASES = ("store", "get", "get_after_kill", "get_after_half_killed")
HOST = "127.0.0.1"


# ------------------------------------------------------------------------------------------------ plan and results


@dataclass
class Plan:
    """The workload both implementations replay: who stores/gets what, and which nodes die when."""

    nodes: int
    keys: list[str]
    values: list[bytes]
    stores: list[tuple[int, int]]  # (node, key index)
    gets: dict[str, list[tuple[int, int]]]  # phase -> [(node, key index)]
    kills: list[list[int]]  # nodes killed before "get_after_kill", then before "get_after_half_killed"


def make_plan(nodes: int, ops: int, kill: int, per_process: int, seed: int) -> Plan:
    rng = random.Random(seed)
    keys = [f"bench:{seed}:{i}" for i in range(ops)]
    values = [rng.randbytes(32) for _ in range(ops)]
    # Kill whole stock processes (groups of `per_process` consecutive indices); ours kills the same indices.
    groups = list(range(math.ceil(nodes / per_process)))
    rng.shuffle(groups)
    per_round = max(1, kill // per_process)
    kills = []
    for round_index in range(2):
        chosen = groups[round_index * per_round:(round_index + 1) * per_round]
        kills.append(sorted(n for g in chosen for n in range(g * per_process, min(nodes, (g + 1) * per_process))))
    alive = set(range(nodes))
    stores = [(rng.randrange(nodes), i) for i in range(ops)]
    gets = {"get": [(rng.choice(sorted(alive)), rng.randrange(ops)) for _ in range(ops)]}
    alive -= set(kills[0])
    gets["get_after_kill"] = [(rng.choice(sorted(alive)), rng.randrange(ops)) for _ in range(ops)]
    alive -= set(kills[1])
    gets["get_after_half_killed"] = [(rng.choice(sorted(alive)), rng.randrange(ops)) for _ in range(ops)]
    return Plan(nodes, keys, values, stores, gets, kills)


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


@dataclass
class PhaseResult:
    latencies_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # ours only: CPU this process spent per operation
    successes: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, ok: bool, ms: float, error: str | None = None, cpu_ms: float | None = None) -> None:
        self.latencies_ms.append(ms)
        if cpu_ms is not None:
            self.cpu_ms.append(cpu_ms)
        self.successes += ok
        if error:
            self.errors[error] = self.errors.get(error, 0) + 1

    def percentile(self, fraction: float) -> float:
        """Nearest-rank percentile over every operation (failures included)."""
        return _percentile(self.latencies_ms, fraction)

    @property
    def success(self) -> float:
        return self.successes / len(self.latencies_ms) if self.latencies_ms else math.nan


# ------------------------------------------------------------------------------------------------ ours


class OursSide:
    """64 of our DHT nodes in this trio process; killing one cancels its scope (its socket closes at once)."""

    name = "ours"

    def __init__(self, plan: Plan, op_timeout: float):
        self.plan = plan
        self.op_timeout = op_timeout
        self.results = {phase: PhaseResult() for phase in PHASES}
        self.nodes: list[Any] = []
        self._scopes: list[trio.CancelScope] = []
        self._finished: list[trio.Event] = []

    async def start(self, nursery: trio.Nursery, seed: int, log: Any) -> None:
        from dht import DHTNode

        network = RealNetwork()

        async def run_node(index: int, initial_peers: list, task_status=trio.TASK_STATUS_IGNORED) -> None:
            done = trio.Event()
            try:
                with trio.CancelScope() as scope:
                    identity = Identity.from_seed(f"bench-dht:{seed}:{index}".encode())
                    async with DHTNode.open(
                        HOST, 0, initial_peers=initial_peers, identity=identity, network=network
                    ) as node:
                        task_status.started((node, scope, done))
                        await trio.sleep_forever()
            finally:
                done.set()

        started = time.perf_counter()
        for index in range(self.plan.nodes):
            initial = [self.nodes[0].address] if self.nodes else []
            with trio.fail_after(30):
                node, scope, done = await nursery.start(run_node, index, initial)
            self.nodes.append(node)
            self._scopes.append(scope)
            self._finished.append(done)
        log(f"ours: {self.plan.nodes} nodes up in {time.perf_counter() - started:.2f} s")

    async def run(self, phase: str, node_index: int, key_index: int) -> None:
        node = self.nodes[node_index]
        key, value = self.plan.keys[key_index], self.plan.values[key_index]
        begin, cpu = time.perf_counter(), time.process_time()
        ok, error = False, None
        try:
            with trio.fail_after(self.op_timeout):
                if phase == "store":
                    ok = bool(await node.store(key, value, node.now() + 3600))
                else:
                    record = await node.get(key)
                    ok = record is not None and record.value == value
                    if not ok:
                        error = "missing" if record is None else "wrong value"
        except trio.TooSlowError:
            error = "timeout"
        except Exception as failure:  # a failed operation is a data point, not the end of the benchmark
            error = type(failure).__name__
        self.results[phase].add(ok, (time.perf_counter() - begin) * 1000, error, (time.process_time() - cpu) * 1000)

    async def compare_disjoint(self, nursery: trio.Nursery, paths: int, gets: list[tuple[int, int]],
                               log: Any) -> dict[str, Any]:
        """Two client readers, 1 and `paths` disjoint paths, read the same keys alternately (same load)."""
        from dht import DHTConfig, DHTNode

        network = RealNetwork()

        async def reader(d: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
            identity = Identity.from_seed(f"bench-dht:reader:{d}".encode())
            async with DHTNode.open(HOST, 0, [self.nodes[0].address], identity=identity, network=network,
                                    client_mode=True, config=DHTConfig(disjoint_paths=d)) as node:
                task_status.started(node)
                await trio.sleep_forever()

        with trio.fail_after(30):
            readers = {1: await nursery.start(reader, 1), paths: await nursery.start(reader, paths)}
        latencies: dict[int, list[float]] = {1: [], paths: []}
        correct = {1: 0, paths: 0}
        for _, key_index in gets:
            key, value = self.plan.keys[key_index], self.plan.values[key_index]
            for d, node in readers.items():
                begin = time.perf_counter()
                try:
                    with trio.fail_after(self.op_timeout):
                        record = await node.get(key)
                    correct[d] += record is not None and record.value == value
                except trio.TooSlowError:
                    pass
                latencies[d].append((time.perf_counter() - begin) * 1000)
        single, disjoint = _percentile(latencies[1], 0.5), _percentile(latencies[paths], 0.5)
        log(f"disjoint paths: get p50 {single:.2f} ms with 1 path, {disjoint:.2f} ms with {paths} "
            f"({disjoint / single:.2f}x); correct {correct[1]}/{len(gets)} and {correct[paths]}/{len(gets)}")
        return {"disjoint_paths": paths, "single_get_p50_ms": round(single, 3),
                "disjoint_get_p50_ms": round(disjoint, 3),
                "disjoint_get_p95_ms": round(_percentile(latencies[paths], 0.95), 3),
                "disjoint_get_ratio": round(disjoint / single, 4),
                "single_get_success": round(correct[1] / len(gets), 4),
                "disjoint_get_success": round(correct[paths] / len(gets), 4)}

    async def kill(self, victims: list[int]) -> None:
        for victim in victims:
            self._scopes[victim].cancel()
        with trio.fail_after(10):
            for victim in victims:
                await self._finished[victim].wait()


# ------------------------------------------------------------------------------------------------ stock


class StockSide:
    """64 stock nodes in child processes of `per_process`; killing = SIGKILL of whole processes."""

    name = "stock"

    def __init__(self, plan: Plan, op_timeout: float, per_process: int):
        self.plan = plan
        self.op_timeout = op_timeout
        self.per_process = per_process
        self.results = {phase: PhaseResult() for phase in PHASES}
        self.cluster: Any = None

    async def start(self, stack: AsyncExitStack, seed: int, log: Any) -> None:
        from stock_kademlia_cluster import StockCluster

        self.cluster = await stack.enter_async_context(
            StockCluster.open(self.plan.nodes, per_process=self.per_process, seed=seed)
        )
        started = time.perf_counter()
        for index in range(1, self.plan.nodes):
            await self.cluster.bootstrap(index, [self.cluster.address(0)], timeout=30)
        log(f"stock: {self.plan.nodes} nodes up in {time.perf_counter() - started:.2f} s")

    async def run(self, phase: str, node_index: int, key_index: int) -> None:
        from stock_kademlia_cluster import StockNodeError

        key, value = self.plan.keys[key_index], self.plan.values[key_index]
        begin = time.perf_counter()
        ok, error, ms = False, None, None
        try:
            if phase == "store":
                ok, ms = await self.cluster.set(node_index, key, value, timeout=self.op_timeout)
            else:
                got, ms = await self.cluster.get(node_index, key, timeout=self.op_timeout)
                ok = got == value
                if not ok:
                    error = "missing" if got is None else "wrong value"
        except StockNodeError as failure:
            error = "timeout" if "no reply" in str(failure) else "error"
        if ms is None:
            ms = (time.perf_counter() - begin) * 1000
        self.results[phase].add(ok, ms, error)

    async def kill(self, victims: list[int]) -> None:
        for group in sorted({victim // self.per_process for victim in victims}):
            self.cluster.kill_process_of(group * self.per_process)
        await trio.lowlevel.checkpoint()


async def run_workload(plan: Plan, sides: list[Any], stock_after_kill_ops: int, log: Any,
                       disjoint: Any = None) -> None:
    """Replay the plan on every side, one operation at a time, alternating sides operation by operation, so
    both meet the same machine load at the same moments (this machine is shared). `disjoint` runs between the
    "get" phase and the first kill (the swarm still whole)."""

    async def phase(name: str, operations: list[tuple[int, int]]) -> None:
        started = time.perf_counter()
        for number, (node_index, key_index) in enumerate(operations):
            for side in sides:
                if side.name == "stock" and name.startswith("get_after") and number >= stock_after_kill_ops:
                    continue
                await side.run(name, node_index, key_index)
        log(f"phase {name}: {time.perf_counter() - started:.1f} s")

    await phase("store", plan.stores)
    await phase("get", plan.gets["get"])
    if disjoint is not None:
        await disjoint()
    for side in sides:
        await side.kill(plan.kills[0])
    await phase("get_after_kill", plan.gets["get_after_kill"])
    for side in sides:
        await side.kill(plan.kills[1])
    await phase("get_after_half_killed", plan.gets["get_after_half_killed"])


# ------------------------------------------------------------------------------------------------ report


def summary(prefix: str, results: dict[str, PhaseResult]) -> dict[str, float]:
    out: dict[str, float] = {}
    for phase in PHASES:
        result = results[phase]
        name = {"store": "store", "get": "get", "get_after_kill": "get", "get_after_half_killed": "get"}[phase]
        suffix = {"get_after_kill": "_after_kill", "get_after_half_killed": "_after_half_killed"}.get(phase, "")
        for label, fraction in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
            out[f"{prefix}_{name}_{label}{suffix}_ms"] = round(result.percentile(fraction), 3)
        if result.cpu_ms:
            out[f"{prefix}_{name}_cpu_p50{suffix}_ms"] = round(_percentile(result.cpu_ms, 0.5), 3)
        out[f"{prefix}_{name}_success{suffix}"] = round(result.success, 4)
    return out


def print_table(sides: dict[str, dict[str, PhaseResult]], log: Any) -> None:
    log("")
    log(f"{'phase':<24}{'impl':<7}{'ops':>5}{'success':>9}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'max ms':>10}"
        f"{'cpu p50':>9}  errors")
    for phase in PHASES:
        for side, results in sides.items():
            r = results[phase]
            worst = max(r.latencies_ms) if r.latencies_ms else math.nan
            log(
                f"{phase:<24}{side:<7}{len(r.latencies_ms):>5}{r.success:>9.1%}{r.percentile(0.5):>10.2f}"
                f"{r.percentile(0.95):>10.2f}{r.percentile(0.99):>10.2f}{worst:>10.2f}"
                f"{_percentile(r.cpu_ms, 0.5):>9.2f}  {r.errors or ''}"
            )


def check_targets(figures: dict[str, float], log: Any) -> None:
    targets = [
        ("ours_store_p50_ms", "<=", 12.0),
        ("ours_get_success_after_kill", ">=", 1.0),
        ("ours_get_p95_after_kill_ms", "<=", 25.0),
        ("ours_get_p99_after_kill_ms", "<=", 250.0),
        ("ours_get_success_after_half_killed", ">=", 0.99),
        ("disjoint_get_ratio", "<=", 2.0),
    ]
    log("")
    for key, relation, bound in targets:
        if key not in figures:
            continue
        value = figures[key]
        ok = value <= bound if relation == "<=" else value >= bound
        log(f"target {key} {relation} {bound}: {value} {'ok' if ok else 'MISSED'}")


async def main_async(args: argparse.Namespace) -> None:
    def log(line: str) -> None:
        print(line, flush=True)

    plan = make_plan(args.nodes, args.ops, args.kill, args.per_process, args.seed)
    log(
        f"DHT benchmark: {args.nodes} nodes, {args.ops} ops per phase, kill {len(plan.kills[0])} then "
        f"{len(plan.kills[1])} more; seed {args.seed}"
    )
    figures: dict[str, Any] = {"nodes": args.nodes, "ops_per_phase": args.ops, "killed_per_round": len(plan.kills[0])}
    after_kill_ops = min(args.stock_after_kill_ops or args.ops, args.ops)
    sides: list[Any] = []
    disjoint = None
    started = time.perf_counter()
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        if not args.skip_ours:
            ours = OursSide(plan, args.op_timeout)
            await ours.start(nursery, args.seed, log)
            sides.append(ours)
            if args.disjoint_paths > 1:
                async def disjoint() -> None:
                    figures.update(await ours.compare_disjoint(nursery, args.disjoint_paths, plan.gets["get"], log))
        if not args.skip_stock:
            stock = StockSide(plan, args.stock_op_timeout, args.per_process)
            await stock.start(stack, args.seed, log)
            sides.append(stock)
            figures["stock_ops_after_kill"] = after_kill_ops
        await run_workload(plan, sides, after_kill_ops, log, disjoint)
        nursery.cancel_scope.cancel()
    log(f"workload done in {time.perf_counter() - started:.1f} s")
    for side in sides:
        figures.update(summary(side.name, side.results))
    for name in ("store_p50", "get_p50", "get_p95_after_kill", "get_p99_after_kill"):
        ours_value, stock_value = figures.get(f"ours_{name}_ms"), figures.get(f"stock_{name}_ms")
        if ours_value is not None and stock_value:  # same-run ratios: comparable across days and machines
            figures[f"{name}_ratio_ours_to_stock"] = round(ours_value / stock_value, 4)
    results = {side.name: side.results for side in sides}
    print_table(results, log)
    check_targets(figures, log)
    print(json.dumps(figures), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 nodes, 40 ops per phase, kill 4+4")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--kill", type=int, default=16, help="nodes killed in each of the two kill rounds")
    parser.add_argument("--per-process", type=int, default=8, help="stock nodes per child process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--op-timeout", type=float, default=30.0, help="bound on each of our operations (s)")
    parser.add_argument("--stock-op-timeout", type=float, default=60.0, help="bound on each stock operation (s)")
    parser.add_argument(
        "--stock-after-kill-ops", type=int, default=50,
        help="stock gets per post-kill phase (its gets wait out 5 s timeouts: 200 take ~16 min; 0 = --ops)",
    )
    parser.add_argument("--disjoint-paths", type=int, default=4,
                        help="paths of the disjoint-path reader compared with a 1-path one (1: skip that phase)")
    parser.add_argument("--skip-stock", action="store_true")
    parser.add_argument("--skip-ours", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.ops, args.kill, args.per_process = 16, 40, 4, 4
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
