"""`peer train`: an example trainer that needs nothing but this package and a running swarm.

The model classifies scikit-learn's handwritten digits (8x8 images, shipped inside scikit-learn: nothing is
downloaded): Linear(64 -> hidden) -> ReLU -> residual RemoteMixtureOfExperts over the swarm's `ffn` experts ->
Linear(hidden -> 10). The experts live on `peer join` daemons and learn from every backward pass; their prefix,
grid and hidden size are read from the swarm's peer directory unless given (`peer.discover`: a given value that
no daemon serves is an error at once, naming what the swarm declares). The trainer's own layers (input, gate,
output) are trained with a `CollaborativeOptimizer`, so several trainers of one `--run-id` average with each other.

Output (stdout), made for both people and scripts:
- every `--log-every` steps a JSON line `{"event": "progress", "step", "steps", "time" (ISO 8601, UTC),
  "elapsed_s" (since start), "step_s" (mean step time since the previous line), "loss", "accuracy",
  "samples_per_s", "experts_alive", "failed_calls" (failed expert calls so far), and on a swarm "epoch",
  "averaging_rounds", "swarm_trainers"}` (a progress bar is drawn on stderr when it is a terminal);
- a line `{"event": "failed_step", "step", "stage" ("forward" or "backward"), "time", "error"}` for each step
  that did not get enough expert answers (it is retried with the next batch);
- last line: a JSON object with the held-out `accuracy`, `loss`, `steps` (done), `interrupted`, `samples_per_s`,
  `failed_steps` (and the last 20 `failures`), `averaging_rounds`, `peers_averaged_with`, `failed_expert_calls`,
  `checkpoint`...

SIGINT or SIGTERM ends the run after the current step: it is evaluated, the result line is written with
`"interrupted": true`, and the exit status is 130 (SIGINT) or 143 (SIGTERM); a second signal exits at once.

`--local-experts` trains the same model with the experts in this process (no swarm): the baseline of
`benchmarks/bench_train.py`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TextIO

import torch
import trio
from torch import nn

from averaging.collaborative import CollaborativeOptimizer
from averaging.diloco import DiLoCoHooks, DiLoCoOptimizer
from averaging.quorum import QuorumPolicy
from averaging.schema import MISMATCHES
from dht.client import SwarmHandle
from moe.declare import get_experts
from moe.errors import NotEnoughExperts
from moe.experts import make_expert
from moe.mixture import RemoteMixtureOfExperts
from moe.pipeline import StepResult
from peer.client import Swarm, normalize_peers
from peer.dashboard.training import publish_point
from peer.lm import ByteLM, LMTask
from peer.metrics import PeerMetrics, SwarmCollector, peer_metrics
from peer.options import TRAIN, TRAIN_SIGNALS_EPILOG, OptionParser, parse_grid_size
from peer.p2p.addresses import local_host_towards
from peer.p2p.bridge import Bridge
from peer.p2p.identity import load_membership
from peer.p2p.wire import Compression, set_default_density
from peer.steps import step_runner
from peer.tasks import (
    BatchStream,
    GridTask,
    LocalMixtureOfExperts,
    discover_swarm_experts,
    expert_settings,
    grid_uids,
    run_seed,
)
from peer.user_model import UserTask

if TYPE_CHECKING:
    from averaging.optimizer import SwarmOptimizer

parse_grid = parse_grid_size  # '12' -> (12,), '4x4' -> (4, 4)


class TrainingFailed(RuntimeError):
    """A run that ended without doing its job (never averaged, held-out evaluation failed, too few outer steps,
    no experts): the message says why in one line, so the command line prints it without a traceback."""


DIGITS_SPLIT_SEED = 20240607  # the held-out set is the same for every trainer of every run
HELD_OUT_FRACTION = 0.2


# ------------------------------------------------------------------------------------------------ data


def load_digits_split(seed: int = DIGITS_SPLIT_SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): scikit-learn's 1797 digits, pixels scaled to [0, 1], a fixed 80/20
    split (the same for every trainer, so their held-out accuracies compare)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(round(len(x) * (1 - HELD_OUT_FRACTION)))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


# ------------------------------------------------------------------------------------------------ model


class DigitsModel(nn.Module):
    """64 pixels -> hidden -> (residual mixture of experts) -> 10 classes."""

    def __init__(self, hidden_dim: int, mixture: LocalMixtureOfExperts | RemoteMixtureOfExperts):
        super().__init__()
        self.inp = nn.Linear(64, hidden_dim)
        self.moe: LocalMixtureOfExperts | RemoteMixtureOfExperts = mixture
        self.out = nn.Linear(hidden_dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        out: torch.Tensor = self.out(h + self.moe(h))
        return out

    def remote_mixture(self) -> RemoteMixtureOfExperts:
        """The mixture of a model built on a swarm (its experts are remote)."""
        if not isinstance(self.moe, RemoteMixtureOfExperts):
            raise TypeError("this model mixes local experts")
        return self.moe

    def local_mixture(self) -> LocalMixtureOfExperts:
        """The mixture of a model built with --local-experts."""
        if not isinstance(self.moe, LocalMixtureOfExperts):
            raise TypeError("this model mixes remote experts")
        return self.moe

    def remote_mixtures(self) -> list[RemoteMixtureOfExperts]:
        """Every remote mixture of the model (the LM task's models have one per layer)."""
        return [self.remote_mixture()]

    def local_expert_modules(self) -> nn.ModuleList:
        return self.local_mixture().experts


_FAILURES_KEPT = 20  # failed steps the result line lists (each also has a `failed_step` line of its own)


def _utc_now() -> str:
    """The `time` of a progress or failed-step line: ISO 8601, UTC, to the millisecond."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def build_model(args: argparse.Namespace, swarm: SwarmHandle | None) -> DigitsModel:
    hidden_dim, prefix, grid = expert_settings(args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run_seed(args.run_id))
        if swarm is None:
            experts = [make_expert(uid, "ffn", hidden_dim, seed=run_seed(uid)).module
                       for uid in grid_uids(prefix, grid)]
            mixture: LocalMixtureOfExperts | RemoteMixtureOfExperts = LocalMixtureOfExperts(
                hidden_dim, grid, experts, args.k_best)
        else:
            mixture = RemoteMixtureOfExperts(
                hidden_dim, grid, prefix, k_best=args.k_best, k_min=1,
                timeout_after_k_min=args.expert_grace, forward_timeout=args.expert_timeout,
                backward_timeout=args.expert_timeout, swarm=swarm,
                compression=Compression[args.expert_compression.upper()],
            )
        return DigitsModel(hidden_dim, mixture)


class DigitsTask(GridTask):
    """The hooks `run_training` calls for one task: data, model, loss, held-out evaluation. `--task lm` has the
    same hooks in `peer.lm.LMTask`; the loop, the swarm, the optimizer and the output are shared."""

    name = "digits"

    def __init__(self, args: argparse.Namespace):
        self.x_train, self.y_train, self.x_test, self.y_test = load_digits_split()

    def discover(self, args: argparse.Namespace, swarm: SwarmHandle) -> argparse.Namespace:
        return discover_swarm_experts(args, swarm)

    def batches(self, args: argparse.Namespace) -> BatchStream:
        return BatchStream(self.x_train, self.y_train, args.batch_size, seed=args.seed)

    def build_model(self, args: argparse.Namespace, swarm: SwarmHandle | None) -> DigitsModel:
        return build_model(args, swarm)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        logits = model(x)
        return nn.functional.cross_entropy(logits, y), float((logits.argmax(1) == y).float().mean().item())

    def before_training(self, model: nn.Module) -> None:
        return None

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        accuracy, test_loss = evaluate(model, self.x_test, self.y_test)
        return {"accuracy": accuracy, "loss": test_loss}

    def finish(self, model: nn.Module) -> dict[str, Any]:
        return {}


def make_task(args: argparse.Namespace) -> DigitsTask | LMTask | UserTask:
    """The task object: peer.user_model.UserTask with --model, else that of `--task` (DigitsTask or
    peer.lm.LMTask)."""
    if getattr(args, "model", None) is not None:
        return UserTask(args)
    if getattr(args, "data", None) is not None:
        raise ValueError("--data needs --model (the digits and lm tasks bring their own data)")
    if getattr(args, "task", "digits") == "lm":
        return LMTask(args)
    return DigitsTask(args)


# ------------------------------------------------------------------------------------------------ options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `peer train` options (defined in peer/options.py, with their config-file keys and defaults)."""
    TRAIN.add_to(parser)


def build_parser() -> OptionParser:
    """`python -m peer.train`'s parser: the same options as `peer train`, `--config` included; a usage error
    prints one line and exits 2."""
    parser = OptionParser(prog="peer train", description=__doc__.split("\n")[0], exits=True,
                          epilog=TRAIN_SIGNALS_EPILOG)
    add_arguments(parser)
    return parser


# ------------------------------------------------------------------------------------------------ training


class _Meter:
    """Loss and accuracy over the last few steps (exponential moving averages)."""

    def __init__(self, alpha: float = 0.1):
        self.alpha = alpha
        self.loss = math.nan
        self.accuracy = math.nan

    def update(self, loss: float, accuracy: float) -> None:
        if math.isnan(self.loss):
            self.loss, self.accuracy = loss, accuracy
        else:
            self.loss += self.alpha * (loss - self.loss)
            self.accuracy += self.alpha * (accuracy - self.accuracy)


def _experts_alive(swarm: SwarmHandle, model: Any, uids: list[str]) -> int:
    """Experts declared in the DHT right now and not banned by this trainer after a failure."""

    async def count() -> int:
        found = await get_experts(swarm.dht, uids)
        blacklists = {id(m.client.blacklist): m.client.blacklist for m in model.remote_mixtures()}.values()
        return sum(1 for uid, location in found.items()
                   if location is not None and not any(b.is_banned(uid, location) for b in blacklists))

    return swarm.run(count)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on a held-out set."""
    model.train(False)  # evaluation mode
    correct, total_loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            logits = model(x[start:start + batch_size])
            target = y[start:start + batch_size]
            total_loss += nn.functional.cross_entropy(logits, target, reduction="sum").item()
            correct += (logits.argmax(1) == target).sum().item()
    model.train()
    return correct / len(x), total_loss / len(x)


class StopSignal:
    """SIGINT/SIGTERM for `peer train`: finish the current step, evaluate, write the result line, then exit.

    Why a flag instead of Python's KeyboardInterrupt: the loop is synchronous torch code that spends much of a
    step blocked in a bridge call to the swarm's trio thread; an exception raised there loses the step, the
    evaluation and the result line. The handler only records the signal; the loop checks `requested` between
    steps, and a step blocked in the swarm is bounded by the call timeouts (`--expert-timeout`, the averaging
    timeout). Installing our own handler also overrides SIG_IGN, which non-interactive shells give SIGINT in
    background jobs (Python then never raises KeyboardInterrupt). A second signal exits at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def exit_code(self) -> int:
        """0 after a normal run; 128 + the signal number after a signal (130 SIGINT, 143 SIGTERM)."""
        return 0 if self.signum is None else 128 + self.signum

    def request(self, signum: int) -> None:
        """What the handler does; also callable directly (tests, embedding code)."""
        self.signum = signum

    def _handle(self, signum: int, frame: Any) -> None:
        # os.write, not print: a signal handler may run in the middle of a buffered write to the same stream
        clear = b"\r\x1b[K" if sys.stderr.isatty() else b""
        name = signal.Signals(signum).name.encode()
        if self.signum is not None:
            os.write(2, clear + b"peer train: " + name + b" again, exiting now\n")
            os._exit(128 + signum)
        self.request(signum)
        os.write(2, clear + b"peer train: " + name + b" received: finishing the current step, then evaluating "
                 b"(send it again to exit at once)\n")

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignal"]:
        """Handle SIGINT and SIGTERM inside the block (main thread only), restoring the previous handlers after."""
        previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _same_terminal(first: TextIO, second: TextIO) -> bool:
    try:
        if not (first.isatty() and second.isatty()):
            return False
        a, b = os.fstat(first.fileno()), os.fstat(second.fileno())
    except (OSError, ValueError, AttributeError):  # closed, or a stream without a file descriptor
        return False
    return (a.st_rdev, a.st_ino) == (b.st_rdev, b.st_ino)


class _Output:
    """JSON lines on stdout (for scripts) and a progress bar on stderr when stderr is a terminal (for people).

    The bar is redrawn in place with a carriage return, so on a terminal that shows both streams a JSON line
    would be appended to the half-drawn bar line: when stdout and stderr are the same terminal, the bar line is
    cleared before each JSON line and drawn again after it.
    """

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None):
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.bar = self.stderr.isatty()
        self.shared = self.bar and _same_terminal(self.stdout, self.stderr)
        self._bar_open = False  # the cursor is on a drawn bar line
        self._lock = threading.Lock()

    def emit(self, line: dict[str, Any]) -> None:
        """Thread-safe: DiLoCo's outer-round events come from the swarm's trio thread."""
        with self._lock:
            if self._bar_open and self.shared:
                self.stderr.write("\r\x1b[K")
                self.stderr.flush()
                self._bar_open = False
            self.stdout.write(json.dumps(line) + "\n")
            self.stdout.flush()

    def draw_bar(self, line: dict[str, Any]) -> None:
        if not self.bar:
            return
        self.stderr.write("\r" + _bar_text(line) + "\x1b[K")
        self._bar_open = True
        if line["step"] == line["steps"]:
            self.end_bar()
        self.stderr.flush()

    def end_bar(self) -> None:
        """Leave the bar on its own line (the end of the run, or a signal before the last step)."""
        if self._bar_open:
            self.stderr.write("\n")
            self.stderr.flush()
            self._bar_open = False


