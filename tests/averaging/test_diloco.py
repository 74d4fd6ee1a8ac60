"""DiLoCo: the blockwise INT8 codec and error feedback (no network), then trainers on the in-memory network, each a
thread around one shared bridge (its trio thread runs every simulated peer): outer steps agree bit for bit and
equal a reference Nesterov step on the sample-weighted mean of the pseudo-gradients; a newcomer and a
partitioned trainer get the swarm's outer state; overlap never makes an inner step wait on a fast network."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import pytest
import torch
import trio
from torch import nn

from averaging import progress
from averaging.diloco import DiLoCoHooks, DiLoCoOptimizer, ErrorFeedback, NotAgreed, state_hash
from peer.p2p import wire
from peer.p2p.bridge import Bridge
from peer.p2p.net import MemoryNetwork
from tests.averaging.diloco_sim import (
    SimSwarm,
    close_all,
    make_together,
    make_trainer,
    reference_check,
    run_threads,
    start_swarm,
    start_trainers,
    train_steps,
)

INT8 = wire.Compression.INT8


def _block_bound(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % wire.INT8_BLOCK
    blocks = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, wire.INT8_BLOCK).amax(1)
    return blocks.repeat_interleave(wire.INT8_BLOCK)[:flat.numel()].view(x.shape) / 127


# ------------------------------------------------------------------------------------------- codec


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_int8_blocks_stay_within_the_documented_error_and_are_idempotent(dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 700, generator=generator, dtype=dtype) * torch.logspace(-6, 4, 700, dtype=dtype)
    y = wire.roundtrip(x, INT8)
    assert y.dtype == dtype and y.shape == x.shape
    assert bool(((x - y).abs() <= _block_bound(x)).all())
    assert torch.equal(wire.roundtrip(y, INT8), y)  # what lets every all-reduce member hold the same bytes
    # per-block scales: a tiny block next to a huge one keeps its precision (one scale would zero it)
    mixed = torch.cat([torch.full((256,), 1e-4), torch.full((256,), 1e4)]) * torch.linspace(0.5, 1, 512)
    assert torch.allclose(wire.roundtrip(mixed, INT8)[:256], mixed[:256], rtol=1 / 100)
    assert len(wire.encode_bytes(x, compression=INT8)) < x.numel() * 1.02 + 200


def test_int8_edge_cases_and_hostile_headers():
    for value in (torch.zeros(5), torch.empty(0), torch.tensor(3.0), torch.tensor([1.0, float("nan")]),
                  torch.tensor([float("inf"), 1.0])):
        out = wire.roundtrip(value, INT8)
        assert out.shape == value.shape and torch.equal(out.isnan(), value.isnan())
    assert torch.equal(wire.roundtrip(torch.tensor([float("inf"), 1.0]), INT8), torch.tensor([float("inf"), 1.0]))
    message = bytearray(wire.encode_bytes(torch.randn(300), compression=INT8))
    body_len = int.from_bytes(message[:4], "little")
    body = msgpack.unpackb(bytes(message[4:4 + body_len]), raw=False)
    for bad in ([], [0], [2**30], ["x"], [256, 1]):
        payload = msgpack.packb(["float32", [300], 3, 0, 2 * 4 + 300, bad], use_bin_type=True)
        forged = msgpack.packb(msgpack.ExtType(1, payload), use_bin_type=True)
        data = message[-(2 * 4 + 300):]
        pad = (-(4 + len(forged))) % wire.ALIGNMENT
        with pytest.raises(wire.WireError):
            wire.decode(bytearray(len(forged).to_bytes(4, "little") + forged + bytes(pad) + data))
    assert body.code == 1
    scales_nan = bytearray(message)
    scales_nan[-(2 * 4 + 300):-(300 + 4)] = bytes.fromhex("0000c07f")  # a NaN scale
    with pytest.raises(wire.WireError):
        wire.decode(scales_nan)


def test_error_feedback_tracks_the_uncompressed_sum_over_20_rounds():
    generator = torch.Generator().manual_seed(7)
    rounds = [torch.randn(2000, generator=generator) * (1 + i % 3) for i in range(20)]
    with_feedback = ErrorFeedback([rounds[0]], INT8, enabled=True)
    without = ErrorFeedback([rounds[0]], INT8, enabled=False)
    sent_fb = torch.zeros(2000)
    sent_plain = torch.zeros(2000)
    for values in rounds:
        a, b = [values.clone()], [values.clone()]
        with_feedback.compress(a)
        with_feedback.commit()
        without.compress(b)
        sent_fb += a[0]
        sent_plain += b[0]
    total = torch.stack(rounds).sum(0)
    # documented bound: the sum of what was sent misses the true sum by the last residual only, i.e. by at most
    # the codec's error on the last round's input (last values + the residual before it)
    bound = _block_bound(rounds[-1]) * 2 + 1e-5
    assert bool(((sent_fb - total).abs() <= bound).all())
    assert (sent_fb - total).abs().max() < (sent_plain - total).abs().max()  # feedback does better than none


# ------------------------------------------------------------------------------------------- in-memory swarm


def _four_to_partition(bridge: Bridge) -> tuple[MemoryNetwork, list[tuple[nn.Module, DiLoCoOptimizer]], list[str]]:
    """Four trainers built together, with load and averaging timeouts short enough that a partitioned one gives up
    within the test, and the peers' names (to cut the last one off); the network is returned to cut and heal."""
    memory, peers, made = start_trainers(bridge, 4, load_state_timeout=4.0, averaging_timeout=8.0, start_with=4)
    return memory, made, [peer.name for peer in peers]


