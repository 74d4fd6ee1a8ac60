"""The dockerized swarm, run for real: the image built offline from a local base and a wheelhouse, the generated
docker/compose.yaml brought up, a volunteer container SIGKILLed mid-training, both trainers finishing accurate,
the volunteer behind the NAT container finding itself private and serving the trainers through a relay, and
`down` leaving nothing of the project behind.

Needs a docker daemon (started here as root when none runs, and stopped again) and a Compose tool (`docker
compose` or Debian's docker-compose 1.29): `.ci/run` installs docker.io, docker-compose and debootstrap when it
runs as root and they are missing. Where docker cannot run, the test is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from peer.testing.peer_processes import ROOT
from peer.topology import HOME_SUBNET, NAT_NAME, Topology

pytestmark = pytest.mark.slow

COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
PROJECT = "swarmd-test"
DAEMON_START_S = 60
BASE_IMAGE = "swarmd-base:bookworm-2"  # docker/make-base-image.sh's default tag
BUILD_S = 1800           # the first build on a machine: debootstrap, the wheelhouse, the image
TRAIN_S = 1200           # compose up until both trainers have exited, on a loaded 2-core machine


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
    return result


def daemon_answers() -> bool:
    try:
        return docker("info", timeout=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def docker_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A running docker daemon: the one already there, or one started here (as root) and stopped afterwards."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client (as root, .ci/run installs docker.io)")
    if daemon_answers():
        yield
        return
    dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if os.path.exists("/usr/sbin/dockerd") else None)
    if os.geteuid() != 0:
        pytest.skip("no docker daemon runs and starting one needs root")
    if dockerd is None:
        pytest.skip("no docker daemon runs and dockerd is not installed (.ci/run installs docker.io as root)")
    log_path = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + DAEMON_START_S
        while not daemon_answers():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"dockerd does not run here (no kernel support?): {log_path.read_text()[-1500:]}")
            time.sleep(0.5)  # polling a condition (the daemon's socket answering), not a synchronization sleep
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def compose_tool() -> list[str]:
    """`docker compose` (current Compose) where the plugin is there, else Debian's docker-compose 1.29."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("no Compose tool (as root, .ci/run installs docker-compose)")


def project_objects() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    return {"containers": docker("ps", "--all", "--quiet", "--filter", label).stdout.split(),
            "networks": docker("network", "ls", "--quiet", "--filter", label).stdout.split()}


def inspect(container: str) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(docker("inspect", container).stdout)[0]
    return info


def service_of(info: dict[str, Any]) -> str:
    return str(info["Config"]["Labels"]["com.docker.compose.service"])


def result_line(container: str) -> dict[str, Any]:
    logs = docker("logs", container).stdout.splitlines()
    result: dict[str, Any] = json.loads(next(line for line in reversed(logs) if '"event": "result"' in line))
    return result


def has_progress(container: str) -> bool:
    return '"event": "progress"' in docker("logs", container).stdout


def peer_id_of(container: str) -> str:
    match = re.search(r"^peer ([0-9a-f]{40}) listening on", docker("logs", container).stdout, re.M)
    assert match, docker("logs", container).stdout[-2000:]
    return match.group(1)


def forward_counters(nat_container: str) -> dict[str, int]:
    """The NAT container's FORWARD rules by what they match: packets through each (`iptables -L -v -x`)."""
    listing = docker("exec", nat_container, "iptables", "-L", "FORWARD", "-v", "-n", "-x").stdout.splitlines()
    counters = {}
    for line in listing[2:]:
        fields = line.split()
        counters[f"{fields[2]} {fields[7]} {' '.join(fields[9:])}"] = int(fields[0])
    return counters


