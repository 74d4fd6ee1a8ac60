"""`peer train --algorithm diloco` as processes (peer/testing/peer_processes.py): four trainers agree on the outer state
after every outer step and match a reference Nesterov step; one SIGKILLed while its part is being sent does not
stop the others; SIGINT during an outer step ends a trainer within 10 s with exit status 0."""

from __future__ import annotations

import glob
import json
import signal
import time

import pytest
import torch

from tests.averaging.diloco_sim import reference_check
from tests.peer.train_processes import diloco_daemon, diloco_trainer, train_result


@pytest.mark.slow
def test_four_trainer_processes_agree_and_match_reference_nesterov(processes, tmp_path):
    address = diloco_daemon(processes)
    trainers = [diloco_trainer(processes, address, "--inner-steps", "20", "--steps", "200", "--seed", str(i),
                               "--log-every", "20", start_with=4, hooks=["--trace", str(tmp_path)]) for i in range(4)]
    results = [train_result(t) for t in trainers]
    assert all(t.wait(30) == 0 for t in trainers)
    assert {r["outer_step"] for r in results} == {10}
    assert len({r["hash"] for r in results}) == 1
    reference_check(str(tmp_path), 10, 4)


@pytest.mark.slow
def test_trainer_killed_while_sending_its_part_the_others_finish_and_agree(processes, tmp_path):
    address = diloco_daemon(processes)
    common = ["--inner-steps", "20", "--steps", "80", "--log-every", "20"]
    victim = diloco_trainer(processes, address, *common, "--seed", "9", start_with=4, hooks=["--hold-at", "1"])
    trace = ["--trace", str(tmp_path)]
    others = [diloco_trainer(processes, address, *common, "--seed", str(i), start_with=4, hooks=trace)
              for i in range(3)]
    victim.read_until(r'"diloco_hold"', 300)
    victim.kill()  # SIGKILL while its part of outer step 2 is being sent
    hold = json.loads([line for line in victim.lines if "diloco_hold" in line][-1])
    assert (hold["outer_step"], hold["phase"]) == (1, "chunk_pushed"), hold  # the round 1 -> 2, while sending
    results = [train_result(t) for t in others]
    assert all(t.wait(30) == 0 for t in others)
    assert {r["outer_step"] for r in results} == {4}
    assert len({r["hash"] for r in results}) == 1
    # every survivor applied every outer step through the all-reduce (none missed the round the kill hit)
    records = {step: [torch.load(f, weights_only=True) for f in sorted(glob.glob(f"{tmp_path}/*.{step}.pt"))]
               for step in (1, 2, 3, 4)}
    assert {step: len(r) for step, r in records.items()} == {1: 3, 2: 3, 3: 3, 4: 3}
    survivors = {bytes.fromhex(r["peer_id"]) for r in results}
    for step, taken in records.items():
        members = {bytes(g.tolist()) for g in taken[0]["group"]}
        # steps 1 and 2 in a group of four (the victim was in the round the kill hit), later ones of three
        assert survivors <= members and len(members) == (4 if step <= 2 else 3), (step, len(members))
        assert len({r["hash"] for r in taken}) == 1
    # the round the kill hit: the survivors' own pseudo-gradients, weights renormalised over the three of them
    hit = records[2]
    weights = torch.stack([r["weight"] for r in hit])
    for index in range(len(hit[0]["own"])):
        mean = sum(w * r["own"][index] for w, r in zip(weights, hit)) / weights.sum()
        assert torch.allclose(hit[0]["averaged"][index], mean, atol=1e-6)


@pytest.mark.slow
def test_sigint_during_an_outer_step_exits_0_within_10_s(processes):
    address = diloco_daemon(processes)
    common = ["--inner-steps", "10", "--steps", "1000", "--log-every", "5"]
    frozen = diloco_trainer(processes, address, *common, "--seed", "1", start_with=2, hooks=["--hold-at", "0"])
    trainer = diloco_trainer(processes, address, *common, "--seed", "0", start_with=2)
    frozen.read_until(r'"diloco_hold"', 120)  # the other stopped in the middle of sending: we are in the round
    started = time.monotonic()
    trainer.signal(signal.SIGINT)
    assert trainer.wait(10) == 0
    assert time.monotonic() - started < 10
    frozen.kill()