def _bar_text(line: dict[str, Any]) -> str:
    width = 24
    step, steps = line["step"], line["steps"]
    filled = int(width * step / steps)
    text = (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{steps} {line['elapsed_s']:.0f}s "
            f"{line['step_s']:.2f} s/step loss {line['loss']:.3f} acc {line['accuracy'] or math.nan:.3f} "
            f"{line['samples_per_s']:.0f} samples/s experts {line['experts_alive']} failed {line['failed_calls']}")
    if "epoch" in line:
        text += f" epoch {line['epoch']}"
    return text


def _failed_expert_calls(model: Any, swarm: SwarmHandle | None) -> int:
    if swarm is None:
        return 0  # local experts cannot fail a call
    return int(sum(m.client.stats["forward_failures"] + m.client.stats["backward_failures"]
                   for m in model.remote_mixtures()))


def _expert_tensor_bytes(model: Any) -> dict[str, int]:
    """The expert calls' tensor bytes both ways, as sent (`--expert-compression`) and as they would go exact."""
    mixtures = model.remote_mixtures()
    return {"expert_tensor_bytes": int(sum(m.client.stats["tensor_bytes"] for m in mixtures)),
            "expert_tensor_bytes_exact": int(sum(m.client.stats["tensor_bytes_exact"] for m in mixtures))}


