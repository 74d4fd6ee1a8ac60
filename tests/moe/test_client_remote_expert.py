"""RemoteExpert: a remote expert behaves like the same module run locally, autograd and optimizer step included."""

from __future__ import annotations

import copy

import pytest
import torch

from moe.errors import BadExpertInput, ExpertNotFound
from moe.experts import OptimizerConfig, make_expert
from moe.remote_expert import RemoteExpert
from peer.p2p.identity import Identity
from peer.p2p.rpc import HandshakeError


@pytest.mark.parametrize("kind, shape", [("ffn", (6, 32)), ("transformer", (2, 16, 32))])
def test_forward_backward_and_server_step_equal_local(harness, kind, shape):
    expert = make_expert(f"{kind}.0", kind, 32, seed=3, optimizer=OptimizerConfig("sgd", lr=0.05))
    local = copy.deepcopy(expert.module)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    server = harness.server([expert])
    remote = RemoteExpert(f"{kind}.0", server.address, harness.client())

    torch.manual_seed(0)
    x, w = torch.randn(*shape), torch.randn(*shape)
    for _step in range(3):  # each step uses the weights the previous server-side step produced
        x_remote, x_local = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_remote, y_local = remote(x_remote), local(x_local)
        torch.testing.assert_close(y_remote, y_local, rtol=1e-5, atol=1e-5)
        (y_remote * w).sum().backward()
        (y_local * w).sum().backward()
        local_opt.step()
        local_opt.zero_grad()
        torch.testing.assert_close(x_remote.grad, x_local.grad, rtol=1e-4, atol=1e-5)
    assert expert.steps == 3
    for p_server, p_local in zip(expert.module.parameters(), local.parameters()):
        torch.testing.assert_close(p_server, p_local, rtol=1e-4, atol=1e-6)


def test_server_learns_even_when_inputs_need_no_grad(harness):
    expert = make_expert("ffn.1", "ffn", 8, seed=0, optimizer=OptimizerConfig("sgd", lr=0.5))
    before = [p.detach().clone() for p in expert.module.parameters()]
    server = harness.server([expert])
    remote = RemoteExpert("ffn.1", server.address, harness.client(), peer_id=server.peer_id)
    out = remote(torch.randn(4, 8))  # plain data, no requires_grad
    assert out.requires_grad
    out.sum().backward()
    assert expert.steps == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, expert.module.parameters()))


def test_info_and_typed_errors(harness):
    server = harness.server([make_expert("ffn.2", "ffn", 8, seed=0)], max_batch_size=16)
    swarm = harness.client()
    remote = RemoteExpert("ffn.2", server.address, swarm)
    assert remote.info["outputs"] == [{"shape": [8], "dtype": "float32"}]
    assert remote.info["max_batch_size"] == 16
    with pytest.raises(BadExpertInput):
        remote(torch.randn(3, 9))
    with pytest.raises(BadExpertInput):
        remote(torch.full((3, 8), float("nan")))
    with pytest.raises(BadExpertInput):
        remote(torch.randn(17, 8))
    with pytest.raises(ExpertNotFound):
        RemoteExpert("ffn.9", server.address, swarm)(torch.randn(3, 8))
    assert remote(torch.randn(3, 8)).shape == (3, 8)  # the server kept serving


def test_wrong_peer_at_the_address_is_refused(harness):
    server = harness.server([make_expert("ffn.3", "ffn", 8, seed=0)])
    impostor = Identity.generate().peer_id
    remote = RemoteExpert("ffn.3", server.address, harness.client(), peer_id=impostor)
    with pytest.raises(HandshakeError):
        remote(torch.randn(2, 8))


def test_float16_compression_both_ways(harness):
    from peer.p2p.wire import Compression

    expert = make_expert("ffn.4", "ffn", 32, seed=5, optimizer=OptimizerConfig("sgd", lr=0.0))
    server = harness.server([expert])
    remote = RemoteExpert("ffn.4", server.address, harness.client(), compression=Compression.FLOAT16)
    x = torch.randn(8, 32, requires_grad=True)
    y = remote(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expert.module(x).detach(), rtol=1e-2, atol=1e-2)
    y.sum().backward()
    x_local = x.detach().clone().requires_grad_()
    expert.module(x_local).sum().backward()
    torch.testing.assert_close(x.grad, x_local.grad, rtol=1e-2, atol=1e-2)
