"""Batched expert calls: a mixture layer sends one RPC per server per forward and per backward, carrying every
expert of that server the batch routes to, and faults stay per expert (an expert's error fails it alone, a dead
server fails all its experts in that call, and training goes on through either)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe import calls
from moe.beam_search import StaticGridOracle
from moe.errors import BadExpertOutput, ExpertNotFound
from moe.experts import ExpertKind, make_expert, register_expert_kind
from moe.schema import TensorSpec
from tests.moe.bad_experts import AnswersInf
from tests.moe.process_training import TIMEOUT
from tests.moe.two_layer_grid import (
    GRID,
    HIDDEN,
    LAYERS,
    TwoLayers,
    mixture_layer,
    server_experts,
    static_model,
    two_servers,
    uid_seed,
)

register_expert_kind(ExpertKind("test_batched_inf", lambda h, **o: AnswersInf(h),
                                lambda h, **o: [TensorSpec((h,))]), replace=True)


def _rpc_calls(server) -> dict[str, int]:
    return dict(server.server.stats()["rpc_calls"])


def test_a_step_sends_one_forward_and_one_backward_rpc_per_server_and_layer(harness):
    servers, locations = two_servers(harness, lr=0.01)
    swarm = harness.client()
    torch.manual_seed(0)
    model = static_model(swarm, locations, k_best=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        before = [_rpc_calls(server) for server in servers]
        sent_before = swarm.rpc.stats["calls_sent"]
        layer_before = [dict(layer.client.stats) for layer in model.layers]
        x = torch.randn(16, HIDDEN)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for server, was in zip(servers, before):
            now = _rpc_calls(server)
            delta = {method: now[method] - was[method] for method in now}
            # one batched call per layer each way (16 samples x 3 of 8 experts reach both servers in each
            # layer), and no call to a single expert
            assert delta[calls.FORWARD_BATCH] == len(LAYERS), (step, delta)
            assert delta[calls.BACKWARD_BATCH] == len(LAYERS), (step, delta)
            assert delta[calls.FORWARD] == delta[calls.BACKWARD] == 0
        # counted at the client's RPC layer too: nothing else was sent
        assert swarm.rpc.stats["calls_sent"] - sent_before == 2 * len(servers) * len(LAYERS)
        for layer, was in zip(model.layers, layer_before):
            stats = layer.client.stats
            assert stats["forward_rpcs"] - was["forward_rpcs"] == len(servers)
            assert stats["backward_rpcs"] - was["backward_rpcs"] == len(servers)
            assert stats["forward_calls"] - was["forward_calls"] > len(servers)  # several experts per RPC
            assert stats["forward_failures"] == stats["backward_failures"] == 0


def _local_reference(x: torch.Tensor, model: TwoLayers) -> tuple[torch.Tensor, list[dict[str, nn.Module]]]:
    """The same model with every expert computed in this process (k_best = the whole grid, so routing is the
    softmax over all experts)."""
    experts = [{f"{prefix}.{i}": make_expert(f"{prefix}.{i}", "ffn", HIDDEN, seed=uid_seed(f"{prefix}.{i}")).module
                for i in range(GRID)} for prefix in LAYERS]
    h = x
    for layer, prefix, table in zip(model.layers, LAYERS, experts):
        weights = torch.softmax(layer.gate(h), dim=1)  # [B, GRID]
        outputs = torch.stack([table[f"{prefix}.{i}"](h) for i in range(GRID)], dim=1)
        h = h + torch.einsum("bk,bko->bo", weights, outputs)
    return h, experts


def test_gradients_match_the_same_model_computed_locally(harness):
    """Inputs, gate and expert gradients through batched calls equal those of the local computation: the
    servers' SGD step (lr 0.5) moved each expert's weights by exactly -lr times the local gradient."""
    lr = 0.5
    servers, locations = two_servers(harness, lr=lr)
    swarm = harness.client()
    torch.manual_seed(1)
    model = static_model(swarm, locations, k_best=GRID)
    x = torch.randn(12, HIDDEN, requires_grad=True)
    target = torch.randn(12, HIDDEN)

    out = model(x)
    ((out - target) ** 2).mean().backward()
    remote_x_grad = x.grad.clone()
    remote_gate_grads = [layer.gate.weight.grad.clone() for layer in model.layers]

    x.grad = None
    model.zero_grad()
    ref_out, ref_experts = _local_reference(x, model)
    ((ref_out - target) ** 2).mean().backward()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(remote_x_grad, x.grad, atol=1e-5, rtol=1e-4)
    for remote, layer in zip(remote_gate_grads, model.layers):
        torch.testing.assert_close(remote, layer.gate.weight.grad, atol=1e-5, rtol=1e-4)
    served = {uid: expert for server in servers for uid, expert in server.experts.items()}
    for table in ref_experts:
        for uid, module in table.items():
            initial = make_expert(uid, "ffn", HIDDEN, seed=uid_seed(uid)).module
            for after, before, local in zip(served[uid].module.parameters(), initial.parameters(),
                                            module.parameters()):
                torch.testing.assert_close(after.detach(), before.detach() - lr * local.grad, atol=1e-5, rtol=1e-4)


def test_batched_calls_answer_as_single_calls_do_and_fail_per_expert(harness):
    """forward_batch / backward_batch give the same tensors as one call per expert, and a missing expert fails
    alone, with the typed error a single call raises."""
    server = harness.server(server_experts(0, lr=0.0))
    swarm = harness.client()
    peer_id = server.peer_id
    xs = {uid: torch.randn(3 + i, HIDDEN) for i, uid in enumerate(["la.0", "la.1", "lb.2"])}
    grads = {uid: torch.randn_like(x) for uid, x in xs.items()}

    async def compare() -> None:
        batch = await calls.forward_batch(swarm.rpc, server.address, peer_id,
                                          [(uid, [x]) for uid, x in xs.items()] + [("la.7", [xs["la.0"]])],
                                          timeout=TIMEOUT, out_shape=(HIDDEN,))
        assert isinstance(batch[-1], ExpertNotFound) and "la.7" in str(batch[-1])
        for (uid, x), answer in zip(xs.items(), batch):
            single = await calls.forward(swarm.rpc, server.address, peer_id, uid, [x], timeout=TIMEOUT)
            assert not isinstance(answer, Exception)
            torch.testing.assert_close(answer[0], single[0], atol=0, rtol=0)
        back = await calls.backward_batch(swarm.rpc, server.address, peer_id,
                                          [(uid, [x], [grads[uid]]) for uid, x in xs.items()], timeout=TIMEOUT)
        for (uid, x), answer in zip(xs.items(), back):
            single = await calls.backward(swarm.rpc, server.address, peer_id, uid, [x], [grads[uid]],
                                          timeout=TIMEOUT)
            assert not isinstance(answer, Exception)
            torch.testing.assert_close(answer[0], single[0], atol=0, rtol=0)
        with pytest.raises(ValueError, match="at most once"):
            await calls.forward_batch(swarm.rpc, server.address, peer_id, [("la.0", [xs["la.0"]])] * 2,
                                      timeout=TIMEOUT)
        wrong = await calls.forward_batch(swarm.rpc, server.address, peer_id,
                                          [("la.0", [xs["la.0"]])], timeout=TIMEOUT, out_shape=(HIDDEN + 1,))
        assert isinstance(wrong[0], BadExpertOutput)

    swarm.bridge.run(compare)


def test_one_bad_expert_in_a_batched_call_is_masked_alone(harness):
    """An expert answering inf fails alone: its server's other experts in the same RPC are used, and only it is
    banned; the step succeeds with finite outputs."""
    bad = make_expert("la.3", "test_batched_inf", HIDDEN, seed=0)
    good = [expert for expert in server_experts(0, lr=0.0) if expert.uid.startswith("la.") and expert.uid != "la.3"]
    server = harness.server([*good, bad])
    swarm = harness.client()
    locations = server.locations()
    layer = mixture_layer(swarm, "la", 4, 4, StaticGridOracle(locations))
    x = torch.randn(8, HIDDEN, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    stats = layer.client.stats
    assert stats["forward_rpcs"] == 1 and stats["forward_failures"] == 1 and stats["forward_calls"] == 3
    assert stats["backward_rpcs"] == 1 and stats["backward_calls"] == 3 and stats["backward_failures"] == 0

    async def banned() -> dict[str, bool]:
        return {uid: layer.client.blacklist.is_banned(uid, loc) for uid, loc in locations.items()}

    assert swarm.bridge.run(banned) == {"la.0": False, "la.1": False, "la.2": False, "la.3": True}


# ------------------------------------------------------------------------------------- SIGKILLed server processes


@pytest.mark.slow
def test_two_layer_training_survives_servers_killed_mid_forward_and_mid_backward(dht_harness, server_processes):
    """Three server processes with 4 experts of each layer each; server 1 is SIGKILLed inside a (batched)
    forward at step 5, server 2 inside a backward at step 12. Each kill fails every expert of that server in
    that call at once (one RPC carried them all), bans the server, and no step is lost or NaN."""
    bootstrap = dht_harness.dht_bootstrap()
    processes = [
        server_processes.launch([f"{layer}.{4 * i + j}" for layer in LAYERS for j in range(4)], "--hidden",
                                str(HIDDEN), "--seed", str(10 * i), "--lr", "0.01", "--torch-threads", "1",
                                "--dht-peer", "%s:%d" % bootstrap, phase_hooks=i > 0)
        for i in range(3)
    ]
    for process in processes:
        server_processes.wait_ready(process, timeout=120.0)
    swarm = dht_harness.client()
    model = TwoLayers([mixture_layer(swarm, prefix, 12, k_best=6) for prefix in LAYERS])
    head = nn.Linear(HIDDEN, HIDDEN)
    opt = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=0.01)
    torch.manual_seed(0)
    xs, ys = torch.randn(256, HIDDEN), torch.randn(256, HIDDEN)
    kills = {}
    losses, forward_failed, backward_failed = [], [], []
    for step in range(20):
        x, y = xs[(step * 32) % 256:][:32], ys[(step * 32) % 256:][:32]
        if step == 5:
            kills["forward"] = server_processes.kill_in(processes[1], "forward")
        before = [dict(layer.client.stats) for layer in model.layers]
        loss = ((head(model(x)) - y) ** 2).mean()
        middle = [dict(layer.client.stats) for layer in model.layers]
        if step == 12:
            kills["backward"] = server_processes.kill_in(processes[2], "backward")
        opt.zero_grad()
        loss.backward()
        opt.step()
        after = [dict(layer.client.stats) for layer in model.layers]
        losses.append(loss.item())
        forward_failed.append(sum(m["forward_failures"] - b["forward_failures"] for b, m in zip(before, middle)))
        backward_failed.append(sum(a["backward_failures"] - m["backward_failures"] for m, a in zip(middle, after)))
    assert kills["forward"].killed.wait(TIMEOUT) and kills["backward"].killed.wait(TIMEOUT)
    assert all(torch.isfinite(torch.tensor(losses)))  # 0 NaN steps, and every step ran
    assert sum(forward_failed[:5]) == sum(backward_failed[:5]) == 0
    # the forward at step 5 lost the killed server's experts in the call it was computing: all of them at once
    assert forward_failed[5] >= 2 and backward_failed[5] == 0
    assert forward_failed[12] == 0 and backward_failed[12] >= 2
    assert sum(forward_failed[6:12]) == sum(backward_failed[6:12]) == 0  # the dead server was avoided after
    assert sum(forward_failed[13:]) == sum(backward_failed[13:]) == 0


# ------------------------------------------------------------------------------------------------ the runtime


class _Threads(nn.Module):
    """Linear layer that records the thread computing it, and fails on a marker value."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.threads: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import threading

        self.threads.append(threading.get_ident())
        if bool((x == 1234.0).any()):
            raise RuntimeError("marker value")
        return self.linear(x)