def run_training(args: argparse.Namespace, on_progress: Callable[[dict[str, Any]], None] | None = None,
                 stop: StopSignal | None = None, hooks: DiLoCoHooks | None = None) -> dict[str, Any]:
    """Train as configured by `args` (see `add_arguments`); print progress and the result; return the result.
    `on_progress` (optional) receives every progress line as a dict, in the training thread. Once `stop` is
    requested (`peer train` installs it for SIGINT/SIGTERM) the run ends after the current step: it is
    evaluated and its result (`"interrupted": true`, `"steps"` done) written as usual. `hooks`: test hooks of
    the DiLoCo optimizer (`averaging.diloco.DiLoCoHooks`; tests pass them, the command line cannot)."""

    mismatch_mark = MISMATCHES.mark()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task = make_task(args)
    remote_experts = getattr(task, "remote_experts", True) and not args.local_experts
    if remote_experts and not args.initial_peers:
        raise ValueError("--initial-peers is required (HOST:PORT of any `peer join`), or use --local-experts")
    batches = task.batches(args)

    stop = stop or StopSignal()
    out = _Output()
    swarm = None
    metrics_bridge = None
    optimizer: SwarmOptimizer | None = None
    started = time.monotonic()
    try:
        diloco = getattr(args, "algorithm", "collaborative") == "diloco"
        if args.initial_peers and (diloco or remote_experts or not getattr(task, "remote_experts", True)):
            # with --algorithm diloco and --local-experts, the swarm only carries the averaging: every
            # parameter lives in this trainer (the setting DiLoCo is made for)

            peers = normalize_peers(args.initial_peers)
            swarm_key, allowed_peers = load_membership(getattr(args, "swarm_key", None),
                                                       getattr(args, "allow_peers", None))
            swarm = Swarm(initial_peers=peers, host=local_host_towards(peers[0]),
                          secure=not args.insecure_transport, swarm_key=swarm_key, allowed_peers=allowed_peers,
                          reachability=None if args.client_mode else getattr(args, "reachability", "auto"))
            if remote_experts:
                args = task.discover(args, swarm)
        experts_swarm = swarm if remote_experts else None  # where the experts live (None: in this process)
        uids = task.expert_uids(args)
        model = task.build_model(args, experts_swarm)
        if args.local_experts and getattr(task, "remote_experts", True):  # experts learn at the daemons' rate

            assert isinstance(model, (DigitsModel, ByteLM))
            local_experts = model.local_expert_modules()
            expert_params = {id(p) for p in local_experts.parameters()}
            base = torch.optim.Adam([
                {"params": [p for p in model.parameters() if id(p) not in expert_params], "lr": args.lr},
                {"params": list(local_experts.parameters()), "lr": args.expert_lr},
            ])
        else:
            base = torch.optim.Adam(model.parameters(), lr=args.lr)
        if swarm is not None:
            optimizer = _make_optimizer(args, base, swarm, hooks, out, stop)
        meter = _Meter()
        training: dict[str, Any] = {"step": 0, "samples": 0}  # what --metrics-port exports of the loop
        metrics_bridge = _start_metrics(args, swarm, model, optimizer, training)
        task.before_training(model)
        failed_steps = consecutive_failures = 0
        failures: collections.deque[dict[str, Any]] = collections.deque(maxlen=_FAILURES_KEPT)  # for the result
        samples = 0
        train_started = last_line_at = time.monotonic()
        step = last_line_step = 0

        def apply_update(batch: int) -> None:
            if optimizer is not None:
                optimizer.step(batch_size=batch)
            else:
                base.step()
                base.zero_grad(set_to_none=True)

        steps = step_runner(model, lambda x, y: task.loss(model, x, y), apply_update,
                            steps_in_flight(args, remote_experts))

        def training_continues() -> bool:
            if stop.requested:
                return False
            if optimizer is not None:  # DiLoCo counts the swarm's outer steps (see its more_steps)
                return optimizer.more_steps(step + steps.in_flight, args.steps)
            return bool(step + steps.in_flight < args.steps)

        def finished(outcome: StepResult) -> None:
            """Count one finished step: a failure (retried with the next batch after a pause that grows), or a
            step done, with its progress line every --log-every steps."""
            nonlocal failed_steps, consecutive_failures, step, samples
            if isinstance(outcome.error, NotEnoughExperts):
                # experts not declared yet (a swarm starting up) or all failing at once: retry after a pause
                # that grows, so a swarm that comes back is used again and one that never does ends the run
                failed_steps += 1
                consecutive_failures += 1
                failure = {"event": "failed_step", "step": step + 1, "stage": outcome.error.stage,
                           "time": _utc_now(), "error": str(outcome.error)[:300]}
                failures.append(failure)
                out.emit(failure)
                if consecutive_failures >= args.max_failed_steps:
                    raise TrainingFailed(
                        f"{consecutive_failures} steps in a row without enough experts: {outcome.error}") from None
                time.sleep(min(1.0, 0.02 * 2 ** consecutive_failures))
                return
            if outcome.error is not None:
                raise outcome.error
            if not outcome.applied:  # dropped by drain(apply=False): past the swarm's last outer step
                return
            consecutive_failures = 0
            step += 1
            samples += outcome.samples
            assert outcome.loss is not None
            meter.update(outcome.loss, outcome.metric)
            if step % args.log_every == 0 or step == args.steps:
                progress_line()

        def progress_line() -> None:
            nonlocal last_line_at, last_line_step
            now = time.monotonic()
            elapsed = now - train_started
            line = {
                "event": "progress", "step": step, "steps": args.steps,
                "time": _utc_now(),
                "elapsed_s": round(now - started, 3),
                "step_s": round((now - last_line_at) / (step - last_line_step), 4),  # mean since last line
                "loss": round(meter.loss, 4),
                "accuracy": None if math.isnan(meter.accuracy) else round(meter.accuracy, 4),
                "samples_per_s": round(samples / max(elapsed, 1e-9), 1),
                "experts_alive": len(uids) if experts_swarm is None else _experts_alive(experts_swarm, model, uids),
                "failed_calls": _failed_expert_calls(model, experts_swarm),
            }
            last_line_at, last_line_step = now, step
            if optimizer is not None:
                line.update(optimizer.report())
            out.emit(line)
            out.draw_bar(line)
            training.update(line, samples=samples)
            if swarm is not None:
                _publish_point(swarm, args.run_id, line, optimizer.stats() if optimizer is not None else None)
            if on_progress is not None:
                on_progress(line)

        while True:
            try:
                while training_continues():
                    x, y = batches.next()
                    for done in steps.submit(x, y):
                        finished(done)
            except BaseException:
                steps.drain(apply=False)  # no step thread outlives the run
                raise
            # the steps still in flight: a collaborative loop never submits past --steps, but DiLoCo's swarm may
            # have taken its last outer step meanwhile, and an update after it would leave this trainer's model apart
            for done in steps.drain(apply=not diloco):
                finished(done)
            # a drained step that failed for want of experts is retried like any other failed step (else the run
            # ends a step short); DiLoCo's loop ended on the swarm's last outer step, not on a count of steps
            if diloco or not training_continues():
                break
        if step != last_line_step:  # the last step's line (a stop request, DiLoCo's last outer step)
            progress_line()
        out.end_bar()
        train_seconds = time.monotonic() - train_started
        if optimizer is not None:
            optimizer.finish()  # DiLoCo: agree on the final outer state (skipped after a stop request)
        evaluation_error: NotEnoughExperts | None = None
        held_out: dict[str, Any] = {"accuracy": None, "loss": None}
        for attempt in range(_EVALUATION_TRIES):
            try:
                held_out = task.evaluate(model)
                held_out.update(task.finish(model))
                evaluation_error = None
                break
            except NotEnoughExperts as error:  # the swarm is gone: the result line still says what was done
                # (or busy for a moment, as at the end of a run when the others average: tried again)
                evaluation_error = error
                if attempt + 1 < _EVALUATION_TRIES and not stop.requested:
                    time.sleep(1.0 + attempt)
        result: dict[str, Any] = {
            "event": "result", "task": task.name,
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in held_out.items()}, "steps": step,
            "steps_planned": args.steps, "interrupted": stop.requested, "signal": stop.name,
            "failed_steps": failed_steps, "failures": list(failures),
            "samples_per_s": round(samples / max(train_seconds, 1e-9), 1),
            "train_seconds": round(train_seconds, 3), "wall_seconds": round(time.monotonic() - started, 3),
            "run_id": args.run_id, "local_experts": bool(args.local_experts),
        }
        if optimizer is not None:
            result.update(optimizer.report(final=True))
            result["failed_expert_calls"] = _failed_expert_calls(model, experts_swarm)
            if experts_swarm is not None:
                result.update(_expert_tensor_bytes(model))
        if swarm is not None and swarm.reached is not None:  # how others reached this trainer (--reachability)
            result["reachability"] = swarm.reached.reachability.stats()
            result["relay"] = swarm.reached.relaying.stats()
        if args.checkpoint is not None:
            args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": base.state_dict(), "args": _plain_args(args),
                        "accuracy": held_out["accuracy"], "epoch": result.get("epoch")},
                       args.checkpoint)
            result["checkpoint"] = str(args.checkpoint)
        if evaluation_error is not None:
            result["evaluation_error"] = str(evaluation_error)
        mismatch = _never_averaged_for_mismatch(result, mismatch_mark) if optimizer is not None else None
        if mismatch is not None:
            result["model_mismatch"] = mismatch
        out.emit(result)
        if mismatch is not None and not stop.requested:
            raise TrainingFailed(f"never averaged: {mismatch} (every trainer of --run-id needs the same model)")
        if evaluation_error is not None and not stop.requested:
            raise TrainingFailed(f"held-out evaluation failed: {evaluation_error}")
        shortfall = optimizer.shortfall(step, args.steps) if optimizer is not None else None
        if shortfall is not None and not stop.requested:
            raise TrainingFailed(shortfall)
        return result
    finally:
        if metrics_bridge is not None:
            metrics_bridge.close()
        if optimizer is not None:
            optimizer.close()
        if swarm is not None:
            swarm.close()


