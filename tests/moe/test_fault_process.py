"""Expert servers in separate processes, SIGKILLed while a model trains through a RemoteMixtureOfExperts: one dies
inside a backward it is computing, one inside a forward, one between two steps (before a forward). Every step
completes, and training goes on with the experts that are left.

The kills land where each test says: a server started with phase hooks announces on stdout that it is inside a
forward or backward computation (and stays there), and a watcher thread SIGKILLs it at that line, while the
trainer is still waiting for that server's answer. The tests then check, per step and phase, which failures the
trainer saw. The mixture waits for every expert (`timeout_after_k_min` = the full timeout), so an armed server is
always part of the step it is armed for, however slow a loaded machine makes it."""

from __future__ import annotations

import pytest

from tests.moe.process_training import TIMEOUT, armed_kill, banned, mean, mixture, server_uids, start_servers, train

# per phase: the `train` hook that arms the kill and the one that checks it landed while the client waited; the
# kill lands after step 10's forward returned from both servers (mid-backward) or inside that forward
KILL_HOOKS = {"backward": ("before_backward", "after_backward"), "forward": ("before_forward", "before_backward")}


@pytest.mark.parametrize("phase", ["backward", "forward"])
def test_training_survives_a_server_process_killed_mid_phase(dht_harness, server_processes, phase):
    """Killed mid-backward: the step's forward succeeded everywhere and its backward lost the dead server's experts.
    Killed mid-forward: the forward lost them, yet the step ran (k_min), and the backward only asks the experts
    that answered. Either way nothing failed before, the dead server is banned and the survivor keeps learning."""
    servers, infos, swarm = start_servers(dht_harness, server_processes, 2, hooked={1})
    moe = mixture(swarm, 8)
    arm, kills = armed_kill(server_processes, servers[1], phase, at=10)

    def landed(step):
        if step == 10:
            assert kills[10].entered.is_set()  # inside this step's phase, while the client waited for it

    arm_at, check_at = KILL_HOOKS[phase]
    run = train(moe, 30, **{arm_at: arm, check_at: landed})
    assert kills[10].killed.wait(TIMEOUT) and kills[10].uid in server_uids(1)
    failures = {"forward": run.forward_failures[10], "backward": run.backward_failures[10]}
    other = "forward" if phase == "backward" else "backward"
    assert failures[phase] >= 1, failures  # the killed phase lost the dead server's experts
    assert failures[other] == 0, failures  # and the other phase of that step lost nothing
    assert sum(run.forward_failures[:10]) == sum(run.backward_failures[:10]) == 0  # nothing failed before
    assert banned(moe, swarm, infos[1], server_uids(1)) and not banned(moe, swarm, infos[0], server_uids(0))
    assert mean(run.losses[-5:]) < mean(run.losses[10:15])  # the survivor keeps learning
    assert mean(run.losses[-5:]) < 0.6 * mean(run.losses[:5])


@pytest.mark.slow
def test_training_survives_server_processes_killed_mid_backward_and_before_forward(dht_harness, server_processes):
    servers, infos, swarm = start_servers(dht_harness, server_processes, 3, hooked={1})
    moe = mixture(swarm, 12)
    arm, kills = armed_kill(server_processes, servers[1], "backward", at=10)

    def after(step):
        if step == 10:
            assert kills[10].entered.is_set()
        if step == 20:  # between two steps; its experts are still in the DHT when the next forward searches
            servers[2].kill()
            servers[2].wait()

    run = train(moe, 40, before_backward=arm, after_backward=after)
    assert kills[10].killed.wait(TIMEOUT) and kills[10].uid in server_uids(1)
    assert run.forward_failures[10] == 0 and run.backward_failures[10] >= 1
    assert run.forward_failures[21] >= 1 and run.backward_failures[21] == 0  # found dead at the next forward
    assert sum(run.forward_failures[11:21]) == sum(run.backward_failures[11:21]) == 0  # server 1 was avoided
    assert banned(moe, swarm, infos[1], server_uids(1)) and banned(moe, swarm, infos[2], server_uids(2))
    assert not banned(moe, swarm, infos[0], server_uids(0))
    assert mean(run.losses[-5:]) < mean(run.losses[21:26])
    assert mean(run.losses[-5:]) < 0.6 * mean(run.losses[:5])
