"""Lying experts: the MoE client checks the size of every reply against the expert's own record and the other
experts of the same samples (moe.trust.ExpertTrust); an outlier's reply is left out of that step, and an expert
whose replies are outliers in several steps is banned for the run. A server whose outputs are scaled x100, or
are random values, or whose input gradients are scaled x100, is banned within 20 steps and training reaches the
loss it reaches without the liar; the bans are published in the DHT where `peer status` shows them."""

from __future__ import annotations

import pytest
import torch
import trio
from torch import nn

from moe.bans import BANS_KEY, parse_bans
from moe.declare import get_experts
from moe.experts import OptimizerConfig, make_expert
from moe.mixture import RemoteMixtureOfExperts
from moe.trust import ExpertTrust
from peer.status import format_status, gather_status
from tests.moe.small_regression import regression_losses, teacher_data

HIDDEN = 16
GRID = (3, 4)
LIAR = "ffn.1.2"


class Lying(nn.Module):
    """An expert module that lies in its forward (what the caller mixes in) and learns normally otherwise, or
    (`gradients`) answers the forward honestly and lies in the input gradients of its backward."""

    def __init__(self, inner: nn.Module, how: str):
        super().__init__()
        self.inner, self.how = inner, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "gradients":  # honest outputs; the input gradients it returns are x100
            return self.inner(x * 100 - x.detach() * 99)
        out = self.inner(x)
        # the server keeps the forward's graph for the backward (moe.kept), so the lie is in that graph too
        if self.how == "scaled":
            return out * 100
        return out * 0 + torch.rand_like(out) * 100 - 50  # finite garbage: passes every NaN and shape check


def servers(harness, liar: str | None):
    for i in range(GRID[0]):
        experts = [make_expert(f"ffn.{i}.{j}", "ffn", HIDDEN, seed=10 * i + j,
                               optimizer=OptimizerConfig("adam", lr=0.01)) for j in range(GRID[1])]
        for expert in experts:
            if liar is not None and expert.uid == LIAR:
                expert.module = Lying(expert.module, liar)
        harness.server(experts)


def every_expert_declared(swarm, timeout: float = 60.0) -> None:
    """Wait until the client finds all of the grid's experts in the DHT. A server's first declaration round can
    time out on a loaded machine (it is retried a quarter interval later); a run that started before the
    liar's server was findable never called the liar and so never banned it (seen once, under load: 8 of the 12
    experts checked, no outlier)."""
    uids = [f"ffn.{i}.{j}" for i in range(GRID[0]) for j in range(GRID[1])]

    async def declared() -> None:
        with trio.fail_after(timeout):
            while not all(location is not None for location in (await get_experts(swarm.dht, uids)).values()):
                await trio.sleep(0.1)

    swarm.bridge.run(declared)


def train(swarm, steps: int):
    """The small regression of tests/moe/small_regression.py; returns (losses, step at which LIAR was banned)."""
    every_expert_declared(swarm)
    xs, ys = teacher_data(HIDDEN)
    # every reply is waited for (the run is deterministic then: same losses, same ban step, run after run); with
    # the 10 s defaults a reply cut off on a very loaded machine changes which experts a step mixed, and the
    # liar-vs-honest comparison below would compare two different runs (seen once in CI at load ~17)
    moe = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn", k_best=4, swarm=swarm, timeout_after_k_min=60.0,
                                 forward_timeout=60.0, backward_timeout=60.0)
    losses, banned_at = [], None
    for step, loss in enumerate(regression_losses(moe, xs, ys, steps)):
        losses.append(loss)
        if banned_at is None and moe.client.trust.is_banned(LIAR):
            banned_at = step
    return moe, losses, banned_at


def mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize("how", ["scaled", "random", "gradients"])
def test_a_lying_expert_is_banned_within_20_steps_and_training_reaches_its_usual_loss(dht_harness, how):
    servers(dht_harness, liar=how)
    swarm = dht_harness.client()
    moe, losses, banned_at = train(swarm, 60)
    seen = (moe.client.trust.stats(), moe.client.stats)  # what a failure report needs
    assert banned_at is not None and banned_at < 20, seen
    assert list(moe.client.trust.bans()) == [LIAR], seen  # nobody else
    assert moe.client.stats["trust_bans"] == 1, seen
    # the honest baseline: the same run on a swarm without the liar
    from tests.moe.conftest import Harness

    honest = Harness(dht_harness.bridge, dht=True)
    servers(honest, liar=None)
    _, baseline, _ = train(honest.client(), 60)
    assert mean(losses[-5:]) < 0.5 * mean(losses[:5])
    # measured: 0.0014 with the liar banned, 0.0014 without a liar, 0.007-0.009 with the liar and no checks
    assert mean(losses[-5:]) <= 1.5 * mean(baseline[-5:]) + 0.001, (losses[-5:], baseline[-5:])

    # the ban is published in the DHT, and `peer status` shows it
    async def status():
        with trio.fail_after(30):
            return await gather_status(swarm.rpc, swarm.dht, entries=[], read_bans=True)

    shown = swarm.bridge.run(status)
    assert list(shown["bans"]) == [LIAR]
    assert swarm.rpc.peer_id.hex() in shown["bans"][LIAR]
    assert f"{LIAR}: banned by 1 trainer" in format_status(shown)


