"""Expert servers in separate processes for the training fault tests: starting them on a DHT, a mixture that waits
for every expert, a training loop that counts each step's forward and backward failures, and a hook that arms a
SIGKILL inside a server's forward or backward (the tests in test_fault_process.py and test_trust_processes.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moe.beam_search import ExpertLocation
from moe.mixture import RemoteMixtureOfExperts

HIDDEN = 16
TIMEOUT = 30.0


def start_servers(harness, server_processes, count, hooked=()):
    """`count` server processes of 4 ffn experts each (ffn.0-3, ffn.4-7, ...) joining a DHT bootstrapped in the
    test process, all started at once; those in `hooked` accept `kill_in`. Returns (processes, their ready
    lines, client swarm)."""
    bootstrap = harness.dht_bootstrap()
    servers = [
        server_processes.launch([f"ffn.{4 * i + j}" for j in range(4)], "--hidden", str(HIDDEN), "--seed",
                                str(10 * i), "--lr", "0.01", "--torch-threads", "1", "--dht-peer", "%s:%d" % bootstrap,
                                phase_hooks=i in hooked)
        for i in range(count)
    ]
    infos = [server_processes.wait_ready(process, timeout=120.0) for process in servers]
    return servers, infos, harness.client()


def mixture(swarm, experts):
    # k_best=5 over servers of 4 experts: every sample has experts on at least two servers. The grace period is
    # the whole timeout, so every call is waited for: an armed server is always in the step (see module doc).
    return RemoteMixtureOfExperts(HIDDEN, (experts,), "ffn", k_best=5, k_min=1, forward_timeout=TIMEOUT,
                                  timeout_after_k_min=TIMEOUT, backward_timeout=TIMEOUT, swarm=swarm)


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    # per step: failures the client counted during that step's forward and during its backward
    forward_failures: list[float] = field(default_factory=list)
    backward_failures: list[float] = field(default_factory=list)


def train(moe, steps, before_forward=None, before_backward=None, after_backward=None) -> Run:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(HIDDEN, 32), nn.Tanh(), nn.Linear(32, HIDDEN))
    xs = torch.randn(512, HIDDEN)
    with torch.no_grad():
        ys = teacher(xs)
    head = nn.Linear(HIDDEN, HIDDEN)
    opt = torch.optim.Adam([*moe.parameters(), *head.parameters()], lr=0.01)
    run = Run()
    stats = moe.client.stats
    for step in range(steps):
        batch = slice((step * 32) % 512, (step * 32) % 512 + 32)
        if before_forward:
            before_forward(step)
        start = dict(stats)
        loss = ((head(moe(xs[batch])) - ys[batch]) ** 2).mean()
        middle = dict(stats)
        if before_backward:
            before_backward(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_backward:
            after_backward(step)
        run.losses.append(loss.item())
        run.forward_failures.append(middle["forward_failures"] - start["forward_failures"])
        run.backward_failures.append(stats["backward_failures"] - middle["backward_failures"])
        assert middle["backward_failures"] == start["backward_failures"]  # no backward inside a forward
        assert stats["forward_failures"] == middle["forward_failures"]  # no forward inside a backward
    assert all(torch.isfinite(torch.tensor(run.losses)))
    return run


def mean(values):
    return sum(values) / len(values)


def banned(moe, swarm, info, uids) -> bool:
    """Whether the client banned the server at `info` for all of `uids` (a lost connection bans the address)."""
    location = ExpertLocation(info["address"][0], info["address"][1], info["peer_id"])

    async def check() -> bool:
        return all(moe.client.blacklist.is_banned(uid, location) for uid in uids)

    return swarm.bridge.run(check)


def server_uids(index):
    return [f"ffn.{4 * index + j}" for j in range(4)]


def armed_kill(server_processes, server, phase, at):
    """A hook for `train` that arms `server` to be SIGKILLed inside its `phase` ("forward" or "backward") of step
    `at`, and the dict where the kill lands (`kills[at]`, with `entered`, `killed` and `uid`)."""
    kills = {}

    def arm(step):
        if step == at:
            kills[step] = server_processes.kill_in(server, phase)

    return arm, kills
