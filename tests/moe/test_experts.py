"""Expert kinds, the registry, and the forward/backward/optimizer semantics the server relies on."""

import copy
import sys
import types

import pytest
import torch
from torch import nn

from moe.experts import (
    ExpertKind,
    OptimizerConfig,
    UnknownExpertKind,
    get_expert_kind,
    make_expert,
    register_expert_kind,
)
from moe.schema import TensorSpec


def test_ffn_shapes_and_schema():
    expert = make_expert("ffn.0", "ffn", 32, seed=0)
    assert expert.inputs == [TensorSpec((32,), torch.float32)]
    assert expert.outputs == [TensorSpec((32,), torch.float32)]
    (y,) = expert.forward([torch.randn(5, 32)])
    assert y.shape == (5, 32) and y.dtype == torch.float32
    info = expert.info(max_batch_size=64)
    assert info == {
        "uid": "ffn.0", "kind": "ffn", "hidden_dim": 32, "max_batch_size": 64,
        "inputs": [{"shape": [32], "dtype": "float32"}], "outputs": [{"shape": [32], "dtype": "float32"}],
    }


def test_transformer_block_on_sequences():
    expert = make_expert("tr.1", "transformer", 32, options={"seq_len": 6, "heads": 4}, seed=0)
    assert expert.inputs == [TensorSpec((6, 32))]
    x = torch.randn(3, 6, 32)
    (y,) = expert.forward([x])
    assert y.shape == (3, 6, 32)
    # each sample is processed independently: batching two requests together changes nothing
    (y0,) = expert.forward([x[:1]])
    torch.testing.assert_close(y[:1], y0, rtol=1e-5, atol=1e-5)


def test_seed_makes_weights_reproducible_without_touching_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = make_expert("ffn.1", "ffn", 16, seed=7)
    after = torch.rand(1)
    b = make_expert("ffn.2", "ffn", 16, seed=7)
    assert torch.equal(before, after)
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(pa, pb)


def test_backward_equals_local_autograd_and_applies_optimizer_step():
    expert = make_expert("ffn.3", "ffn", 16, seed=1, optimizer=OptimizerConfig("adam", lr=0.01))
    local = copy.deepcopy(expert.module)
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    grad_out = torch.randn(4, 16)

    x_local = x.clone().requires_grad_()
    local(x_local).backward(grad_out)
    local_opt.step()

    (grad_x,) = expert.backward([x], [grad_out])
    torch.testing.assert_close(grad_x, x_local.grad)
    assert expert.steps == 1
    for p_remote, p_local in zip(expert.module.parameters(), local.parameters()):
        torch.testing.assert_close(p_remote, p_local)
    assert all(p.grad is None for p in expert.module.parameters())  # nothing accumulates into the next step


def test_forward_keeps_no_autograd_state():
    expert = make_expert("ffn.4", "ffn", 8, seed=0)
    (y,) = expert.forward([torch.randn(2, 8)])
    assert not y.requires_grad and y.grad_fn is None


