"""The `peer` command line: `join` runs a volunteer daemon, `status` shows the swarm.

Every failure a user can cause (bad option, port in use, unreachable bootstrap peer, bad key file) ends with one
line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any, Callable, Sequence

import trio

from peer import __version__
from peer.net import parse_address

EXIT_USAGE = 2
EXIT_FAILURE = 1


class UsageError(Exception):
    """Bad command-line or config-file input; the message is shown as is."""


class _Parser(argparse.ArgumentParser):
    _deferred: Callable[[argparse.ArgumentParser], None] | None = None

    def error(self, message: str) -> None:  # one line instead of argparse's usage dump
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")

    def defer(self, add_options: Callable[[argparse.ArgumentParser], None]) -> None:
        """Add this (sub)command's options only when it is used (parsed, or its help shown). Why: `peer train`'s
        options live in peer.train, which imports torch (1 s idle, several on a busy machine) that the other
        commands do not need."""
        self._deferred = add_options

    def _add_deferred(self) -> None:
        add_options, self._deferred = self._deferred, None
        if add_options is not None:
            add_options(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._add_deferred()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._add_deferred()
        return super().format_help()

    def format_usage(self) -> str:
        self._add_deferred()
        return super().format_usage()


def _address(text: str) -> tuple[str, int]:
    try:
        return parse_address(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _number(kind: type, what: str, accept: Any, rule: str) -> Any:
    """An argparse type: `kind(text)` that `accept`s, with one-line messages for everything else."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"{text!r} {rule}")
        return value

    return parse


_positive_int = _number(int, "a whole number", lambda v: v > 0, "must be positive")
_port = _number(int, "a port number", lambda v: 0 <= v < 65536, "is outside 0..65535")
_positive_float = _number(float, "a number", lambda v: v > 0, "must be positive")


# ------------------------------------------------------------------------------------------------------- join

JOIN_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1", "port": 0, "announce": None, "initial_peers": [], "identity": None, "experts": None,
    "num_experts": None, "expert_kind": "ffn", "hidden_dim": 256, "max_batch_size": 4096, "optimizer": "adam",
    "lr": 1e-3, "checkpoint_dir": None, "checkpoint_interval": 300.0, "device": "cpu", "threads": None,
    "replicate": None, "average_every": 30.0, "log_level": "info",
}


