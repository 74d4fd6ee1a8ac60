"""Progress tracking through the DHT: when the swarm's samples reach the target, every trainer sees it; dead
trainers drop out; nobody can report for somebody else. Simulated: MemoryNetwork + MockClock (autojump)."""

from __future__ import annotations

import math
from contextlib import asynccontextmanager

import pytest
import trio

from averaging.progress import (
    PeerProgress,
    ProgressTracker,
    SwarmProgress,
    estimate,
    list_runs,
    parse_records,
    progress_key,
)
from dht import DHTNode
from dht.node import key_id_of
from dht.records import Record, make_entry
from peer.p2p.identity import Identity, PeerID
from peer.p2p.net import MemoryNetwork
from tests.dht.dht_swarm import forge_store


def _pid(n: int) -> PeerID:
    return PeerID(bytes([n]) * 20)


# ------------------------------------------------------------------------------------------- pure estimate


def test_estimate_sums_the_newest_epoch_and_extrapolates_by_throughput():
    reports = [
        PeerProgress(_pid(1), epoch=3, samples=100, samples_per_second=50.0, time=10.0),
        PeerProgress(_pid(2), epoch=3, samples=40, samples_per_second=10.0, time=12.0),
        PeerProgress(_pid(3), epoch=2, samples=900, samples_per_second=500.0, time=12.0),  # behind: ignored
    ]
    progress = estimate(reports, target=400, now=12.0)
    assert progress.epoch == 3
    assert progress.num_peers == 2
    assert progress.samples == 100 + 50 * 2 + 40
    assert progress.samples_per_second == 60.0
    assert progress.eta == pytest.approx(12.0 + (400 - 240) / 60.0)
    assert not progress.target_reached
    assert estimate(reports, target=200, now=12.0).eta == 12.0  # already there
    assert estimate(reports, target=200, now=12.0).target_reached


def test_estimate_caps_extrapolation_of_stale_reports_and_handles_no_progress():
    stale = [PeerProgress(_pid(1), epoch=0, samples=10, samples_per_second=100.0, time=0.0)]
    assert estimate(stale, target=10_000, now=100.0, max_extrapolation=5.0).samples == 10 + 500
    idle = [PeerProgress(_pid(1), epoch=0, samples=10, samples_per_second=0.0, time=0.0)]
    assert estimate(idle, target=100, now=1.0).eta == math.inf
    empty = estimate([], target=100, now=5.0)
    assert (empty.epoch, empty.samples, empty.num_peers, empty.eta) == (0, 0, 0, math.inf)


def test_records_round_trip_and_malformed_values_are_dropped():
    record = PeerProgress(_pid(7), epoch=2, samples=64, samples_per_second=12.5, time=99.0, client_mode=False,
                          address=("10.0.0.7", 31337))
    assert PeerProgress.from_wire(bytes(_pid(7)), record.to_wire()) == record
    gone = PeerProgress(_pid(7), epoch=2, samples=64, samples_per_second=0.0, time=99.0, left=True)
    assert PeerProgress.from_wire(bytes(_pid(7)), gone.to_wire()) == gone
    odd_address = PeerProgress.from_wire(bytes(_pid(7)), [1, 2, 64, 1.0, 1.0, False, False, ["h", 70000]])
    assert odd_address is not None and odd_address.address is None
    for bad in (None, "x", [], [1, 2], [99, 2, 64, 1.0, 1.0, True], [1, -1, 64, 1.0, 1.0, True],
                [1, 2, 64, float("nan"), 1.0, True], [1, 2.5, 64, 1.0, 1.0, True], [1, 2, 64, -3.0, 1.0, True]):
        assert PeerProgress.from_wire(bytes(_pid(7)), bad) is None


# ------------------------------------------------------------------------------------------- over a DHT


async def _dht_node(host: str, network: MemoryNetwork, peers: list, client_mode: bool, identity=None, *,
                    task_status=trio.TASK_STATUS_IGNORED):
    with trio.CancelScope() as scope:
        async with DHTNode.open(host, 0, peers, network=network.host(host), client_mode=client_mode,
                                identity=identity, clock=trio.current_time, seed=len(host)) as node:
            task_status.started((node, scope))
            await trio.sleep_forever()


async def _run_tracker(name, network, servers, run_id, target, options, *, task_status=trio.TASK_STATUS_IGNORED):
    """A trainer's DHT node and its tracker under one cancel scope: cancelling it is the trainer dying."""
    with trio.CancelScope() as scope:
        async with DHTNode.open(name, 0, servers, network=network.host(name), client_mode=True,
                                clock=trio.current_time, seed=len(name)) as node:
            tracker = ProgressTracker(node, run_id, target, min_refresh=0.05, max_refresh=1.0, ttl=5.0, **options)
            async with trio.open_nursery() as nursery:
                loop_scope = await nursery.start(_loop, tracker)
                _LOOPS[id(tracker)] = loop_scope
                task_status.started((tracker, scope))
                await trio.sleep_forever()  # the node outlives its tracker loop