_EVALUATION_TRIES = 3  # a held-out evaluation that found too few experts, tried again after 1 s, then 2 s
DEFAULT_STEPS_IN_FLIGHT = 2  # with remote experts (see peer.steps); measured in benchmarks/README.md


def steps_in_flight(args: argparse.Namespace, remote_experts: bool) -> int:
    """--steps-in-flight, or its default: several where steps wait on remote experts, else one."""
    given: int | None = getattr(args, "steps_in_flight", None)
    if given is not None:
        return given
    return DEFAULT_STEPS_IN_FLIGHT if remote_experts else 1


def _make_optimizer(args: argparse.Namespace, base: torch.optim.Optimizer, swarm: Any, hooks: DiLoCoHooks | None,
                    out: _Output, stop: StopSignal) -> SwarmOptimizer:
    """The one place that reads `--algorithm`: the loop uses what it returns through `SwarmOptimizer` only."""
    if args.algorithm == "diloco":
        set_default_density(args.density)  # what the top-k codecs keep of what this trainer sends
        diloco_hooks = dataclasses.replace(hooks) if hooks is not None else DiLoCoHooks()
        if diloco_hooks.on_event is None:
            diloco_hooks.on_event = out.emit  # outer rounds, as JSON lines beside the progress lines
        return DiLoCoOptimizer(
            base, swarm, args.run_id, inner_steps=args.inner_steps, batch_size_per_step=args.batch_size,
            outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
            compression=Compression[args.compression.upper()], overlap=args.overlap,
            quorum=QuorumPolicy(quorum_min=args.quorum_min, quorum_fraction=args.quorum_fraction,
                                max_staleness=args.max_staleness),
            start_with=args.start_with, fragments=args.fragments, exchange=args.exchange,
            listen=not args.client_mode, should_stop=lambda: stop.requested,
            aggregation=args.aggregation, hooks=diloco_hooks,
        )

    return CollaborativeOptimizer(
        base, swarm, args.run_id, target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size, average=args.average, target_group_size=args.group_size,
        matchmaking_time=args.matchmaking_time, listen=not args.client_mode, aggregation=args.aggregation,
    )


