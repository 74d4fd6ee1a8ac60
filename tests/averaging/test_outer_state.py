"""DiLoCo's outer state (averaging/outer_state.py): fragments, and the local <-> outer arithmetic in both modes."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from averaging.outer_state import OuterState, default_outer, nesterov_sgd, split_fragments
from peer.p2p import wire


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.integers(1, 8))
def test_fragments_are_contiguous_cover_everything_and_are_not_empty(sizes, count):
    fragments = split_fragments(sizes, count)
    assert len(fragments) == min(count, len(sizes))
    assert [i for f in fragments for i in f] == list(range(len(sizes)))
    assert all(f for f in fragments)


def test_fragments_have_about_equal_size():
    fragments = split_fragments([100] * 16, 4)
    assert [len(f) for f in fragments] == [4, 4, 4, 4]


def _state(fragments: int = 1) -> tuple[list[torch.Tensor], OuterState]:
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    return params, OuterState(params, lambda ps: torch.optim.SGD(ps, lr=1.0), fragments=fragments)


def _move(params: list[torch.Tensor], by: float) -> None:
    with torch.no_grad():
        for p in params:
            p.sub_(by)


def test_overlap_keeps_fresh_progress_and_drops_the_pending_one_once_applied():
    params, outer = _state()
    _move(params, 1.0)  # phase 0: progress 1
    outer.from_progress([0, 1])  # contributes 1 (pending)
    assert all(torch.equal(p, torch.full_like(p, 1.0)) for p in outer.pseudo)
    _move(params, 0.5)  # phase 1 while round 0 runs: fresh 0.5
    outer.pseudo[0].fill_(2.0)
    outer.pseudo[1].fill_(2.0)  # the round's average
    outer.apply([0, 1])  # outer = 0 - 1.0 * 2 = -2
    outer.from_progress([0, 1])  # rebase (local = -2 - 0.5), then contribute 0.5
    assert all(torch.allclose(p, torch.full_like(p, -2.5)) for p in params)
    assert all(torch.allclose(q, torch.full_like(q, 0.5)) for q in outer.pseudo)
    assert outer.step == 1


def test_with_fragments_a_round_moves_only_its_fragment_and_the_others_keep_their_progress():
    params, outer = _state(fragments=2)
    assert outer.fragments == [[0], [1]] and outer.fragment(0) == [0] and outer.fragment(3) == [1]
    _move(params, 1.0)
    outer.from_outer([0])
    assert torch.equal(outer.pseudo[0], torch.ones(3))
    momentum_before = outer.hash
    outer.apply([0])
    assert outer.hash != momentum_before and outer.step == 1
    assert torch.equal(outer.outer_params[0], -torch.ones(3)) and torch.equal(outer.outer_params[1], torch.zeros(2))
    outer.reset_local([0])
    assert torch.equal(params[0], -torch.ones(3)) and torch.equal(params[1], -torch.ones(2))  # fragment 1 kept
    _move(params, 1.0)
    outer.from_outer([1])  # fragment 1's pseudo-gradient covers both phases
    assert torch.equal(outer.pseudo[1], torch.full((2,), 2.0))


def test_overlap_with_fragments_contributes_all_progress_since_the_fragments_last_contribution():
    params, outer = _state(fragments=2)
    _move(params, 1.0)
    outer.from_progress([0])  # round 0 (fragment 0): 1
    _move(params, 1.0)
    outer.pseudo[0].fill_(1.0)
    outer.apply([0])  # fragment 0's round applied while phase 1 runs
    outer.from_progress([1])  # round 1 (fragment 1): progress of both phases
    assert torch.equal(outer.pseudo[1], torch.full((2,), 2.0))
    assert torch.equal(params[0], torch.full((3,), -2.0))  # rebased: new outer (-1) minus fresh (1)
    _move(params, 1.0)
    outer.pseudo[1].fill_(2.0)
    outer.apply([1])
    outer.from_progress([0])  # round 2 (fragment 0): the two phases since its contribution
    assert torch.equal(outer.pseudo[0], torch.full((3,), 2.0))
    assert torch.equal(params[1], torch.full((2,), -3.0))  # new outer (-2) minus fresh (1)


def test_overlap_a_lost_round_gives_its_progress_back_to_the_next_contribution():
    params, outer = _state()
    _move(params, 1.0)
    outer.from_progress([0, 1])  # contributes 1
    _move(params, 0.5)
    outer.unapplied()  # the round was lost: nothing applied
    outer.from_progress([0, 1])
    assert all(torch.allclose(q, torch.full_like(q, 1.5)) for q in outer.pseudo)  # both phases' progress
    assert outer.step == 0


def test_top_k_codecs_default_to_a_plain_outer_step_and_dense_ones_to_nesterov():
    """SparseLoCo's outer step for sparse updates (their error feedback carries each round forward), DiLoCo's
    Nesterov for the others; momentum 0 builds plain SGD, which torch refuses to make Nesterov."""
    assert default_outer(wire.Compression.TOPK2) == default_outer(wire.Compression.TOPK8) == (1.0, 0.0)
    assert default_outer(wire.Compression.INT8) == default_outer(wire.Compression.NONE) == (0.7, 0.9)
    param = torch.zeros(3, requires_grad=True)
    plain = nesterov_sgd([param], *default_outer(wire.Compression.TOPK2))
    assert plain.param_groups[0]["nesterov"] is False and plain.param_groups[0]["lr"] == 1.0
    param.grad = torch.ones(3)
    plain.step()
    assert torch.equal(param.detach(), -torch.ones(3))  # exactly the averaged update, applied once
    assert nesterov_sgd([param], 0.7, 0.9).param_groups[0]["nesterov"] is True