@pytest.fixture
def bridge():
    with Bridge.start() as bridge:
        yield bridge


def test_four_trainers_agree_after_every_outer_step_and_match_reference_nesterov(bridge, tmp_path):
    memory, peers, made = start_trainers(bridge, 4, hooks=DiLoCoHooks(trace_dir=str(tmp_path)), start_with=4)
    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 15, seed=i) for i, (m, o) in enumerate(made)])
        assert {opt.outer_step for _, opt in made} == {3}
        assert len({opt.hash for _, opt in made}) == 1
        reference_check(str(tmp_path), 3, 4)
        for model, opt in made:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), opt.outer_params))
            assert opt.stats()["group_sizes"] == {4: 3}
            assert opt.stats()["bytes_sent"] > 0
    finally:
        close_all(made)


def test_newcomer_holds_the_outer_params_and_momentum_before_its_first_inner_step(bridge):
    memory, peers, made = start_trainers(bridge, 3, building=2, start_with=2)
    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 25, seed=i) for i, (m, o) in enumerate(made)])
        assert {opt.outer_step for _, opt in made} == {5}
        model, newcomer = make_trainer(SimSwarm(bridge, peers[2]))
        try:
            reference = made[0][1]
            assert newcomer.outer_step == 5 and newcomer.local_steps == 0
            assert newcomer.hash == reference.hash
            assert all(torch.equal(a, b) for a, b in zip(newcomer.outer_params, reference.outer_params))
            momentum = [newcomer.outer_optimizer.state[p]["momentum_buffer"] for p in newcomer.outer_params]
            expected = [reference.outer_optimizer.state[p]["momentum_buffer"] for p in reference.outer_params]
            assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(momentum, expected))
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.outer_params))
        finally:
            newcomer.close()
    finally:
        close_all(made)


def _in_bridge(bridge: Bridge, fn: Any, *args: Any) -> None:
    """Run a MemoryNetwork change in the trio thread that owns the network."""
    async def change() -> None:
        fn(*args)

    bridge.run(change)


