"""Packed expert calls and kept forwards (issue 39): one request and one reply tensor per server per layer call,
checked as a whole with per-expert failures; a forward under autograd keeps its graph on the server so the
backward does not recompute it, bounded in bytes and time; and the results equal the per-expert path."""

from __future__ import annotations

import gc
import weakref

import torch

from moe import calls
from moe.errors import BadExpertInput
from moe.experts import OptimizerConfig, make_expert
from moe.kept import KeptStore
from moe.mixture import RemoteMixtureOfExperts
from moe.remote_expert import RemoteExpert
from tests.moe.process_training import TIMEOUT
from tests.moe.two_layer_grid import HIDDEN, server_experts, static_model, two_servers


def _count_recomputes(experts) -> list[int]:
    """Wrap each expert's `_recompute` (the backward's forward recomputation); returns the running count."""
    count = [0]
    for expert in experts:
        original = expert._recompute

        def counted(inputs, original=original):
            count[0] += 1
            return original(inputs)

        expert._recompute = counted
    return count


def test_packed_calls_equal_single_calls_bit_for_bit_with_and_without_kept_forwards(harness):
    """A packed forward + backward (kept graphs) gives exactly the tensors of one call per expert (recomputed
    backward), and the kept backward recomputes nothing."""
    served = server_experts(0, lr=0.0)
    server = harness.server(served)
    swarm = harness.client()
    uids = ["la.0", "la.1", "lb.2"]
    rows = [3, 1, 5]
    xs = [torch.randn(r, HIDDEN) for r in rows]
    grads = [torch.randn(r, HIDDEN) for r in rows]
    recomputes = _count_recomputes(served)

    async def compare() -> None:
        forward = await calls.forward_packed(swarm.rpc, server.address, server.peer_id, uids, rows,
                                             [torch.cat(xs)], timeout=TIMEOUT, out_shape=(HIDDEN,), keep=True)
        assert len(forward.tensors) == 1 and forward.tensors[0].shape == (sum(rows), HIDDEN)
        assert not forward.errors and all(token > 0 for token in forward.kept)
        backward = await calls.backward_packed(swarm.rpc, server.address, server.peer_id, uids, rows,
                                               [torch.cat(xs)], [torch.cat(grads)], timeout=TIMEOUT,
                                               kept=forward.kept)
        assert recomputes[0] == 0  # every backward went through its kept graph
        outputs = calls.unpack(forward, rows)
        grad_inputs = calls.unpack(backward, rows)
        for uid, x, g, out, grad in zip(uids, xs, grads, outputs, grad_inputs):
            single = await calls.forward(swarm.rpc, server.address, server.peer_id, uid, [x], timeout=TIMEOUT)
            single_grad = await calls.backward(swarm.rpc, server.address, server.peer_id, uid, [x], [g],
                                               timeout=TIMEOUT)
            assert not isinstance(out, Exception) and not isinstance(grad, Exception)
            torch.testing.assert_close(out[0], single[0], atol=0, rtol=0)
            torch.testing.assert_close(grad[0], single_grad[0], atol=0, rtol=0)
        assert recomputes[0] == 3  # the single backwards kept nothing: recomputed
        # a token the server does not hold costs a recomputation, never a failure
        again = await calls.backward_packed(swarm.rpc, server.address, server.peer_id, uids, rows,
                                            [torch.cat(xs)], [torch.cat(grads)], timeout=TIMEOUT,
                                            kept=forward.kept)
        torch.testing.assert_close(again.tensors[0], backward.tensors[0], atol=0, rtol=0)
        assert recomputes[0] == 6

    swarm.bridge.run(compare)
    kept = server.server.stats()["kept"]
    assert kept["kept"] == 3 and kept["used"] == 3 and kept["held"] == 0 and kept["nbytes"] == 0


def test_packed_call_fails_only_the_experts_whose_rows_are_bad(harness):
    server = harness.server(server_experts(0, lr=0.0))
    swarm = harness.client()
    x = torch.randn(6, HIDDEN)
    x[4, 1] = float("nan")  # in la.2's rows

    async def check() -> None:
        reply = await calls.forward_packed(swarm.rpc, server.address, server.peer_id,
                                           ["la.0", "la.9", "la.2"], [3, 1, 2], [x], timeout=TIMEOUT,
                                           out_shape=(HIDDEN,))
        assert sorted(reply.errors) == [1, 2]
        assert isinstance(reply.errors[2], BadExpertInput) and "NaN" in str(reply.errors[2])
        single = await calls.forward(swarm.rpc, server.address, server.peer_id, "la.0", [x[:3]], timeout=TIMEOUT)
        torch.testing.assert_close(reply.tensors[0][:3], single[0], atol=0, rtol=0)
        assert not bool(reply.tensors[0][3:].any())  # failed experts' rows are zeros

    swarm.bridge.run(check)


