"""`peer join`: one trio program that owns a volunteer's DHT node, expert server, replica averager and status
service.

Why one nursery: cancelling it stops everything — the expert server saves its checkpoints on the way out, the
DHT node stops answering, connections close — so SIGTERM means "cancel", and nothing is left behind.

Which experts a daemon serves, so that `peer join --initial-peers X` alone is useful to the swarm:
- `--experts PATTERN`: `--num-experts` uids of the pattern (default all of it);
- no `--experts`: it reads the swarm's expert families from the peer directory (`peer.discover`) and joins the
  largest family of its own `--hidden-dim` (default 64, as `peer train`'s), serving `--num-experts` (default 4)
  free uids of that family's grid; when the grid has fewer free uids than that, its first dimension grows by just
  enough. In a new swarm it serves 4 uids of `ffn.[0:12]`. A swarm that declares experts of other hidden sizes
  only is a startup error naming them (pass their `--hidden-dim`, or `--experts` for a family of your own).
Either way checkpointed uids come back first, then the uids this PeerID still declares (a daemon restarted
with the same `--identity` takes back what it served), then free ones. The directory summary publishes the
pattern, the count and the hidden size, which is how trainers and later volunteers find the family.

`--no-experts` serves none and never imports torch (issue 38): a light daemon (DHT, relay, reachability, status,
metrics) for an always-on bootstrap. So everything that needs torch (moe.experts, moe.server, moe.specs,
moe.upcycle, peer.replicas) is imported inside the methods that only run with experts, not at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from dht import records
from dht.node import DHTConfig, DHTNode
from dht.routing import has_work, identity_with_work
from moe.declare import find_free_uids
from moe.grid import GridPattern, InvalidUID, expand_pattern
from peer import __version__
from peer.directory import PeerDirectory
from peer.discover import SwarmMismatch, choose_family, discover_families, summary_fields
from peer.options import JOIN
from peer.p2p.addresses import WILDCARDS, announced_address, default_listen_host, pick_free_port
from peer.p2p.budget import DEFAULT_BUDGET
from peer.p2p.identity import Identity, load_membership
from peer.p2p.net import Address, Network, RealNetwork
from peer.p2p.rpc import CallContext, RPCNode
from peer.reachability import DialBackService, Reachability, check_reachability, fixed
from peer.relays import Relaying, run_relaying
from peer.status import MAX_REPLICA_KEYS, STATUS_METHOD

if TYPE_CHECKING:  # these bring torch: at run time only the expert-serving path imports them
    from moe.server import CallerPolicy, ExpertServer
    from moe.specs import ExpertSpec
    from peer.metrics import PeerMetrics
    from peer.replicas import ReplicaAverager

logger = logging.getLogger(__name__)


_JOIN = JOIN.defaults()


@dataclass
class DaemonConfig:
    """What a daemon runs with. The defaults are `peer join`'s, taken from its option table (peer/options.py), so a
    daemon started from Python and one started from the command line agree; `declare_ttl` and `seed` have no
    flag (tests and simulations set them)."""

    host: str | None = _JOIN["host"]  # None: `peer.p2p.addresses.default_listen_host`
    port: int = _JOIN["port"]
    announce: Address | None = _JOIN["announce"]
    initial_peers: list[Address] = field(default_factory=lambda: list(_JOIN["initial_peers"]))
    identity: Path | None = _JOIN["identity"]
    experts: str | None = _JOIN["experts"]
    num_experts: int | None = _JOIN["num_experts"]
    no_experts: bool = _JOIN["no_experts"]  # serve none, import no torch (a light bootstrap)
    expert_kind: str = _JOIN["expert_kind"]
    hidden_dim: int = _JOIN["hidden_dim"]
    max_batch_size: int = _JOIN["max_batch_size"]
    optimizer: str = _JOIN["optimizer"]
    lr: float = _JOIN["lr"]
    clip_grad_norm: float = _JOIN["clip_grad_norm"]
    checkpoint_dir: Path | None = _JOIN["checkpoint_dir"]
    checkpoint_interval: float = _JOIN["checkpoint_interval"]
    device: str = _JOIN["device"]
    threads: int | None = _JOIN["threads"]
    declare_ttl: float = 30.0
    seed: int | None = None
    replicate: bool = _JOIN["replicate"]
    average_every: float = _JOIN["average_every"]
    accept_weights_from: list[str] = field(default_factory=lambda: list(_JOIN["accept_weights_from"]))
    insecure_transport: bool = _JOIN["insecure_transport"]
    swarm_key: Path | None = _JOIN["swarm_key"]
    allow_peers: Path | None = _JOIN["allow_peers"]
    reachability: str = _JOIN["reachability"]
    metrics_port: int | None = _JOIN["metrics_port"]
    relay_limit: int = _JOIN["relay_limit"]
    relay_rate: float = _JOIN["relay_rate"]
    relay_total_rate: float = _JOIN["relay_total_rate"]
    no_relay: bool = _JOIN["no_relay"]
    budget: list[str] = field(default_factory=lambda: list(_JOIN["budget"]))  # NAME=VALUE limit overrides
    trainers: Path | None = _JOIN["trainers"]
    forward_from: Path | None = _JOIN["forward_from"]
    dht_disjoint_paths: int = _JOIN["dht_disjoint_paths"]
    dht_id_difficulty: int = _JOIN["dht_id_difficulty"]


@dataclass
class DaemonInfo:
    """What a started daemon tells whoever started it (the CLI prints it)."""

    peer_id: str
    address: Address
    experts: list[str]
    pattern: str | None = None  # the grid the experts were chosen from
    hidden_dim: int | None = None
    reachability: str | None = None  # `Reachability.describe()`
    metrics_address: Address | None = None  # where /metrics is served (--metrics-port)
    swarm_key: str | None = None  # the private swarm's key file (--swarm-key): others need a copy to join
    expert_kind: str | None = None
    notes: list[str] = field(default_factory=list)  # start-up remarks (fewer experts than asked, and why)
    status: str | None = None  # public / private (`Reachability.status`)
    reached: str | None = None  # direct / relay / none (`Reachability.how`)

    @property
    def join_command(self) -> str:
        key = f" --swarm-key {self.swarm_key}" if self.swarm_key else ""
        return f"peer join --initial-peers {self.address[0]}:{self.address[1]}{key}"


DEFAULT_PATTERN = "ffn.[0:12]"  # the family a daemon without --experts starts in a new swarm
DEFAULT_COUNT = 4  # experts a daemon without --experts (nor --num-experts) serves
DISCOVERY_TIMEOUT = 10.0  # seconds for reading the peer directory at startup


class StartupError(Exception):
    """The daemon could not start (port in use, bad expert configuration); the message says what to change."""


def caller_policy(path: Path | None, flag: str) -> CallerPolicy:
    """The allow list of `flag` (None: anyone); a list that cannot be read stops the start with one line."""
    from moe.server import CallerPolicy, read_peer_list  # brings torch: keeps a --no-experts daemon free of it

    if path is None:
        return CallerPolicy()
    try:
        return CallerPolicy(read_peer_list(path), f"{flag} {path}")
    except OSError as error:
        raise StartupError(f"{flag} {path}: {error.strerror or error}") from None
    except ValueError as error:
        raise StartupError(f"{flag} {error}") from None


def check_checkpoint_dir(directory: Path) -> None:
    """Create the checkpoint directory and prove it writable (a temporary file is created and removed). Why at
    start: otherwise the first sign is a failed checkpoint minutes later, or at shutdown, with the weights lost."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(prefix=".write-check-", dir=directory)
        os.close(descriptor)
        os.unlink(name)
    except OSError as error:
        raise StartupError(f"checkpoint directory {directory} is not writable: {error.strerror or error}") from None


