"""An ExpertServer over real sockets on 127.0.0.1, called with a plain RPCNode: the wire contract of moe.*."""

import copy

import pytest
import torch
import trio
from torch import nn

from moe.errors import BadExpertInput, ExpertFailed, ExpertNotFound
from moe.experts import ExpertKind, OptimizerConfig, make_expert, register_expert_kind
from moe.schema import TensorSpec
from peer.p2p.identity import Identity
from peer.p2p.net import RealNetwork
from peer.p2p.rpc import RPCNode
from peer.p2p.wire import Compression
from tests.moe.serving import serving

TIMEOUT = 30.0


class Exploding(nn.Module):
    def __init__(self, hidden_dim):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x):
        if bool((x > 100).any()):
            raise RuntimeError("exploded")
        return self.linear(x)


register_expert_kind(
    ExpertKind("test_exploding", lambda h, **o: Exploding(h), lambda h, **o: [TensorSpec((h,))]), replace=True
)


async def test_info_describes_the_schema():
    expert = make_expert("ffn.0.1", "ffn", 16, seed=0)
    async with serving([expert], max_batch_size=64) as (_, client, address, _):
        info = await client.call(address, "moe.info", {"uid": "ffn.0.1"}, timeout=TIMEOUT)
    assert info == {
        "uid": "ffn.0.1", "kind": "ffn", "hidden_dim": 16, "max_batch_size": 64,
        "inputs": [{"shape": [16], "dtype": "float32"}], "outputs": [{"shape": [16], "dtype": "float32"}],
    }


@pytest.mark.parametrize("kind, shape", [("ffn", (5, 32)), ("transformer", (3, 16, 32))])
async def test_forward_and_backward_equal_local_computation_including_optimizer_step(kind, shape):
    expert = make_expert(f"{kind}.0", kind, 32, seed=1, optimizer=OptimizerConfig("adam", lr=0.01))
    local = copy.deepcopy(expert.module)
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    x, grad_out = torch.randn(*shape), torch.randn(*shape)
    async with serving([expert]) as (server, client, address, _):
        reply = await client.call(address, "moe.forward", {"uid": f"{kind}.0", "inputs": [x]}, timeout=TIMEOUT)
        torch.testing.assert_close(reply["outputs"][0], local(x).detach(), rtol=1e-5, atol=1e-5)

        reply = await client.call(address, "moe.backward", {"uid": f"{kind}.0", "inputs": [x],
                                                            "grad_outputs": [grad_out]}, timeout=TIMEOUT)
        x_local = x.clone().requires_grad_()
        local(x_local).backward(grad_out)
        local_opt.step()
        torch.testing.assert_close(reply["grad_inputs"][0], x_local.grad, rtol=1e-5, atol=1e-5)

        # the step was applied on the server: the next forward uses updated weights, like the local copy
        reply = await client.call(address, "moe.forward", {"uid": f"{kind}.0", "inputs": [x]}, timeout=TIMEOUT)
        torch.testing.assert_close(reply["outputs"][0], local(x).detach(), rtol=1e-5, atol=1e-5)
        stats = server.stats()
    for p_remote, p_local in zip(expert.module.parameters(), local.parameters()):
        torch.testing.assert_close(p_remote, p_local, rtol=1e-5, atol=1e-6)
    assert stats["requests"] == {"info": 0, "forward": 2, "backward": 1} and stats["errors_total"] == 0


async def test_bad_inputs_get_typed_errors_while_others_are_served():
    expert = make_expert("ffn.1", "ffn", 8, seed=0)
    good = {"uid": "ffn.1", "inputs": [torch.randn(4, 8)]}
    bad_requests = [
        ("moe.forward", {"uid": "ffn.1", "inputs": [torch.randn(4, 9)]}, "shape"),
        ("moe.forward", {"uid": "ffn.1", "inputs": [torch.randn(4, 8, dtype=torch.float64)]}, "dtype"),
        ("moe.forward", {"uid": "ffn.1", "inputs": [torch.full((2, 8), float("nan"))]}, "NaN"),
        ("moe.forward", {"uid": "ffn.1", "inputs": [torch.randn(17, 8)]}, "exceeds"),
        ("moe.forward", {"uid": "ffn.1", "inputs": "tensor"}, "list"),
        ("moe.forward", {"uid": "ffn.1", "inputs": [torch.randn(2, 8)], "compression": 9}, "compression"),
        ("moe.forward", ["ffn.1"], "uid"),
        ("moe.backward", {"uid": "ffn.1", "inputs": [torch.randn(3, 8)], "grad_outputs": [torch.randn(2, 8)]},
         "batch size"),
        ("moe.backward", {"uid": "ffn.1", "inputs": [torch.randn(3, 8)]}, "grad_outputs"),
        ("moe.backward", {"uid": "ffn.1", "inputs": [torch.randn(3, 8)],
                          "grad_outputs": [torch.full((3, 8), float("inf"))]}, "infinite"),
    ]
    async with serving([expert], max_batch_size=16) as (server, client, address, _):
        other = RPCNode(Identity.generate(), RealNetwork())
        async with other:
            good_results = []

            async def good_caller():
                for _ in range(5):
                    reply = await other.call(address, "moe.forward", good, timeout=TIMEOUT)
                    good_results.append(reply["outputs"][0].shape)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(good_caller)
                for method, args, message in bad_requests:
                    with pytest.raises(BadExpertInput, match=message) as caught:
                        await client.call(address, method, args, timeout=TIMEOUT)
                    assert caught.value.method == method and caught.value.address == address
                with pytest.raises(ExpertNotFound, match="ffn.2"):
                    await client.call(address, "moe.forward", {"uid": "ffn.2", "inputs": [torch.randn(1, 8)]},
                                      timeout=TIMEOUT)
                with pytest.raises(ExpertNotFound):
                    await client.call(address, "moe.info", {"uid": "nope.0"}, timeout=TIMEOUT)
            assert good_results == [(4, 8)] * 5
            reply = await client.call(address, "moe.forward", good, timeout=TIMEOUT)
            assert reply["outputs"][0].shape == (4, 8)
        stats = server.stats()
    assert stats["errors"]["bad_input"] == len(bad_requests) and stats["errors"]["not_found"] == 2
    assert expert.steps == 0  # no bad backward reached the optimizer


