"""Nothing silent (issue 38), DiLoCo: two trainers of one run with different models each log ONE line naming the
difference (the tensor and both shapes), never wait for, average with or download from each other (each goes on
alone), and `peer train`'s end-of-run check (`_never_averaged_for_mismatch`) finds the mismatch on both sides."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from averaging.schema import MISMATCHES
from peer.p2p.bridge import Bridge
from peer.p2p.net import MemoryNetwork
from peer.train import _never_averaged_for_mismatch
from tests.averaging.diloco_sim import SimSwarm, close_all, make_trainer, run_threads, start_swarm, train_steps


def test_mismatched_diloco_models_are_named_once_on_both_sides(caplog):
    caplog.set_level(logging.WARNING)
    MISMATCHES.seen.clear()
    mark = MISMATCHES.mark()
    with Bridge.start() as bridge:
        peers = start_swarm(bridge, MemoryNetwork(latency=0.002), 2)
        torch.manual_seed(0)
        models = [nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 2)) for width in (8, 9)]
        made = [make_trainer(SimSwarm(bridge, peer), model, averaging_timeout=4.0, load_state_timeout=4.0)
                for peer, model in zip(peers, models)]
        try:
            run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 15, seed=i) for i, (m, o) in enumerate(made)])
            deadline = time.monotonic() + 60
            while len(MISMATCHES.seen) < 2 and time.monotonic() < deadline:  # each side reads the other's record
                time.sleep(0.05)
            stats = [opt.stats() for _, opt in made]
        finally:
            close_all(made)
    named = [r.getMessage() for r in caplog.records if "not averaging with it" in r.getMessage()]
    assert len(named) == 2, named  # one line per side, not one per round
    assert sorted(line.split("(")[1] for line in named) == [
        "pseudo.0: shape [8, 6] there, [9, 6] here); not averaging with it",
        "pseudo.0: shape [9, 6] there, [8, 6] here); not averaging with it"], named
    for stat in stats:
        assert stat["outer_step"] == 3  # each went on alone: nobody waited for a trainer it can never average with
        assert not any(int(size) > 1 for size in stat["group_sizes"]), stat["group_sizes"]
        assert stat["state_loads"] == 0
        assert _never_averaged_for_mismatch(stat, mark) is not None
    MISMATCHES.seen.clear()


def test_trainers_that_start_from_different_weights_converge_on_one_state():
    """Same model, different initial weights (each seeded its own, as threads sharing torch's global seed do by
    accident): the first trainers agree on one state before their first step (a tie of one hash each is broken the
    same way on every side, never 'mine'), so they average from the first round and end with one hash."""
    with Bridge.start() as bridge:
        peers = start_swarm(bridge, MemoryNetwork(latency=0.002), 2)
        models = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            models.append(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)))
        swarms = [SimSwarm(bridge, peer) for peer in peers]
        made: dict[int, tuple] = {}
        run_threads([lambda i=i: made.__setitem__(i, make_trainer(swarms[i], models[i], start_with=2))
                     for i in range(2)])
        pairs = [made[0], made[1]]
        try:
            run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 15, seed=i) for i, (m, o) in enumerate(pairs)])
            assert {opt.outer_step for _, opt in pairs} == {3}
            assert len({opt.hash for _, opt in pairs}) == 1
            assert all(opt.stats()["group_sizes"].get(2, 0) >= 2 for _, opt in pairs)
        finally:
            close_all(pairs)