def add_join_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults are None here so that values from --config fill what the command line left out (flags win).
    parser.add_argument("--config", type=Path, help="TOML file with any of these options (flags win)")
    parser.add_argument("--host", help="address to listen on, TCP and UDP (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, help="port to listen on, TCP and UDP (default: any free port)")
    parser.add_argument("--announce", type=_address, metavar="HOST:PORT",
                        help="address other peers should use to reach this one (default: the listen address)")
    parser.add_argument("--initial-peers", type=_address, nargs="+", metavar="HOST:PORT",
                        help="any running peers to join through; none starts a new swarm")
    parser.add_argument("--identity", type=Path, metavar="PATH",
                        help="key file (created on first run) so a restarted peer keeps its PeerID")
    parser.add_argument("--experts", metavar="PATTERN", help="experts to serve, e.g. 'ffn.[0:4].[0:4]'")
    parser.add_argument("--num-experts", type=_positive_int,
                        help="serve this many free uids of the pattern (default: all of it)")
    parser.add_argument("--expert-kind", help="ffn, transformer, or package.module:factory (default ffn)")
    parser.add_argument("--hidden-dim", type=_positive_int, help="experts' hidden size (default 256)")
    parser.add_argument("--max-batch-size", type=_positive_int, help="largest batch per expert (default 4096)")
    parser.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], help="experts' optimizer (default adam)")
    parser.add_argument("--lr", type=_positive_float, help="experts' learning rate (default 0.001)")
    parser.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                        help="save experts here periodically and on shutdown; reload them on start")
    parser.add_argument("--checkpoint-interval", type=_positive_float, help="seconds between checkpoints")
    parser.add_argument("--device", help="torch device for the experts (default cpu)")
    parser.add_argument("--threads", type=_positive_int,
                        help="torch threads for expert compute (default: torch's choice; use 1 when several "
                             "peers share a machine)")
    parser.add_argument("--replicate", action="store_true", default=None,
                        help="serve the pattern's experts even where others already do, and keep these replicas' "
                             "weights averaged with theirs (hot standby)")
    parser.add_argument("--average-every", type=_positive_float, metavar="SECONDS",
                        help="seconds between replica averaging rounds (default 30)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def load_config_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            raw = tomllib.load(file)
    except OSError as error:
        raise UsageError(f"cannot read config file {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"config file {path} is not valid TOML: {error}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in JOIN_DEFAULTS:
            raise UsageError(f"config file {path}: unknown option {key!r}")
        values[name] = value
    try:
        if isinstance(values.get("announce"), str):
            values["announce"] = parse_address(values["announce"])
        if "initial_peers" in values:
            peers = values["initial_peers"]
            values["initial_peers"] = [parse_address(p) for p in ([peers] if isinstance(peers, str) else peers)]
    except (ValueError, TypeError) as error:
        raise UsageError(f"config file {path}: {error}") from None
    for name in ("identity", "checkpoint_dir"):
        if values.get(name) is not None:
            values[name] = Path(values[name])
    return values


def join_options(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, overridden by the config file, overridden by flags."""
    options = dict(JOIN_DEFAULTS)
    if args.config is not None:
        options.update(load_config_file(args.config))
    for name in JOIN_DEFAULTS:
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    if options["experts"]:
        from moe.grid import GridPattern

        try:
            GridPattern.parse(options["experts"])
        except ValueError as error:
            raise UsageError(f"--experts {options['experts']!r}: {error}") from None
        from moe.experts import UnknownExpertKind, get_expert_kind

        try:
            get_expert_kind(options["expert_kind"])
        except (UnknownExpertKind, ValueError, ImportError) as error:
            raise UsageError(f"--expert-kind {options['expert_kind']!r}: {error}") from None
    return options


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")


async def _run_join(options: dict[str, Any]) -> int:
    from peer.daemon import Daemon, DaemonConfig

    fields = {name: value for name, value in options.items() if name != "log_level"}
    daemon = Daemon(DaemonConfig(**fields))
    async with trio.open_nursery() as nursery:
        stop = trio.Event()

        async def watch_signals(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                task_status.started()
                async for signum in signals:
                    if stop.is_set():
                        print("peer: second signal, exiting now", file=sys.stderr, flush=True)
                        os._exit(EXIT_FAILURE)
                    print(f"peer: {signal.Signals(signum).name} received, shutting down "
                          f"(checkpointing; send it again to exit at once)", file=sys.stderr, flush=True)
                    stop.set()
                    daemon_scope.cancel()

        await nursery.start(watch_signals)
        with trio.CancelScope() as daemon_scope:
            info = await nursery.start(daemon.run)
            print(f"peer {info.peer_id} listening on {info.address[0]}:{info.address[1]}", flush=True)
            if info.experts:
                print(f"serving {len(info.experts)} experts: {', '.join(info.experts)}", flush=True)
            print(f"others join with: {info.join_command}", flush=True)
            await stop.wait()
        nursery.cancel_scope.cancel()
    print("peer: stopped", file=sys.stderr, flush=True)
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    options = join_options(args)
    configure_logging(options["log_level"])
    return trio.run(_run_join, options)


# ------------------------------------------------------------------------------------------------------- status


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", type=_address, nargs="+", required=True, metavar="HOST:PORT",
                        help="any running peer of the swarm")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--timeout", type=_positive_float, default=3.0, help="seconds to wait for each peer")


async def _run_status(args: argparse.Namespace) -> int:
    from dht.node import DHTNode
    from peer.identity import Identity
    from peer.net import RealNetwork
    from peer.rpc import RPCNode
    from peer.status import format_status, gather_status, to_json

    identity = Identity.generate()
    network = RealNetwork()
    # A loopback swarm is reached from loopback; anything else from all interfaces (nothing is served).
    client_host = "127.0.0.1" if all(host.startswith("127.") for host, _ in args.initial_peers) else "0.0.0.0"
    async with RPCNode(identity, network) as rpc:
        peers = [await network.resolve(peer) for peer in args.initial_peers]
        async with DHTNode.open(client_host, 0, peers, identity=identity, network=network,
                                client_mode=True) as dht:
            status = await gather_status(rpc, dht, timeout=args.timeout, runs_reader=_runs_reader())
    print(to_json(status) if args.json else format_status(status), flush=True)
    return 0 if status["peers_reachable"] else EXIT_FAILURE


def _runs_reader() -> Any:
    try:
        from averaging.progress import list_runs
    except ImportError:
        return None
    return list_runs


def cmd_status(args: argparse.Namespace) -> int:
    configure_logging("warning")
    return trio.run(_run_status, args)


# ------------------------------------------------------------------------------------------------------- train


TRAIN_SIGNALS_EPILOG = (
    "SIGINT (Ctrl-C) or SIGTERM ends the run after the current step: it is evaluated and the result line written "
    "with \"interrupted\": true; exit status 0 for a finished run, 130 after SIGINT, 143 after SIGTERM, 1 on an "
    "error. A second signal exits at once.")


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from peer.train import add_arguments

    add_arguments(parser)


def cmd_train(args: argparse.Namespace) -> int:
    from peer.train import run_command

    configure_logging("warning")
    if not args.local_experts and not args.initial_peers:
        raise UsageError("peer train: --initial-peers HOST:PORT is required (or --local-experts for a baseline)")
    return run_command(args)  # 0, or 130 / 143 after SIGINT / SIGTERM (the result line is written first)


# ------------------------------------------------------------------------------------------------------- swarm


def add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    from peer.topology import Topology

    defaults = Topology()
    actions = parser.add_subparsers(dest="swarm_command", metavar="ACTION", parser_class=_Parser, required=True)
    up = actions.add_parser("up", help="start volunteers and trainers on this machine and train",
                            description="Start a local swarm (separate processes on 127.0.0.1), show it live, "
                                        "and print a summary when the trainers finish. Ctrl-C stops everything.",
                            epilog="Ctrl-C (SIGINT) or SIGTERM stops every process it started: the trainers "
                                   "finish their step and report (a second Ctrl-C kills at once), then the "
                                   "summary and its JSON line are printed. Exit status: 0 when every trainer "
                                   "finished, 1 when one failed, 130 after Ctrl-C (SIGINT), 143 after SIGTERM.")
    compose = actions.add_parser("compose", help="print docker/compose.yaml for the same topology")
    for sub in (up, compose):
        sub.add_argument("--volunteers", type=_positive_int, default=defaults.volunteers)
        sub.add_argument("--trainers", type=_positive_int, default=defaults.trainers)
        sub.add_argument("--experts-per-volunteer", type=_positive_int, default=defaults.experts_per_volunteer)
        sub.add_argument("--hidden-dim", type=_positive_int, default=defaults.hidden_dim)
        sub.add_argument("--steps", type=_positive_int, default=defaults.steps)
        sub.add_argument("--batch-size", type=_positive_int, default=defaults.batch_size)
        sub.add_argument("--target-batch-size", type=_positive_int, default=defaults.target_batch_size)
    up.add_argument("--kill-one-at", type=_positive_float, metavar="SECONDS",
                    help="SIGKILL one volunteer this many seconds after the trainers start training (their "
                         "first progress line; fault-tolerance demo)")
    up.add_argument("--log-dir", type=Path, help="where each process's output goes (default runs/swarm-TIME)")
    up.set_defaults(swarm_handler=_swarm_up)
    compose.set_defaults(swarm_handler=_swarm_compose)


def _topology(args: argparse.Namespace) -> Any:
    from peer.topology import Topology

    return Topology(volunteers=args.volunteers, trainers=args.trainers,
                    experts_per_volunteer=args.experts_per_volunteer, hidden_dim=args.hidden_dim, steps=args.steps,
                    batch_size=args.batch_size, target_batch_size=args.target_batch_size)


def _swarm_up(args: argparse.Namespace) -> int:
    import time as time_module

    from peer.swarm import SwarmLauncher

    log_dir = args.log_dir or Path("runs") / time_module.strftime("swarm-%Y%m%d-%H%M%S")
    launcher = SwarmLauncher(_topology(args), kill_one_at=args.kill_one_at, log_dir=log_dir)
    trio.run(launcher.run)
    return launcher.exit_code()  # 0 finished, 1 a trainer failed, 128 + N after signal N (130 for Ctrl-C)


def _swarm_compose(args: argparse.Namespace) -> int:
    from peer.topology import render_compose

    sys.stdout.write(render_compose(_topology(args)))
    return 0


def cmd_swarm(args: argparse.Namespace) -> int:
    configure_logging("warning")
    return args.swarm_handler(args)


# ------------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="peer",
        description="swarmd: decentralized peer-to-peer training (DHT, remote mixture-of-experts, averaging)",
    )
    parser.add_argument("--version", action="version", version=f"swarmd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    join = commands.add_parser("join", help="run a volunteer daemon: DHT node + expert server",
                               description="Run a volunteer daemon. With no --initial-peers it starts a new swarm "
                                           "and prints the command others use to join it.")
    add_join_arguments(join)
    join.set_defaults(handler=cmd_join)
    status = commands.add_parser("status", help="show the swarm: peers, experts, training runs",
                                 description="Attach in client mode and show every live peer of the swarm.")
    add_status_arguments(status)
    status.set_defaults(handler=cmd_status)
    train = commands.add_parser("train", help="train a model with MoE layers served by the swarm (digits)",
                                description="Example trainer: a model whose mixture-of-experts layer is served by "
                                            "the swarm, trained on scikit-learn's handwritten digits with a "
                                            "collaborative optimizer; prints JSON progress lines and a result.",
                                epilog=TRAIN_SIGNALS_EPILOG)
    train.defer(_add_train_arguments)
    train.set_defaults(handler=cmd_train)
    swarm = commands.add_parser("swarm", help="run a whole local swarm (volunteers + trainers) on this machine",
                                description="Local swarms for demos and tests.")
    add_swarm_arguments(swarm)
    swarm.set_defaults(handler=cmd_swarm)
    return parser


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def _describe(error: BaseException) -> str:
    """One line for an error that stopped a command, whatever nursery it came through."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in error.exceptions)
    if isinstance(error, OSError) and error.strerror:
        target = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror}{target}"
    return str(error) or error.__class__.__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return args.handler(args)
    except UsageError as error:
        print(f"peer: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except (Exception, BaseExceptionGroup) as error:  # the CLI's last line of defence: one line, no traceback
        from dht.errors import BootstrapFailed
        from peer.daemon import StartupError
        from peer.identity import IdentityError

        expected = (OSError, BootstrapFailed, IdentityError, ValueError, StartupError)
        if not all(isinstance(leaf, expected) for leaf in _leaves(error)):
            logging.getLogger("peer").exception("unexpected error")
        print(f"peer: error: {_describe(error)}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
