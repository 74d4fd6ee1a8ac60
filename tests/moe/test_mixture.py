"""RemoteMixtureOfExperts / RemoteSwitchMixtureOfExperts over expert servers found through the DHT: same numbers
as the same mixture computed locally, and a small model trains."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moe.experts import OptimizerConfig, make_expert
from moe.mixture import RemoteMixtureOfExperts, RemoteSwitchMixtureOfExperts
from peer.client import Swarm
from tests.moe.small_regression import regression_losses, teacher_data

HIDDEN = 16
GRID = (3, 4)


def make_servers(harness, optimizer=OptimizerConfig("sgd", lr=0.05)):
    """3 servers x 4 experts: server i hosts ffn.i.0 .. ffn.i.3. Returns (servers, {uid: local copy})."""
    servers, local = [], {}
    for i in range(GRID[0]):
        experts = [make_expert(f"ffn.{i}.{j}", "ffn", HIDDEN, seed=10 * i + j, optimizer=optimizer)
                   for j in range(GRID[1])]
        for expert in experts:
            local[expert.uid] = copy.deepcopy(expert.module)
        servers.append(harness.server(experts))
    return servers, local


def local_mixture(x, gate, experts, k, alive=None, detached=()):
    """The reference: top-k experts by gate score among `alive` (default all), softmax over them, weighted sum.
    Experts in `detached` contribute to the output but pass no gradient to x (they died mid-backward)."""
    logits = gate(x).split(GRID, dim=-1)
    uids = [uid for uid in experts if alive is None or uid in alive]
    outputs = []
    for b in range(x.shape[0]):
        def score_of(u, b=b):
            return sum(float(logits[d][b, int(c)].detach()) for d, c in enumerate(u.split(".")[1:]))

        scored = sorted(uids, key=lambda u: -score_of(u))
        chosen = scored[:k]
        scores = torch.stack([sum(logits[d][b, int(c)] for d, c in enumerate(u.split(".")[1:])) for u in chosen])
        weights = torch.softmax(scores, dim=0)
        rows = []
        for u in chosen:
            inp = x[b : b + 1].detach() if u in detached else x[b : b + 1]
            rows.append(experts[u](inp)[0])
        outputs.append((weights[:, None] * torch.stack(rows)).sum(0))
    return torch.stack(outputs)


def test_mixture_equals_local_computation_forward_backward_and_server_steps(dht_harness):
    servers, local = make_servers(dht_harness)
    swarm = dht_harness.client()
    torch.manual_seed(0)
    moe = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn", k_best=4, swarm=swarm)
    gate = copy.deepcopy(moe.gate)
    x = torch.randn(10, HIDDEN)
    target = torch.randn(10, HIDDEN)

    x_remote = x.clone().requires_grad_()
    loss_remote = ((moe(x_remote) - target) ** 2).mean()
    x_local = x.clone().requires_grad_()
    loss_local = ((local_mixture(x_local, gate, local, k=4) - target) ** 2).mean()
    torch.testing.assert_close(loss_remote, loss_local, rtol=1e-5, atol=1e-6)

    loss_remote.backward()
    loss_local.backward()
    torch.testing.assert_close(x_remote.grad, x_local.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(moe.gate.weight.grad, gate.weight.grad, rtol=1e-4, atol=1e-6)
    # every expert that served applied one SGD step with the gradient the local computation gives it
    for server in servers:
        for uid, expert in server.experts.items():
            reference = local[uid]
            used = any(p.grad is not None for p in reference.parameters())
            assert expert.steps == int(used)
            for p_server, p_local in zip(expert.module.parameters(), reference.parameters()):
                expected = p_local - 0.05 * p_local.grad if used else p_local
                torch.testing.assert_close(p_server, expected.detach(), rtol=1e-4, atol=1e-6)


def test_mixture_trains_a_small_model_through_the_trainers_swarm(dht_harness):
    make_servers(dht_harness, optimizer=OptimizerConfig("adam", lr=0.01))
    # the trainer's own client peer (peer.client.Swarm: its own trio thread), joining the servers' DHT
    with Swarm(initial_peers=[dht_harness.dht_peers[0]]) as swarm:
        losses = train_small_model(swarm)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def train_small_model(swarm):
    xs, ys = teacher_data(HIDDEN)
    moe = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn", k_best=3, swarm=swarm)
    return list(regression_losses(moe, xs, ys, 40))


def test_switch_mixture_equals_local_top1_and_balancing_loss(dht_harness):
    servers, local = make_servers(dht_harness)
    swarm = dht_harness.client()
    torch.manual_seed(2)
    # hedging only after the whole timeout: on a loaded machine a reply late by more than the default 1 s would
    # be hedged to the next best expert, and that sample would rightly differ from the local top-1
    moe = RemoteSwitchMixtureOfExperts(HIDDEN, GRID, "ffn", swarm=swarm, hedge_after=10.0)
    x = torch.randn(12, HIDDEN, requires_grad=True)
    out, balancing = moe(x)

    logits = moe.gate(x).split(GRID, dim=-1)
    probs = [torch.softmax(lg, dim=-1) for lg in logits]
    coords = [tuple(int(lg[b].argmax()) for lg in logits) for b in range(12)]  # full grid: best = argmax per dim
    expected = torch.stack([
        probs[0][b, i] * probs[1][b, j] * local[f"ffn.{i}.{j}"](x[b : b + 1])[0] for b, (i, j) in enumerate(coords)
    ])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    expected_balancing = sum(
        GRID[d] * sum((sum(1 for c in coords if c[d] == j) / 12) * probs[d][:, j].mean() for j in range(GRID[d]))
        for d in range(2)
    )
    torch.testing.assert_close(balancing, expected_balancing, rtol=1e-5, atol=1e-6)
    (out.sum() + balancing).backward()
    assert moe.gate.weight.grad is not None and x.grad is not None
    assert sum(e.steps for s in servers for e in s.experts.values()) == len(set(coords))


def test_server_killed_between_forward_and_backward_step_completes_matches_local_and_training_goes_on(dht_harness):
    servers, local = make_servers(dht_harness)
    swarm = dht_harness.client()
    torch.manual_seed(3)
    # k_best=5 over servers of 4 experts: each sample keeps experts on at least one surviving server. The grace
    # period is the whole timeout: every expert's forward answer is used however slow a loaded machine is, so
    # server 1 is surely in this step's backward.
    moe = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn", k_best=5, timeout_after_k_min=10.0, swarm=swarm)
    gate = copy.deepcopy(moe.gate)
    x, target = torch.randn(16, HIDDEN), torch.randn(16, HIDDEN)

    x_remote = x.clone().requires_grad_()
    loss = ((moe(x_remote) - target) ** 2).mean()
    assert moe.client.stats["forward_failures"] == 0  # the forward succeeded on every server
    servers[1].kill()  # between this step's forward and its backward
    loss.backward()  # completes: server 1's experts give zero gradient
    assert 1 <= moe.client.stats["backward_failures"] <= len(servers[1].experts)  # only server 1's experts failed

    killed = set(servers[1].experts)
    x_local = x.clone().requires_grad_()
    ((local_mixture(x_local, gate, local, k=5, detached=killed) - target) ** 2).mean().backward()
    torch.testing.assert_close(x_remote.grad, x_local.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(moe.gate.weight.grad, gate.weight.grad, rtol=1e-4, atol=1e-6)
    for server in (servers[0], servers[2]):  # survivors applied exactly the local SGD step
        for uid, expert in server.experts.items():
            for p_server, p_local in zip(expert.module.parameters(), local[uid].parameters()):
                expected = p_local - 0.05 * p_local.grad if p_local.grad is not None else p_local
                torch.testing.assert_close(p_server, expected.detach(), rtol=1e-4, atol=1e-6)

    # training continues on the survivors, without touching the dead server again
    failures = moe.client.stats["forward_failures"] + moe.client.stats["backward_failures"]
    opt = torch.optim.Adam(moe.parameters(), lr=0.01)
    losses = []
    for _step in range(15):
        loss = ((moe(x) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert moe.client.stats["forward_failures"] + moe.client.stats["backward_failures"] == failures


def test_empty_batch_and_wrong_input_shape(dht_harness):
    make_servers(dht_harness)
    moe = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn", k_best=2, swarm=dht_harness.client())
    out = moe(torch.zeros(0, HIDDEN))
    assert out.shape == (0, HIDDEN)
    with pytest.raises(ValueError):
        moe(torch.zeros(3, HIDDEN + 1))


def test_switch_mixture_trains_with_the_balancing_loss(dht_harness):
    make_servers(dht_harness, optimizer=OptimizerConfig("adam", lr=0.01))
    torch.manual_seed(5)
    moe = RemoteSwitchMixtureOfExperts(HIDDEN, GRID, "ffn", swarm=dht_harness.client())
    teacher = nn.Sequential(nn.Linear(HIDDEN, 32), nn.Tanh(), nn.Linear(32, HIDDEN))
    xs = torch.randn(256, HIDDEN)
    with torch.no_grad():
        ys = teacher(xs)
    opt = torch.optim.Adam(moe.parameters(), lr=0.01)
    losses = []
    for step in range(40):
        batch = slice((step * 32) % 256, (step * 32) % 256 + 32)
        out, balancing = moe(xs[batch])
        loss = ((out - ys[batch]) ** 2).mean()
        opt.zero_grad()
        (loss + 0.01 * balancing).backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_fixed_expert_set_without_a_dht(harness):
    from moe.beam_search import StaticGridOracle

    server = harness.server([make_expert(f"ffn.{i}", "ffn", HIDDEN, seed=i) for i in range(3)])
    swarm = harness.client()  # no DHT
    with pytest.raises(ValueError):
        RemoteMixtureOfExperts(HIDDEN, (3,), "ffn", k_best=2, swarm=swarm)
    moe = RemoteMixtureOfExperts(HIDDEN, (3,), "ffn", k_best=2, swarm=swarm,
                                 oracle=StaticGridOracle(server.locations()))
    assert moe(torch.randn(4, HIDDEN)).shape == (4, HIDDEN)
