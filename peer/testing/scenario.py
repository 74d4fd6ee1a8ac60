"""Scenarios: a DiLoCo swarm of real `peer train` processes on the WAN testbed, under a churn schedule.

Why: the issue's promises (training that never waits for a dead, frozen or slow peer; joiners that contribute at
once; one outer state everywhere) are about processes on real links, killed and frozen by signals. A scenario
puts D daemons (the DHT bootstrap; with `--local-experts` every parameter lives in the trainers) and T trainers
each on its own host of a `WanTestbed` profile (`lan`, `home`, `intercontinental`, `mixed`), follows a churn
schedule in outer steps through `peer.testing.churn.Churn`, and collects what each trainer reports
(`peer.testing.scenario_report`).

    result = run_scenario(Scenario("churn", profile="home", kill_every=1, join_every=2))
    result.goodput, result.accuracy, result.hash_conflicts(), result.trainers["j1"].first_contribution

The schedule (`plan`), in outer steps of the swarm ("the swarm reaches step s": some trainer reported it):
- `kill_every=k`: once every live trainer holds step s (s a multiple of k), SIGKILL one, rotating: of those
  that have contributed to a round, the one that has run longest. A kill that would leave fewer than `min_live`
  such trainers is skipped (4 trainers, a kill every step and a join every two would otherwise leave none by
  step 6; `Runner.pick_victim` says why joiners that have not contributed do not count); `applied` says which.
- `join_every=m`: when the swarm reaches step s (a multiple of m), start a fresh trainer (a joiner: no
  --start-with; it downloads the outer state and trains to the same last outer step).
- `stop_at=s, stop_for=k`: SIGSTOP the last trainer once every live trainer holds step s, SIGCONT when the others
  reach s + k.
- `slowdown=f`: trainer t0 computes f times slower (`peer.testing.trainer --slowdown`).
At one step, joins come before kills, so the swarm never dips lower than the plan says.

The task (`Model`): digits with `--local-experts`, hidden 128, grid 4, batch 1152: 536,974 parameters, one inner
step 55 ms on one core of this machine when idle (median of 200 steps, 2 cores, measured 2026-12-05; hidden 256
at batch 256 takes 48 ms, hence the large batch); four trainers share the two cores, so a step takes 150-300 ms
of wall time in a scenario. Inner Adam at lr 0.01 and an outer momentum of 0.6 (DiLoCo's default is 0.9): with
0.9 the held-out accuracy swings by about 1% from one outer step to the next, so two identical runs, which differ
only in where phases were cut short, end 1-3% apart; with 0.6 the model settles by outer step 8 and such runs end
within 0.6% (benchmarks/README.md, "WAN scenarios", has the figures).

Trainers run `--overlap --compression int8` through `peer.testing.trainer`. Every `outer_round` line carries the
outer state's hash after the round, so `hash_conflicts()` checks that all trainers that completed an outer step hold
the same state. The run ends when every trainer that was not killed has written its result line and exited. Goodput
and accuracy of the run are means over the trainers that finished. Each trainer's stderr (product logs at info) and
JSON lines stay in `workdir` for a person to read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.testing.bandwidth import InterfaceMeter
from peer.testing.churn import Action, Churn
from peer.testing.lines import LineReader
from peer.testing.scenario_report import LOST, ScenarioResult, TrainerReport
from peer.testing.wan import WanHost, WanTestbed, swarm_profiles

PORT = 31337
ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds `peer`


@dataclass(frozen=True)
class Model:
    """The trainers' digits model (`peer train --local-experts`); see the module docstring for its step time."""

    hidden_dim: int = 128
    grid_size: int = 4
    batch_size: int = 1152
    lr: float = 0.01
    outer_momentum: float = 0.6

    def args(self) -> list[str]:
        return ["--local-experts", "--hidden-dim", str(self.hidden_dim), "--grid-size", str(self.grid_size),
                "--batch-size", str(self.batch_size), "--lr", str(self.lr),
                "--outer-momentum", str(self.outer_momentum)]


