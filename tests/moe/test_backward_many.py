"""`Expert.backward_many`: several experts' backward in one autograd pass with fused optimizer steps must give
exactly what `Expert.backward` gives expert by expert (bitwise: the same kernels on the same tensors)."""

import pytest
import torch
import trio

from moe.experts import Expert, OptimizerConfig, make_expert
from moe.runtime import BACKWARD, ExpertComputeError, ExpertRuntime


def _experts() -> list[Expert]:
    """Fused Adam (grouped), fused AdamW with another lr (its own group), SGD and a clipping Adam (stepped alone)."""
    configs = [OptimizerConfig(lr=1e-2)] * 3 + [
        OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.1), OptimizerConfig(name="sgd", lr=0.1, momentum=0.9),
        OptimizerConfig(lr=1e-2, clip_grad_norm=0.05)]
    return [make_expert(f"ffn.{i}", "ffn", 16, optimizer=config, seed=i) for i, config in enumerate(configs)]


def _requests(count: int, seed: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    return [([torch.randn(3 + i, 16, generator=generator)], [torch.randn(3 + i, 16, generator=generator)])
            for i in range(count)]


def _assert_same(a: Expert, b: Expert) -> None:
    assert a.steps == b.steps and a.skipped_steps == b.skipped_steps
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)
    state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for name in state_a[key]:
            assert torch.equal(torch.as_tensor(state_a[key][name]), torch.as_tensor(state_b[key][name])), name


def test_backward_many_equals_backward_one_by_one_over_several_steps(monkeypatch):
    fused_groups: list[list[str]] = []
    original = Expert._fused_adam_step
    monkeypatch.setattr(Expert, "_fused_adam_step", staticmethod(
        lambda experts: (fused_groups.append([e.uid for e in experts]), original(experts))[1]))
    together = _experts()
    alone = _experts()  # the same seeds: equal starting weights
    for step in range(4):  # the first step creates the optimizer state; later ones take the fused group path
        requests = _requests(len(together), seed=step)
        got = Expert.backward_many(together, requests)
        expected = [expert.backward(*request) for expert, request in zip(alone, requests)]
        for mine, theirs in zip(got, expected):
            assert not isinstance(mine, Exception)
            assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
        for a, b in zip(together, alone):
            _assert_same(a, b)
            assert all(p.grad is None for p in a.module.parameters())
    assert [e.steps for e in together] == [4] * len(together)
    # steps 2-4: the equal fused Adams (clipped or not) in one kernel call; AdamW (other settings) and SGD alone
    assert fused_groups == [["ffn.0", "ffn.1", "ffn.2", "ffn.5"]] * 3


def test_a_non_finite_or_failing_expert_is_skipped_alone():
    together = _experts()[:4]
    alone = _experts()[:4]  # the same seeds: equal starting weights
    for step in range(2):
        requests = _requests(4, seed=10 + step)
        requests[1] = (requests[1][0], [torch.full_like(requests[1][1][0], float("inf"))])  # overflowing grads
        requests[2] = ([torch.randn(2, 7)], [torch.randn(2, 16)])  # the module raises: wrong width
        got = Expert.backward_many(together, requests)
        assert isinstance(got[2], Exception)
        with pytest.raises(RuntimeError):
            alone[2].backward(*requests[2])
        for index in (0, 1, 3):
            expected = alone[index].backward(*requests[index])
            assert all(torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) for x, y in zip(got[index], expected))
        for a, b in zip(together, alone):
            _assert_same(a, b)
    assert together[1].skipped_steps == 2 and together[1].steps == 0
    assert together[0].steps == together[3].steps == 2


async def test_run_many_backward_takes_the_joint_path_with_per_expert_errors():
    experts = _experts()[:3]
    reference = _experts()[:3]
    runtime = ExpertRuntime({e.uid: e for e in experts}, inline_threshold=0.0)
    requests = _requests(3, seed=5)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        bad = ("ffn.1", [torch.randn(2, 7), torch.randn(2, 16)])
        outcomes = await runtime.run_many(BACKWARD, [
            ("ffn.0", [*requests[0][0], *requests[0][1]]), bad, ("ffn.2", [*requests[2][0], *requests[2][1]])])
        nursery.cancel_scope.cancel()
    assert isinstance(outcomes[1], ExpertComputeError) and outcomes[1].uid == "ffn.1"
    for index in (0, 2):
        expected = reference[index].backward(*requests[index])
        assert all(torch.equal(x, y) for x, y in zip(outcomes[index], expected))
        _assert_same(experts[index], reference[index])
