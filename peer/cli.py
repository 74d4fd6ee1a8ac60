"""The `peer` command line: `join` runs a volunteer daemon, `status` shows the swarm, `dashboard` serves a live
web page of it, `train` is the example trainer, `swarm up/compose` runs a local swarm or writes its compose file,
`keygen` writes a private swarm's key.

Every failure a user can cause (bad option, port in use, unreachable bootstrap peer, bad key file, unwritable
checkpoint directory) ends with one line on stderr and a non-zero exit code, never a traceback: 2 for usage
errors, 1 otherwise. The options themselves (flags, config-file keys, defaults) are defined in peer/options.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from peer import __version__
from peer.options import (
    DASHBOARD,
    JOIN,
    KEYGEN,
    STATUS,
    SWARM_COMPOSE,
    SWARM_UP,
    TRAIN,
    TRAIN_SIGNALS_EPILOG,
    OptionParser,
    UsageError,
)

if TYPE_CHECKING:  # the daemon imports torch: only the type, at parse time
    from peer.daemon import DaemonInfo

# Parsing the command line imports nothing heavy (no torch, no trio): `peer --version` and `--help` answer at once;
# each command imports what it runs.

EXIT_USAGE = 2
EXIT_FAILURE = 1

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "UsageError", "build_parser", "join_options", "main"]


# ------------------------------------------------------------------------------------------------------- join


def join_options(args: argparse.Namespace) -> dict[str, Any]:
    """The DaemonConfig fields (and the log level) of a parsed `peer join`."""
    return {name: getattr(args, name) for name in JOIN.defaults()}


def print_serving(info: DaemonInfo) -> None:
    """The join line naming the served experts (`peer swarm up`'s live view parses it: peer/swarm.py)."""
    for note in info.notes:
        print(note, flush=True)
    if info.experts:
        print(f"serving {len(info.experts)} experts: {', '.join(info.experts)} "
              f"(of {info.pattern}, hidden {info.hidden_dim}, {info.expert_kind})", flush=True)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")


async def _run_join(options: dict[str, Any]) -> int:
    import trio

    from peer.daemon import Daemon, DaemonConfig

    fields = {name: value for name, value in options.items() if name != "log_level"}
    daemon = Daemon(DaemonConfig(**fields))
    async with trio.open_nursery() as nursery:
        stop = trio.Event()

        async def watch_signals(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
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
            print(f"reachability: {info.reachability}", flush=True)
            print_serving(info)
            if info.metrics_address is not None:
                print(f"metrics at http://{info.metrics_address[0]}:{info.metrics_address[1]}/metrics", flush=True)
            print(f"others join with: {info.join_command}", flush=True)
            from peer.events import event_line, joined_event

            print(event_line(joined_event(info)), flush=True)  # the same, for programs (docs/reference/events.md)
            await stop.wait()
        nursery.cancel_scope.cancel()
    server = daemon.expert_server
    if server is not None and server.checkpoint_error is not None:
        raise server.checkpoint_error  # the final checkpoint failed: weights are lost, so not exit 0
    print("peer: stopped", file=sys.stderr, flush=True)
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    import trio

    options = join_options(args)
    configure_logging(options["log_level"])
    return trio.run(_run_join, options)


# ------------------------------------------------------------------------------------------------------- status


async def _run_status(args: argparse.Namespace) -> int:
    from peer.client import open_client_peer
    from peer.p2p.identity import load_membership
    from peer.status import format_status, gather_status, to_json

    swarm_key, _ = load_membership(args.swarm_key, None)
    async with open_client_peer(args.initial_peers, secure=not args.insecure_transport,
                                swarm_key=swarm_key) as (rpc, dht):
        status = await gather_status(rpc, dht, timeout=args.timeout, runs_reader=_runs_reader(), read_bans=True)
    print(to_json(status) if args.json else format_status(status), flush=True)
    return 0 if status["peers_reachable"] else EXIT_FAILURE


def _runs_reader() -> Any:
    try:
        from averaging.progress import list_runs
    except ImportError:
        return None
    return list_runs


def cmd_status(args: argparse.Namespace) -> int:
    import trio

    configure_logging("warning")
    return trio.run(_run_status, args)


# ------------------------------------------------------------------------------------------------------- keygen


def cmd_keygen(args: argparse.Namespace) -> int:
    """A fresh random swarm key, written 0600; an existing file is kept unless --force (whoever still holds the
    old key would be cut off, and a lost key cannot be recovered)."""
    from peer.p2p.identity import SwarmKey

    SwarmKey.generate().save(args.swarm_key, overwrite=args.force)
    print(f"wrote a new swarm key to {args.swarm_key} (mode 0600): copy it to every member of the private swarm "
          f"over a channel you trust; each passes --swarm-key FILE", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------- train


def cmd_train(args: argparse.Namespace) -> int:
    from peer.train import run_command

    configure_logging("warning")
    if not args.local_experts and not args.initial_peers and args.model is None:
        raise UsageError("peer train: --initial-peers HOST:PORT is required (or --local-experts for a baseline, "
                         "or --model to train your model alone)")
    return run_command(args)  # 0, or 130 / 143 after SIGINT / SIGTERM (the result line is written first)


# ------------------------------------------------------------------------------------------------------- swarm


def add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="swarm_command", metavar="ACTION", parser_class=OptionParser, required=True)
    up = actions.add_parser("up", help="start volunteers and trainers on this machine and train",
                            description="Start a local swarm (separate processes on 127.0.0.1), show it live, "
                                        "and print a summary when the trainers finish. Ctrl-C stops everything.",
                            epilog="Ctrl-C (SIGINT) or SIGTERM stops every process it started: the trainers "
                                   "finish their step and report (a second Ctrl-C kills at once), then the "
                                   "summary and its JSON line are printed. Exit status: 0 when every trainer "
                                   "finished, 1 when one failed, 130 after Ctrl-C (SIGINT), 143 after SIGTERM.")
    SWARM_UP.add_to(up)
    up.set_defaults(swarm_handler=_swarm_up)
    compose = actions.add_parser("compose", help="print docker/compose.yaml for the same topology",
                                 description="Print docker/compose.yaml for the topology `peer swarm up` would "
                                             "start with the same options.")
    SWARM_COMPOSE.add_to(compose)
    compose.set_defaults(swarm_handler=_swarm_compose)


def _topology(args: argparse.Namespace) -> Any:
    from peer.topology import Topology

    return Topology(volunteers=args.volunteers, trainers=args.trainers,
                    experts_per_volunteer=args.experts_per_volunteer, hidden_dim=args.hidden_dim, steps=args.steps,
                    batch_size=args.batch_size, target_batch_size=args.target_batch_size, task=args.task,
                    private_volunteers=args.private_volunteers)


def _swarm_up(args: argparse.Namespace) -> int:
    import time as time_module

    import trio

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
    handler: Callable[[argparse.Namespace], int] = args.swarm_handler
    return handler(args)


# ------------------------------------------------------------------------------------------------------- dashboard


def cmd_dashboard(args: argparse.Namespace) -> int:
    import trio

    from peer.dashboard.server import run_dashboard

    configure_logging("warning")
    trio.run(run_dashboard, args)  # returns after SIGINT / SIGTERM
    print("peer: dashboard stopped", file=sys.stderr, flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(
        prog="peer",
        description="swarmd: decentralized peer-to-peer training (DHT, remote mixture-of-experts, averaging)",
    )
    parser.add_argument("--version", action="version", version=f"swarmd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OptionParser)
    _add_command(commands, "join", JOIN.add_to, cmd_join, help="run a volunteer daemon: DHT node + expert server",
                 description="Run a volunteer daemon. With no --initial-peers it starts a new swarm and prints the "
                             "command others use to join it.")
    _add_command(commands, "status", STATUS.add_to, cmd_status, help="show the swarm: peers, experts, training runs",
                 description="Attach in client mode and show every live peer of the swarm.")
    _add_command(commands, "train", TRAIN.add_to, cmd_train,
                 help="train a model with MoE layers served by the swarm (digits)",
                 description="Example trainer: a model whose mixture-of-experts layer is served by the swarm, "
                             "trained on scikit-learn's handwritten digits with a collaborative optimizer; prints "
                             "JSON progress lines and a result.",
                 epilog=TRAIN_SIGNALS_EPILOG)
    _add_command(commands, "dashboard", DASHBOARD.add_to, cmd_dashboard,
                 help="serve a live web page of the swarm (and its state as JSON)",
                 description="Attach in client mode and serve a web page that shows the swarm live: peers, experts, "
                             "training runs, failures; the same data at /api/v1/state.")
    _add_command(commands, "keygen", KEYGEN.add_to, cmd_keygen, help="write a private swarm's key (--swarm-key FILE)",
                 description="Write a fresh random swarm key (mode 0600). Peers started with --swarm-key FILE form a "
                             "private swarm: only holders of the key complete an RPC handshake or get an answer from "
                             "the DHT.")
    _add_command(commands, "swarm", add_swarm_arguments, cmd_swarm,
                 help="run a whole local swarm (volunteers + trainers) on this machine",
                 description="Local swarms for demos and tests.")
    return parser


def _add_command(commands: argparse._SubParsersAction[OptionParser], name: str,
                 add_arguments: Callable[[argparse.ArgumentParser], None],
                 handler: Callable[[argparse.Namespace], int], *, help: str, description: str,
                 epilog: str | None = None) -> None:
    """One `peer` command: its parser and texts, its arguments, and the handler `main` runs for it; every command
    is declared the same way, so none can miss its handler."""
    command = commands.add_parser(name, help=help, description=description, epilog=epilog)
    add_arguments(command)
    command.set_defaults(handler=handler)


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
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except UsageError as error:
        print(f"peer: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except (Exception, BaseExceptionGroup) as error:  # the CLI's last line of defence: one line, no traceback
        from averaging.diloco import NotAgreed
        from dht.errors import BootstrapFailed
        from moe.errors import CheckpointError
        from peer.daemon import StartupError
        from peer.p2p.identity import IdentityError
        from peer.train import TrainingFailed

        expected = (OSError, BootstrapFailed, IdentityError, ValueError, StartupError, CheckpointError,
                    TrainingFailed, NotAgreed)
        if not all(isinstance(leaf, expected) for leaf in _leaves(error)):
            logging.getLogger("peer").exception("unexpected error")
        print(f"peer: error: {_describe(error)}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
