"""Defaults that work together: `peer join` and `peer train` with nothing but `--initial-peers` train together, a
trainer whose options match no declared expert fails at once naming both sides, and a daemon restarted with the
same identity serves its uids again at once.

Listening and announcing: without --host a daemon listens toward its initial peers (everywhere in a new swarm) and
announces the address they observe (the DHT's `stun`); tested across network namespaces the test creates, so no
test binds the machine's real interfaces.

The discovery rules (`peer.discover`) and the daemons' expert choice run in-process on the in-memory network; the
CLI contract runs real processes on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess

import pytest
import trio

from dht import DHTNode
from moe.declare import get_experts
from peer.daemon import DEFAULT_PATTERN, Daemon, DaemonConfig, StartupError
from peer.directory import PeerDirectory, PeerEntry
from peer.discover import (
    ExpertFamily,
    NoExpertsDeclared,
    SwarmMismatch,
    choose_family,
    discover_experts,
    families_from_entries,
    summary_fields,
)
from peer.p2p.net import MemoryNetwork
from peer.testing.netns import HostNetwork, netns_available
from peer.testing.peer_processes import PEER, ROOT, PeerProcess, run_peer, start_daemon


def entry(peer: int, summary: dict) -> PeerEntry:
    return PeerEntry(f"{peer:040x}", ("h", 1), summary, 1e18)


# ------------------------------------------------------------------------------------------- family rules


def test_families_are_the_bounding_grids_of_the_daemons_patterns_largest_first():
    entries = [
        entry(1, summary_fields("ffn.[0:4]", 4, 64)),
        entry(2, summary_fields("ffn.[4:8]", 4, 64)),
        entry(3, summary_fields("ffn.[8:12]", 2, 64)),
        entry(4, summary_fields("big.[0:2].3", 2, 32)),
        entry(5, {"experts": 0, "version": "x"}),  # serves nothing
        entry(6, {"experts": 3, "grid": "not a pattern", "hidden_dim": 64}),
        entry(7, {"experts": 3, "grid": "ffn.[0:99]", "hidden_dim": "64"}),
        entry(8, {"experts": True, "grid": "ffn.[0:99]", "hidden_dim": 64}),
    ]
    families = families_from_entries(entries)
    assert families == [ExpertFamily("ffn", (12,), 64, 10, 3), ExpertFamily("big", (2, 4), 32, 2, 1)]
    assert families[0].pattern == "ffn.[0:12]" and families[1].grid_size == "2x4"
    assert families[0].describe() == "ffn (10 experts on 3 peers, grid 12, hidden 64)"
    # a restarted daemon leaves its own previous entry out
    assert families_from_entries(entries, exclude_peer=f"{1:040x}")[0].experts == 6


def test_choose_family_takes_the_largest_match_and_names_both_sides_when_none_matches():
    ffn = ExpertFamily("ffn", (12,), 64, 12, 3)
    wide = ExpertFamily("wide", (4, 4), 256, 4, 1)
    assert choose_family([ffn, wide]) == ffn
    assert choose_family([ffn, wide], hidden_dim=256) == wide
    assert choose_family([ffn, wide], ndim=2) == wide
    with pytest.raises(SwarmMismatch, match=r"takes --hidden-dim 32: the swarm declares ffn .*hidden 64.*; wide"):
        choose_family([ffn, wide], hidden_dim=32)
    with pytest.raises(SwarmMismatch, match=r"no expert under prefix 'nosuch': the swarm declares ffn \(12 exp"):
        choose_family([ffn], prefix="nosuch")
    with pytest.raises(SwarmMismatch, match=r"under prefix 'ffn' takes --hidden-dim 256"):
        choose_family([ffn, wide], prefix="ffn", hidden_dim=256)
    with pytest.raises(SwarmMismatch, match=r"2-dimensional grid"):
        choose_family([ffn], ndim=2)
    with pytest.raises(NoExpertsDeclared):
        choose_family([])


# ------------------------------------------------------------------------------------------- discovery


async def _dht_node(network, host, initial, *, task_status=trio.TASK_STATUS_IGNORED):
    async with DHTNode.open(host, 4000, initial, network=network.host(host), clock=trio.current_time) as node:
        task_status.started(node)
        await trio.sleep_forever()


async def test_discover_experts_fills_what_was_left_out_and_checks_what_was_given(autojump_clock):
    network = MemoryNetwork(latency=0.005, seed=1)
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(_dht_node, network, "d0", [])
        other = await nursery.start(_dht_node, network, "d1", [daemon.address])
        trainer = await nursery.start(_dht_node, network, "t0", [daemon.address])
        for node, pattern in ((daemon, "ffn.[0:6]"), (other, "ffn.[6:12]")):
            assert await PeerDirectory(node).declare(node.address, node.identity.peer_id,
                                                     summary_fields(pattern, 3, 48))
        found = await discover_experts(trainer)
        assert (found.prefix, found.grid_size, found.hidden_dim) == ("ffn", "12", 48)
        assert found.family.experts == 6 and found.family.peers == 2
        given = await discover_experts(trainer, hidden_dim=48, prefix="ffn", grid_size="16")
        assert given.grid_size == "16"  # a given grid is kept: only its number of dimensions must match
        started = trio.current_time()
        with pytest.raises(SwarmMismatch) as error:
            await discover_experts(trainer, hidden_dim=32)
        assert "32" in str(error.value) and "hidden 48" in str(error.value)
        assert trio.current_time() - started < 5  # experts exist, so there is nothing to wait for
        with pytest.raises(SwarmMismatch, match="'nosuch'.*ffn"):
            await discover_experts(trainer, prefix="nosuch")
        nursery.cancel_scope.cancel()


async def test_discover_experts_waits_a_bounded_time_for_a_swarm_starting_up(autojump_clock):
    network = MemoryNetwork(latency=0.005, seed=2)
    async with trio.open_nursery() as nursery:
        bootstrap = await nursery.start(_dht_node, network, "d0", [])
        trainer = await nursery.start(_dht_node, network, "t0", [bootstrap.address])
        waits: list[float] = []
        started = trio.current_time()
        with pytest.raises(NoExpertsDeclared, match="after waiting 15 s"):
            await discover_experts(trainer, wait=15.0, on_wait=lambda waited, wait: waits.append(waited))
        assert 15.0 <= trio.current_time() - started < 20.0
        assert len(waits) >= 3 and waits == sorted(waits)

        async def declare_later() -> None:
            await trio.sleep(4.0)
            await PeerDirectory(bootstrap).declare(bootstrap.address, bootstrap.identity.peer_id,
                                                   summary_fields("ffn.[0:4]", 4, 64))

        nursery.start_soon(declare_later)
        started = trio.current_time()
        found = await discover_experts(trainer, wait=15.0)
        assert found.hidden_dim == 64 and 4.0 <= trio.current_time() - started < 6.0
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------------------- daemons


async def _run_daemon(config: DaemonConfig, network: MemoryNetwork, host: str, *,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        daemon = Daemon(config, network=network.host(host))
        async with trio.open_nursery() as nursery:
            info = await nursery.start(daemon.run)
            task_status.started((daemon, info, scope))


async def test_daemons_without_experts_share_the_default_family_and_grow_it_when_full():
    network = MemoryNetwork(seed=3)
    async with trio.open_nursery() as nursery:
        first, info, _ = await nursery.start(_run_daemon, DaemonConfig(host="a", hidden_dim=8), network, "a")
        assert info.pattern == DEFAULT_PATTERN and len(info.experts) == 4 and info.hidden_dim == 8
        bootstrap = [first.rpc.address]
        served = set(info.experts)
        for _index, host in enumerate("bc"):
            _, info, _ = await nursery.start(_run_daemon, DaemonConfig(host=host, hidden_dim=8,
                                                                       initial_peers=bootstrap), network, host)
            assert info.pattern == DEFAULT_PATTERN and not served & set(info.experts)
            served |= set(info.experts)
        assert served == {f"ffn.{i}" for i in range(12)}
        # the grid is full: the next volunteer extends it rather than duplicating anyone
        _, info, _ = await nursery.start(_run_daemon, DaemonConfig(host="d", hidden_dim=8, num_experts=2,
                                                                   initial_peers=bootstrap), network, "d")
        assert info.pattern == "ffn.[0:14]" and set(info.experts) == {"ffn.12", "ffn.13"}
        # a volunteer whose hidden size the swarm does not use is told which it does
        with pytest.raises(StartupError, match="takes --hidden-dim 16: the swarm declares ffn .*hidden 8"):
            await nursery.start(Daemon(DaemonConfig(host="e", hidden_dim=16, initial_peers=bootstrap),
                                       network=network.host("e")).run)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("experts", ["ffn.[0:4]", None])
async def test_a_daemon_restarted_with_its_identity_serves_its_uids_again_at_once(tmp_path, experts):
    """SIGKILLed (its host crashes: its declarations stay live in the others' DHT until they expire) and
    restarted with the same key file and no checkpoints: it takes back what it served."""
    network = MemoryNetwork(seed=4)
    async with trio.open_nursery() as nursery:
        bootstrap, _, _ = await nursery.start(_run_daemon, DaemonConfig(host="b", experts="ffn.[4:8]", hidden_dim=8),
                                              network, "b")
        config = DaemonConfig(host="v", port=7000, experts=experts, hidden_dim=8, identity=tmp_path / "id.key",
                              initial_peers=[bootstrap.rpc.address])
        _, before, scope = await nursery.start(_run_daemon, config, network, "v")
        network.crash("v")
        scope.cancel()
        with trio.fail_after(30):  # the old failure was a 60 s stall (then an error): far beyond this
            daemon, after, _ = await nursery.start(_run_daemon, config, network, "v")
        assert after.peer_id == before.peer_id and after.experts == before.experts
        found = await get_experts(bootstrap.dht, after.experts)
        assert {location.peer_id_hex for location in found.values()} == {after.peer_id}
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def daemon():
    process, _, address = start_daemon()
    yield address
    process.kill()


def _one_error_line(result, *needles: str) -> str:
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert all(needle in lines[0] for needle in needles), lines[0]
    return lines[0]


def test_a_trainer_with_another_hidden_size_fails_at_once_naming_both(daemon):
    result = run_peer("train", "--initial-peers", daemon, "--hidden-dim", "32", timeout=120)
    line = _one_error_line(result, "--hidden-dim 32", "hidden 64", "ffn")
    assert "no expert" in line
    # failed at discovery, not after waiting out the retry budget of steps without experts (its own message)
    assert "in a row" not in line


def test_a_trainer_with_an_unknown_prefix_fails_at_once_naming_both(daemon):
    result = run_peer("train", "--initial-peers", daemon, "--expert-prefix", "nosuch", timeout=120)
    line = _one_error_line(result, "'nosuch'", "ffn (4 experts")
    assert "in a row" not in line  # failed at discovery, not after the retry budget


@pytest.mark.slow
def test_join_and_two_trainers_with_nothing_but_initial_peers_train_together():
    daemon, _, address = start_daemon()
    trainers = []
    try:
        trainers = [PeerProcess(["train", "--initial-peers", address, "--seed", str(i)]) for i in range(2)]
        results = []
        for trainer in trainers:
            match = trainer.read_until(r'^\{"event": "result"', timeout=900)
            results.append(json.loads(match.string))
            assert trainer.wait(timeout=60) == 0, f"{match.string}\nstderr: {trainer.stderr_tail()}"
        logs = "\n".join(f"trainer {i}: {trainer.lines[-6:]}\nstderr: {trainer.stderr_tail()}"
                         for i, trainer in enumerate(trainers))
    finally:
        for process in [daemon, *trainers]:
            process.kill()
    for me, other in ((results[0], results[1]), (results[1], results[0])):
        assert me["accuracy"] >= 0.9, f"{json.dumps(me)}\n{logs}"
        assert other["peer_id"] in me["peers_averaged_with"], f"{json.dumps(me)}\n{logs}"


# ------------------------------------------------------------------------------ listening and announcing

def test_without_host_a_daemon_listens_toward_its_initial_peers_or_everywhere_in_a_new_swarm():
    from peer.p2p.addresses import default_listen_host

    assert default_listen_host([("127.0.0.1", 4000)]) == "127.0.0.1"  # a swarm on this machine stays on loopback
    assert default_listen_host([]) == "0.0.0.0"


async def test_the_observed_address_is_what_most_asked_peers_report(autojump_clock):
    network = MemoryNetwork()
    async with DHTNode.open("a", 4000, network=network.host("a")) as a, \
            DHTNode.open("b", 4000, [("a", 4000)], network=network.host("b")) as b, \
            DHTNode.open("c", 4000, [("a", 4000)], network=network.host("c"), client_mode=True) as c:
        assert await c.observed_address([("a", 4000), ("b", 4000)]) == ("c", 4000)
        assert await c.observed_address([("nobody", 9)], timeout=1.0) is None
        assert await b.observed_address() == ("b", 4000)  # default: contacts of its routing table
        assert a is not None


async def test_an_announced_wildcard_is_refused_in_command_line_words():
    config = DaemonConfig(host="127.0.0.1", announce=("0.0.0.0", 4000))
    with pytest.raises(StartupError) as caught:
        await Daemon(config).run()
    message = str(caught.value)
    assert "--announce" in message and "=" not in message and "\n" not in message


AVAILABLE, WHY_NOT = netns_available()


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)
def test_join_with_nothing_but_a_remote_initial_peer_joins_from_another_host():
    """Two hosts (network namespaces the test creates): a bootstrap volunteer and a second one started with
    nothing but `--initial-peers BOOTSTRAP` (no --host, no --announce). The second listens toward the bootstrap,
    announces the address the bootstrap sees, and `peer status` from a third host reaches both."""
    port = 31337
    with HostNetwork() as network:
        first, second, observer = (network.add_host(name) for name in ("boot", "second", "observer"))
        processes = []
        try:
            boot = PeerProcess(["join", "--port", str(port), "--experts", "ffn.[0:2]", "--hidden-dim", "8"],
                               prefix=first.command())
            processes.append(boot)
            boot.read_until(r"^others join with", timeout=120)
            joined = PeerProcess(["join", "--initial-peers", f"{first.address}:{port}", "--hidden-dim", "8"],
                                 prefix=second.command())
            processes.append(joined)
            match = joined.read_until(r"^peer ([0-9a-f]{40}) listening on (\S+)$", timeout=120)
            assert match.group(2).startswith(f"{second.address}:"), match.group(0)
            joined.read_until(r"^reachability: public, reached directly \(dialed back on TCP and UDP by 1 of 1",
                              timeout=60)
            joined.read_until(r"^others join with", timeout=60)
            status = subprocess.run([*observer.command(), *PEER, "status", "--initial-peers",
                                     f"{first.address}:{port}", "--json"], capture_output=True, text=True,
                                    timeout=120, cwd=ROOT)
            assert status.returncode == 0, status.stderr
            report = json.loads(status.stdout)
            assert report["peers_reachable"] == 2, report
            assert "announce=" not in joined.stderr_tail() + boot.stderr_tail()
        finally:
            for process in processes:
                process.kill()