def test_lr_schedule_warmup_then_linear_decay():
    config = OptimizerConfig("sgd", lr=1.0, warmup_steps=2, total_steps=6)
    assert [config.lr_factor(step) for step in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    expert = make_expert("ffn.5", "ffn", 4, seed=0, optimizer=config)
    lrs = []
    for _ in range(3):
        lrs.append(expert.optimizer.param_groups[0]["lr"])
        expert.backward([torch.randn(1, 4)], [torch.randn(1, 4)])
    assert lrs == [0.5, 1.0, 1.0]


def test_state_dict_round_trip_restores_weights_optimizer_and_schedule():
    config = OptimizerConfig("adam", lr=0.1, warmup_steps=10)
    a = make_expert("ffn.6", "ffn", 8, seed=0, optimizer=config)
    a.backward([torch.randn(3, 8)], [torch.randn(3, 8)])
    b = make_expert("ffn.6", "ffn", 8, seed=99, optimizer=config)
    b.load_state_dict(a.state_dict())
    assert b.steps == 1
    x, g = torch.randn(2, 8), torch.randn(2, 8)
    a.backward([x], [g])
    b.backward([x], [g])  # identical Adam moments and LR: identical second step
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(pa, pb)
    other = make_expert("ffn.6", "ffn", 16, seed=0)
    with pytest.raises(ValueError, match="hidden_dim"):
        other.load_state_dict(a.state_dict())


def test_custom_kind_by_import_path(monkeypatch):
    module = types.ModuleType("custom_experts_for_test")

    class Doubler(nn.Module):
        def __init__(self, hidden_dim, scale=2.0):
            super().__init__()
            self.proj = nn.Linear(hidden_dim, 3)
            self.scale = scale

        def forward(self, x):
            return self.proj(x) * self.scale

    module.make_doubler = lambda hidden_dim, **options: Doubler(hidden_dim, **options)
    module.pair_kind = ExpertKind(
        "ignored", lambda h, **o: nn.Bilinear(h, h, h), lambda h, **o: [TensorSpec((h,)), TensorSpec((h,))]
    )
    monkeypatch.setitem(sys.modules, "custom_experts_for_test", module)

    expert = make_expert("c.0", "custom_experts_for_test:make_doubler", 5, options={"scale": 3.0})
    assert expert.kind == "custom_experts_for_test:make_doubler"
    assert expert.outputs == [TensorSpec((3,))]  # inferred from a dry run
    (y,) = expert.forward([torch.ones(2, 5)])
    assert y.shape == (2, 3)

    pair = make_expert("p.0", "custom_experts_for_test:pair_kind", 4)
    assert len(pair.inputs) == 2 and pair.outputs == [TensorSpec((4,))]
    grads = pair.backward([torch.randn(2, 4), torch.randn(2, 4)], [torch.randn(2, 4)])
    assert [g.shape for g in grads] == [(2, 4), (2, 4)]


def test_unknown_kinds_are_reported():
    with pytest.raises(UnknownExpertKind, match="registered"):
        get_expert_kind("no_such_kind")
    with pytest.raises(UnknownExpertKind, match="cannot import"):
        get_expert_kind("no.such.module:factory")
    with pytest.raises(ValueError, match="already registered"):
        register_expert_kind(ExpertKind("ffn", lambda h: nn.Identity(), lambda h: [TensorSpec((h,))]))


def test_deep_ffn_matches_hivemind_layer_stack():
    expert = make_expert("d.0", "deep_ffn", 8, seed=0)
    linears = [m for m in expert.module.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(8, 32), (32, 32), (32, 8)]


def test_overflowing_gradients_skip_the_step_instead_of_ruining_the_expert():
    expert = make_expert("ffn.7", "ffn", 8, seed=0, optimizer=OptimizerConfig("adam", lr=0.01))
    before = [p.detach().clone() for p in expert.module.parameters()]
    (grad_x,) = expert.backward([torch.full((2, 8), 3e38)], [torch.full((2, 8), 3e38)])  # finite, but overflows
    assert expert.steps == 0 and expert.skipped_steps == 1
    for p, b in zip(expert.module.parameters(), before):
        assert torch.equal(p, b)
    expert.backward([torch.randn(2, 8)], [torch.randn(2, 8)])
    assert expert.steps == 1 and all(bool(torch.isfinite(p).all()) for p in expert.module.parameters())


def test_clip_grad_norm_bounds_the_update():
    config = OptimizerConfig("sgd", lr=1.0, clip_grad_norm=0.5)
    expert = make_expert("ffn.8", "ffn", 8, seed=0, optimizer=config)
    before = torch.cat([p.detach().flatten().clone() for p in expert.module.parameters()])
    expert.backward([torch.randn(4, 8) * 10], [torch.randn(4, 8) * 10])
    after = torch.cat([p.detach().flatten() for p in expert.module.parameters()])
    assert float((after - before).norm()) == pytest.approx(0.5, rel=1e-4)