def test_compose_swarm_trains_through_a_killed_volunteer_container_and_down_leaves_nothing(docker_daemon: None) -> None:
    compose = [*compose_tool(), "--project-name", PROJECT, "--file", str(COMPOSE_FILE)]
    if os.geteuid() != 0 and docker("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        pytest.skip("making the local base image (debootstrap) needs root")
    if os.geteuid() == 0 and shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is not installed (.ci/run installs it as root)")
    build_started = time.monotonic()
    build = subprocess.run([str(ROOT / "docker" / "build-image.sh"), "--local-base"], capture_output=True,
                           text=True, cwd=ROOT, timeout=BUILD_S, env={**os.environ, "PYTHON": sys.executable})
    assert build.returncode == 0, build.stderr[-3000:]
    image = json.loads(build.stdout.strip().splitlines()[-1])
    print(f"image {image} built in {time.monotonic() - build_started:.0f} s")
    config = subprocess.run([*compose, "config", "--quiet"], capture_output=True, text=True, timeout=60)
    assert config.returncode == 0, config.stderr

    topology = Topology()
    trainers = {topology.trainer_name(i) for i in range(topology.trainers)}
    (private_index,) = topology.private_indices
    private_service = topology.volunteer_name(private_index)
    victim_service = topology.volunteer_name(1)  # public: a relay of the private volunteer, which moves on
    assert victim_service != private_service
    healthy_seen: set[str] = set()
    started = time.monotonic()
    # what a run killed before its `down` may have left; the assertion at the end is about this run
    subprocess.run([*compose, "down", "--volumes", "--remove-orphans"], capture_output=True, timeout=300)
    try:
        up = subprocess.run([*compose, "up", "--detach", "--no-build"], capture_output=True, text=True,
                            timeout=600)
        assert up.returncode == 0, up.stderr[-3000:]
        containers = {service_of(inspect(cid)): cid for cid in project_objects()["containers"]}
        assert set(containers) == ({topology.volunteer_name(i) for i in range(topology.volunteers)} | trainers
                                   | {NAT_NAME})
        killed_at_steps: list[int] = []
        deadline = time.monotonic() + TRAIN_S
        while True:
            states = {service: inspect(cid)["State"] for service, cid in containers.items()}
            healthy_seen |= {s for s, state in states.items() if state.get("Health", {}).get("Status") == "healthy"}
            if all(states[t]["Status"] == "exited" for t in trainers):
                break
            if not killed_at_steps and all(has_progress(containers[t]) for t in trainers):
                docker("kill", containers[victim_service])  # SIGKILL, the default signal of docker kill
                killed_at_steps = [json.loads([line for line in docker("logs", containers[t]).stdout.splitlines()
                                               if '"event": "progress"' in line][-1])["step"] for t in trainers]
            assert time.monotonic() < deadline, f"trainers still running after {TRAIN_S} s: {states}"
            time.sleep(2)  # polling the containers' states, not a synchronization sleep
        print(f"compose up to both trainers done: {time.monotonic() - started:.0f} s")

        assert killed_at_steps and all(step < topology.steps for step in killed_at_steps), killed_at_steps
        victim = inspect(containers[victim_service])["State"]
        assert victim["Status"] == "exited" and victim["ExitCode"] == 137, victim
        for trainer in trainers:
            info = inspect(containers[trainer])
            assert info["State"]["ExitCode"] == 0, docker("logs", containers[trainer]).stderr[-3000:]
            result = result_line(containers[trainer])
            assert result["steps"] == topology.steps and not result["interrupted"], result
            assert result["accuracy"] >= 0.9, result
            # a trainer is a client-mode peer with no port to probe: compose disables its healthcheck
            assert info["Config"]["Healthcheck"]["Test"] == ["NONE"]
        volunteers = set(containers) - trainers  # and the NAT container, whose check is its MASQUERADE rule
        assert healthy_seen >= volunteers, f"never healthy: {volunteers - healthy_seen}"
        for service in volunteers - {victim_service}:
            assert inspect(containers[service])["State"]["Health"]["Status"] == "healthy", service

        # the volunteer behind the NAT found out for itself that it is private (its dial-backs failed), and the
        # trainers used its experts: every request it served came through a connection it opened outwards (a
        # relay reservation or a hole punch), since the NAT forwards nothing unsolicited inwards
        private_logs = docker("logs", containers[private_service]).stdout
        assert re.search(r"^reachability: private, reached through relays.*\(dialed back", private_logs, re.M), \
            private_logs[-2000:]
        status = json.loads(docker("exec", containers[topology.volunteer_name(0)], "peer", "status", "--json",
                                   "--initial-peers", f"{topology.volunteer_name(0)}:31337", timeout=120).stdout)
        rows = {row["peer_id"]: row for row in status["peers"]}
        private = rows[peer_id_of(containers[private_service])]
        assert private["reachable"] and private["reachability"] == "private" and private["reached"] == "relay", private
        assert private["requests_served"] > 0, private
        assert private["connections"]["relayed"] + private["connections"]["upgraded"] >= 1, private
        counters = forward_counters(containers[NAT_NAME])
        print(f"private volunteer: {private}; NAT FORWARD counters: {counters}")
        assert counters[f"ACCEPT {HOME_SUBNET} ctstate NEW"] > 0, counters  # it connected out through the NAT
    finally:
        down = subprocess.run([*compose, "down", "--volumes", "--remove-orphans"], capture_output=True,
                              text=True, timeout=300)
    assert down.returncode == 0, down.stderr[-3000:]
    assert project_objects() == {"containers": [], "networks": []}
