"""`peer train` with test hooks: `python -m peer.testing.trainer [hook options] -- <peer train arguments>`.

Why a separate entry point: the hooks (`averaging.diloco.DiLoCoHooks`) change what a trainer does (freeze it at a
chosen moment, make it Byzantine, slow it down), so no flag of `peer train` and no environment variable read by
product code may reach them. Tests and benchmarks start this module instead, which builds the hooks from its
own options and hands them to `peer.train.main`.

    --hold-at N       freeze the trainer while its part of outer round N is being sent (then kill it)
    --trace DIR       save every outer step there (torch.save, tensors only)
    --scale X         send X times the pseudo-gradient (a Byzantine trainer)
    --slowdown F      compute takes F times longer
    --stamp-offers    with --overlap, `since_offer` of `outer_round` lines counts from the offer (see `patch`)
    --open-race       answer a round's opening "coming" while my offer to it is on its way (see `patch`)
    --log-level L     log the product's messages at level L to stderr (`peer train` itself configures none)
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(hook options, the `peer train` arguments after `--`)."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m peer.testing.trainer")
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--stamp-offers", action="store_true")
    parser.add_argument("--open-race", action="store_true")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def patch(*, stamp_offers: bool = False, open_race: bool = False) -> None:
    """Workarounds, for the harness only, of two faults of `averaging.diloco` (benchmarks/README.md, "WAN
    scenarios", has the evidence); each leaves the product's code as it is. `peer.train` imports the optimizer
    class when it builds one, so a subclass put in its place here is what it builds.

    stamp_offers: `_Contribution.started` is set only on the blocking path (`_timed_contribute`); with --overlap it
    stays 0.0 and every `since_offer` is the trio clock itself (tens of thousands of seconds). The subclass stamps
    a background contribution when it is offered, so `since_offer` is the time from the offer to the round's end.

    open_race: `_on_open` answers a coordinator's "the window of round N opened" with "not coming" while this
    trainer's own offer to round N is on its way (`_next_round()` is then N + 1). The coordinator takes that as a
    trainer that will not come and drops it from the expected set; when it was the only other one, the round
    starts "all ready" with the coordinator alone, the offer arrives 30 ms later and is late, and the lone member
    skips the round (it had no other member) and offers to it again, forever: the run stops. The subclass answers
    "coming" while its offer to that round is in flight."""
    import trio

    from averaging import diloco

    base = diloco.DiLoCoOptimizer
    if getattr(base, "harness_patch", None) == (stamp_offers, open_race):
        return

    class Patched(base):  # type: ignore[valid-type,misc]  # a subclass of a class bound at run time
        harness_patch = (stamp_offers, open_race)

        async def _start_background(self, contribution: Any) -> None:
            if stamp_offers:
                contribution.started = trio.current_time()
            await super()._start_background(contribution)

        def _on_open(self, step: int, closes_in: float) -> bool:
            coming = bool(super()._on_open(step, closes_in))
            if open_race and not coming and step == self._inflight_round and not self._finishing:
                return True  # my offer to that very round is on its way
            return coming

    setattr(diloco, "DiLoCoOptimizer", Patched)  # noqa: B010  # replaced on purpose, see the docstring


def main(argv: Sequence[str] | None = None) -> int:
    from averaging.diloco import DiLoCoHooks
    from peer import train

    options, rest = parse(sys.argv[1:] if argv is None else argv)
    if options.log_level:
        logging.basicConfig(level=getattr(logging, options.log_level.upper()), stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if options.stamp_offers or options.open_race:
        patch(stamp_offers=options.stamp_offers, open_race=options.open_race)
    hooks = DiLoCoHooks(hold_at=options.hold_at, trace_dir=options.trace, scale_pseudo_gradient=options.scale,
                        slowdown=options.slowdown)
    return train.main(rest, hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())