async def test_module_failure_is_typed_and_server_keeps_serving():
    expert = make_expert("boom.0", "test_exploding", 4, seed=0)
    async with serving([expert]) as (server, client, address, _):
        with pytest.raises(ExpertFailed, match="exploded"):
            await client.call(address, "moe.forward", {"uid": "boom.0", "inputs": [torch.full((1, 4), 1000.0)]},
                              timeout=TIMEOUT)
        reply = await client.call(address, "moe.forward", {"uid": "boom.0", "inputs": [torch.ones(1, 4)]},
                                  timeout=TIMEOUT)
        assert reply["outputs"][0].shape == (1, 4)
        assert server.stats()["errors"]["expert_failed"] == 1


async def test_concurrent_callers_share_batches_and_get_their_own_rows():
    expert = make_expert("ffn.2", "ffn", 16, seed=0)
    xs = [torch.randn(3, 16) for _ in range(8)]
    results = [None] * len(xs)
    async with serving([expert], min_batch_size=24, batch_timeout=30) as (server, client, address, _):
        async def call(i):
            reply = await client.call(address, "moe.forward", {"uid": "ffn.2", "inputs": [xs[i]]}, timeout=TIMEOUT)
            results[i] = reply["outputs"][0]

        async with trio.open_nursery() as nursery:
            for i in range(len(xs)):
                nursery.start_soon(call, i)
        stats = server.stats()
    assert stats["batches"] == 1 and stats["samples"] == 24
    for x, y in zip(xs, results):
        torch.testing.assert_close(y, expert.module(x).detach(), rtol=1e-5, atol=1e-5)


async def test_compressed_replies_on_request():
    expert = make_expert("ffn.3", "ffn", 32, seed=0)
    x = torch.randn(4, 32)
    async with serving([expert]) as (_, client, address, _):
        exact = await client.call(address, "moe.forward", {"uid": "ffn.3", "inputs": [x]}, timeout=TIMEOUT)
        half = await client.call(address, "moe.forward", {"uid": "ffn.3", "inputs": [x],
                                                          "compression": int(Compression.FLOAT16)}, timeout=TIMEOUT)
    assert half["outputs"][0].dtype == torch.float32
    assert not torch.equal(half["outputs"][0], exact["outputs"][0])
    torch.testing.assert_close(half["outputs"][0], exact["outputs"][0], rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_expert_serves_cpu_callers_and_trains():
    expert = make_expert("ffn.9", "ffn", 64, seed=2, device="cuda", optimizer=OptimizerConfig("adam", lr=0.01))
    local = copy.deepcopy(expert.module).cpu()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    x, grad_out = torch.randn(8, 64), torch.randn(8, 64)
    async with serving([expert]) as (_, client, address, _):
        reply = await client.call(address, "moe.forward", {"uid": "ffn.9", "inputs": [x]}, timeout=TIMEOUT)
        assert reply["outputs"][0].device.type == "cpu"
        torch.testing.assert_close(reply["outputs"][0], local(x).detach(), rtol=1e-3, atol=1e-3)
        reply = await client.call(address, "moe.backward", {"uid": "ffn.9", "inputs": [x],
                                                            "grad_outputs": [grad_out]}, timeout=TIMEOUT)
    x_local = x.clone().requires_grad_()
    local(x_local).backward(grad_out)
    local_opt.step()
    torch.testing.assert_close(reply["grad_inputs"][0], x_local.grad, rtol=1e-3, atol=1e-3)
    for p_remote, p_local in zip(expert.module.parameters(), local.parameters()):
        torch.testing.assert_close(p_remote.cpu(), p_local, rtol=1e-3, atol=1e-4)
