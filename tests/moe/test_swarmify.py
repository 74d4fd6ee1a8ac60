"""moe.swarmify on torch and Hugging Face transformers, and upcycling, against daemons on 127.0.0.1 sockets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe.experts import UnknownExpertKind, get_expert_kind, registered_kinds
from moe.swarmify import SwarmNotServing, find_ffn_blocks, swarmify
from peer.client import Swarm
from peer.options import INNER_WIDTH_KINDS, ExpertKindName, OptionError
from peer.p2p.identity import Identity
from tests.moe.daemon_swarm import daemons

HIDDEN = 16


def _train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn, steps: int) -> list[float]:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        loss = loss_fn(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(HIDDEN, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(HIDDEN, 1))


def test_kind_at_width_sets_the_inner_width_and_kinds_without_one_refuse_it():
    for name, params in (("relu_ffn@24", 2 * (HIDDEN * 24) + 24 + HIDDEN), ("swiglu@24", 3 * HIDDEN * 24)):
        module = get_expert_kind(name).build(HIDDEN)
        assert sum(p.numel() for p in module.parameters()) == params, name
    for name in ("ffn@128", "relu_ffn@0", "relu_ffn@x", "no_such@8"):
        with pytest.raises(UnknownExpertKind, match="inner width"):
            get_expert_kind(name)
    # the option check (which needs no torch) knows the same kinds
    assert set(INNER_WIDTH_KINDS) == {k for k in registered_kinds() if get_expert_kind(k).inner_width}
    with pytest.raises(OptionError, match="unknown expert kind"):
        ExpertKindName().check("ffn@128")
    assert ExpertKindName().check("swiglu@24") == "swiglu@24"


def test_swarmify_without_daemons_is_one_line_naming_what_to_run():
    with daemons(["other.[0:2]"], "ffn", HIDDEN) as bootstrap, Swarm([bootstrap]) as swarm:
        model = _encoder()
        with pytest.raises(SwarmNotServing) as caught:
            swarmify(model, swarm, k_best=2, experts_per_layer=2, wait=1.0)
    message = str(caught.value)
    assert "\n" not in message
    assert f"peer join --initial-peers {bootstrap} --experts 'swarm.[0:2].[0:2]' --expert-kind relu_ffn@32 " \
           "--hidden-dim 16 --num-experts 2" in message
    assert len(find_ffn_blocks(model)) == 2  # the model is left as it was


def test_swarmify_encoder_trains_through_the_swarm():
    with daemons(["swarm.[0:2].[0:2]", "swarm.[0:2].[2:4]"], "relu_ffn@32", HIDDEN) as bootstrap, \
            Swarm([bootstrap]) as swarm:
        model = _encoder()
        specs = swarmify(model, swarm, k_best=2, experts_per_layer=4)
        assert [s.pattern for s in specs] == ["swarm.[0:2].[0:4]"]
        assert not find_ffn_blocks(model) and not any(n.endswith("linear1.weight") for n, _ in model.named_parameters())
        generator = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 5, HIDDEN, generator=generator), torch.randn(8, 1, generator=generator))
                   for _ in range(4)]

        def loss_fn(m, x, y):
            return nn.functional.mse_loss(m(x).mean(1), y)

        losses = _train(model, batches, loss_fn, 40)
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8


def test_upcycled_experts_reproduce_the_dense_model_and_strangers_are_refused():
    from moe.upcycle import WeightsRefused

    trainer = Identity.generate()
    torch.manual_seed(0)
    dense = nn.TransformerEncoderLayer(HIDDEN, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    x = torch.randn(3, 4, HIDDEN)
    with torch.no_grad():
        dense.train()
        expected = dense(x)
    with daemons(["swarm.[0:1].[0:2]", "swarm.[0:1].[2:4]"], "relu_ffn@32", HIDDEN,
                 accept=[trainer.peer_id.hex()]) as bootstrap:
        with Swarm([bootstrap]) as stranger:  # a fresh PeerID, not in --accept-weights-from
            with pytest.raises(WeightsRefused, match="accept-weights-from"):
                swarmify(nn.Sequential(_copy_layer(dense)), stranger, k_best=4, experts_per_layer=4, upcycle=True)
        with Swarm([bootstrap], identity=trainer) as swarm:
            model = _copy_layer(dense)
            swarmify(model, swarm, k_best=4, experts_per_layer=4, upcycle=True)
            with torch.no_grad():
                got = model(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _copy_layer(layer: nn.Module) -> nn.Module:
    copy = nn.TransformerEncoderLayer(HIDDEN, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    copy.load_state_dict(layer.state_dict())
    return copy


transformers = pytest.importorskip("transformers")


def _lm_loss(m, x, y):
    return m(input_ids=x, labels=x).loss


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_swarmify_hugging_face_models_train_and_generate(family):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=HIDDEN, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        kind = "gpt2_ffn@64"
    else:
        config = transformers.LlamaConfig(vocab_size=50, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
        model = transformers.LlamaForCausalLM(config)
        kind = "swiglu@40"
    with daemons(["swarm.[0:2].[0:2]", "swarm.[0:2].[2:4]"], kind, HIDDEN) as bootstrap, Swarm([bootstrap]) as swarm:
        specs = swarmify(model, swarm, k_best=2, experts_per_layer=4)
        assert [s.kind for s in specs] == [kind]
        generator = torch.Generator().manual_seed(2)
        batches = [(torch.randint(0, 10, (4, 12), generator=generator), None) for _ in range(2)]
        losses = _train(model, batches, _lm_loss, 30)
        # min_new_tokens: an untrained model may emit its EOS id early (Llama's default eos is 2), ending generation
        out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert out.shape == (1, 7)