def test_mixture_training_through_packed_kept_calls_equals_the_recomputing_path(harness):
    """Two mixture layers over two servers, experts learning (SGD): outputs, input gradients and the experts'
    weights after 3 steps equal those of the same run whose servers keep nothing (every backward recomputed)."""
    results = []
    for kept_bytes in (256 << 20, 0):  # 0: nothing fits, every backward recomputes
        servers = [harness.server(server_experts(index, lr=0.1), kept_bytes=kept_bytes) for index in range(2)]
        locations = {uid: loc for server in servers for uid, loc in server.locations().items()}
        swarm = harness.client()
        model = static_model(swarm, locations, k_best=3)
        for layer in model.layers:
            torch.manual_seed(7)
            layer.gate.reset_parameters()
        torch.manual_seed(3)
        outs, grads = [], []
        for _ in range(3):
            x = torch.randn(10, HIDDEN, requires_grad=True)
            out = model(x)
            out.pow(2).sum().backward()
            outs.append(out.detach())
            grads.append(x.grad)
        weights = {uid: [p.detach().clone() for p in e.module.parameters()]
                   for server in servers for uid, e in server.server.experts.items()}
        used = sum(server.server.stats()["kept"]["used"] for server in servers)
        results.append((outs, grads, weights, used))
        for server in servers:
            server.kill()
    (outs, grads, weights, used), (outs0, grads0, weights0, used0) = results
    assert used > 0 and used0 == 0
    for a, b in zip(outs + grads, outs0 + grads0):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for uid in weights:
        for a, b in zip(weights[uid], weights0[uid]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_remote_expert_backward_uses_the_kept_graph_and_no_grad_keeps_nothing(harness):
    expert = make_expert("la.0", "ffn", HIDDEN, seed=1, optimizer=OptimizerConfig("sgd", lr=0.0))
    server = harness.server([expert])
    swarm = harness.client()
    recomputes = _count_recomputes([expert])
    remote = RemoteExpert("la.0", server.address, swarm, peer_id=server.peer_id, timeout=TIMEOUT)
    with torch.no_grad():
        remote(torch.randn(2, HIDDEN))
    assert server.server.stats()["kept"]["kept"] == 0
    x = torch.randn(4, HIDDEN, requires_grad=True)
    remote(x).sum().backward()
    assert recomputes[0] == 0 and server.server.stats()["kept"]["used"] == 1
    local = x.detach().requires_grad_()
    expert.module(local).sum().backward()
    torch.testing.assert_close(x.grad, local.grad)


def test_a_stale_kept_graph_is_recomputed():
    """Once the expert stepped since the forward (another caller's backward), its kept graph is not used: the
    backward recomputes with the current weights, exactly as without keeping."""
    expert = make_expert("la.0", "ffn", HIDDEN, seed=1, optimizer=OptimizerConfig("sgd", lr=0.5))
    twin = make_expert("la.0", "ffn", HIDDEN, seed=1, optimizer=OptimizerConfig("sgd", lr=0.5))
    x, g = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    _, kept = expert.forward_keeping([x])
    expert.backward([x], [g])  # a step: the kept graph is now stale
    twin.backward([x], [g])
    assert kept.held
    torch.testing.assert_close(expert.backward([x], [g], kept)[0], twin.backward([x], [g])[0], atol=0, rtol=0)
    assert not kept.held


def test_a_thousand_abandoned_forwards_are_freed_by_their_deadline_and_the_byte_bound():
    """Kept graphs whose backward never comes are freed: the store's bytes go back to zero at the TTL and the
    activations themselves are garbage (weak references dead); the byte bound evicts the oldest first."""
    expert = make_expert("la.0", "ffn", HIDDEN, seed=1)
    store = KeptStore(max_bytes=1 << 30, ttl=5.0)
    refs = []
    for i in range(1000):
        _, graph = expert.forward_keeping([torch.randn(2, HIDDEN)])
        assert graph.outputs is not None
        refs.append(weakref.ref(graph.outputs[0]))
        store.put(f"caller{i % 7}", "la.0", graph, now=i * 1e-3)
        del graph
    assert len(store) == 1000 and store.nbytes > 0
    store.expire(now=4.0)
    assert len(store) == 1000  # not yet
    store.expire(now=6.0)
    gc.collect()
    assert len(store) == 0 and store.nbytes == 0 and all(ref() is None for ref in refs)
    assert store.stats().expired == 1000

    _, one = expert.forward_keeping([torch.randn(2, HIDDEN)])
    small = KeptStore(max_bytes=3 * one.nbytes, ttl=5.0)
    tokens = [small.put("a", "la.0", expert.forward_keeping([torch.randn(2, HIDDEN)])[1], now=0.0)
              for _ in range(5)]
    assert len(small) == 3 and small.nbytes <= 3 * one.nbytes and small.stats().evicted == 2
    assert small.take("a", "la.0", tokens[0], now=0.0) is None  # the oldest went first
    assert small.take("b", "la.0", tokens[4], now=0.0) is None  # another caller's token is not its own
    assert small.take("a", "la.1", tokens[4], now=0.0) is None  # nor another expert's
    assert small.take("a", "la.0", tokens[4], now=0.0) is not None


def test_a_server_killed_mid_call_fails_the_packed_call_as_a_whole(harness):
    servers, locations = two_servers(harness)
    swarm = harness.client()
    model = static_model(swarm, locations, k_best=4)
    x = torch.randn(6, HIDDEN, requires_grad=True)
    model(x).sum().backward()  # both servers answer
    servers[1].kill()
    out = model(x)  # its experts fail as a group; the layer mixes the other server's
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    layer: RemoteMixtureOfExperts = model.layers[0]
    assert layer.client.stats["forward_failures"] >= 4

    async def call_dead() -> None:
        try:
            await calls.forward_packed(swarm.rpc, servers[1].address, servers[1].peer_id, ["la.4"], [1],
                                       [torch.randn(1, HIDDEN)], timeout=5.0)
        except calls.CALL_FAILURES:
            return
        raise AssertionError("a call to a killed server succeeded")

    swarm.bridge.run(call_dead)