register_expert_kind(ExpertKind("test_batched_threads", lambda h, **o: _Threads(h),
                                lambda h, **o: [TensorSpec((h,))]), replace=True)


async def test_run_many_computes_idle_experts_in_one_thread_hand_off_and_fails_per_expert():
    import threading

    import trio

    from moe.runtime import BACKWARD, FORWARD, ExpertComputeError, ExpertRuntime

    experts = {f"thr.{i}": make_expert(f"thr.{i}", "test_batched_threads", HIDDEN, seed=i) for i in range(3)}
    runtime = ExpertRuntime(experts, inline_threshold=0.0)  # always in a worker thread
    xs = [torch.randn(2 + i, HIDDEN) for i in range(3)]
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        outs = await runtime.run_many(FORWARD, [(uid, [x]) for uid, x in zip(experts, xs)])
        threads = {expert.module.threads[-1] for expert in experts.values()}
        assert len(threads) == 1 and threads != {threading.get_ident()}  # one hand-off for the three
        for expert, x, out in zip(experts.values(), xs, outs):
            assert not isinstance(out, Exception)
            torch.testing.assert_close(out[0], expert.module.linear(x))
        bad = xs[1].clone()
        bad[0, 0] = 1234.0
        mixed = await runtime.run_many(FORWARD, [("thr.0", [xs[0]]), ("thr.1", [bad])])
        assert not isinstance(mixed[0], Exception) and isinstance(mixed[1], ExpertComputeError)
        grads = await runtime.run_many(BACKWARD, [("thr.2", [xs[2], torch.ones_like(xs[2])])])
        assert not isinstance(grads[0], Exception) and grads[0][0].shape == xs[2].shape
        assert experts["thr.2"].steps == 1
        nursery.cancel_scope.cancel()
    stats = runtime.stats()["per_expert"]
    assert stats["thr.1"]["failures"] == 1 and stats["thr.0"]["batches"]["forward"] == 2


