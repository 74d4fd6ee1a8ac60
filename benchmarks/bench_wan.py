"""DiLoCo training that never waits, measured on the WAN testbed (`peer.testing.scenario`): real `peer train
--algorithm diloco --overlap --compression int8` processes and `peer join` daemons, each on its own emulated
host, under churn. Needs root and iproute2 (`peer.testing.wan.available()`); prints why not otherwise.

With no arguments it runs five scenarios (each 4 trainers + 2 daemons, 12 outer steps of 20 inner steps, the
digits model of `peer.testing.scenario.Model`: one inner step >= 50 ms on one core here) and ends with ONE JSON
line holding every key:

- home profile, a SIGKILL every outer step and a fresh join every two (`home-churn`): `goodput` (mean over the
  trainers that finished; target >= 0.92); `metric_gap_relative` = |accuracy - accuracy of the same run without
  churn (`home-calm`)| / the latter (target <= 0.01); `joiner_first_contribution_outer_steps`: the worst joiner,
  counted from the outer state it joined at, as the trainer reports it (target <= 2; the same counted from the
  joiner's process start, in outer steps of the swarm and seconds, beside it);
- intercontinental, no churn: `goodput_intercontinental` (target >= 0.95); `round_rtts`: per round, (time from
  ready to applied - transfer time) / RTT, median over the rounds (target <= 8; `round_rtts_max` beside it).
  Ready to applied: the smallest `since_offer` of the round's members (the last one to offer; `since_offer` is
  counted from the offer). Transfer: that member's bytes sent per
  averaged round (its `bytes_sent` / its averaged rounds) over its uplink (100 Mbit/s); RTT 150 ms
  (`ScenarioResult.round_rtts`);
- home, one trainer 3x slower (`home-slow`): `goodput_fast_peers`, mean goodput of the others (target >= 0.92;
  `goodput_fast_peers_reference` is theirs in `home-calm`), and the slow one's samples counted in rounds
  (`slow_peer_samples_counted`, `slow_peer_cut_short`: phases it ended early so its work made the window);
- home with `--fragments 4` (`home-f4`): `peak_bandwidth_ratio_f4` = the most a trainer sent in one outer round
  (mean over trainers; each round's `bytes_sent` in its outer_round events) with --fragments 4 over `home-calm`'s.
  That is Streaming DiLoCo's peak bandwidth: a sync must be sent within the inner steps it overlaps, the same
  number with or without fragments, so the bytes/s it needs scale with its bytes per sync.
  `metric_gap_relative_f4`: its held-out accuracy against `home-calm`'s. `peak_link_ratio_f4` beside it: the same
  ratio of the peak bytes/s over 1 s windows of the interface counters (sampled every 100 ms,
  `peer.testing.bandwidth`), which cannot show it on a capped link: both runs send at the 20 Mbit/s cap while they
  send, and this model's fragment rounds come every 5 inner steps (0.25 s), so a 1 s window holds all four.

`hash_conflicts` counts outer steps at which two trainers held different outer states (any run); `errors` names
runs that failed (their keys are null). One scenario alone, its own figures on the JSON line:

    .venv/bin/python benchmarks/bench_wan.py --profile home --churn kill-every-outer-step
        [--churn none|kill-every-outer-step|stop|slow] [--fragments N] [--outer-steps 12] [--inner-steps 20]
        [--seed 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer.testing.scenario import Scenario, ScenarioError, ScenarioResult, run_scenario  # noqa: E402
from peer.testing.wan import available  # noqa: E402

CHURN = {
    "none": {},
    "kill-every-outer-step": {"kill_every": 1, "join_every": 2},
    "stop": {"stop_at": 3, "stop_for": 3},
    "slow": {"slowdown": 3.0},
}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(name: str, options: argparse.Namespace, **fields: Any) -> tuple[ScenarioResult | None, str | None]:
    """One scenario; (result, None) or (None, why it failed)."""
    scenario = Scenario(name, outer_steps=options.outer_steps, inner_steps=options.inner_steps, seed=options.seed,
                        **fields)
    log(f"== {name}: {fields or 'no churn'}")
    started = time.monotonic()
    try:
        result = run_scenario(scenario, log=log)
    except ScenarioError as error:
        log(f"== {name} FAILED after {time.monotonic() - started:.0f} s: {error}")
        return None, f"{name}: {error}"
    log(f"== {name}: {result.seconds:.0f} s, goodput {_fmt(result.goodput)}, accuracy {_fmt(result.accuracy)}, "
        f"outer steps agreed {len(result.hashes_by_step()) - len(result.hash_conflicts())}"
        f"/{len(result.hashes_by_step())}; logs in {result.workdir}")
    return result, None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def figures(result: ScenarioResult | None) -> dict[str, Any]:
    """One run's figures for the JSON line."""
    if result is None:
        return {}
    joiners = [t for t in result.trainers.values() if t.joiner and t.first_contribution]
    peaks = [t.peak_sent_bytes_s for t in result.trainers.values() if t.finished]
    round_peaks = [t.peak_round_bytes_sent for t in result.trainers.values() if t.finished]
    return {
        "goodput": _round(result.goodput), "accuracy": _round(result.accuracy),
        "hash_conflicts": len(result.hash_conflicts()), "seconds": round(result.seconds, 1),
        "survivors_reached_end": all(t.reached_end for t in result.trainers.values() if not t.killed),
        "joiner_first_contribution_outer_steps": max(
            (t.first_contribution["outer_steps"] for t in joiners
             if t.first_contribution and t.first_contribution.get("outer_steps") is not None), default=None),
        "joiner_first_contribution_since_spawn_outer_steps": max(
            (t.first_contribution_since_spawn["outer_steps"] for t in joiners if t.first_contribution_since_spawn),
            default=None),
        "joiner_first_contribution_since_spawn_seconds": max(
            (t.first_contribution_since_spawn["seconds"] for t in joiners if t.first_contribution_since_spawn),
            default=None),
        "kills": len([a for a in result.applied if a["kind"] == "kill" and a["outcome"] == "done"]),
        "kills_skipped": len([a for a in result.applied if a["kind"] == "kill" and a["outcome"] == "skipped"]),
        "lost_rounds": sum(t.lost_rounds for t in result.trainers.values()),
        "peak_sent_bytes_s": _round(sum(peaks) / len(peaks), 1) if peaks else None,
        "peak_round_bytes_sent": round(sum(round_peaks) / len(round_peaks)) if round_peaks else None,
        "round_rtts": result.round_rtts()["median"], "round_rtts_max": result.round_rtts()["max"],
        "trainers": {n: {"goodput": t.goodput, "accuracy": t.accuracy, "outer_step": t.outer_step,
                         "killed": t.killed, "first_contribution": t.first_contribution,
                         "samples_counted": t.samples_counted, "cut_short": t.cut_short}
                     for n, t in result.trainers.items()},
    }