@dataclass(frozen=True)
class Scenario:
    """What to run; see the module docstring for the churn options. `outer_steps` is the run's length
    (`--steps` = outer_steps * inner_steps). `fragments`: passed as `--fragments N` (Streaming DiLoCo: outer steps
    then count fragment rounds, N per `inner_steps`, and the churn schedule's steps are those).
    `stall_timeout`: give up when no live trainer reported a new outer step, or anything at all, for that long (a
    swarm that stopped moving; averaging/diloco.py has rounds that never end, see `pick_victim`). `train_args`: more
    `peer train` arguments for every trainer. `timeout`: the whole run, in seconds."""

    name: str
    profile: str = "home"
    trainers: int = 4
    daemons: int = 2
    outer_steps: int = 12
    inner_steps: int = 20
    model: Model = Model()
    kill_every: int = 0
    join_every: int = 0
    min_live: int = 2
    stop_at: int = 0
    stop_for: int = 3
    slowdown: float = 1.0
    fragments: int | None = None
    seed: int = 1
    train_args: tuple[str, ...] = ()
    timeout: float = 420.0
    stall_timeout: float = 90.0


@dataclass(frozen=True)
class Planned:
    """One step of the plan: `kind` (kill, stop, cont, spawn) of `target` at swarm outer step `step`; a kill's
    target is chosen when it is applied (empty here)."""

    kind: str
    target: str
    step: int


def plan(scenario: Scenario) -> list[Planned]:
    """The churn schedule as a list, decided up front but for the kills' victims (so a run's log and its plan can
    be compared)."""
    stopped = f"t{scenario.trainers - 1}"
    steps: list[Planned] = []
    joined = 0
    for step in range(1, scenario.outer_steps):
        if scenario.join_every and step % scenario.join_every == 0:
            joined += 1
            steps.append(Planned("spawn", f"j{joined}", step))
        if scenario.stop_at and step == scenario.stop_at:
            steps.append(Planned("stop", stopped, step))
        if scenario.stop_at and step == scenario.stop_at + scenario.stop_for:
            steps.append(Planned("cont", stopped, step))
        if scenario.kill_every and step % scenario.kill_every == 0:
            steps.append(Planned("kill", "", step))
    return steps


@dataclass
class Trainer:
    """One trainer process of a run: what it printed (`reader.events`) and what the runner did to it."""

    name: str
    host: WanHost
    seed: int
    joiner: bool
    slowdown: float
    process: subprocess.Popen[str]
    reader: LineReader
    stderr_path: str
    spawned_at: float
    spawned_step: int
    killed_at: float | None = None
    stopped_at: float | None = None
    continued_at: float | None = None
    outer_step: int = 0  # the newest outer step it reported (an outer_round or progress line)
    reported: bool = False

    def note(self, event: dict[str, Any]) -> None:
        """Called by the reader thread for each event."""
        step = event.get("outer_step")
        if isinstance(step, int) and event.get("event") in ("outer_round", "progress", "result"):
            self.outer_step = max(self.outer_step, step)
            self.reported = True

    @property
    def contributed(self) -> bool:
        """A round averaged its contribution (it is a member the next round's coordinator expects)."""
        return any(e.get("event") == "outer_round" and e.get("outcome") == "averaged" for e in self.reader.events)

    @property
    def frozen(self) -> bool:
        return self.stopped_at is not None and self.continued_at is None

    @property
    def result(self) -> dict[str, Any] | None:
        return next((e for e in reversed(self.reader.events) if e.get("event") == "result"), None)

    @property
    def rounds(self) -> list[dict[str, Any]]:
        return [e for e in self.reader.events if e.get("event") == "outer_round"]

    @property
    def done(self) -> bool:
        """Exited and everything it wrote was read."""
        return self.process.poll() is not None and self.reader.closed

    def stderr_tail(self, size: int = 3000) -> str:
        try:
            return Path(self.stderr_path).read_text(errors="replace")[-size:]
        except OSError:
            return ""