def _never_averaged_for_mismatch(result: dict[str, Any], since: int) -> str | None:
    """One line when this trainer averaged with nobody and met peers of another model (averaging.schema keeps
    them; `since` is its mark at the start of this run), else None: a run that trained alone because its
    friends have another model must not exit 0."""

    groups = result.get("group_sizes") or {}
    if any(int(size) > 1 and count for size, count in groups.items()):
        return None
    return MISMATCHES.summary(since=since)


def _publish_point(swarm: Any, run_id: str, line: dict[str, Any], averaging: dict[str, Any] | None) -> None:
    """Put this progress line's loss and throughput in the DHT for `peer dashboard` (peer/dashboard/training.py);
    bounded to 2 s, and a failure only costs the dashboard one point."""


    async def publish() -> None:
        with trio.move_on_after(2.0):
            await publish_point(swarm.dht, swarm.peer_id, run_id, line, averaging)

    try:
        swarm.run(publish)
    except (OSError, RuntimeError) as error:  # the swarm's thread is gone: training reports it elsewhere
        print(f"peer train: could not publish progress for the dashboard: {error}", file=sys.stderr)


def _start_metrics(args: argparse.Namespace, swarm: Any, model: Any, optimizer: Any,
                   training: dict[str, Any]) -> Any:
    """With --metrics-port: serve /metrics from a trio thread (the swarm's, or one of its own with
    --local-experts); returns the Bridge to close with --local-experts, else None."""
    if args.metrics_port is None:
        return None

    sources: dict[str, Any] = {"training": lambda: dict(training)}
    if swarm is None:
        bridge, own, host = Bridge.start(), True, "127.0.0.1"
        metrics = PeerMetrics(SwarmCollector(**sources))
    else:
        bridge, own, host = swarm.bridge, False, swarm.dht.address[0]
        mixtures = model.remote_mixtures() if hasattr(model, "remote_mixtures") else []
        metrics = swarm.run(_make_swarm_metrics, peer_metrics, swarm, {
            **sources, "expert_client": (lambda: dict(mixtures[0].client.stats)) if mixtures else None,
            "averaging": optimizer.stats if optimizer is not None else None})
    address = bridge.start_and_wait(metrics.serve, host, args.metrics_port)
    print(f"peer train: metrics at http://{address[0]}:{address[1]}/metrics", file=sys.stderr, flush=True)
    return bridge if own else None