def test_a_joiner_the_swarm_outran_contributes_from_its_state_in_its_second_round(bridge):
    """A newcomer downloads outer step 2; the others apply round 2 before its first phase ends. It offers its
    pseudo-gradient (computed on step 2) to round 3 as a member behind by one, vouched for by the others' chains,
    and downloads step 4 after it: it contributed in its second outer step instead of after a catch-up download
    that the swarm outruns again, and all three hold one state."""
    memory, peers, made = start_trainers(bridge, 3, building=2, start_with=2)
    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 10, seed=i) for i, (m, o) in enumerate(made)])
        model, newcomer = make_trainer(SimSwarm(bridge, peers[2]))
        made.append((model, newcomer))
        assert newcomer.outer_step == 2
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 5, seed=10 + i) for i, (m, o) in enumerate(made[:2])])
        assert {opt.outer_step for _, opt in made[:2]} == {3} and newcomer.outer_step == 2
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 5, seed=20 + i) for i, (m, o) in enumerate(made)])
        behind = [r for r in newcomer.round_records if r.get("behind") is not None]
        assert [(r["round"], r["behind"], r["staleness"], r["members"]) for r in behind] == [(3, 2, 1, 3)], behind
        assert newcomer.first_contribution is not None and newcomer.first_contribution["outer_steps"] == 2
        assert behind[0]["first_contribution"] == newcomer.first_contribution  # in its events too (if killed)
        assert {opt.outer_step for _, opt in made} == {4} and len({opt.hash for _, opt in made}) == 1
        assert made[0][1].stats()["group_sizes"].get(3) == 1  # its pseudo-gradient is in the others' step 4
    finally:
        close_all(made)


@pytest.mark.slow
def test_partitioned_trainer_resyncs_after_the_partition_heals(bridge):
    memory, made, names = _four_to_partition(bridge)
    cut = threading.Event()

    def partition_at(step: int) -> None:
        if step == 5 and not cut.is_set():  # the last trainer, after its first outer step
            cut.set()
            _in_bridge(bridge, memory.partition, [names[3]], names[:3])

    def healed_at(step: int) -> None:
        if step == 10:
            _in_bridge(bridge, memory.heal)

    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 25, seed=i, before_step=partition_at if i == 3 else (
            healed_at if i == 0 else None)) for i, (m, o) in enumerate(made)])
        last = made[3][1]
        # cut off, it found no group (applied nothing)
        assert last.stats()["skipped_rounds"] >= 1, last.stats()
        # a skipped round says how long it waited and its window, as any started round does (the WAN reports)
        skipped = [r for r in last.round_records if r.get("outcome") == "skipped"]
        assert skipped and all(r["window"] is not None and r["waited"] is not None for r in skipped), skipped
        # healed: all four go on, one round at a time, until they hold one outer state (a condition, at most
        # 8 more rounds: the straggler re-syncs by download in its first round that sees the others ahead)
        for extra in range(8):
            if len({opt.hash for _, opt in made}) == 1 and len({opt.outer_step for _, opt in made}) == 1:
                break
            run_threads([lambda m=m, o=o, s=100 * extra + i: train_steps(m, o, 5, seed=s)
                         for i, (m, o) in enumerate(made)])
        assert len({opt.hash for _, opt in made}) == 1, [opt.stats() for _, opt in made]
        assert len({opt.outer_step for _, opt in made}) == 1, [opt.stats() for _, opt in made]
        assert last.stats()["state_loads"] >= 1, last.stats()
        assert all(state_hash(opt._outer_state) == opt.hash for _, opt in made)
    finally:
        close_all(made)