def test_trust_bans_a_scaled_liar_by_peers_and_never_an_honest_expert():
    trust = ExpertTrust()
    torch.manual_seed(0)
    for step in range(200):
        x = torch.randn(8, HIDDEN)
        replies = {f"ffn.{i}": (list(range(8)), x * (1 + 0.3 * i) + 0.1 * torch.randn(8, HIDDEN))
                   for i in range(4)}
        if step >= 100:  # from step 100 on, ffn.3 lies
            replies["ffn.3"] = (list(range(8)), replies["ffn.3"][1] * 100)
        verdicts = trust.check(replies)
        assert not any(verdicts[f"ffn.{i}"].outlier for i in range(3))
        if step >= 100:
            assert verdicts["ffn.3"].outlier and verdicts["ffn.3"].basis == "peers"
    assert list(trust.bans()) == ["ffn.3"]


def test_an_expert_far_smaller_than_its_peers_is_never_banned_and_its_record_stays_clean():
    """An honest expert whose units mostly died answers a fraction of its peers' size: that weakens its share of
    a sample and harms nobody, so it earns no strike (only "too large" does)."""
    trust = ExpertTrust()
    torch.manual_seed(1)
    for _ in range(50):
        x = torch.randn(8, HIDDEN)
        replies = {f"ffn.{i}": (list(range(8)), x + 0.1 * torch.randn(8, HIDDEN)) for i in range(3)}
        replies["ffn.3"] = (list(range(8)), x * 0.01)
        verdicts = trust.check(replies)
        assert verdicts["ffn.3"].ratio < 0.1 and not verdicts["ffn.3"].outlier
    assert trust.bans() == {}
    assert trust.record("ffn.3").stats.count == 0  # too small to be typical: it does not shape the record


def test_history_decides_when_too_few_experts_share_the_samples_and_honest_drift_is_not_a_lie():
    trust = ExpertTrust(warmup=4)
    scale = 1.0
    for _ in range(300):
        scale *= 1.02  # an honest expert whose outputs grow steadily: x370 over the run, 2% a step
        trust.check({"ffn.0": ([0, 1], torch.ones(2, 4) * scale)})
    assert not trust.bans()
    for _ in range(trust.strikes):  # a jump by x1000 in one step is not drift
        trust.check({"ffn.0": ([0, 1], torch.ones(2, 4) * scale * 1000)})
    assert list(trust.bans()) == ["ffn.0"]
    assert trust.bans()["ffn.0"].startswith("outputs ")


def test_an_empty_reply_gets_no_verdict():
    trust = ExpertTrust(warmup=1)
    trust.check({"ffn.0": ([0], torch.ones(1, 4))})
    assert trust.check({"ffn.0": ([], torch.ones(0, 4)), "ffn.1": ([0], torch.ones(1, 4))}).keys() == {"ffn.1"}


def test_two_experts_per_sample_never_blame_each_other():
    """With two answers per sample a median cannot say who is off: only history is used, so the honest one of
    a pair is never banned for its partner's lies."""
    trust = ExpertTrust(warmup=4)
    for step in range(50):
        liar = torch.ones(3, 4) * (100 if step >= 10 else 1)
        trust.check({"ffn.0": ([0, 1, 2], torch.ones(3, 4)), "ffn.1": ([0, 1, 2], liar)})
    assert list(trust.bans()) == ["ffn.1"]


def test_published_bans_are_parsed_per_uid_and_malformed_entries_skipped():
    entries = {b"\x01" * 20: {"ffn.3": "outputs 100x"}, b"\x02" * 20: {"ffn.3": "x", "ffn.5": "y"},
               b"\x03" * 20: ["not", "a", "map"], b"\x04" * 20: {"ffn.6": 7}}
    assert parse_bans(entries) == {"ffn.3": {"01" * 20: "outputs 100x", "02" * 20: "x"}, "ffn.5": {"02" * 20: "y"}}
    assert BANS_KEY == "moe.bans"