_LOOPS: dict[int, trio.CancelScope] = {}  # each tracker's background loop, to stop it alone


async def _loop(tracker: ProgressTracker, *, task_status=trio.TASK_STATUS_IGNORED):
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(tracker.run)
            task_status.started(scope)


class _DHT:
    """DHT servers on a fresh in-memory network, in a nursery: trainers (their trackers) and client nodes join them."""

    def __init__(self, nursery, network, servers):
        self.nursery = nursery
        self.network = network
        self.servers = servers

    async def tracker(self, name, run_id="run", target=600, **options):
        """A trainer's tracker, and the cancel scope of the trainer (cancelling it is the trainer dying)."""
        return await self.nursery.start(_run_tracker, name, self.network, self.servers, run_id, target, options)

    async def client(self, name):
        node, _ = await self.nursery.start(_dht_node, name, self.network, self.servers, True)
        return node


@asynccontextmanager
async def _dht(seed, count=3):
    """`count` DHT servers on a fresh in-memory network seeded with `seed`, in a nursery cancelled when the block
    ends."""
    network = MemoryNetwork(latency=0.003, seed=seed)
    async with trio.open_nursery() as nursery:
        addresses: list = []
        for i in range(count):
            node, _ = await nursery.start(_dht_node, f"s{i}", network, list(addresses), False)
            addresses.append(node.address)
        yield _DHT(nursery, network, addresses)
        nursery.cancel_scope.cancel()


async def test_every_trainer_sees_the_epoch_end_when_the_swarm_reaches_the_target(autojump_clock):
    detected: dict[str, float] = {}
    totals: dict[str, int] = {}
    trackers: list[ProgressTracker] = []
    async with _dht(5) as dht:
        for i in range(3):
            trackers.append((await dht.tracker(f"t{i}", target=600))[0])
        start = trio.current_time()

        async def train(name: str, tracker: ProgressTracker) -> None:
            # 100 samples/s each: the swarm of 3 reaches 600 samples 2 s after the start
            while True:
                await trio.sleep(0.1)
                tracker.report(10)
                if tracker.progress().target_reached:
                    detected[name] = trio.current_time() - start
                    totals[name] = sum(t.samples for t in trackers)
                    return

        async with trio.open_nursery() as workers:
            for i, tracker in enumerate(trackers):
                workers.start_soon(train, f"t{i}", tracker)
    assert set(detected) == {"t0", "t1", "t2"}
    for name, when in detected.items():
        assert 1.8 <= when <= 2.3, (name, when)
        assert totals[name] >= 0.9 * 600, (name, totals[name])  # not fooled into ending early


async def test_a_new_epoch_resets_the_count_and_laggards_no_longer_count(autojump_clock):
    async with _dht(6) as dht:
        a, _ = await dht.tracker("a", target=1000)
        b, _ = await dht.tracker("b", target=1000)
        a.report(300)
        b.report(200)
        await a.publish()
        await b.publish()
        seen = await a.fetch()
        assert (seen.epoch, seen.num_peers) == (0, 2)
        assert seen.samples >= 500
        b.new_epoch(1)
        b.report(50)
        await b.publish()
        seen = await a.fetch()
        assert seen.epoch == 1  # a learns the swarm moved on: only b counts now
        assert seen.num_peers == 1
        assert 50 <= seen.samples < 300


async def test_a_dead_trainer_drops_out_after_its_record_expires(autojump_clock):
    async with _dht(7) as dht:
        alive, _ = await dht.tracker("alive")
        dying, dying_scope = await dht.tracker("dying")
        dying.report(10)
        await dying.publish()
        assert (await alive.fetch()).num_peers == 2
        dying_scope.cancel()  # its DHT node and its tracker loop are gone, no goodbye
        killed_at = trio.current_time()
        while (await alive.fetch()).num_peers != 1:
            await trio.sleep(0.5)
        assert trio.current_time() - killed_at <= dying.ttl + 1.0
        # a trainer that finishes says goodbye and stops counting at once, without waiting for expiry
        leaving, _ = await dht.tracker("leaving")
        leaving.report(10)
        await leaving.publish()
        assert (await alive.fetch()).num_peers == 2
        _LOOPS[id(leaving)].cancel()  # the trainer stops its loop, then says goodbye through its DHT node
        assert await leaving.leave()
        assert (await alive.fetch()).num_peers == 1


