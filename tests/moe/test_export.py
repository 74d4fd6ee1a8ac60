"""Your weights back: moe.read_weights and deswarmify/export against daemons on 127.0.0.1 sockets, each a separate
peer (its own identity, TCP and UDP sockets), the trainer a Swarm client joined through them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe.errors import NotAllowed
from moe.export import ExportError, deswarmify, save_safetensors
from moe.swarmify import find_ffn_blocks, swarmify
from peer.client import Swarm
from peer.p2p.identity import Identity
from tests.moe.daemon_swarm import daemons

transformers = pytest.importorskip("transformers")
HIDDEN = 16


def _gpt2():
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=HIDDEN, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    return config, transformers.GPT2LMHeadModel(config)


def _loss(model: nn.Module, batch: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def test_swarmified_gpt2_trains_on_daemons_and_exports_a_plain_model_with_the_same_loss(tmp_path):
    trainer = Identity.generate()
    config, model = _gpt2()
    generator = torch.Generator().manual_seed(3)
    train = [torch.randint(0, 12, (4, 12), generator=generator) for _ in range(3)]
    held_out = torch.randint(0, 12, (6, 12), generator=generator)
    with daemons(["swarm.[0:1].[0:1]", "swarm.[1:2].[0:1]"], "gpt2_ffn@64", HIDDEN,
                 accept=[trainer.peer_id.hex()]) as bootstrap, Swarm([bootstrap], identity=trainer) as swarm:
        swarmify(model, swarm, k_best=1, experts_per_layer=1, upcycle=True)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        before = _loss(model, held_out)
        model.train()
        for step in range(8):
            batch = train[step % len(train)]
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        swarm_loss = _loss(model, held_out)
        plain = deswarmify(model, swarm)
        assert find_ffn_blocks(model) == []  # the swarm model is left swarmified (training may go on)
    assert swarm_loss < before  # the daemons' experts trained, so the export must carry their weights
    assert type(plain) is transformers.GPT2LMHeadModel
    fresh = transformers.GPT2LMHeadModel(config)
    fresh.load_state_dict(plain.state_dict())  # strict: exactly the original architecture's keys
    assert _loss(fresh, held_out) == pytest.approx(swarm_loss, rel=1e-4)
    save_safetensors(plain, tmp_path / "model.safetensors")
    from safetensors.torch import load_model

    reloaded = transformers.GPT2LMHeadModel(config)
    load_model(reloaded, tmp_path / "model.safetensors")
    assert _loss(reloaded, held_out) == pytest.approx(swarm_loss, rel=1e-4)


def test_torch_encoder_exports_and_read_weights_is_refused_to_peers_who_may_not_train(tmp_path):
    trainer = Identity.generate()
    allowed = tmp_path / "trainers.txt"
    allowed.write_text(trainer.peer_id.hex() + "\n")
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(HIDDEN, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    original_keys = set(model.state_dict())
    x = torch.randn(2, 5, HIDDEN)
    with daemons(["swarm.[0:2].[0:1]"], "relu_ffn@32", HIDDEN, trainers=allowed) as bootstrap:
        with Swarm([bootstrap], identity=trainer) as swarm:
            swarmify(model, swarm, k_best=1, experts_per_layer=1)
            model.eval()
            with torch.no_grad():
                expected = model(x)
            plain = deswarmify(model, swarm)
        with Swarm([bootstrap]) as stranger:  # not in --trainers: may neither train nor read
            with pytest.raises(ExportError, match="NotAllowed") as caught:
                deswarmify(model, stranger)
            assert isinstance(caught.value.__cause__, NotAllowed)
            assert "\n" not in str(caught.value)
    assert set(plain.state_dict()) == original_keys
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected, atol=1e-5, rtol=1e-5)


def test_a_layer_of_several_experts_needs_merge_and_mean_merges():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(HIDDEN, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False))
    with daemons(["swarm.[0:1].[0:2]"], "relu_ffn@32", HIDDEN) as bootstrap, Swarm([bootstrap]) as swarm:
        swarmify(model, swarm, k_best=2, experts_per_layer=2)
        with pytest.raises(ValueError, match="experts_per_layer=1"):
            deswarmify(model, swarm)
        plain = deswarmify(model, swarm, merge="mean")
        server_states = []
        from moe.declare import get_prefix_entries
        from moe.upcycle import read_weights

        async def read_all():
            entries = await get_prefix_entries(swarm.dht, "swarm.0.")
            return [(await read_weights(swarm.rpc, uid, loc, timeout=10))["state"] for uid, loc in entries.values()]

        server_states = swarm.run(read_all)
    linear1 = plain[0].layers[0].linear1.weight
    torch.testing.assert_close(linear1, (server_states[0]["up.weight"] + server_states[1]["up.weight"]) / 2)