@pytest.mark.slow
def test_finish_resyncs_a_trainer_partitioned_during_the_last_outer_round(bridge):
    memory, made, names = _four_to_partition(bridge)

    def partition_at(step: int) -> None:
        if step == 10:  # the last trainer, at the start of the third and last outer round, once the others
            # have applied the second one too (they may still be pulling the part the last trainer reduced)
            for _ in range(6000):
                if all(opt.outer_step == 2 and opt.hash == made[3][1].hash for _, opt in made[:3]):
                    break
                threading.Event().wait(0.01)  # polling the optimizers' own state, not a timed sync
            _in_bridge(bridge, memory.partition, [names[3]], names[:3])

    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 15, seed=i, before_step=partition_at if i == 3 else None)
                     for i, (m, o) in enumerate(made)])
        last = made[3][1]
        # the run ended with the laggard on its own outer state: no later round would ever fix that
        assert last.hash != made[0][1].hash and {opt.outer_step for _, opt in made[:3]} == {3}
        _in_bridge(bridge, memory.heal)
        agreed: list[bool] = [False] * 4

        def finish(index: int) -> None:
            agreed[index] = made[index][1].finish(timeout=30.0)

        run_threads([lambda i=i: finish(i) for i in range(4)])
        assert agreed == [True] * 4, [opt.stats() for _, opt in made]
        assert len({opt.hash for _, opt in made}) == 1 and {opt.outer_step for _, opt in made} == {3}
        assert [opt.stats()["final_resyncs"] for _, opt in made] == [0, 0, 0, 1]
        assert state_hash(last._outer_state) == last.hash
        assert all(torch.equal(p, q) for p, q in zip(made[3][0].parameters(), made[0][1].outer_params))
    finally:
        close_all(made)


def test_trainers_started_apart_with_the_same_loop_end_with_one_state(bridge):
    """The natural loop, `for step in range(N)`, with the second trainer started most of an outer step later:
    the first waits in finish() and the second takes its state when it finishes (no `start_with`)."""
    memory = MemoryNetwork(latency=0.002)
    peers = start_swarm(bridge, memory, 2)
    first = make_trainer(SimSwarm(bridge, peers[0]))
    second: list = []
    agreed: dict[int, bool] = {}

    def run_first() -> None:
        def start_second(step: int) -> None:
            if step == 9:  # most of the second outer step done: the other one starts now
                second.append(make_trainer(SimSwarm(bridge, peers[1])))
                threading.Thread(target=run_second, daemon=True).start()

        train_steps(*first, 15, seed=0, before_step=start_second)
        agreed[0] = first[1].finish(timeout=60.0)

    def run_second() -> None:
        model, opt = second[0]
        train_steps(model, opt, 15, seed=1)
        agreed[1] = opt.finish(timeout=60.0)

    try:
        run_threads([run_first])
        for _ in range(6000):  # the second trainer's thread ends on its own (polled: no timed sync)
            if 1 in agreed:
                break
            threading.Event().wait(0.01)
        assert agreed == {0: True, 1: True}
        assert first[1].hash == second[0][1].hash and first[1].outer_step == second[0][1].outer_step
        assert all(torch.equal(p, q) for p, q in zip(second[0][0].parameters(), first[1].outer_params))
    finally:
        first[1].close()
        for _, opt in second:
            opt.close()


def test_finish_says_why_within_its_timeout_when_nobody_is_left_to_agree_with(bridge):
    memory, peers, made = start_trainers(bridge, 3, start_with=3)
    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 5, seed=i) for i, (m, o) in enumerate(made)])
        assert len({opt.hash for _, opt in made}) == 1
        made[2][1].close()  # left with a goodbye: not waited for
        _in_bridge(bridge, memory.isolate, peers[1].name)  # gone without one: its record lives on, never "fin"
        started = time.monotonic()
        with pytest.raises(NotAgreed, match="still training at outer step 1"):  # names the silent one
            made[0][1].finish(timeout=1.0)
        elapsed = time.monotonic() - started
        assert 1.0 <= elapsed < 10.0, elapsed  # waited for the silent one until the timeout, then gave up
        assert made[0][1].stats()["final_resyncs"] == 0
        # on the peer of the one that left (its state server is gone); the isolated one cannot give the state
        stopped = make_trainer(SimSwarm(bridge, peers[2]), should_stop=lambda: True, load_state_timeout=2.0)[1]
        try:
            assert stopped.finish(timeout=60.0) is False  # a stop request skips the final agreement
            assert "fin" not in stopped.tracker.info
        finally:
            stopped.close()
    finally:
        close_all(made)