class ScenarioError(RuntimeError):
    """The run did not finish as it should (a trainer failed, or the timeout passed); the message says why."""


def _env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}


class Runner:
    """Runs one `Scenario` on a testbed it builds (see `run_scenario`). `log`: progress lines for a person."""

    def __init__(self, scenario: Scenario, *, log: Callable[[str], None] | None = None, workdir: str | None = None,
                 log_level: str = "info"):
        self.scenario = scenario
        self.log_level = log_level
        self.log = log or (lambda line: None)
        self.workdir = workdir or tempfile.mkdtemp(prefix=f"swarmd-scenario-{scenario.name}-")
        # the run id seeds the model's initial weights (`peer.tasks.run_seed`): runs of one seed compare
        self.run_id = f"wan-{scenario.seed}"
        self.condition = threading.Condition()
        self.trainers: dict[str, Trainer] = {}
        self.daemons: list[tuple[subprocess.Popen[str], LineReader]] = []
        self.plan = plan(scenario)
        self.final_step = scenario.outer_steps * (scenario.fragments or 1)  # with fragments: fragment rounds
        self.applied: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.bootstrap = ""
        self._hosts: dict[str, WanHost] = {}

    # ------------------------------------------------------------------------------------------ the swarm

    def swarm_step(self) -> int:
        """The newest outer step any trainer that is not killed reported."""
        steps = [t.outer_step for t in self.trainers.values() if t.killed_at is None]
        return max(steps, default=0)

    def all_hold(self, step: int) -> bool:
        """Every live trainer that reported something holds `step` (or the swarm is a step past it: a trainer
        left behind must not hold the schedule up)."""
        live = [t for t in self.trainers.values() if t.killed_at is None and not t.frozen and t.reported
                and t.process.poll() is None]
        return self.swarm_step() > step or (bool(live) and all(t.outer_step >= step for t in live))

    def pick_victim(self) -> str | None:
        """The trainer to kill now: of the live ones that have contributed, the one started first; None (skip the
        kill) when it would leave fewer than `min_live` of them.

        Why only trainers that contributed count: a joiner that has not been in a round yet is not expected by the
        next round's coordinator, so killing the last but one established trainer leaves a round of one member.
        Such a round livelocks in averaging/diloco.py (its lone member skips it, then offers to it again and is
        answered with the same start, forever, while the joiner waits for that round's result; see the report in
        benchmarks/README.md), so the schedule never makes one on purpose."""
        with self.condition:
            established = [t for t in self.trainers.values()
                           if t.killed_at is None and not t.frozen and t.process.poll() is None and t.contributed]
        if len(established) - 1 < self.scenario.min_live:
            return None
        return min(established, key=lambda t: t.spawned_at).name

    def trainer_argv(self, index: int, joiner: bool, slowdown: float) -> list[str]:
        scenario = self.scenario
        hooks = ["--log-level", self.log_level]
        if slowdown != 1.0:
            hooks += ["--slowdown", str(slowdown)]
        train = ["--initial-peers", self.bootstrap, "--run-id", self.run_id, "--algorithm", "diloco",
                 *scenario.model.args(), "--inner-steps", str(scenario.inner_steps),
                 "--steps", str(scenario.inner_steps * scenario.outer_steps), "--overlap", "--compression", "int8",
                 "--seed", str(scenario.seed * 100 + index), "--threads", "1",
                 "--log-every", str(scenario.inner_steps)]
        if not joiner:
            train += ["--start-with", str(scenario.trainers)]
        if scenario.fragments is not None:
            train += ["--fragments", str(scenario.fragments)]
        return [sys.executable, "-m", "peer.testing.trainer", *hooks, "--", *train, *scenario.train_args]

    def spawn_trainer(self, wan: WanTestbed, name: str, index: int, joiner: bool) -> subprocess.Popen[str]:
        slowdown = self.scenario.slowdown if name == "t0" else 1.0
        host = self._hosts[name]
        stderr_path = os.path.join(self.workdir, f"{name}.err")
        with open(stderr_path, "w") as stderr:
            process: subprocess.Popen[str] = wan.spawn(
                host, self.trainer_argv(index, joiner, slowdown), stdout=subprocess.PIPE, stderr=stderr, text=True,
                cwd=ROOT, env=_env())
        trainer = Trainer(name, host, self.scenario.seed * 100 + index, joiner, slowdown, process,
                          LineReader(process, self.condition, name=name), stderr_path, time.monotonic(),
                          self.swarm_step())
        trainer.reader.on_event = trainer.note
        with self.condition:
            self.trainers[name] = trainer
        trainer.reader.start()
        self.log(f"[{self.elapsed():6.1f} s] started {name} on {host.address}"
                 f"{' (joiner at outer step %d)' % trainer.spawned_step if joiner else ''}"
                 f"{' (%gx slower)' % slowdown if slowdown != 1.0 else ''}")
        return process

    def start_daemons(self, wan: WanTestbed) -> None:
        for index in range(self.scenario.daemons):
            host = self._hosts[f"d{index}"]
            argv = [sys.executable, "-m", "peer.cli", "join", "--host", host.address, "--port", str(PORT),
                    "--log-level", "warning", "--hidden-dim", "16", "--num-experts", "1"]
            if self.bootstrap:
                argv += ["--initial-peers", self.bootstrap]
            with open(os.path.join(self.workdir, f"d{index}.err"), "w") as stderr:
                process: subprocess.Popen[str] = wan.spawn(host, argv, stdout=subprocess.PIPE, stderr=stderr,
                                                           text=True, cwd=ROOT, env=_env())
            reader = LineReader(process, self.condition, name=f"d{index}").start()
            self.daemons.append((process, reader))
            self.wait_for(self._listening(reader), 120, f"daemon d{index} to listen")
            if reader.closed:
                raise ScenarioError(f"daemon d{index} exited: {reader.text[-5:]}")
            self.bootstrap = self.bootstrap or f"{host.address}:{PORT}"

    @staticmethod
    def _listening(reader: LineReader) -> Callable[[], bool]:
        return lambda: reader.closed or any(line.startswith("others join with") for line in reader.text)

    # ------------------------------------------------------------------------------------------ running

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self.condition:
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ScenarioError(f"timed out after {timeout:.0f} s waiting for {what}")
                self.condition.wait(min(left, 0.5))

    def actions(self, wan: WanTestbed) -> list[Action]:
        """The plan as churn actions (conditions on the trainers' reports)."""
        def reached(step: int) -> Callable[[], bool]:
            return lambda: self.swarm_step() >= step

        def all_hold(step: int) -> Callable[[], bool]:
            return lambda: self.all_hold(step)

        def spawner(name: str, index: int) -> Callable[[], subprocess.Popen[str]]:
            return lambda: self.spawn_trainer(wan, name, index, True)

        actions = []
        joiners = 0
        for planned in self.plan:
            step = planned.step
            if planned.kind == "spawn":
                joiners += 1
                actions.append(Action("spawn", planned.target, when=reached(step),
                                      start=spawner(planned.target, self.scenario.trainers + joiners - 1)))
            elif planned.kind == "kill":
                actions.append(Action("kill", f"victim@{step}", when=all_hold(step), pick=self.pick_victim))
            elif planned.kind == "stop":
                actions.append(Action("stop", planned.target, when=all_hold(step)))
            elif planned.kind == "cont":
                actions.append(Action("cont", planned.target, when=reached(step)))
        return actions

    def run(self) -> ScenarioResult:
        scenario = self.scenario
        names = [f"d{i}" for i in range(scenario.daemons)] + [f"t{i}" for i in range(scenario.trainers)]
        names += [p.target for p in self.plan if p.kind == "spawn"]
        with WanTestbed(seed=scenario.seed) as wan:
            for name, profile in zip(names, swarm_profiles(scenario.profile, len(names))):
                self._hosts[name] = wan.add_host(name, profile)
            meter = InterfaceMeter(wan.stage_pid or 0).start()
            try:
                self.started = time.monotonic()
                self.start_daemons(wan)
                self.log(f"[{self.elapsed():6.1f} s] {scenario.daemons} daemons up ({scenario.profile}); "
                         f"plan: {', '.join(f'{p.kind} {p.target or chr(63)} @{p.step}' for p in self.plan) or '-'}"
                         f"; logs in {self.workdir}")
                for index in range(scenario.trainers):
                    self.spawn_trainer(wan, f"t{index}", index, False)
                churn = Churn(self.actions(wan), {n: t.process for n, t in self.trainers.items()})
                self._follow(churn)
            finally:
                meter.stop()
                self._stop_all()
                self._save_events()
            first = self._hosts["t0"]
            rtt = 2 * wan.link(first, first).delay_s
            up = first.profile.up_mbit * 1e6 / 8 if first.profile.up_mbit else None
            reports = {name: self._report(trainer, meter) for name, trainer in self.trainers.items()}
        events = {name: list(t.reader.events) for name, t in self.trainers.items()}
        return ScenarioResult(scenario, self.plan, self.applied, reports, events, self.elapsed(), rtt, up,
                              self.workdir)

    def _save_events(self) -> None:
        """Each trainer's JSON lines beside its stderr log, for a person to read (also after a failed run)."""
        for name, trainer in self.trainers.items():
            with open(os.path.join(self.workdir, f"{name}.jsonl"), "w") as file:
                file.writelines(json.dumps(line) + "\n" for line in trainer.reader.events)

    def _follow(self, churn: Churn) -> None:
        """Apply the schedule as the trainers report, until every trainer not killed is done."""
        deadline = self.started + self.scenario.timeout
        last_step, last_events, moved_at = -1, -1, time.monotonic()
        while True:
            for applied in churn.poll():
                self._note_applied(applied.action, applied.target, applied.pid, applied.outcome)
            with self.condition:
                step = self.swarm_step()
                steps = {n: t.outer_step for n, t in self.trainers.items() if t.killed_at is None}
                # moving: a new swarm step, or any live trainer reporting anything (inner steps on a loaded machine
                # may take longer than `stall_timeout` per outer step, and that is slow, not stalled)
                events = sum(len(t.reader.events) for t in self.trainers.values() if t.killed_at is None)
                if events != last_events:
                    last_events, moved_at = events, time.monotonic()
                if step != last_step:
                    last_step, moved_at = step, time.monotonic()
                    live = sorted(steps)
                    self.log(f"[{self.elapsed():6.1f} s] swarm at outer step {step}; live: {' '.join(live)}")
                failed = [t for t in self.trainers.values()
                          if t.killed_at is None and t.done and (t.result is None or t.process.returncode != 0)]
                if failed:
                    t = failed[0]
                    # the others still running are often the cause (a final agreement that one of them never
                    # joined): their last lines too, since the workdir is gone once the process pool is
                    others = "".join(f"\n--- {o.name} (still running) ---\n{o.stderr_tail(1500)}"
                                     for o in self.trainers.values() if o.killed_at is None and not o.done)
                    raise ScenarioError(f"{t.name} exited with {t.process.returncode} without a result: "
                                        f"{t.reader.text[-5:]}\n{t.stderr_tail()}{others}")
                if churn.done and all(t.done for t in self.trainers.values() if t.killed_at is None):
                    return
                stalled = time.monotonic() - moved_at > self.scenario.stall_timeout and step > 0
                if time.monotonic() > deadline or stalled:
                    pending = ", ".join(f"{a.kind} {a.target}" for a in churn.pending)
                    why = (f"stalled: no trainer passed outer step {step} or reported anything in "
                           f"{self.scenario.stall_timeout:.0f} s"
                           if stalled else f"not done after {self.scenario.timeout:.0f} s")
                    raise ScenarioError(f"scenario {self.scenario.name} {why}; outer steps {steps}; churn pending: "
                                        f"{pending or '-'}; logs in {self.workdir}")
                self.condition.wait(0.1)

    def _note_applied(self, action: Action, target: str, pid: int, outcome: str) -> None:
        now = time.monotonic()
        trainer = self.trainers.get(target)
        if trainer is not None:
            if action.kind == "kill":
                trainer.killed_at = now
            elif action.kind == "stop":
                trainer.stopped_at = now
            elif action.kind == "cont":
                trainer.continued_at = now
        self.applied.append({"kind": action.kind, "target": target, "seconds": round(now - self.started, 3),
                             "swarm_step": self.swarm_step(), "outcome": outcome, "pid": pid})
        if action.kind != "spawn":
            self.log(f"[{self.elapsed():6.1f} s] {action.kind} {target or '-'} at outer step {self.swarm_step()}"
                     f" ({outcome})")

    def _stop_all(self) -> None:
        """Whatever still runs: SIGCONT (a stopped process cannot die of SIGKILL's reaping otherwise), SIGKILL."""
        for trainer in self.trainers.values():
            if trainer.process.poll() is None:
                trainer.process.send_signal(signal.SIGCONT)
                trainer.process.kill()
        for process, _ in self.daemons:
            if process.poll() is None:
                process.kill()
        for trainer in self.trainers.values():
            try:
                trainer.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
            trainer.reader.join(5)

    # ------------------------------------------------------------------------------------------ reports

    def _report(self, trainer: Trainer, meter: InterfaceMeter) -> TrainerReport:
        result = trainer.result or {}
        rounds = [e for e in trainer.rounds if "round" in e]
        applied = [e for e in rounds if e.get("outcome") == "averaged"]
        first = result.get("first_contribution")
        since_spawn = None
        if applied:
            event = applied[0]
            since_spawn = {"seconds": round(event["_at"] - trainer.spawned_at, 3),
                           "outer_steps": int(event["round"]) - trainer.spawned_step + 1, "round": event["round"]}
            if first is None:  # killed before its result: the same figure from its events
                first = next((e["first_contribution"] for e in rounds if e.get("first_contribution")),
                             {"seconds": None, "outer_steps": None, "round": event["round"]})
        lost = [e for e in trainer.rounds if e.get("outcome") in LOST]
        device = trainer.host.gateway_port
        finished = trainer.killed_at is None and bool(result) and trainer.process.returncode == 0
        outer_step = int(result.get("outer_step", trainer.outer_step))
        return TrainerReport(
            name=trainer.name, joiner=trainer.joiner, slowdown=trainer.slowdown, killed=trainer.killed_at is not None,
            finished=finished, reached_end=finished and outer_step >= self.final_step,
            exit_code=trainer.process.returncode, outer_step=outer_step, hash=result.get("hash"),
            accuracy=result.get("accuracy"), goodput=result.get("goodput"),
            bytes_sent=int(result.get("bytes_sent", 0)), bytes_received=int(result.get("bytes_received", 0)),
            rounds=len(rounds), averaged_rounds=len(applied), lost_rounds=len(lost),
            samples_counted=sum(int(e.get("samples", 0)) for e in applied),
            cut_short=result.get("cut_short"), late_contributions=result.get("late_contributions"),
            stale_contributions=result.get("stale_contributions"),
            dropped_contributions=result.get("dropped_contributions"),
            first_contribution=first, first_contribution_since_spawn=since_spawn,
            peak_sent_bytes_s=round(meter.peak_sent(device), 1),
            peak_round_bytes_sent=max((int(e.get("bytes_sent", 0)) for e in applied), default=0),
            peak_received_bytes_s=round(meter.peak_received(device), 1),
            compute_seconds=result.get("compute_seconds"), blocked_seconds=result.get("blocked_seconds"))


def run_scenario(scenario: Scenario, *, log: Callable[[str], None] | None = None) -> ScenarioResult:
    """Run `scenario` on a fresh testbed (needs `peer.testing.wan.available()`); see the module docstring."""
    return Runner(scenario, log=log).run()


def to_json(result: ScenarioResult) -> str:
    return json.dumps(result.summary(), default=str)