def _identity_for(config: DaemonConfig) -> Identity:
    """The daemon's identity: its --identity file (made on first run) or a fresh one, carrying the swarm's
    proof-of-work bits when --dht-id-difficulty asks for them (made once, then kept in the file)."""
    bits = config.dht_id_difficulty
    path = config.identity
    if path is not None and Path(path).exists():
        identity = Identity.load(path)
        if not has_work(identity.peer_id, bits):
            raise StartupError(f"the identity in {path} lacks the {bits} bits of proof of work that "
                               f"--dht-id-difficulty {bits} asks for; give a new --identity path to make one")
        return identity
    identity = identity_with_work(bits) if bits else Identity.generate()
    if path is not None:
        identity.save(path)
    return identity


class Daemon:
    def __init__(self, config: DaemonConfig, *, network: Network | None = None, identity: Identity | None = None):
        self.config = config
        self.network = network or RealNetwork()
        if identity is None:
            identity = _identity_for(config)
        self.identity = identity
        # a private swarm's key and the allow list, read at once so a bad file stops the start with one line
        self.swarm_key, self.allowed_peers = load_membership(config.swarm_key, config.allow_peers)
        self.started_at = time.time()
        self.rpc: RPCNode | None = None
        self.dht: DHTNode | None = None
        self.expert_server: ExpertServer | None = None
        self.directory: PeerDirectory | None = None
        self.replicas: ReplicaAverager | None = None
        self.pattern: str | None = None  # the grid pattern the served experts come from
        self.reachability: Reachability | None = None
        self.relaying: Relaying | None = None
        # what the experts are: the flags', or an advertised model spec's (moe.specs) without --experts
        self.expert_kind: str = config.expert_kind
        self.hidden_dim: int = config.hidden_dim
        self.notes: list[str] = []  # start-up lines for whoever started it (the CLI prints them)

    async def run(self, *, task_status: trio.TaskStatus[DaemonInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. Reports a DaemonInfo through `task_status` once the peer is reachable."""
        config = self.config
        if config.checkpoint_dir is not None:
            check_checkpoint_dir(Path(config.checkpoint_dir))
        if config.no_experts and (config.experts or config.num_experts is not None):
            raise StartupError("--no-experts serves no experts: drop --experts and --num-experts, or --no-experts")
        if config.announce is not None and config.announce[0] in WILDCARDS:
            raise StartupError(f"--announce {config.announce[0] or '*'}:{config.announce[1]} is no address others "
                               f"can connect to: give this machine's public address, or leave --announce out "
                               f"to announce the address the initial peers see")
        try:
            peers = [await self.network.resolve(peer) for peer in config.initial_peers]
        except OSError as error:
            raise StartupError(f"cannot resolve the initial peers: {error.strerror or error}") from None
        if config.host is None and not isinstance(self.network, RealNetwork):
            raise StartupError("a daemon on a simulated network needs DaemonConfig.host (its host's name)")
        host = config.host if config.host is not None else default_listen_host(peers)
        try:
            limits = DEFAULT_BUDGET.with_overrides(config.budget)
        except ValueError as error:
            raise StartupError(f"--budget: {error}") from None
        async with RPCNode(self.identity, self.network, announce=config.announce,
                           secure=not config.insecure_transport, swarm_key=self.swarm_key,
                           allowed_peers=self.allowed_peers, budget_limits=limits) as rpc:
            self.rpc = rpc
            port = config.port
            try:
                if port == 0 and isinstance(self.network, RealNetwork):
                    port = pick_free_port(host)
                address = await rpc.listen(host, port)
            except OSError as error:
                raise StartupError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
            # a peer that may be private starts as a DHT client and becomes a server once dialed back
            client_first = config.reachability == "private" or (config.reachability == "auto" and bool(peers))
            async with contextlib.AsyncExitStack() as stack:
                try:
                    dht = await stack.enter_async_context(DHTNode.open(
                        host, address[1], peers, identity=self.identity, network=self.network,
                        client_mode=client_first, swarm_key=self.swarm_key,
                        config=DHTConfig(disjoint_paths=config.dht_disjoint_paths,
                                         id_difficulty=config.dht_id_difficulty)))
                except OSError as error:
                    raise StartupError(f"cannot open UDP {host}:{address[1]} for the DHT: "
                                       f"{error.strerror or error}") from None
                if rpc.announce is None:
                    rpc.announce = await announced_address(host, address[1], peers, dht.observed_address)
                announced = rpc.announce
                DialBackService(rpc, dht).register()
                if config.reachability != "auto":
                    self.reachability = fixed(config.reachability)
                else:
                    self.reachability = await check_reachability(rpc, peers)
                    if self.reachability.status == "public":
                        await dht.become_server()
                self.dht = dht
                rpc.register(STATUS_METHOD, self._handle_status)
                # made before the services start, so their first DHT operations are timed too
                metrics = self._metrics() if config.metrics_port is not None else None
                if config.no_experts:
                    self.notes.append("serving no experts (--no-experts): DHT, relay and status only")
                else:  # before the nursery: plain errors
                    self.expert_server = await self._make_expert_server(dht)
                async with trio.open_nursery() as nursery:
                    # a relay service (public), or reservations and a relayed announced address (private): before
                    # anything publishes where this peer is reached
                    self.relaying = await nursery.start(functools.partial(
                        run_relaying, rpc, dht, self.reachability, limit=config.relay_limit,
                        rate_mb_s=config.relay_rate, total_rate_mb_s=config.relay_total_rate,
                        offer=not config.no_relay))
                    uids: list[str] = []
                    if self.expert_server is not None:
                        uids = sorted(self.expert_server.experts)
                        await self._serve_experts(nursery, self.expert_server, rpc, dht)
                    self.directory = PeerDirectory(dht)
                    await nursery.start(self.directory.run, lambda: rpc.announced_address or announced,
                                        self.identity.peer_id, self._summary)
                    metrics_address = None
                    if metrics is not None and config.metrics_port is not None:
                        metrics_address = await nursery.start(metrics.serve, host, config.metrics_port)
                    serving = self.expert_server is not None  # a --no-experts daemon has no size or kind
                    task_status.started(DaemonInfo(str(self.identity.peer_id), announced, uids, self.pattern,
                                                   self.hidden_dim if serving else None,
                                                   self.reachability.describe(), metrics_address,
                                                   str(config.swarm_key) if config.swarm_key else None,
                                                   self.expert_kind if serving else None, list(self.notes),
                                                   self.reachability.status, self.reachability.how))
                    await trio.sleep_forever()

    async def _serve_experts(self, nursery: trio.Nursery, server: ExpertServer, rpc: RPCNode,
                             dht: DHTNode) -> None:
        """Start the expert server, the weight upcycling methods and (--replicate) the replica averager."""
        from moe.upcycle import WeightReader, WeightWriter  # brings torch: keeps a --no-experts daemon free of it

        await nursery.start(server.run, rpc, dht)
        # always registered: a peer outside the allow list gets a typed refusal, not "no such method"
        WeightWriter(server, self.config.accept_weights_from).register(rpc)
        WeightReader(server, self.config.accept_weights_from).register(rpc)
        if self.config.replicate:
            from peer.replicas import ReplicaAverager  # brings torch: keeps a --no-experts daemon free of it

            self.replicas = ReplicaAverager(rpc, dht, server.experts, server.runtime.exclusive,
                                            interval=self.config.average_every)
            await nursery.start(self.replicas.run)

    async def _swarm_pattern(self, dht: DHTNode, count: int) -> str:
        """With no --experts: the grid of the swarm's largest family of this daemon's hidden size, grown when it
        has fewer than `count` free uids; `DEFAULT_PATTERN` in a new swarm (see the module docstring)."""
        families = []
        with trio.move_on_after(DISCOVERY_TIMEOUT):  # an unreadable directory looks like a new swarm
            families = await discover_families(dht, exclude_peer=self.identity.peer_id.hex())
        if not families:
            return DEFAULT_PATTERN
        try:
            family = choose_family(families, hidden_dim=self.config.hidden_dim)
        except SwarmMismatch as error:
            raise StartupError(f"{error}; pass --hidden-dim to join a family, or --experts PATTERN to start "
                               "one") from None
        free = math.prod(family.grid) - family.experts
        if free < count and not self.config.replicate:
            rows = -(-(count - max(free, 0)) // math.prod(family.grid[1:]))  # ceiling: whole rows of the grid
            family = dataclasses.replace(family, grid=(family.grid[0] + rows, *family.grid[1:]))
        return family.pattern

    async def _advertised_spec(self, dht: DHTNode) -> tuple[ExpertSpec | None, list[ExpertSpec]]:
        """The first model spec trainers advertise (`moe.specs`) that still has free uids, and every advertised
        spec (empty in a swarm with no swarmified model)."""
        from moe.specs import read_specs  # brings torch: keeps a --no-experts daemon free of it

        specs: list[ExpertSpec] = []
        with trio.move_on_after(DISCOVERY_TIMEOUT):
            specs = await read_specs(dht)
        for spec in specs:
            with trio.move_on_after(DISCOVERY_TIMEOUT):
                if await find_free_uids(dht, spec.pattern, 1, peer_id=self.identity.peer_id, fewer_ok=True):
                    return spec, specs
        return None, specs

    async def _make_expert_server(self, dht: DHTNode) -> ExpertServer:
        # torch and the expert stack, only for a daemon that serves experts: keeps a --no-experts daemon free of it
        import torch

        from moe.experts import OptimizerConfig, make_expert
        from moe.server import ExpertServer, choose_uids

        config = self.config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if config.experts:
            pattern = config.experts
            count = config.num_experts if config.num_experts is not None else GridPattern.parse(pattern).size
        else:
            count = config.num_experts if config.num_experts is not None else DEFAULT_COUNT
            spec, advertised = await self._advertised_spec(dht)
            if spec is not None:  # a swarmified model needs these: its grid, kind and sizes, no layer beyond
                pattern, self.expert_kind, self.hidden_dim = spec.pattern, spec.kind, spec.hidden_dim
            elif advertised:  # every advertised model is fully served: growing a grid would add unused layers
                pattern = advertised[0].pattern
                self.notes.append(f"every expert the swarm's models need is served "
                                  f"({'; '.join(s.describe() for s in advertised)}): serving none")
                count = 0
            else:
                pattern = await self._swarm_pattern(dht, count)
        self.pattern = pattern
        if config.replicate:  # serve the pattern's first uids even where others already do: they are replicas
            uids = expand_pattern(pattern)[:count]
        elif count == 0:
            uids = []
        else:
            # a pattern partly served already (the same `peer join` line run on several machines): the free part
            try:
                uids = await choose_uids(pattern, count, dht=dht, checkpoint_dir=config.checkpoint_dir,
                                         peer_id=self.identity.peer_id, fewer_ok=True)
            except InvalidUID as error:
                raise StartupError(f"cannot choose {count} experts from {pattern}: {error}") from None
            if len(uids) < count:
                self.notes.append(f"{pattern} has {len(uids)} free uids of the {count} asked: serving "
                                  f"{'those' if uids else 'none'}")
        optimizer = OptimizerConfig(name=config.optimizer, lr=config.lr,
                                    clip_grad_norm=config.clip_grad_norm or None)

        def seed_for(index: int, uid: str) -> int:
            if config.seed is not None:
                return config.seed + index
            if config.replicate:  # replicas of one uid start from the same weights
                return int.from_bytes(hashlib.sha1(uid.encode()).digest()[:4], "big")
            return int.from_bytes(self.identity.peer_id[:4], "big") + index

        experts = [
            make_expert(uid, self.expert_kind, self.hidden_dim, optimizer=optimizer, seed=seed_for(index, uid),
                        device=config.device)
            for index, uid in enumerate(uids)
        ]
        return ExpertServer(
            experts, max_batch_size=config.max_batch_size, checkpoint_dir=config.checkpoint_dir,
            checkpoint_interval=config.checkpoint_interval if config.checkpoint_dir else math.inf,
            declare_ttl=config.declare_ttl, trainers=caller_policy(config.trainers, "--trainers"),
            forward_from=caller_policy(config.forward_from, "--forward-from"),
        )

    def _metrics(self) -> PeerMetrics:
        from peer.metrics import peer_metrics  # prometheus_client and the HTTP stack only with --metrics-port

        def experts() -> dict[str, Any] | None:
            return self.expert_server.stats() if self.expert_server else None

        def replicas() -> dict[str, Any] | None:
            return self.replicas.stats() if self.replicas else None

        return peer_metrics(self.rpc, self.dht, experts=experts, replicas=replicas)

    def _summary(self) -> dict[str, Any]:
        """The short description published in the peer directory: read by `peer status` without a call, and by
        trainers and starting daemons to find the swarm's expert families (`peer.discover`)."""
        served = len(self.expert_server.experts) if self.expert_server else 0
        summary: dict[str, Any] = {"experts": served, "version": __version__}
        if self.relaying is not None and self.relaying.service is not None:
            summary["relay"] = True  # private peers pick their relays among these
        if served and self.pattern is not None:
            summary.update(summary_fields(self.pattern, served, self.hidden_dim, self.expert_kind))
        return summary

    def status(self) -> dict[str, Any]:
        assert self.rpc is not None and self.dht is not None
        return {
            "peer_id": str(self.identity.peer_id),
            "version": __version__,
            "address": list(self.rpc.announced_address or ()),
            "uptime_s": round(time.time() - self.started_at, 1),
            "dht": self.dht.stats(),
            "rpc": dict(self.rpc.stats),
            "experts": self.expert_server.stats() if self.expert_server else None,
            "expert_uids": sorted(self.expert_server.experts) if self.expert_server else [],
            "expert_pattern": self.pattern,
            "hidden_dim": self.hidden_dim if self.expert_server else None,
            "expert_kind": self.expert_kind if self.expert_server else None,
            "averaging": self.replicas.stats() if self.replicas else None,
            "reachability": self.reachability.stats() if self.reachability else None,
            "relay": self.relaying.stats() if self.relaying else None,
            "budgets": self.budget_usage(),
        }

    def budget_usage(self) -> dict[str, Any]:
        """Use against each limit (`peer.p2p.budget.Accountant.usage`): the RPC node's, and the relay's when
        this daemon relays."""
        assert self.rpc is not None
        usage = self.rpc.accountant.usage()
        if self.relaying is not None and self.relaying.service is not None:
            usage.update(self.relaying.service.core.accountant.usage())
        return usage

    async def _handle_status(self, context: CallContext, args: Any) -> dict[str, Any]:
        status = self.status()
        keys = args.get("replicas") if isinstance(args, dict) else None
        if isinstance(keys, list):
            status["replicas"] = self.replicas_held(keys)
        return status

    def replicas_held(self, keys: list[Any]) -> dict[str, Any]:
        """The records this node holds as a DHT replica for `keys` (at most MAX_REPLICA_KEYS, in the DHT's
        signed encoding), without asking anyone: `peer dashboard` reads the directory and the runs this way, in
        the status call it makes anyway, instead of DHT lookups."""
        assert self.dht is not None
        held: dict[str, Any] = {}
        for key in keys[:MAX_REPLICA_KEYS]:
            if isinstance(key, str) and len(key) <= 200:
                record = self.dht.local_record(key)
                if record is not None:
                    held[key] = records.encode(record)
        return held
