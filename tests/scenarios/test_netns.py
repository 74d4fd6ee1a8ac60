"""The swarm across separate hosts: every peer in its own network namespace with its own address and a capped
link, as containers would be. Training must carry on through a volunteer cut off from the network (and brought
back) and through a volunteer host that is killed.
"""

from __future__ import annotations

import json
import signal

import pytest

from peer.testing.netns import HostNetwork, netns_available
from peer.testing.peer_processes import PeerProcess
from peer.topology import Topology

AVAILABLE, WHY_NOT = netns_available()
pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)]
PORT = 31337


def progress_step(process: PeerProcess, at_least: int, timeout: float = 300) -> dict:
    match = process.read_until(r'"event": "progress", "step": (\d+)', timeout)
    while int(match.group(1)) < at_least:
        match = process.read_until(r'"event": "progress", "step": (\d+)', timeout)
    return json.loads(process.lines[-1])


def test_training_across_namespaces_survives_a_partition_and_a_killed_host():
    topology = Topology(volunteers=3, trainers=2, steps=300)
    processes: list[PeerProcess] = []
    with HostNetwork() as network:
        volunteers = [network.add_host(topology.volunteer_name(i)) for i in range(topology.volunteers)]
        trainers = [network.add_host(topology.trainer_name(i)) for i in range(topology.trainers)]
        bootstrap = f"{volunteers[0].address}:{PORT}"
        try:
            for index, host in enumerate(volunteers):
                args = topology.volunteer_args(index, host=host.address, port=PORT, bootstrap=bootstrap,
                                               announce=f"{host.address}:{PORT}")
                daemon = PeerProcess(args, prefix=host.command())
                daemon.read_until(r"^others join with", timeout=120)
                processes.append(daemon)
            runners = []
            for index, host in enumerate(trainers):
                runner = PeerProcess(topology.trainer_args(index, bootstrap=bootstrap), prefix=host.command())
                runners.append(runner)
                processes.append(runner)

            partitioned, killed = volunteers[1], processes[2]
            progress_step(runners[0], 60)
            network.cut(partitioned)  # volunteer-1 vanishes from the network, its process keeps running
            progress_step(runners[0], 120)
            network.restore(partitioned)
            progress_step(runners[0], 160)
            killed.signal(signal.SIGKILL)  # volunteer-2's host dies

            for runner in runners:
                runner.read_until(r'"event": "result"', timeout=600)
                result = json.loads(runner.lines[-1])
                assert result["accuracy"] >= 0.9, result
                assert runner.wait(timeout=60) == 0
        finally:
            for process in processes:
                process.kill()