async def test_records_not_signed_by_their_subkey_peer_are_ignored(autojump_clock):
    async with _dht(8) as dht:
        honest, _ = await dht.tracker("honest", target=1000)
        liar = await dht.client("liar")
        victim = Identity.from_seed(b"victim" * 6)
        fake = PeerProgress(victim.peer_id, epoch=9, samples=10_000, samples_per_second=1e6, time=liar.now())
        key = progress_key("run")
        # signed by the liar but claiming the victim's subkey, and an unsigned claim: both must be ignored
        await forge_store(liar, key, fake.to_wire(), liar.now() + 30, bytes(victim.peer_id), liar.identity)
        await forge_store(liar, key, fake.to_wire(), liar.now() + 30, bytes(_pid(3)))
        seen = await honest.fetch()
        assert (seen.epoch, seen.num_peers) == (0, 1)
        assert not seen.target_reached
        # storing nodes refused both (a subkey naming a PeerID holds only that peer's signed entry)
        record = await honest.dht.get(key, latest=True)
        assert set(record.subkeys) == {bytes(honest.peer_id)}
        # the parser itself: only entries whose owner hashes to the subkey survive
        forged = Record(None, {**record.subkeys, bytes(victim.peer_id): make_entry(
            key_id_of(key), bytes(victim.peer_id), fake.to_wire(), liar.now() + 30, liar.identity)})
        assert set(parse_records(forged, liar.now())) == {honest.peer_id}


async def test_the_tracker_republishes_before_expiry_and_reports_a_rate(autojump_clock):
    async with _dht(9) as dht:
        watcher, _ = await dht.tracker("watcher")
        worker, _ = await dht.tracker("worker")
        for _ in range(20):
            await trio.sleep(0.1)
            worker.report(5)  # 50 samples/s
        await trio.sleep(3 * worker.ttl)  # idle for long: the record must stay alive through refreshes
        seen = await watcher.fetch()
        peers = {p.peer_id: p for p in seen.peers}
        assert worker.peer_id in peers
        assert peers[worker.peer_id].samples == 100
        assert peers[worker.peer_id].samples_per_second == pytest.approx(50.0, rel=0.2)
        assert isinstance(seen, SwarmProgress)


async def test_status_lists_the_live_runs_and_their_progress(autojump_clock):
    async with _dht(10) as dht:
        a, _ = await dht.tracker("a", run_id="digits", target=512)
        b, b_scope = await dht.tracker("b", run_id="digits", target=512)
        c, _ = await dht.tracker("c", run_id="cifar", target=4096)
        a.report(100)
        b.report(28)
        c.report(7)
        a.note_group([a.peer_id, b.peer_id])  # a and b averaged together
        for tracker in (a, b, c):
            await tracker.publish()
        observer = await dht.client("observer")
        runs = {run["run_id"]: run for run in await list_runs(observer)}
        assert set(runs) == {"digits", "cifar"}
        assert runs["digits"]["recent_groups"] == [[a.peer_id.hex()[:12], b.peer_id.hex()[:12]]]
        assert runs["cifar"]["recent_groups"] == []
        assert runs["digits"]["trainers"] == 2 and runs["digits"]["target_batch_size"] == 512
        assert runs["digits"]["samples"] >= 128 and runs["digits"]["epoch"] == 0
        assert runs["cifar"]["trainers"] == 1 and runs["cifar"]["target_batch_size"] == 4096
        b_scope.cancel()
        await trio.sleep(b.ttl + 1.0)
        runs = {run["run_id"]: run for run in await list_runs(observer)}
        assert runs["digits"]["trainers"] == 1  # the dead trainer is gone from the listing


def test_algorithm_summary_shows_dilocos_rounds_under_churn():
    from averaging.progress import PeerProgress, algorithm_summary
    from peer.p2p.identity import PeerID

    def report(index: int, epoch: int, **info: object) -> PeerProgress:
        return PeerProgress(PeerID(bytes([index]) * 20), epoch, 0, 0.0, 0.0,
                            info={"alg": "diloco", "hash": "h", **info})

    summary = algorithm_summary([
        report(1, 7, mem=3, why="quorum after grace", win=0.2, late=1, join=1),
        report(2, 7, mem=4, why="all ready", win=0.25, late=2, join=2),
        report(3, 7, mem=4, why="all ready", win=0.1, late=0),
    ])
    assert summary["round_members"] == 4 and summary["round_started"] == "all ready"
    assert summary["grace_window"] == 0.25 and summary["late_contributions"] == 3
    assert summary["joiner_first_contribution"] == 2 and summary["hashes_agree"] is True
    assert algorithm_summary([report(1, 0)])["round_members"] is None  # before any round


async def test_samples_added_directly_are_published_as_throughput(autojump_clock):
    """A driver that adds to `tracker.samples` from its training thread instead of calling `report` (DiLoCo
    does) still publishes its samples/s, and `peer status`'s listing shows it (it showed 0.0)."""
    async with _dht(11) as dht:
        worker, _ = await dht.tracker("worker", run_id="plain-loop")
        for _ in range(20):
            await trio.sleep(0.1)
            worker.samples += 5  # 50 samples/s
        await worker.publish()
        worker.new_epoch(1)
        assert worker.local().samples_per_second == pytest.approx(50.0, rel=0.2)  # a reset is no negative rate
        observer = await dht.client("observer")
        (run,) = await list_runs(observer)
        assert run["samples_per_s"] == pytest.approx(50.0, rel=0.2)