async def _make_swarm_metrics(factory: Any, swarm: Any, sources: dict[str, Any]) -> Any:
    return factory(swarm.rpc, swarm.dht, **sources)  # in the swarm's trio thread: hooks set where they are used


def _plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options as plain values (a checkpoint must load with torch.load(weights_only=True))."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, list, Path, type(None)))}


def run_command(args: argparse.Namespace, hooks: DiLoCoHooks | None = None) -> int:
    """`peer train` as a command: train with SIGINT/SIGTERM handled (see `StopSignal`); the exit status is 0 for
    a finished run, 130 after SIGINT and 143 after SIGTERM (the result line is written in every case)."""
    stop = StopSignal()
    with stop.installed():
        run_training(args, stop=stop, hooks=hooks)
    if getattr(args, "algorithm", None) == "diloco" and stop.signum == signal.SIGINT:
        return 0  # a DiLoCo run stopped with Ctrl-C is a clean stop (the outer state is on the other trainers)
    return stop.exit_code()


def main(argv: Sequence[str] | None = None, hooks: DiLoCoHooks | None = None) -> int:
    """`peer train`; `hooks` are the tests' (see `peer.testing.trainer`)."""
    args = build_parser().parse_args(argv)
    try:
        return run_command(args, hooks)
    except KeyboardInterrupt:  # Ctrl-C before the handlers were installed (while parsing, importing)
        return 130
    except Exception as error:  # one line, like the other `peer` commands
        print(f"peer train: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
