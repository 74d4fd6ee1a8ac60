"""CollaborativeOptimizer over real sockets (127.0.0.1): trainers are `peer.client.Swarm`s (each its own bridge
thread) around one DHT bootstrap node; what a user relies on: the collective epoch ends for everyone, the update
applied is the sample-weighted mean of everyone's gradients, parameters agree afterwards, and a trainer that
joins late or falls behind gets the swarm's current state."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from averaging.collaborative import CollaborativeOptimizer, initialize_optimizer_state, state_tensors
from averaging.progress import parse_records
from peer.client import Swarm
from tests.threaded import run_in_threads


def _template(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 1)


def _data(seed: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 1, generator=generator)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------------- no network


def test_optimizer_state_is_created_without_moving_the_parameters():
    model = _template()
    before = _params(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    initialize_optimizer_state(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    names = [name for name, _ in state_tensors(optimizer)]
    assert names == ["param.0.0", "state.0.0.exp_avg", "state.0.0.exp_avg_sq", "state.0.0.step",
                     "param.0.1", "state.0.1.exp_avg", "state.0.1.exp_avg_sq", "state.0.1.step"]
    assert all(not t.any() for name, t in state_tensors(optimizer) if name.startswith("state."))
    # the first real step behaves exactly as on a fresh optimizer
    fresh_model = _template()
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
    for m, opt in ((model, optimizer), (fresh_model, fresh)):
        x, y = _data(1)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    assert all(torch.allclose(a, b) for a, b in zip(_params(model), _params(fresh_model)))


# ------------------------------------------------------------------------------------------- two trainers


def _run_pair(bootstrap, mode: str, make_optimizer, target: int = 400, batch: int = 8,
              listen: tuple[bool, bool] = (True, True), matchmaking_time: float = 5.0) -> dict[int, dict]:
    """Two trainers in threads, each with its own Swarm and data; each runs until its first epoch ends."""
    template = _template()
    results: dict[int, dict] = {}
    ready = threading.Barrier(2, timeout=60)

    def train(index: int) -> None:
        with Swarm([bootstrap]) as swarm:
            model = copy.deepcopy(template)
            opt = CollaborativeOptimizer(make_optimizer(model), swarm, f"pair-{mode}", target_batch_size=target,
                                         batch_size_per_step=batch, average=mode, listen=listen[index],
                                         matchmaking_time=matchmaking_time)
            x, y = _data(10 + index, batch)
            ready.wait()
            steps = 0
            while True:
                nn.functional.mse_loss(model(x), y).backward()
                steps += 1
                if opt.step():
                    break
            results[index] = {"samples": steps * batch, "params": _params(model), "stats": opt.stats(),
                              "epoch": opt.epoch, "peer_id": str(opt.averager.peer_id)}
            opt.close()

    run_in_threads(train, 2, timeout=120)
    assert set(results) == {0, 1}
    return results


def test_the_epoch_update_is_the_sample_weighted_mean_gradient_of_both_trainers(bootstrap):
    lr = 0.1
    results = _run_pair(bootstrap, "gradients", lambda model: torch.optim.SGD(model.parameters(), lr=lr))
    a, b = results[0], results[1]
    for me, other in ((a, b), (b, a)):
        assert me["epoch"] == 1
        assert me["stats"]["averaging_rounds"] == 1
        assert me["stats"]["group_sizes"] == {2: 1}
        assert me["stats"]["peers_averaged_with"] == [other["peer_id"]]
    # reference: one SGD step with the sample-weighted mean of the two trainers' gradients at the start point
    # (in gradients mode the parameters do not move within an epoch, so every local batch had the same gradient)
    reference = _template()
    grads = []
    for index in (0, 1):
        model = _template()
        x, y = _data(10 + index, 8)
        nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    n0, n1 = a["samples"], b["samples"]
    with torch.no_grad():
        for p, g0, g1 in zip(reference.parameters(), *grads):
            p -= lr * (n0 * g0 + n1 * g1) / (n0 + n1)
    for got in (a["params"], b["params"]):
        for value, expected in zip(got, reference.parameters()):
            assert torch.allclose(value, expected, atol=1e-6), (value, expected)


def test_parameter_averaging_leaves_both_trainers_with_the_same_model(bootstrap):
    results = _run_pair(bootstrap, "parameters", lambda model: torch.optim.Adam(model.parameters(), lr=0.05))
    a, b = results[0], results[1]
    assert a["stats"]["averaging_rounds"] == b["stats"]["averaging_rounds"] == 1
    assert a["stats"]["peers_averaged_with"] == [b["peer_id"]]
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.allclose(pa, pb, atol=1e-6)
    assert not all(torch.equal(p, q) for p, q in zip(a["params"], _params(_template())))  # it did train


def test_a_client_mode_trainer_averages_in_a_group_with_a_reachable_one(bootstrap):
    results = _run_pair(bootstrap, "gradients", lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
                        listen=(True, False))
    a, b = results[0], results[1]
    assert a["stats"]["peers_averaged_with"] == [b["peer_id"]]
    assert b["stats"]["peers_averaged_with"] == [a["peer_id"]]
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_two_client_mode_trainers_cannot_group_but_still_apply_their_update(bootstrap):
    # nobody in the group could reduce a part: the round is skipped within the matchmaking window and each
    # trainer applies its own accumulated gradient and moves on
    results = _run_pair(bootstrap, "gradients", lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
                        listen=(False, False), matchmaking_time=1.0)
    for _index, result in results.items():
        assert result["epoch"] == 1
        assert result["stats"]["averaging_rounds"] == 0
        assert result["stats"]["averaging_failures"] == result["stats"]["averaging_attempts"] == 1
        assert not all(torch.equal(p, q) for p, q in zip(result["params"], _params(_template())))


def test_a_crashed_partner_costs_at_most_one_failed_round(bootstrap):
    template = _template()
    ready, dead = threading.Barrier(2, timeout=60), threading.Event()
    stats: dict = {}

    def trainer(index: int) -> None:
        try:
            swarm = Swarm([bootstrap])
            model = copy.deepcopy(template)
            opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, "crash",
                                         target_batch_size=200, batch_size_per_step=8, matchmaking_time=1.0)
            x, y = _data(20 + index)
            ready.wait()
            epochs = 1 if index == 1 else 5
            while opt.epoch < epochs:
                if index == 0 and opt.epoch == 1:
                    dead.wait(timeout=60)
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            stats[index] = opt.stats()
            if index == 1:
                swarm.run(opt.tracker.publish)  # its record says: in epoch 1, training at full speed
                swarm.close()  # a crash as the others see it: no goodbye, its progress record stays behind
                dead.set()
            else:
                opt.close()
                swarm.close()
        except BaseException:
            dead.set()  # the other trainer stops waiting for this one
            raise

    run_in_threads(trainer, 2, timeout=120)
    survivor = stats[0]
    assert survivor["averaging_rounds"] == 1  # the first epoch, together
    # afterwards the crashed partner's live-looking record costs at most one round that finds nobody: the
    # survivor then moves to the next epoch, where the dead record (an older epoch) no longer counts, and goes
    # on alone instead of waiting for it every epoch until the record expires
    assert survivor["averaging_failures"] <= 1
    assert survivor["local_transitions"] >= 3


# ------------------------------------------------------------------------------------------- catching up


def test_a_late_or_lagging_trainer_downloads_the_swarms_state_and_epoch(bootstrap):
    with Swarm([bootstrap]) as leader_swarm, Swarm([bootstrap]) as late_swarm, Swarm([bootstrap]) as lagging_swarm:
        leader_model = _template(0)
        leader = CollaborativeOptimizer(torch.optim.Adam(leader_model.parameters(), lr=0.05), leader_swarm,
                                        "catch-up", target_batch_size=16, batch_size_per_step=8)
        x, y = _data(3)
        for _ in range(6):  # alone in the run: an epoch every 2 steps, no averaging partner needed
            nn.functional.mse_loss(leader_model(x), y).backward()
            leader.step()
        assert leader.epoch == 3
        assert leader.stats()["local_transitions"] == 3
        leader_swarm.run(leader.tracker.publish)  # the leader's epoch is in the DHT before the others look

        late_model = _template(1)  # other weights: joining must replace them
        late = CollaborativeOptimizer(torch.optim.Adam(late_model.parameters(), lr=0.05), late_swarm,
                                      "catch-up", target_batch_size=16, batch_size_per_step=8)
        assert late.epoch == 3
        assert late.stats()["state_loads"] == 1
        assert all(torch.equal(p, q) for p, q in zip(_params(late_model), _params(leader_model)))
        for (name, mine), (_, theirs) in zip(state_tensors(late.optimizer), state_tensors(leader.optimizer)):
            assert torch.equal(mine, theirs), name  # Adam moments and step count came along

        lagging_model = _template(2)
        lagging = CollaborativeOptimizer(torch.optim.Adam(lagging_model.parameters(), lr=0.05), lagging_swarm,
                                         "catch-up", target_batch_size=16, batch_size_per_step=8,
                                         load_state_on_join=False)
        assert lagging.epoch == 0
        nn.functional.mse_loss(lagging_model(x), y).backward()
        assert lagging.step()  # two epochs behind: catch up instead of applying its own update
        assert lagging.epoch == 3
        assert all(torch.equal(p, q) for p, q in zip(_params(lagging_model), _params(leader_model)))
        # the verified parallel download: every trainer of epoch 3 that holds the leader's state may serve it
        assert 1 <= lagging.stats()["state_load_sources"] <= 2
        for opt in (leader, late, lagging):
            opt.close()


# ------------------------------------------------------------------------------------------- the per-step path


def test_a_step_between_epoch_boundaries_makes_no_bridge_round_trip_and_the_count_is_still_published(bootstrap):
    with Swarm([bootstrap]) as swarm, Swarm([bootstrap]) as reader:
        model = _template()
        opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, "local-steps",
                                     target_batch_size=10**9, batch_size_per_step=8)
        round_trips = []
        original = swarm.bridge.run
        swarm.bridge.run = lambda fn, *args: (round_trips.append(fn), original(fn, *args))[1]
        try:
            x, y = _data(4)
            for _ in range(25):
                nn.functional.mse_loss(model(x), y).backward()
                assert not opt.step()
        finally:
            swarm.bridge.run = original
        assert round_trips == []
        assert opt.last_progress.samples == 200 and opt.last_progress.epoch == 0
        # the tracker takes the count when it builds its next record: another trainer reads all 200 samples
        swarm.run(opt.tracker.publish)
        records = reader.run(lambda: reader.dht.get("local-steps.progress", latest=True))
        (record,) = parse_records(records, reader.dht.now()).values()
        assert (record.epoch, record.samples) == (0, 200)
        assert record.samples_per_second > 0
        opt.close()
