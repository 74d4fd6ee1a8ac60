"""Expert servers in separate processes, SIGKILLed while a model trains through a RemoteMixtureOfExperts: one dies
between a step's forward and its backward, another before a step's forward. Every step completes, and training
goes on with the experts that are left."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe.mixture import RemoteMixtureOfExperts

HIDDEN = 16


def start_servers(harness, server_processes, count):
    """`count` server processes of 4 ffn experts each (ffn.0-3, ffn.4-7, ...) joining a DHT bootstrapped in the
    test process, all started at once; returns (processes, client swarm)."""
    bootstrap = harness.dht_bootstrap()
    servers = [
        server_processes.launch([f"ffn.{4 * i + j}" for j in range(4)], "--hidden", str(HIDDEN), "--seed",
                                str(10 * i), "--lr", "0.01", "--torch-threads", "1", "--dht-peer", "%s:%d" % bootstrap)
        for i in range(count)
    ]
    for process in servers:
        server_processes.wait_ready(process, timeout=120.0)
    return servers, harness.client()


def train(moe, steps, on_step_end=None, before_backward=None):
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(HIDDEN, 32), nn.Tanh(), nn.Linear(32, HIDDEN))
    xs = torch.randn(512, HIDDEN)
    with torch.no_grad():
        ys = teacher(xs)
    head = nn.Linear(HIDDEN, HIDDEN)
    opt = torch.optim.Adam([*moe.parameters(), *head.parameters()], lr=0.01)
    losses = []
    for step in range(steps):
        batch = slice((step * 32) % 512, (step * 32) % 512 + 32)
        loss = ((head(moe(xs[batch])) - ys[batch]) ** 2).mean()
        if before_backward:
            before_backward(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step_end:
            on_step_end(step)
    assert all(torch.isfinite(torch.tensor(losses)))
    return losses


def mean(values):
    return sum(values) / len(values)


def test_training_survives_a_server_process_killed_mid_backward(dht_harness, server_processes):
    servers, swarm = start_servers(dht_harness, server_processes, 2)
    # k_best=5 over two servers of 4 experts: every sample has experts on both
    moe = RemoteMixtureOfExperts(HIDDEN, (8,), "ffn", k_best=5, k_min=1, forward_timeout=10.0,
                                 timeout_after_k_min=1.0, backward_timeout=10.0, swarm=swarm)

    def kill(step):
        if step == 10:  # after this step's forward: its backward meets a dead server
            servers[1].kill()
            servers[1].wait()

    losses = train(moe, 30, before_backward=kill)
    assert moe.client.stats["backward_failures"] >= 1
    assert mean(losses[-5:]) < mean(losses[10:15])  # the survivor keeps learning
    assert mean(losses[-5:]) < 0.6 * mean(losses[:5])


@pytest.mark.slow
def test_training_survives_server_processes_killed_mid_backward_and_before_forward(dht_harness, server_processes):
    servers, swarm = start_servers(dht_harness, server_processes, 3)
    # k_best=5 over servers of 4 experts: every sample's experts span at least two servers
    moe = RemoteMixtureOfExperts(HIDDEN, (12,), "ffn", k_best=5, k_min=1, forward_timeout=10.0,
                                 timeout_after_k_min=1.0, backward_timeout=10.0, swarm=swarm)

    def kill_mid_backward(step):
        if step == 10:
            servers[1].kill()
            servers[1].wait()

    def kill_before_forward(step):
        if step == 20:  # its experts are still in the DHT when the next forward searches
            servers[2].kill()
            servers[2].wait()

    losses = train(moe, 40, on_step_end=kill_before_forward, before_backward=kill_mid_backward)
    assert moe.client.stats["backward_failures"] >= 1
    assert moe.client.stats["forward_failures"] >= 1
    assert mean(losses[-5:]) < mean(losses[21:26])
    assert mean(losses[-5:]) < 0.6 * mean(losses[:5])