def test_overlap_offers_nothing_past_the_runs_last_outer_step(bridge):
    """A loop that asks `more_steps` (as `peer train`, Lightning and HF do) tells the optimizer the run's last outer
    step: overlap's eager contribution used to go one round past it (outer step 3 of 2 here), a round that under
    churn could hang the trainers in it while a finished one gave up agreeing with them."""
    memory, peers, made = start_trainers(bridge, 2, overlap=True, inner_steps=5, compression=INT8, start_with=2)
    ended: dict[int, tuple[int, int, bool]] = {}

    def loop(index: int, model: nn.Module, opt: DiLoCoOptimizer) -> None:
        generator = torch.Generator().manual_seed(index)
        step = 0
        while opt.more_steps(step, 10):  # 10 local steps of 5 per outer step: outer step 2 ends the run
            x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step(batch_size=4)
            step += 1
        ended[index] = (step, opt.outer_step, opt.finish(timeout=60.0))

    try:
        run_threads([lambda i=i, m=m, o=o: loop(i, m, o) for i, (m, o) in enumerate(made)])
        # the third phase ran (the second round was still in flight when step 10 was asked about), but its
        # progress went to no round: both end on outer step 2, agreed, after two rounds each
        assert ended == {0: (15, 2, True), 1: (15, 2, True)}
        assert made[0][1].hash == made[1][1].hash
        # a record's info past _MAX_INFO keys is dropped whole by its readers (no "alg", no "fin"): after finish()
        # every key a trainer publishes is there, and they fit
        assert all(0 < len(opt.tracker.info) <= progress._MAX_INFO and opt.tracker.info.get("fin") for _, opt in made)
        assert [opt.stats()["rounds"] for _, opt in made] == [2, 2]
        assert all(torch.equal(p, q) for (model, opt) in made for p, q in zip(model.parameters(), opt.outer_params))
    finally:
        close_all(made)


def test_overlap_no_inner_step_waits_when_the_round_is_faster_than_inner_steps(bridge):
    memory, peers, made = start_trainers(bridge, 2, latency=0.01, overlap=True, inner_steps=40, compression=INT8,
                                         start_with=2)
    gate = threading.Barrier(2, timeout=60)
    rounds: list[list[int]] = [[], []]

    def pace(index: int):
        opt = made[index][1]

        def before(step: int) -> None:
            # the inner steps of a round are paced by the outer round of the other trainer: each trainer's
            # background round must be done before it reaches the end of its next round
            if step % 40 == 39:
                gate.wait()
                while opt._background is not None and not opt._background.is_set():
                    threading.Event().wait(0.01)  # polling the optimizer's own flag, not a timed sync
            rounds[index].append(step)
        return before

    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 160, seed=i, before_step=pace(i))
                     for i, (m, o) in enumerate(made)])
        for _, opt in made:
            stats = opt.stats()
            assert stats["outer_waits"] == 0, stats
            assert stats["outer_step"] >= 3, stats  # 4 rounds, the last one's update maybe still in flight
        run_threads([lambda o=o: o.finish(timeout=30.0) for _, o in made])  # waits for it
        assert {opt.outer_step for _, opt in made} == {4}
        assert len({opt.hash for _, opt in made}) == 1
        assert state_hash(made[0][1]._outer_state) == made[1][1].hash
    finally:
        close_all(made)


# ------------------------------------------------------------------------------------------- traffic counts


