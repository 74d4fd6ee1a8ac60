"""`peer train` with test hooks: `python -m peer.testing.trainer [hook options] -- <peer train arguments>`.

Why a separate entry point: the hooks (`averaging.diloco.DiLoCoHooks`) change what a trainer does (freeze it at a
chosen moment, make it Byzantine, slow it down), so no flag of `peer train` and no environment variable read by
product code may reach them. Tests and benchmarks start this module instead, which builds the hooks from its
own options and hands them to `peer.train.main`.

    --hold-at N       freeze the trainer while its part of outer round N is being sent (then kill it)
    --trace DIR       save every outer step there (torch.save, tensors only)
    --scale X         send X times the pseudo-gradient (a Byzantine trainer)
    --slowdown F      compute takes F times longer
    --log-level L     log the product's messages at level L to stderr (`peer train` itself configures none)
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(hook options, the `peer train` arguments after `--`)."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m peer.testing.trainer")
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--full-phases", action="store_true")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    from averaging.diloco import DiLoCoHooks
    from peer import train

    options, rest = parse(sys.argv[1:] if argv is None else argv)
    if options.log_level:
        logging.basicConfig(level=getattr(logging, options.log_level.upper()), stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hooks = DiLoCoHooks(hold_at=options.hold_at, trace_dir=options.trace, scale_pseudo_gradient=options.scale,
                        slowdown=options.slowdown, full_phases=options.full_phases)
    return train.main(rest, hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())
