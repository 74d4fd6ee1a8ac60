"""The local launcher and the docker files describe the same swarm, and the launcher cleans up after itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from peer.topology import Topology, render_compose
from tests.peer_processes import ROOT, run_peer


def test_compose_file_is_rendered_from_the_launcher_topology():
    committed = (ROOT / "docker" / "compose.yaml").read_text()
    assert committed == render_compose(Topology()), "regenerate: peer swarm compose > docker/compose.yaml"


def test_compose_runs_each_launcher_command_in_its_own_container():
    topology = Topology()
    compose = render_compose(topology)
    bootstrap = "bootstrap:31337"
    for index in range(topology.volunteers):
        args = topology.volunteer_args(index, host="0.0.0.0", port=31337, bootstrap=bootstrap,
                                       announce=f"{topology.volunteer_name(index)}:31337")
        assert json.dumps(args) in compose
    for index in range(topology.trainers):
        assert f"  {topology.trainer_name(index)}:" in compose
        assert json.dumps(topology.trainer_args(index, bootstrap=bootstrap)) in compose


def test_dockerfile_installs_only_what_the_package_declares():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
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