def test_one_dimensional_search_shortcut_equals_the_general_search():
    """The 1-D grid shortcut (`GridSearch._choose_flat`) picks what the general heap search picks on the same
    experts laid out as a (1, N) grid, ties, bans and exclusions included."""
    import random

    from moe.beam_search import ExpertLocation, GridSearch

    rng = random.Random(5)
    for trial in range(30):
        n, batch, k = rng.randint(1, 12), rng.randint(1, 9), rng.randint(1, 5)
        alive = [c for c in range(n) if rng.random() < 0.8]
        location = ExpertLocation("127.0.0.1", 1, "ab" * 20)
        banned_coords = {c for c in alive if rng.random() < 0.2}
        rows = [[round(rng.gauss(0, 1), 1) for _ in range(n)] for _ in range(batch)]  # rounding makes ties
        excluded = [{c for c in alive if rng.random() < 0.2} for _ in range(batch)]
        def banned(uid, location, banned_coords=banned_coords):
            return int(uid.split(".")[-1]) in banned_coords

        flat = GridSearch("ffn", (n,), [rows], k, banned=banned, exclude=[{f"ffn.{c}" for c in e} for e in excluded])
        flat.provide({"ffn.": {c: ["127.0.0.1", 1, "ab" * 20] for c in alive}})
        general = GridSearch("grid", (1, n), [[[0.0]] * batch, rows], k,
                             banned=banned,
                             exclude=[{f"grid.0.{c}" for c in e} for e in excluded])
        general.provide({"grid.": {0: None}})
        general.provide({"grid.0.": {c: ["127.0.0.1", 1, "ab" * 20] for c in alive}})
        assert flat.done and general.done
        got = [[(c.coords[0], c.score, c.location) for c in sample] for sample in flat.results()]
        want = [[(c.coords[1], c.score, location) for c in sample] for sample in general.results()]
        assert got == want, trial


