"""Updates bounded per step: the server clips each backward batch's gradient to `clip_grad_norm` (alone and in
the batched backward, with the same values as torch's `clip_grad_norm_`), and refuses inputs or gradients far
larger than the expert usually gets, so one caller cannot wreck an expert in a step."""

from __future__ import annotations

import copy

import pytest
import torch
import trio

from moe import calls
from moe.errors import BadExpertInput
from moe.experts import Expert, OptimizerConfig, make_expert
from moe.trust import NormStats
from tests.moe.serving import serving

HIDDEN = 8
SGD = OptimizerConfig("sgd", lr=0.1, clip_grad_norm=1.0)


def flat(expert: Expert) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in expert.module.parameters()])


def test_a_huge_gradient_moves_the_expert_by_at_most_lr_times_the_clip_norm():
    expert = make_expert("ffn.0", "ffn", HIDDEN, seed=0, optimizer=SGD)
    before = flat(expert)
    x = torch.randn(4, HIDDEN)
    expert.backward([x], [torch.full((4, HIDDEN), 1e12)])
    moved = float(torch.linalg.vector_norm(flat(expert) - before))
    assert 0 < moved <= 0.1 * 1.0 * (1 + 1e-4)
    assert expert.steps == 1 and expert.clipped_steps == 1
    # a small gradient is left alone
    expert.backward([x], [torch.full((4, HIDDEN), 1e-6)])
    assert expert.clipped_steps == 1


def test_clipping_equals_torch_clip_grad_norm_alone_and_in_the_batched_backward():
    experts = [make_expert(f"ffn.{i}", "ffn", HIDDEN, seed=i, optimizer=SGD) for i in range(3)]
    references = [copy.deepcopy(e.module) for e in experts]
    xs = [torch.randn(5, HIDDEN) for _ in experts]
    grads = [torch.randn(5, HIDDEN) * scale for scale in (1e-3, 1e3, 1e6)]
    results = Expert.backward_many(experts, [([x], [g]) for x, g in zip(xs, grads)])
    assert all(not isinstance(r, Exception) for r in results)
    for expert, reference, x, g in zip(experts, references, xs, grads):
        out = reference(x)
        out.backward(g)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
        for mine, theirs in zip(expert.module.parameters(), reference.parameters()):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert [e.clipped_steps for e in experts] == [0, 1, 1]


def test_norm_stats_ratio_after_warmup():
    stats = NormStats(warmup=3)
    for norm in (1.0, 2.0, 1.0):
        assert stats.ratio(100.0) == 1.0  # nothing known yet
        stats.observe(norm)
    assert 50 < stats.ratio(100.0) < 100
    assert 0.5 < stats.ratio(1.3) < 2


async def test_the_server_refuses_gradients_and_inputs_far_above_the_usual():
    expert = make_expert("ffn.0", "ffn", HIDDEN, seed=0, optimizer=SGD)
    torch.manual_seed(0)
    async with serving([expert], max_norm_ratio=100.0) as (server, client, address, peer_id):
        with trio.fail_after(60):
            for _ in range(10):  # the usual: unit-sized inputs and gradients
                await calls.backward(client, address, peer_id, "ffn.0", [torch.randn(4, HIDDEN)],
                                     [torch.randn(4, HIDDEN)], timeout=10)
            weights = flat(expert)
            with pytest.raises(BadExpertInput, match=r"grad_outputs\[0\] norm .* this expert's usual"):
                await calls.backward(client, address, peer_id, "ffn.0", [torch.randn(4, HIDDEN)],
                                     [torch.randn(4, HIDDEN) * 1e30], timeout=10)
            with pytest.raises(BadExpertInput, match=r"inputs\[0\] norm"):
                await calls.forward(client, address, peer_id, "ffn.0", [torch.randn(4, HIDDEN) * 1e6], timeout=10)
            answers = await calls.backward_batch(client, address, peer_id, [
                ("ffn.0", [torch.randn(4, HIDDEN)], [torch.randn(4, HIDDEN) * 1e4])], timeout=10)
            assert isinstance(answers[0], BadExpertInput)
            assert torch.equal(weights, flat(expert)) and expert.steps == 10
            # smaller than usual is harmless, and the usual still works
            await calls.backward(client, address, peer_id, "ffn.0", [torch.randn(4, HIDDEN)],
                                 [torch.randn(4, HIDDEN) * 1e-3], timeout=10)
            assert expert.steps == 11
        assert server.stats()["errors"]["bad_input"] == 3
