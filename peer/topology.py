"""The shape of a demo swarm, in one place: the local launcher (`peer swarm up`) and docker/compose.yaml are both
rendered from a `Topology`, so the two cannot drift (a test renders the compose file and compares).

Volunteer 0 is the bootstrap peer; the others join through it. Experts are spread over the volunteers, each
serving its own slice of a one-dimensional grid; trainers use the whole grid. With `task="lm"` the grid has one
row per transformer layer (`lm.[0:2].[0:12]`), and each volunteer serves its slice of every row, so killing one
volunteer thins every layer instead of emptying one.

The last `private_volunteers` volunteers are behind NAT: reached only through relays (the public volunteers
offer relay service) or connections a hole punch upgraded. `peer swarm up` runs them with `--reachability
private` (on loopback nothing else would make them private); docker/compose.yaml puts them on a second network,
`home`, whose only way out is a NAT container (MASQUERADE, unsolicited inbound dropped), so they find out they
are private for themselves (`--reachability auto`). The bootstrap peer is always public: it is the first relay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

COMPOSE_PORT = 31337
# docker/compose.yaml's fixed addresses: the public volunteers' (the private ones reach them through the NAT by
# name, from /etc/hosts: docker's DNS answers only for containers on the same network), the NAT container's on
# both networks, and the private volunteers' behind it
SWARM_SUBNET = "10.77.0.0/24"
HOME_SUBNET = "10.77.1.0/24"
NAT_SWARM_IP = "10.77.0.2"
NAT_HOME_IP = "10.77.1.2"
NAT_NAME = "nat"


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
    private_volunteers: int = 1  # behind NAT; at most all volunteers but the bootstrap (`private_indices`)

    def __post_init__(self) -> None:
        if self.volunteers < 1 or self.trainers < 0 or self.experts_per_volunteer < 1:
            raise ValueError("a swarm needs at least one volunteer serving at least one expert")
        if self.private_volunteers < 0:
            raise ValueError("--private-volunteers cannot be negative")
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

    @property
    def private_indices(self) -> range:
        """The volunteers behind NAT: the last `private_volunteers`, never the bootstrap (a single-volunteer swarm
        has none, so the default works with `--volunteers 1` too)."""
        count = min(self.private_volunteers, self.volunteers - 1)
        return range(self.volunteers - count, self.volunteers)

    def is_private(self, index: int) -> bool:
        return index in self.private_indices

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

    def compose_volunteer_args(self, index: int, *, bootstrap: str) -> list[str]:
        """A volunteer's command in docker/compose.yaml. A public one announces its service name and skips the
        dial-back check (on one bridge network every container reaches every other; judging by dial-backs of
        compose host names it came out private); a private one, behind the NAT container, finds out for itself
        (`--reachability auto`: its dial-backs fail) and announces what the relays give it."""
        if self.is_private(index):
            return self.volunteer_args(index, host="0.0.0.0", port=COMPOSE_PORT, bootstrap=bootstrap,
                                       reachability="auto")
        return self.volunteer_args(index, host="0.0.0.0", port=COMPOSE_PORT, bootstrap=bootstrap,
                                   announce=f"{self.volunteer_name(index)}:{COMPOSE_PORT}", reachability="public")

    def first_expert(self, index: int) -> str:
        """The first uid volunteer `index` serves (`ffn.8`; `lm.0.8` for the language model)."""
        first = index * self.experts_per_volunteer
        return f"{self.prefix}.0.{first}" if self.task == "lm" else f"{self.prefix}.{first}"

    def compose_healthcheck(self, index: int, *, bootstrap: str) -> list[str]:
        """A volunteer container's healthcheck. A public one answers `peer status` itself; a private one is a DHT
        client, which answers no DHT bootstrap, so its check asks the swarm (through the NAT) and passes once a
        reachable peer serving its first expert is reached through a relay."""
        if not self.is_private(index):
            return ["CMD", "peer", "status", "--initial-peers", f"{self.volunteer_name(index)}:{COMPOSE_PORT}"]
        check = ("import json, sys; peers = json.load(sys.stdin)['peers']; sys.exit(not any(p['reachable'] and "
                 "p['reached'] == 'relay' and sys.argv[1] in p['experts'] for p in peers))")
        return ["CMD-SHELL", f"peer status --json --initial-peers {bootstrap} | python -c \"{check}\" "
                             f"{self.first_expert(index)}"]

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
    """docker/compose.yaml for `topology`: every peer in its own container on a private network, the private
    volunteers on a second one (`home`) behind a NAT container.

    Written for both Debian's docker-compose 1.29 and current Compose: no top-level `name:` (1.29 rejects it;
    the project name comes from `-p`), and only keys both accept (extension fields, `depends_on` conditions,
    fixed addresses from an `ipam` subnet).
    """
    bootstrap = f"{topology.volunteer_name(0)}:{COMPOSE_PORT}"
    private = topology.private_indices
    lines = [
        "# Generated from peer/topology.py by `peer swarm compose`; tests/peer/test_swarm.py checks it is current.",
        "# Run: docker compose -p swarmd -f docker/compose.yaml up --build   (README: Docker; docker-compose 1.29 too)",
        "x-peer: &peer",
        "  build:",
        "    context: ..",
        "    dockerfile: docker/Dockerfile",
        "  image: swarmd:latest",
        "  networks: [swarm]",
        "services:",
    ]
    public_hosts = [f"{topology.volunteer_name(i)}:{public_volunteer_ip(i)}"
                    for i in range(topology.volunteers) if i not in private]
    for index in range(topology.volunteers):
        name = topology.volunteer_name(index)
        lines += [f"  {name}:", "    <<: *peer", f"    hostname: {name}"]
        if index in private:
            # root only for the route through the NAT container; the peer itself runs as the image's user
            lines += ["    user: root", "    cap_add: [NET_ADMIN]",
                      "    networks:", "      home:", f"        ipv4_address: {private_volunteer_ip(index)}",
                      f"    extra_hosts: {_yaml_list(public_hosts)}",
                      f"    entrypoint: {_yaml_list(['sh', '-c', _PRIVATE_ENTRYPOINT, 'peer'])}"]
        else:
            lines += ["    networks:", "      swarm:", f"        ipv4_address: {public_volunteer_ip(index)}"]
        lines += [f"    command: {_yaml_list(topology.compose_volunteer_args(index, bootstrap=bootstrap))}"]
        check = topology.compose_healthcheck(index, bootstrap=bootstrap)
        lines += ["    healthcheck:", f"      test: {_yaml_list(check)}", "      interval: 10s", "      timeout: 10s",
                  "      retries: 3"]
        if index > 0:
            lines += ["    depends_on:", f"      {topology.volunteer_name(0)}:", "        condition: service_healthy"]
        if index in private:
            lines += [f"      {NAT_NAME}:", "        condition: service_healthy"]
    if private:
        lines += [f"  {NAT_NAME}:", "    <<: *peer", f"    hostname: {NAT_NAME}", "    user: root",
                  "    cap_add: [NET_ADMIN]", "    sysctls:", "      net.ipv4.ip_forward: 1",
                  "    networks:", "      swarm:", f"        ipv4_address: {NAT_SWARM_IP}",
                  "      home:", f"        ipv4_address: {NAT_HOME_IP}",
                  f"    entrypoint: {_yaml_list(['sh', '-c'])}",
                  f"    command: {_yaml_list([_NAT_SCRIPT])}",
                  "    healthcheck:",
                  f"      test: {_yaml_list(['CMD-SHELL', 'iptables -t nat -S POSTROUTING | grep -q MASQUERADE'])}",
                  "      interval: 10s", "      timeout: 10s", "      retries: 3"]
    for index in range(topology.trainers):
        name = topology.trainer_name(index)
        lines += [f"  {name}:", "    <<: *peer", f"    hostname: {name}",
                  f"    command: {_yaml_list(topology.trainer_args(index, bootstrap=bootstrap))}",
                  "    healthcheck:", "      disable: true",
                  "    depends_on:"]
        for volunteer in range(topology.volunteers):
            lines += [f"      {topology.volunteer_name(volunteer)}:", "        condition: service_healthy"]
    lines += ["networks:", "  swarm:", "    internal: true", "    ipam:", "      config:",
              f"        - subnet: {SWARM_SUBNET}"]
    if private:
        # not `internal`: docker's isolation rules for an internal network drop every bridged packet addressed
        # outside its subnet, which is all the private volunteers send (to the NAT container's MAC); they never
        # use docker's gateway on it (their default route goes to the NAT container, which drops its own and
        # forwards only toward the swarm network)
        lines += ["  home:", "    ipam:", "      config:", f"        - subnet: {HOME_SUBNET}"]
    lines += [""]
    return "\n".join(lines)


def public_volunteer_ip(index: int) -> str:
    return SWARM_SUBNET.rsplit(".", 1)[0] + f".{10 + index}"


def private_volunteer_ip(index: int) -> str:
    return HOME_SUBNET.rsplit(".", 1)[0] + f".{10 + index}"


# The NAT container: what a home router does. Outbound from `home` leaves with the NAT's address (MASQUERADE);
# inbound is forwarded only as replies to connections from inside; nothing unsolicited gets through. Only toward
# the swarm network: the NAT drops the default route docker gave it on `home` (a bridge with a gateway on the
# host) and forwards nothing else, so nothing inside reaches the host's other networks or beyond. It then
# waits for docker's SIGTERM (a shell as PID 1 would ignore it without the trap, and `down` would wait 10 s).
_NAT_SCRIPT = ("set -e; ip route del default 2>/dev/null || true; "
               f"iptables -t nat -A POSTROUTING -s {HOME_SUBNET} -d {SWARM_SUBNET} -j MASQUERADE; "
               "iptables -P FORWARD DROP; "
               "iptables -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT; "
               f"iptables -A FORWARD -s {HOME_SUBNET} -d {SWARM_SUBNET} -m conntrack --ctstate NEW -j ACCEPT; "
               "iptables -A FORWARD -m conntrack --ctstate NEW -j DROP; "
               "trap 'exit 0' TERM INT; sleep infinity & wait")
# A private volunteer: its default route goes through the NAT container (set as root, the one thing that needs
# NET_ADMIN), then `peer` runs as the image's unprivileged user with the service's command as its arguments.
_PRIVATE_ENTRYPOINT = (f"ip route replace default via {NAT_HOME_IP} && HOME=/home/swarm exec setpriv --reuid=swarm "
                       '--regid=swarm --init-groups peer "$$@"')


def _yaml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"
