"""The shape of a demo swarm, in one place: the local launcher (`peer swarm up`) and docker/compose.yaml are both
rendered from a `Topology`, so the two cannot drift (a test renders the compose file and compares).

Volunteer 0 is the bootstrap peer; the others join through it. Experts are spread over the volunteers, each
serving its own slice of a one-dimensional grid; trainers use the whole grid. With `task="lm"` the grid has one
row per transformer layer (`lm.[0:2].[0:12]`), and each volunteer serves its slice of every row, so killing one
volunteer thins every layer instead of emptying one.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPOSE_PORT = 31337


@dataclass(frozen=True)
class Topology:
    volunteers: int = 3
    trainers: int = 2
    experts_per_volunteer: int = 4
    expert_prefix: str = "ffn"
    hidden_dim: int = 64
    steps: int = 400
    batch_size: int = 32
    target_batch_size: int = 128
    run_id: str | None = None  # the task's name
    task: str = "digits"  # digits | lm
    lm_layers: int = 2

    def __post_init__(self) -> None:
        if self.volunteers < 1 or self.trainers < 0 or self.experts_per_volunteer < 1:
            raise ValueError("a swarm needs at least one volunteer serving at least one expert")
        if self.task not in ("digits", "lm"):
            raise ValueError(f"unknown task {self.task!r} (digits, lm)")

    @property
    def prefix(self) -> str:
        return "lm" if self.task == "lm" and self.expert_prefix == "ffn" else self.expert_prefix

    @property
    def grid_text(self) -> str:
        """The trainers' --grid-size: N, or LAYERSxN for the language model."""
        return f"{self.lm_layers}x{self.grid_size}" if self.task == "lm" else str(self.grid_size)

    @property
    def experts_total(self) -> int:
        return self.grid_size * (self.lm_layers if self.task == "lm" else 1)

    @property
    def grid_size(self) -> int:
        return self.volunteers * self.experts_per_volunteer

    def volunteer_name(self, index: int) -> str:
        return "bootstrap" if index == 0 else f"volunteer-{index}"

    def trainer_name(self, index: int) -> str:
        return f"trainer-{index + 1}"

    def volunteer_args(self, index: int, *, host: str, port: int, bootstrap: str | None,
                       announce: str | None = None, reachability: str | None = None) -> list[str]:
        first = index * self.experts_per_volunteer
        rows = f".[0:{self.lm_layers}]" if self.task == "lm" else ""
        args = ["join", "--host", host, "--port", str(port),
                "--experts", f"{self.prefix}{rows}.[{first}:{first + self.experts_per_volunteer}]",
                "--hidden-dim", str(self.hidden_dim), "--threads", "1"]
        if announce:
            args += ["--announce", announce]
        if reachability:
            args += ["--reachability", reachability]
        if bootstrap and index > 0:
            args += ["--initial-peers", bootstrap]
        return args

    def trainer_args(self, index: int, *, bootstrap: str) -> list[str]:
        # the LM routes every token: 2 experts per token keep a step's expert compute near the dense FFN's; its
        # trainers step their own layers every batch and average parameters once per collective epoch (with
        # gradients averaged, a short demo run would update attention and embeddings only a handful of times)
        task = ["--task", self.task, "--k-best", "2", "--average", "parameters"] if self.task == "lm" else []
        return ["train", "--initial-peers", bootstrap, *task, "--run-id", self.run_id or self.task,
                "--expert-prefix", self.prefix, "--grid-size", self.grid_text,
                "--hidden-dim", str(self.hidden_dim), "--steps", str(self.steps),
                "--batch-size", str(self.batch_size), "--target-batch-size", str(self.target_batch_size),
                "--seed", str(index)]


def render_compose(topology: Topology) -> str:
    """docker/compose.yaml for `topology`: every peer in its own container on a private network.

    Written for both Debian's docker-compose 1.29 and current Compose: no top-level `name:` (1.29 rejects it;
    the project name comes from `-p`), and only keys both accept (extension fields, `depends_on` conditions).
    """
    bootstrap = f"{topology.volunteer_name(0)}:{COMPOSE_PORT}"
    lines = [
        "# Generated from peer/topology.py by `peer swarm compose`; tests/test_swarm.py checks it is current.",
        "# Run: docker compose -p swarmd -f docker/compose.yaml up --build   (README: Docker; docker-compose 1.29 too)",
        "x-peer: &peer",
        "  build:",
        "    context: ..",
        "    dockerfile: docker/Dockerfile",
        "  image: swarmd:latest",
        "  networks: [swarm]",
        "services:",
    ]
    for index in range(topology.volunteers):
        name = topology.volunteer_name(index)
        # every container sits on one bridge network, reachable by all: no dial-back check (it judged the
        # volunteers private there, dialing their compose host names back; see the issue on NAT)
        args = topology.volunteer_args(index, host="0.0.0.0", port=COMPOSE_PORT, bootstrap=bootstrap,
                                       announce=f"{name}:{COMPOSE_PORT}", reachability="public")
        lines += [f"  {name}:", "    <<: *peer", f"    hostname: {name}", f"    command: {_yaml_list(args)}"]
        lines += ["    healthcheck:",
                  f"      test: [\"CMD\", \"peer\", \"status\", \"--initial-peers\", \"{name}:{COMPOSE_PORT}\"]",
                  "      interval: 10s", "      timeout: 10s", "      retries: 3"]
        if index > 0:
            lines += ["    depends_on:", f"      {topology.volunteer_name(0)}:", "        condition: service_healthy"]
    for index in range(topology.trainers):
        name = topology.trainer_name(index)
        lines += [f"  {name}:", "    <<: *peer", f"    hostname: {name}",
                  f"    command: {_yaml_list(topology.trainer_args(index, bootstrap=bootstrap))}",
                  "    healthcheck:", "      disable: true",
                  "    depends_on:"]
        for volunteer in range(topology.volunteers):
            lines += [f"      {topology.volunteer_name(volunteer)}:", "        condition: service_healthy"]
    lines += ["networks:", "  swarm:", "    internal: true", ""]
    return "\n".join(lines)


def _yaml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"
