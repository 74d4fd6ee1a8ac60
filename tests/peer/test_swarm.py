"""The local launcher and the docker files describe the same swarm, the launcher cleans up after itself, and
`peer status` reports the swarm."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import trio

from moe.errors import ExpertNotFound
from peer.daemon import Daemon, DaemonConfig
from peer.p2p import wire
from peer.p2p.rpc import UnknownMethod
from peer.status import format_status, gather_status
from peer.testing.peer_processes import ROOT, run_peer
from peer.topology import Topology, render_compose


def test_compose_file_is_rendered_from_the_launcher_topology():
    committed = (ROOT / "docker" / "compose.yaml").read_text()
    assert committed == render_compose(Topology()), "regenerate: peer swarm compose > docker/compose.yaml"


def test_compose_runs_each_launcher_command_in_its_own_container():
    topology = Topology()
    compose = render_compose(topology)
    bootstrap = "bootstrap:31337"
    for index in range(topology.volunteers):
        args = topology.compose_volunteer_args(index, bootstrap=bootstrap)
        assert json.dumps(args) in compose
        # the same command `peer swarm up` runs, but for where it listens and how it judges its reachability
        local = topology.volunteer_args(index, host="127.0.0.1", port=0, bootstrap=bootstrap)
        assert args[args.index("--experts") + 1] == local[local.index("--experts") + 1]
    for index in range(topology.trainers):
        assert f"  {topology.trainer_name(index)}:" in compose
        assert json.dumps(topology.trainer_args(index, bootstrap=bootstrap)) in compose


def test_the_last_volunteers_are_private_and_never_the_bootstrap():
    assert list(Topology().private_indices) == [2]
    assert list(Topology(volunteers=5, private_volunteers=2).private_indices) == [3, 4]
    assert list(Topology(volunteers=3, private_volunteers=9).private_indices) == [1, 2]
    assert list(Topology(volunteers=1).private_indices) == []
    assert not Topology(volunteers=4, private_volunteers=3).is_private(0)
    with pytest.raises(ValueError):
        Topology(private_volunteers=-1)


def test_compose_puts_the_private_volunteer_behind_a_nat_container():
    """Parsed as Compose reads it (YAML merge keys resolved): the private volunteer is on `home` alone, its route
    goes through the NAT container (the only service on both networks), and it judges its reachability itself."""
    yaml = pytest.importorskip("yaml")
    from peer.topology import HOME_SUBNET, NAT_HOME_IP, NAT_NAME, SWARM_SUBNET

    topology = Topology()
    services = yaml.safe_load(render_compose(topology))["services"]
    private = services[topology.volunteer_name(2)]
    assert list(private["networks"]) == ["home"] and "NET_ADMIN" in private["cap_add"]
    assert f"ip route replace default via {NAT_HOME_IP}" in private["entrypoint"][2]
    assert "setpriv --reuid=swarm" in private["entrypoint"][2]  # the peer itself does not run as root
    assert private["command"][private["command"].index("--reachability") + 1] == "auto"
    assert "--announce" not in private["command"]
    nat = services[NAT_NAME]
    assert set(nat["networks"]) == {"swarm", "home"} and nat["sysctls"] == {"net.ipv4.ip_forward": 1}
    assert f"-s {HOME_SUBNET} -d {SWARM_SUBNET} -j MASQUERADE" in nat["command"][0]
    assert "iptables -P FORWARD DROP" in nat["command"][0]
    # only toward the swarm network: nothing inside reaches the host's other networks through the NAT
    assert "ip route del default" in nat["command"][0]
    assert f"-A FORWARD -s {HOME_SUBNET} -d {SWARM_SUBNET} -m conntrack --ctstate NEW -j ACCEPT" in nat["command"][0]
    on_both = [name for name, service in services.items() if {"swarm", "home"} <= set(service.get("networks", []))]
    assert on_both == [NAT_NAME]
    for index in range(2):
        public = services[topology.volunteer_name(index)]
        assert list(public["networks"]) == ["swarm"]
        assert public["networks"]["swarm"]["ipv4_address"].startswith(SWARM_SUBNET.rsplit(".", 1)[0] + ".")
    # the private volunteer knows the relays by the names they announce
    relays = [topology.volunteer_name(i) for i in range(2)]
    assert private["extra_hosts"] == [f"{n}:{services[n]['networks']['swarm']['ipv4_address']}" for n in relays]
    no_nat = yaml.safe_load(render_compose(Topology(private_volunteers=0)))
    assert NAT_NAME not in no_nat["services"] and "home" not in no_nat["networks"]


def test_docker_compose_accepts_the_generated_file():
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("no docker-compose (Debian's 1.29) installed")
    result = subprocess.run([tool, "--project-name", "swarmd-config", "--file", str(ROOT / "docker" / "compose.yaml"),
                             "config", "--quiet"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_dockerfile_installs_only_what_the_package_declares():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")  # join continued lines
    installs = re.findall(r"^RUN .*?pip install ([^&\n]*)", dockerfile, re.M)
    assert [command.strip() for command in installs] == ["."]
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.M), "the image must not run as root"
    assert 'ENTRYPOINT ["peer"]' in dockerfile and "HEALTHCHECK" in dockerfile


def test_swarm_compose_command_prints_the_same_file():
    result = run_peer("swarm", "compose")
    assert result.returncode == 0 and result.stdout == render_compose(Topology())


def test_topology_spreads_experts_without_overlap():
    topology = Topology(volunteers=3, experts_per_volunteer=4)
    patterns = [topology.volunteer_args(i, host="h", port=1, bootstrap="b:1")[6] for i in range(3)]
    assert patterns == ["ffn.[0:4]", "ffn.[4:8]", "ffn.[8:12]"]
    assert "--grid-size" in topology.trainer_args(0, bootstrap="b:1")


# ------------------------------------------------------------------------------------------- peer status


async def test_status_counts_failed_calls_served_and_sent():

    from peer.status import format_status

    async with trio.open_nursery() as nursery:
        first = Daemon(DaemonConfig(experts="ffn.[0:2]", hidden_dim=8, host="127.0.0.1"))
        await nursery.start(first.run)
        second = Daemon(DaemonConfig(experts="ffn.[2:3]", hidden_dim=8, host="127.0.0.1",
                                     initial_peers=[first.rpc.address]))
        await nursery.start(second.run)

        def failed(status: dict, daemon: Daemon) -> int:
            return next(p["failures_seen"] for p in status["peers"] if p["peer_id"] == str(daemon.identity.peer_id))

        before = await gather_status(second.rpc, second.dht)
        assert failed(before, first) == 0
        with pytest.raises(ExpertNotFound):  # a typed refusal from the expert server
            await second.rpc.call(first.rpc.address, "moe.forward", {"uid": "ffn.99"}, timeout=10)
        with pytest.raises(UnknownMethod):  # refused before any handler ran
            await second.rpc.call(first.rpc.address, "no.such.method", timeout=10)
        after = await gather_status(second.rpc, second.dht)
        assert failed(after, first) == 2
        assert failed(after, second) == 2 + failed(before, second)  # its own two calls failed
        me = next(p for p in after["peers"] if p["peer_id"] == str(first.identity.peer_id))
        assert me["failed_calls"]["served"] == 2
        row = next(line for line in format_status(after).splitlines() if line.startswith(me["peer_id"][:12]))
        assert row.split()[7] == "2"  # the FAILED column
        nursery.cancel_scope.cancel()


def test_status_table_pluralizes():
    peer = {"peer_id": "a" * 40, "address": "127.0.0.1:1", "reachable": True, "uptime_s": 5.0, "dht_table_size": 0,
            "experts": ["ffn.0"], "requests_served": 1, "failures_seen": 0, "averaging_rounds": None}
    run = {"run_id": "digits", "epoch": 3, "trainers": 1, "trainers_in_epoch": 1, "samples": 10,
           "target_batch_size": 128, "samples_per_s": 50.0}
    text = format_status({"peers": [peer], "peers_reachable": 1, "runs": [run],
                          "experts": {"ffn": [{"uid": "ffn.0", "peer_id": "a" * 40, "address": "127.0.0.1:1"}]}})
    assert "ffn: 1 expert on 1 peer (127.0.0.1:1)" in text and "epoch 3, 1 trainer (" in text
    assert " peers " not in text.replace("peers:", "")


def test_peer_status_does_not_import_torch_and_tensors_still_decode_in_a_fresh_process(tmp_path):
    """Importing torch was most of `peer status`'s time (6 s of 7-10 s on a busy machine): the command line and the
    codec import it only when a tensor is built or a train option is needed."""
    check = ("import sys\n"
             "from peer.cli import build_parser\n"
             "import peer.status, peer.p2p.rpc, dht.node\n"
             "from peer.p2p import wire\n"
             "build_parser().parse_args(['status', '--initial-peers', '127.0.0.1:1'])\n"
             "assert wire.decode(wire.encode_bytes({'a': [1, 2.5, b'x']})) == {'a': [1, 2.5, b'x']}\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n"
             "message = wire.decode(bytearray(open(sys.argv[1], 'rb').read()))\n"
             "assert 'torch' in sys.modules\n"
             "print(message['t'].tolist(), message['q'].dtype)\n")
    message = tmp_path / "message.bin"
    message.write_bytes(wire.encode_bytes({"t": torch.arange(4, dtype=torch.int16),
                                           "q": wire.compressed(torch.ones(3), wire.Compression.UINT8)}))
    result = subprocess.run([sys.executable, "-c", check, str(message)], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 1, 2, 3] torch.float32"


def test_the_live_view_reads_the_joined_event_of_peer_join(tmp_path):
    """The launcher reads `peer join`'s `joined` event (peer/events.py), not its human lines."""
    from peer.daemon import DaemonInfo
    from peer.events import event_line, joined_event
    from peer.swarm import Managed, SwarmLauncher
    from peer.topology import Topology

    info = DaemonInfo("ab" * 20, ("127.0.0.1", 1), ["ffn.0", "ffn.1", "ffn.2", "ffn.3"], "ffn.[0:4]", 64)
    launcher = SwarmLauncher(Topology(), kill_one_at=None, log_dir=tmp_path)
    member = Managed("bootstrap", "volunteer", [])
    launcher._on_line(member, "serving 4 experts: a line for people")
    assert not member.ready.is_set()
    launcher._on_line(member, event_line(joined_event(info)))
    assert member.ready.is_set() and (member.peer_id, member.address) == ("ab" * 20, "127.0.0.1:1")
    assert member.experts == "4 experts (ffn.0..ffn.3, hidden 64)"
    assert member.last_line == "serving 4 experts: a line for people"  # the event is no "last line" to show