def test_server_refuses_malformed_batched_calls_and_answers_bad_entries_alone(harness):
    from moe.errors import BadExpertInput

    server = harness.server(server_experts(0, lr=0.0))
    swarm = harness.client()
    good = {"uid": "la.0", "inputs": [torch.randn(2, HIDDEN)]}

    async def check() -> None:
        for args, why in [
            ({"experts": []}, "expected arguments"),
            ({"experts": "la.0"}, "expected arguments"),
            (["la.0"], "expected arguments"),
            ({"experts": [good, good]}, "at most once"),
            ({"experts": [good] + [{"uid": f"x.{i}", "inputs": []} for i in range(8)]}, "at most once"),
            ({"experts": [good], "compression": 9}, "compression"),
        ]:
            with pytest.raises(BadExpertInput, match=why):
                await swarm.rpc.call(server.address, calls.FORWARD_BATCH, args, timeout=TIMEOUT)
        reply = await swarm.rpc.call(server.address, calls.FORWARD_BATCH, {"experts": [
            good, {"uid": "la.1", "inputs": [torch.randn(2, HIDDEN + 1)]}, "garbage"]}, timeout=TIMEOUT)
        first, second, third = reply["results"]
        assert first["outputs"][0].shape == (2, HIDDEN)
        assert second["error"][0] == BadExpertInput.code and "shape" in second["error"][1]
        assert third["error"][0] == BadExpertInput.code

    swarm.bridge.run(check)
    assert server.server.stats()["rpc_calls"][calls.FORWARD_BATCH] == 1  # refused calls are not counted