def all_scenarios(options: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, ScenarioResult | None] = {}
    errors = []
    plan = [("home-calm", {"profile": "home"}),
            ("home-churn", {"profile": "home", **CHURN["kill-every-outer-step"]}),
            ("intercontinental-calm", {"profile": "intercontinental"}),
            ("home-slow", {"profile": "home", **CHURN["slow"]}),
            ("home-f4", {"profile": "home", "fragments": 4})]
    for name, fields in plan:
        results[name], error = run(name, options, **fields)
        if error:
            errors.append(error)
    calm, churn, far = results["home-calm"], results["home-churn"], results["intercontinental-calm"]
    slow, f4 = results["home-slow"], results["home-f4"]
    churned, reference = figures(churn), figures(calm)
    gap = None
    if churned.get("accuracy") is not None and reference.get("accuracy"):
        gap = round(abs(churned["accuracy"] - reference["accuracy"]) / reference["accuracy"], 4)
    others = ["t1", "t2", "t3"]
    ratio = link_ratio = gap_f4 = None
    fragmented = figures(f4)
    if f4 is not None and calm is not None:
        peak_f4, peak_f1 = fragmented["peak_round_bytes_sent"], reference["peak_round_bytes_sent"]
        ratio = round(peak_f4 / peak_f1, 3) if peak_f4 and peak_f1 else None
        link_f4, link_f1 = fragmented["peak_sent_bytes_s"], reference["peak_sent_bytes_s"]
        link_ratio = round(link_f4 / link_f1, 3) if link_f4 and link_f1 else None
        if fragmented.get("accuracy") is not None and reference.get("accuracy"):
            gap_f4 = round(abs(fragmented["accuracy"] - reference["accuracy"]) / reference["accuracy"], 4)
    return {
        "goodput": churned.get("goodput"),
        "metric_gap_relative": gap,
        "metric": churned.get("accuracy"), "metric_no_churn": reference.get("accuracy"),
        "joiner_first_contribution_outer_steps": churned.get("joiner_first_contribution_outer_steps"),
        "joiner_first_contribution_since_spawn_outer_steps":
            churned.get("joiner_first_contribution_since_spawn_outer_steps"),
        "joiner_first_contribution_since_spawn_seconds": churned.get("joiner_first_contribution_since_spawn_seconds"),
        "goodput_no_churn": reference.get("goodput"),
        "goodput_intercontinental": figures(far).get("goodput"),
        "round_rtts": figures(far).get("round_rtts"), "round_rtts_max": figures(far).get("round_rtts_max"),
        "goodput_fast_peers": _round(slow.mean("goodput", others)) if slow else None,
        "goodput_fast_peers_reference": _round(calm.mean("goodput", others)) if calm else None,
        "slow_peer_samples_counted": slow.trainers["t0"].samples_counted if slow else None,
        "slow_peer_cut_short": slow.trainers["t0"].cut_short if slow else None,
        "peak_bandwidth_ratio_f4": ratio, "metric_gap_relative_f4": gap_f4,
        "peak_round_bytes_sent_f1": reference.get("peak_round_bytes_sent"),
        "peak_round_bytes_sent_f4": fragmented.get("peak_round_bytes_sent"),
        "peak_link_ratio_f4": link_ratio,
        "peak_sent_bytes_s_f1": reference.get("peak_sent_bytes_s"),
        "peak_sent_bytes_s_f4": fragmented.get("peak_sent_bytes_s"),
        "hash_conflicts": sum(figures(r).get("hash_conflicts", 0) for r in results.values()),
        "survivors_reached_end": {n: figures(r).get("survivors_reached_end") for n, r in results.items()},
        "kills": churned.get("kills"), "kills_skipped": churned.get("kills_skipped"),
        "seconds": {n: figures(r).get("seconds") for n, r in results.items()},
        "errors": errors,
        "runs": {n: figures(r) for n, r in results.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=["lan", "home", "intercontinental", "mixed"], default=None)
    parser.add_argument("--churn", choices=sorted(CHURN), default=None)
    parser.add_argument("--fragments", type=int, default=None)
    parser.add_argument("--outer-steps", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args()
    ok, why = available()
    if not ok:
        print(json.dumps({"error": f"the WAN testbed cannot run here: {why}"}))
        return 1
    started = time.monotonic()
    if options.profile is None and options.churn is None and options.fragments is None:
        line = all_scenarios(options)
    else:
        profile, churn = options.profile or "home", options.churn or "none"
        fields: dict[str, Any] = {"profile": profile, **CHURN[churn]}
        if options.fragments is not None:
            fields["fragments"] = options.fragments
        result, error = run(f"{profile}-{churn}", options, **fields)
        line = {**figures(result), "profile": profile, "churn": churn, "fragments": options.fragments,
                "errors": [error] if error else []}
    line.update({"total_seconds": round(time.monotonic() - started, 1),
                 "machine": f"{platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}",
                 "date": datetime.date.today().isoformat()})
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