def test_the_live_view_and_summary_show_which_volunteers_are_private_and_how_they_were_reached(tmp_path):
    """The reachability of `peer join`'s `joined` event, and a `peer status` row of the closing status read: the
    live view marks the private volunteer, the summary says what it served."""
    from peer.daemon import DaemonInfo
    from peer.events import event_line, joined_event
    from peer.reachability import fixed
    from peer.swarm import Managed, SwarmLauncher

    reachability = fixed("private")
    reachability.how = "relay"
    launcher = SwarmLauncher(Topology(), kill_one_at=None, log_dir=tmp_path)
    members = [Managed(Topology().volunteer_name(i), "volunteer", []) for i in range(3)]
    launcher.members = members
    private = DaemonInfo("ab" * 20, ("127.0.0.1", 5), ["ffn.8"], reachability=reachability.describe(),
                         status=reachability.status, reached=reachability.how)
    public = DaemonInfo("cd" * 20, ("127.0.0.1", 4), ["ffn.0"], status="public", reached="direct")
    launcher._on_line(members[2], event_line(joined_event(private)))
    launcher._on_line(members[0], event_line(joined_event(public)))
    assert (members[2].peer_id, members[2].reachability, members[0].reachability) == ("ab" * 20, "private", "public")
    members[2].status = {"reached": "relay", "requests_served": 7,
                         "connections": {"direct": 0, "upgraded": 1, "relayed": 2}}
    row = next(line for line in launcher._lines() if line.strip().startswith("volunteer-2"))
    assert " private " in row and "reached through relays, 1 circuit upgraded by hole punching, 2 relayed; " \
                                  "7 requests served" in row
    summary = launcher.summary()
    volunteer = summary["volunteers"][2]
    assert volunteer["private"] and volunteer["reached"] == "relay" and volunteer["requests_served"] == 7
    assert not summary["volunteers"][0]["private"]


def test_a_trainers_failed_step_line_is_not_taken_for_its_result(tmp_path):
    """`peer train` writes a `failed_step` line for a step it retries; only the `result` line is the result."""
    from peer.swarm import Managed, SwarmLauncher

    launcher = SwarmLauncher(Topology(), kill_one_at=None, log_dir=tmp_path)
    trainer = Managed("trainer-0", "trainer", [])
    launcher.members = [trainer]
    launcher._on_line(trainer, json.dumps({"event": "failed_step", "step": 3, "stage": "backward"}))
    assert trainer.result is None
    launcher._on_line(trainer, json.dumps({"event": "result", "accuracy": 0.95, "steps": 10}))
    assert trainer.result == {"event": "result", "accuracy": 0.95, "steps": 10}