@pytest.mark.parametrize("compression", [wire.Compression.NONE, INT8])
async def test_allreduce_counts_the_encoded_bytes_it_sends_and_receives(autojump_clock, compression):
    from swarm_helpers import Swarm

    from averaging.allreduce_core import AllReduceConfig

    numel = 1 << 16
    swarm = Swarm("memory", config=AllReduceConfig(chunk_bytes=1 << 16))
    tensor_sets = [[torch.randn(numel, generator=torch.Generator().manual_seed(seed))] for seed in range(2)]
    async with trio.open_nursery() as nursery:
        peers = await swarm.start(nursery, 2)
        group = swarm.group(peers)
        for peer, tensors in zip(peers, tensor_sets):
            peer.start_round(group, tensors, compression=compression, timeout=30)
        with trio.fail_after(30):
            for peer in peers:
                await peer.done.wait()
        nursery.cancel_scope.cancel()
    a, b = (peer.result for peer in peers)
    assert a.fully_averaged and b.fully_averaged
    # each of the two pushes half its vector and serves the mean of the half it reduces: one vector out, one in
    per_element = 4 if compression == wire.Compression.NONE else 1 + 4 / wire.INT8_BLOCK
    for result in (a, b):
        assert numel * per_element <= result.bytes_sent <= numel * per_element * 1.01 + 2000
    assert a.bytes_sent == b.bytes_received and b.bytes_sent == a.bytes_received  # what one sent, the other got


@pytest.mark.parametrize("overlap", [False, True])
def test_streaming_fragments_alternate_and_each_round_sends_its_fragment_only(bridge, overlap):
    memory, peers, made = start_trainers(bridge, 2, start_with=2, inner_steps=10, fragments=2, overlap=overlap)
    whole = make_together([SimSwarm(bridge, peer) for peer in start_swarm(bridge, memory, 2, first=2)],
                          start_with=2, inner_steps=10)
    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 40, seed=i) for i, (m, o) in enumerate(made + whole)])
        run_threads([lambda o=o: o.finish(timeout=30.0) for _, o in made + whole])
        opt = made[0][1]
        assert opt.fragments == 2 and opt.phase_steps == 5
        assert {o.outer_step for _, o in made} == {8} and len({o.hash for _, o in made}) == 1  # 2 per 10 steps
        assert {o.outer_step for _, o in whole} == {4}
        rounds = [r for r in opt.round_records if r.get("outcome") == "averaged"]
        assert [r["round"] % 2 for r in rounds] == [0, 1] * 4
        # a fragment round sends about half of what a whole-model round sends (the model's two Linear layers)
        per_round = opt.stats()["bytes_sent"] / len(rounds)
        whole_per_round = whole[0][1].stats()["bytes_sent"] / 4
        assert per_round < 0.75 * whole_per_round, (per_round, whole_per_round)
        # each round's record carries its own bytes (Streaming DiLoCo's peak per sync is read from them)
        assert sum(r["bytes_sent"] for r in opt.round_records) == opt.stats()["bytes_sent"]
        whole_rounds = [r for r in whole[0][1].round_records if r.get("outcome") == "averaged"]
        peak, whole_peak = max(r["bytes_sent"] for r in rounds), max(r["bytes_sent"] for r in whole_rounds)
        assert 0 < peak < 0.75 * whole_peak, (peak, whole_peak)
    finally:
        close_all(made + whole)


def test_gather_exchange_agrees_and_matches_reference_nesterov(bridge, tmp_path):
    memory, peers, made = start_trainers(bridge, 4, hooks=DiLoCoHooks(trace_dir=str(tmp_path)), start_with=4,
                                         exchange="gather", compression=INT8)
    try:
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, 15, seed=i) for i, (m, o) in enumerate(made)])
        assert {opt.outer_step for _, opt in made} == {3} and len({opt.hash for _, opt in made}) == 1
        reference_check(str(tmp_path), 3, 4)  # the weighted mean of the members' compressed pseudo-gradients
        stats = made[0][1].stats()
        assert stats["group_sizes"] == {4: 3} and stats["bytes_sent"] > 0
        assert all(o.gather.stats["rounds"] == 3 for _, o in made)
    finally:
        close_all(made)
