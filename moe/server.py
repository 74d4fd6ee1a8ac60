"""`ExpertServer`: hosts experts on a peer's RPC node, declares them in the DHT, keeps their checkpoints.

How a peer composes it (the daemon does this):

    async with RPCNode(identity, network) as rpc:
        await rpc.listen(host, port)                      # TCP first; the DHT then binds UDP on the same port
        async with DHTNode.open(host, port, initial_peers, identity=identity, network=network) as dht:
            server = await ExpertServer.from_pattern("ffn.[0:16].[0:16]", 4, kind="ffn", hidden_dim=1024,
                                                     dht=dht, checkpoint_dir=path, seed=0)
            # or: ExpertServer([make_expert(uid, "ffn", 1024), ...], checkpoint_dir=path)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run, rpc, dht)  # dht may be None (no declarations)
                ...                                        # cancelling the nursery stops the server

`run` loads checkpoints, starts the runtime, registers `moe.info` / `moe.forward` / `moe.backward` and their
batched forms `moe.forward_batch` / `moe.backward_batch` (several experts per call, packed in one tensor per input
and one per output, each expert failing alone: see `moe.calls`), keeps the forward graphs callers ask it to keep
for their backward (`moe.kept`, bounded by `kept_bytes` and `kept_ttl`), declares the
experts every `declare_interval` seconds with expiration `dht.now() + declare_ttl`, saves checkpoints every
`checkpoint_interval` seconds, and on cancellation unregisters the handlers, waits for running batches and saves
a final checkpoint. Use `choose_uids` first to pick uids: checkpointed ones and those the same PeerID still declares
come back, new ones avoid the DHT's.

Every call is decoded and checked (the expert it names, its schema, finiteness, norms against the expert's usual
ones, the reply codec) by `moe.call_checks` before anything reaches the runtime.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TypedDict

import torch
import trio

from dht.client import DHTClient
from moe import calls
from moe.call_checks import CallChecker
from moe.declare import PeerIDLike, declare_experts, find_free_uids, find_own_uids
from moe.errors import CheckpointError, ExpertFailed, NotAllowed, ServerShuttingDown
from moe.experts import Expert, KeptForward, OptimizerConfig, make_expert
from moe.grid import GridPattern, InvalidUID, choose_free_uids, is_valid_uid
from moe.kept import KeptStore
from moe.runtime import ExpertComputeError, ExpertRuntime, RuntimeNotRunning
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.memory import TrimPolicy, keep_returning_memory
from peer.p2p.net import Address
from peer.p2p.periodic import run_periodic
from peer.p2p.rpc import CallContext, RemoteError, RPCNode

logger = logging.getLogger(__name__)
CHECKPOINT_SUFFIX = ".pt"
_CHECKPOINT_NAME = re.compile(r"^(.+)\.pt$")


# ------------------------------------------------------------------------------------------------ checkpoints


def checkpoint_path(directory: str | Path, uid: str) -> Path:
    return Path(directory) / f"{uid}{CHECKPOINT_SUFFIX}"


def save_checkpoint(path: str | Path, state: Mapping[str, Any]) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint intact, never a truncated file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(dict(state), file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    try:
        directory_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(directory_fd)  # make the rename itself durable
    except OSError:
        pass
    finally:
        os.close(directory_fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling errors come in many types; all mean "not a usable checkpoint"
        raise CheckpointError(str(path), f"unreadable checkpoint: {type(error).__name__}: {error}") from error
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(str(path), "not an expert checkpoint")
    return state


def checkpointed_uids(directory: str | Path) -> list[str]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    uids = []
    for entry in sorted(directory.iterdir()):
        match = _CHECKPOINT_NAME.match(entry.name)
        if match and is_valid_uid(match.group(1)):
            uids.append(match.group(1))
    return uids


async def choose_uids(
    pattern: str,
    count: int,
    *,
    dht: DHTClient | None = None,
    checkpoint_dir: str | Path | None = None,
    rng: random.Random | None = None,
    peer_id: PeerIDLike | None = None,
    fewer_ok: bool = False,
) -> list[str]:
    """The uids a starting server should serve (with `fewer_ok`, fewer than `count` when the pattern has fewer
    free ones, maybe none), in this order of preference:
    1. its checkpointed uids of this pattern (a restarted server keeps its experts' weights);
    2. uids of the pattern still declared in the DHT by `peer_id` itself (a server restarted with the same
       identity and no checkpoints takes back what it served: its previous declarations are not someone else's);
    3. fresh uids not declared by anyone in the DHT (any free ones without a DHT)."""
    grid = GridPattern.parse(pattern)
    kept = [uid for uid in checkpointed_uids(checkpoint_dir) if uid in grid][:count] if checkpoint_dir else []
    if dht is not None and peer_id is not None and len(kept) < count:
        kept += [uid for uid in await find_own_uids(dht, grid, peer_id) if uid not in kept][:count - len(kept)]
    need = count - len(kept)
    if need <= 0:
        return kept
    if dht is not None:
        fresh = await find_free_uids(dht, grid, need, taken=kept, rng=rng, peer_id=peer_id, fewer_ok=fewer_ok)
    else:
        fresh = choose_free_uids(grid, need, kept, rng)
    return kept + fresh


def _uid_seed(seed: int, uid: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{uid}".encode()).digest()[:8], "little")


# ------------------------------------------------------------------------------------------------ who may call


def read_peer_list(path: str | Path) -> frozenset[str]:
    """The PeerIDs of an allow-list file: one PeerID (40 hex digits, as `peer join` prints it) per line; blank
    lines and `#` comments are ignored. Raises ValueError naming the file and line of the first bad entry, and
    OSError when the file cannot be read (an unreadable list must stop the start, never mean "anyone")."""
    allowed = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if len(text) != 40:
            raise ValueError(f"{path}:{number}: {text[:60]!r} is not a PeerID (40 hex digits)")
        try:
            allowed.add(PeerID.from_hex(text).hex())
        except ValueError:
            raise ValueError(f"{path}:{number}: {text[:60]!r} is not a PeerID (40 hex digits)") from None
    return frozenset(allowed)


@dataclass(frozen=True)
class CallerPolicy:
    """Who may make one kind of call (train: `moe.backward` and `moe.backward_batch`, which step the expert's
    optimizer; forward: `moe.forward` and `moe.forward_batch`).

    `allowed` None admits anyone who completed the RPC handshake, which proves the caller holds the private key of
    its PeerID: in an open swarm that is anyone, and in a private swarm (where the handshake also requires proof of
    the swarm key) exactly the holders of the key. A set admits only those PeerIDs (hex). The check is on who the
    caller is (the handshake authenticated it), never on what the request claims."""

    allowed: frozenset[str] | None = None
    source: str = "anyone"  # how an error names the list: the flag and file it came from

    @classmethod
    def from_peers(cls, peers: Iterable[str | PeerID] | None, source: str = "the allow list") -> "CallerPolicy":
        if peers is None:
            return cls()
        return cls(frozenset(p.hex() if isinstance(p, PeerID) else PeerID.from_hex(p).hex() for p in peers),
                   source)

    def allows(self, context: CallContext) -> bool:
        """Whether this call may proceed. Takes the whole call context (not only the PeerID) so that a policy
        on what the handshake proved about the connection can be decided here too."""
        return self.allowed is None or context.peer_id.hex() in self.allowed


# ------------------------------------------------------------------------------------------------ server


class _DeclarationStats(TypedDict):
    """Counters of the declaration loop; `last_expiration` stays None until the first round stored anything."""

    rounds: int
    failures: int
    unacknowledged: int
    last_expiration: float | None


class ExpertServer:
    def __init__(
        self,
        experts: Sequence[Expert] | Mapping[str, Expert],
        *,
        max_batch_size: int = 4096,
        min_batch_size: int = 1,
        batch_timeout: float = 0.005,
        threads_per_device: int = 1,
        inline_threshold: float = 3e-4,
        checkpoint_dir: str | Path | None = None,
        checkpoint_interval: float = 300.0,
        declare_ttl: float = 60.0,
        declare_interval: float | None = None,
        trainers: CallerPolicy | None = None,
        forward_from: CallerPolicy | None = None,
        max_norm_ratio: float | None = 1e4,
        kept_bytes: int = 256 << 20,
        kept_ttl: float = 30.0,
        memory: TrimPolicy | None = None,
    ):
        """`trainers`: who may call backward (and so step the experts' optimizers); `forward_from`: who may call
        forward. Both default to anyone who completed the RPC handshake (see `CallerPolicy`); `moe.info` is open.
        `max_norm_ratio`: a request whose inputs or gradients are this many times larger than the expert's usual
        ones (running statistics of the requests it accepted) is refused with BadExpertInput; None: no check.
        Generous by default: an honest trainer's gradients for an expert scale with its gate weight, which may be
        0.001 in one call and 0.5 in the next; the check is for the absurd (1e30 passes the finiteness check),
        and `clip_grad_norm` bounds the step whatever gets through.
        `kept_bytes`, `kept_ttl`: the bounds of the forward graphs kept for callers' backwards (`moe.kept`): at
        most that many bytes of activations, each freed that many seconds after its forward at the latest.
        `memory`: when freed heap memory goes back to the OS after a burst of calls (`peer.p2p.memory`)."""
        if isinstance(experts, Mapping):
            experts = list(experts.values())
        self.experts: dict[str, Expert] = {}
        for expert in experts:
            if not is_valid_uid(expert.uid):
                raise InvalidUID(f"expert uid {expert.uid!r} is not a grid uid (name.i.j...)")
            if expert.uid in self.experts:
                raise ValueError(f"two experts share the uid {expert.uid!r}")
            self.experts[expert.uid] = expert
        self.max_batch_size = max_batch_size
        self.trainers = trainers if trainers is not None else CallerPolicy()
        self.forward_from = forward_from if forward_from is not None else CallerPolicy()
        self.max_norm_ratio = max_norm_ratio
        self.runtime = ExpertRuntime(
            self.experts, max_batch_size=max_batch_size, min_batch_size=min_batch_size,
            batch_timeout=batch_timeout, threads_per_device=threads_per_device, inline_threshold=inline_threshold,
        )
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_interval = checkpoint_interval
        self.declare_ttl = declare_ttl
        self.declare_interval = declare_interval if declare_interval is not None else declare_ttl / 3
        self._served = {"info": 0, "forward": 0, "backward": 0}  # per expert request (a batched call holds several)
        self._rpc_calls = {name: 0 for name in calls.METHODS}  # RPCs received, by method
        self._errors = {"not_found": 0, "bad_input": 0, "expert_failed": 0, "shutting_down": 0, "not_allowed": 0}
        self.checker = CallChecker(self.experts, max_batch_size=max_batch_size, max_norm_ratio=max_norm_ratio,
                                   errors=self._errors)  # decodes and checks every call (`moe.call_checks`)
        self._declarations: _DeclarationStats = {
            "rounds": 0, "failures": 0, "unacknowledged": 0, "last_expiration": None}
        self._checkpoints = {"saved": 0, "loaded": 0, "failures": 0}
        self._unsaved: dict[str, str] = {}  # uid -> why its last synchronous save failed
        # Set when the final checkpoint failed (and raised from `run`): kept so that a caller whose cancellation
        # unwinds through other nurseries can still tell, after the fact, that weights were lost.
        self.checkpoint_error: CheckpointError | None = None
        self._saved_steps: dict[str, int] = {}
        self._running = False
        self.kept = KeptStore(max_bytes=kept_bytes, ttl=kept_ttl)
        self.memory = memory or TrimPolicy()

    @classmethod
    async def from_pattern(
        cls,
        pattern: str,
        count: int,
        *,
        kind: str,
        hidden_dim: int,
        dht: DHTClient | None = None,
        checkpoint_dir: str | Path | None = None,
        optimizer: OptimizerConfig = OptimizerConfig(),  # noqa: B008 (frozen dataclass: one shared value is safe)
        options: Mapping[str, Any] | None = None,
        device: str = "cpu",
        seed: int | None = None,
        rng: random.Random | None = None,
        **server_options: Any,
    ) -> "ExpertServer":
        """`count` experts of one kind on uids from `pattern` (see `choose_uids`): what `peer join --experts`
        needs. With `seed`, each expert's initial weights depend only on (seed, uid)."""
        uids = await choose_uids(pattern, count, dht=dht, checkpoint_dir=checkpoint_dir, rng=rng)
        experts = [
            make_expert(uid, kind, hidden_dim, optimizer=optimizer, options=options, device=device,
                        seed=None if seed is None else _uid_seed(seed, uid))
            for uid in uids
        ]
        return cls(experts, checkpoint_dir=checkpoint_dir, **server_options)

    # ---------------------------------------------------------------------------------------- lifetime

    async def run(
        self,
        rpc: RPCNode,
        dht: DHTClient | None = None,
        *,
        announce: Address | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled (see the module docstring). `announce` is the address declared in the DHT
        (default: the RPC node's announced address)."""
        if self._running:
            raise RuntimeError("this ExpertServer is already running")
        address = announce or rpc.announced_address
        if dht is not None:
            if address is None:
                raise RuntimeError("the RPC node does not listen: nothing to declare in the DHT")
            if address[0] in ("", "0.0.0.0", "::"):
                raise ValueError(f"cannot declare the wildcard address {address[0]!r}: clients could not "
                                 "connect to it; pass announce=(public host, port)")
        self.load_checkpoints()
        self._running = True
        registered: list[str] = []
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.runtime.run)
                nursery.start_soon(keep_returning_memory, self.memory)
                for name, handler in ((calls.INFO, self._handle_info), (calls.FORWARD, self._handle_forward),
                                      (calls.BACKWARD, self._handle_backward),
                                      (calls.FORWARD_BATCH, self._handle_forward_batch),
                                      (calls.BACKWARD_BATCH, self._handle_backward_batch)):
                    rpc.register(name, handler)
                    registered.append(name)
                if dht is not None and address is not None:
                    # the first round runs before `started`: the experts are findable once `run` has started,
                    # unless that round failed (a store timing out on a loaded machine): then a quarter interval
                    # later, when it is retried
                    async def declare_round() -> None:  # the address read every round: relays may change it
                        await self.declare(dht, announce or rpc.announced_address or address, rpc.peer_id)

                    await nursery.start(functools.partial(
                        run_periodic, declare_round,
                        self.declare_interval, name=f"declaring {len(self.experts)} experts",
                        retry=self.declare_interval / 4, max_retry=self.declare_interval,
                        on_failure=self._declaration_failed, log=logger))
                if self.checkpoint_dir is not None and math.isfinite(self.checkpoint_interval):
                    nursery.start_soon(functools.partial(
                        run_periodic, self.checkpoint, self.checkpoint_interval, name="checkpointing experts",
                        first_delay=self.checkpoint_interval, log=logger, traceback=True))
                task_status.started()
        finally:
            for name in registered:
                rpc.unregister(name)
            self._running = False
            self.kept.clear()
            if self.checkpoint_dir is not None:
                self.save_checkpoints(only_changed=True)  # the runtime has stopped: weights are final
                if self._unsaved:  # the training since the last checkpoint is lost: whoever stops us must know
                    uid, error = next(iter(self._unsaved.items()))
                    self.checkpoint_error = CheckpointError(
                        str(checkpoint_path(self.checkpoint_dir, uid)),
                        f"final checkpoint failed ({error}); what {len(self._unsaved)} of the experts learned "
                        f"since their last checkpoint is lost")
                    raise self.checkpoint_error

    async def declare(self, dht: DHTClient, address: Address, peer_id: PeerIDLike) -> None:
        """Declare every expert once, expiring `declare_ttl` seconds from now in the DHT's clock."""
        expiration = dht.now() + self.declare_ttl
        stored = await declare_experts(dht, list(self.experts), address, peer_id, expiration)
        self._declarations["rounds"] += 1
        self._declarations["unacknowledged"] += sum(not ok for ok in stored.values())
        self._declarations["last_expiration"] = expiration

    def _declaration_failed(self, error: Exception) -> None:
        self._declarations["failures"] += 1  # a DHT hiccup must not stop serving; the next round retries

    # ---------------------------------------------------------------------------------------- checkpoints

    def load_checkpoints(self) -> int:
        """Load every expert that has a checkpoint; returns how many. Raises CheckpointError on a mismatch."""
        if self.checkpoint_dir is None:
            return 0
        loaded = 0
        for uid, expert in self.experts.items():
            path = checkpoint_path(self.checkpoint_dir, uid)
            if not path.exists():
                continue
            state = load_checkpoint(path)
            try:
                expert.load_state_dict(state)
            except (ValueError, KeyError, RuntimeError) as error:
                raise CheckpointError(str(path), str(error)) from error
            self._saved_steps[uid] = expert.steps
            loaded += 1
        self._checkpoints["loaded"] += loaded
        return loaded

    def save_checkpoints(self, *, only_changed: bool = False) -> int:
        """Save experts synchronously (call only while no batch runs: before `run` or after it returned)."""
        if self.checkpoint_dir is None:
            return 0
        saved = 0
        for uid, expert in self.experts.items():
            if only_changed and self._saved_steps.get(uid) == expert.steps:
                continue
            try:
                save_checkpoint(checkpoint_path(self.checkpoint_dir, uid), expert.state_dict())
            except OSError as error:
                self._checkpoints["failures"] += 1
                self._unsaved[uid] = error.strerror or str(error)
                logger.error("checkpoint of %s failed: %s", uid, error)
                continue
            self._unsaved.pop(uid, None)
            self._saved_steps[uid] = expert.steps
            saved += 1
        self._checkpoints["saved"] += saved
        return saved

    async def checkpoint(self) -> int:
        """Save experts that trained since their last checkpoint, while serving: each expert's state is copied
        between its batches, then written in a worker thread."""
        assert self.checkpoint_dir is not None
        saved = 0
        for uid, expert in self.experts.items():
            if self._saved_steps.get(uid) == expert.steps:
                continue  # nothing trained since: skip even the copy
            state = await self.runtime.exclusive(uid, lambda expert: expert.state_dict())
            if self._saved_steps.get(uid) == state["steps"]:
                continue
            try:
                await trio.to_thread.run_sync(save_checkpoint, checkpoint_path(self.checkpoint_dir, uid), state)
            except OSError as error:
                self._checkpoints["failures"] += 1
                logger.error("checkpoint of %s failed: %s", uid, error)
                continue
            self._saved_steps[uid] = state["steps"]
            saved += 1
        self._checkpoints["saved"] += saved
        return saved

    # ---------------------------------------------------------------------------------------- handlers

    @staticmethod
    def _reply_tensors(tensors: list[torch.Tensor], codec: wire.Compression) -> list[Any]:
        if codec == wire.Compression.NONE:
            return tensors
        return [wire.compressed(tensor, codec) for tensor in tensors]

    def _compute_error(self, expert: Expert, error: ExpertComputeError | RuntimeNotRunning) -> RemoteError:
        """What the caller is told when the runtime could not compute its request."""
        if isinstance(error, ExpertComputeError):
            self._errors["expert_failed"] += 1
            return ExpertFailed(str(error))
        self._errors["shutting_down"] += 1
        return ServerShuttingDown(f"{expert.uid}: the server is shutting down")

    @staticmethod
    def _reply_key(mode: str) -> str:
        return "outputs" if mode == "forward" else "grad_inputs"

    async def _serve_one(self, mode: str, args: Any, codec: wire.Compression, caller: str) -> dict[str, Any]:
        """One expert's forward or backward: the whole of a single call. A forward asked to `keep` its graph
        answers its token under "kept"; a backward given one uses that graph when it is still held."""
        expert = self.checker.expert_for(args)
        inputs, grad_outputs = self.checker.validate(expert, args, backward=mode == "backward")
        token = 0
        try:
            if mode == "forward" and args.get("keep") is True:
                results, graph = await self.runtime.forward_keeping(expert.uid, inputs)
                if graph is not None:
                    token = self.kept.put(caller, expert.uid, graph, trio.current_time())
            elif mode == "forward":
                results = await self.runtime.forward(expert.uid, inputs)
            else:
                kept = self._kept_graph(caller, expert.uid, args.get("kept"))
                results = await self.runtime.backward(expert.uid, inputs, grad_outputs, kept)
        except (ExpertComputeError, RuntimeNotRunning) as error:
            raise self._compute_error(expert, error) from None
        self._served[mode] += 1
        reply: dict[str, Any] = {self._reply_key(mode): self._reply_tensors(results, codec)}
        if token:
            reply["kept"] = token
        return reply

    def _kept_graph(self, caller: str, uid: str, token: Any) -> KeptForward | None:
        if not isinstance(token, int) or isinstance(token, bool) or token <= 0:
            return None
        return self.kept.take(caller, uid, token, trio.current_time())

    async def _serve_packed(self, mode: str, method: str, args: dict[str, Any], caller: str) -> dict[str, Any]:
        """Several experts in one call, packed (see `moe.calls`): one tensor per input and gradient holds every
        expert's rows. The request is checked as a whole (`CallChecker.packed`, then `CallChecker.screen`): its
        shape once against the first expert's schema (the others must share it), finiteness in one pass, the norm
        checks from one row-norm pass; only what fails a check is looked at expert by expert, and that expert
        alone fails. The experts' rows reach the runtime
        as views of the received tensors (no copy), and their results are written into one reply tensor."""
        call = self.checker.packed(args, backward=mode == "backward")
        self._rpc_calls[method] += 1
        self.checker.screen(call)
        uids, rows, total, codec, groups = call.uids, call.rows, call.total, call.codec, call.groups
        experts, reference, packed, errors = call.experts, call.reference, call.packed, call.errors
        backward = mode == "backward"
        valid = [p for p in range(len(uids)) if p not in errors]
        pieces = {what: [torch.split(tensor, rows) for tensor in tensors] for what, tensors in packed.items()}
        requests = [(uids[p], [piece[p] for what in groups for piece in pieces[what]]) for p in valid]
        keep = mode == "forward" and args.get("keep") is True
        tokens = args.get("kept") if backward else None
        kept = ([self._kept_graph(caller, uids[p], tokens[p]) for p in valid]
                if isinstance(tokens, list) and len(tokens) == len(uids) else None)
        produced: list[KeptForward | None] = []
        outcomes: list[Any] = []
        if requests:
            try:
                outcomes = await self.runtime.run_many(mode, requests, keep=keep, kept=kept, kept_out=produced)
            except RuntimeNotRunning as stopped:
                outcomes = [stopped] * len(requests)
        specs = reference.outputs if reference is not None and not backward else (
            reference.inputs if reference is not None else [])
        replies = [torch.zeros((total, *spec.shape), dtype=spec.dtype) for spec in specs]
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + r)
        reply_tokens = [0] * len(uids)
        for position, outcome in zip(valid, outcomes):
            expert = experts[position]
            assert expert is not None
            if isinstance(outcome, (ExpertComputeError, RuntimeNotRunning)):
                errors[position] = self._compute_error(expert, outcome)
                continue
            start, end = starts[position], starts[position + 1]
            if len(outcome) != len(replies) or any(o.shape != r[start:end].shape for o, r in zip(outcome, replies)):
                self._errors["expert_failed"] += 1
                errors[position] = ExpertFailed(f"{expert.uid}: outputs do not match its declared schema")
                continue
            for output, reply in zip(outcome, replies):
                reply[start:end].copy_(output)
            self._served[mode] += 1
        for offset, graph in enumerate(produced):
            if graph is not None:
                position = valid[offset]
                if position in errors:
                    graph.release()
                else:
                    reply_tokens[position] = self.kept.put(caller, uids[position], graph, trio.current_time())
        answer: dict[str, Any] = {
            self._reply_key(mode): self._reply_tensors(replies, codec),
            "errors": [[position, error.code, error.message] for position, error in sorted(errors.items())]}
        if keep:
            answer["kept"] = reply_tokens
        return answer

    async def _serve_batch(self, mode: str, method: str, args: Any, caller: str) -> dict[str, Any]:
        """Several experts in one call: the packed form (`_serve_packed`), or the per-expert form of earlier
        versions (`{"experts": [{"uid", "inputs", ...}]}`, answered `{"results": [...]}`), where each entry is
        validated and fails alone
        (`{"error": [code, text]}` in its place); the valid ones go through their experts' batching runtime
        together (`ExpertRuntime.run_many`: one thread hand-off for the call, not one per expert)."""
        if isinstance(args, dict) and "uids" in args:
            return await self._serve_packed(mode, method, args, caller)
        entries = self.checker.entries(args)
        codec = self.checker.codec(args)
        self._rpc_calls[method] += 1
        results: list[Any] = [None] * len(entries)
        valid: list[tuple[int, Expert]] = []
        requests: list[tuple[str, list[torch.Tensor]]] = []
        for index, entry in enumerate(entries):
            try:
                expert = self.checker.expert_for(entry)
                inputs, grad_outputs = self.checker.validate(expert, entry, backward=mode == "backward")
            except RemoteError as error:  # that expert's typed refusal; the others still answer
                results[index] = {"error": [error.code, error.message]}
                continue
            valid.append((index, expert))
            requests.append((expert.uid, [*inputs, *grad_outputs]))
        if requests:
            outcomes: list[Any]
            try:
                outcomes = await self.runtime.run_many(mode, requests)
            except RuntimeNotRunning as stopped:
                outcomes = [stopped] * len(requests)
            for (index, expert), outcome in zip(valid, outcomes):
                if isinstance(outcome, (ExpertComputeError, RuntimeNotRunning)):
                    failure = self._compute_error(expert, outcome)
                    results[index] = {"error": [failure.code, failure.message]}
                else:
                    self._served[mode] += 1
                    results[index] = {self._reply_key(mode): self._reply_tensors(outcome, codec)}
        return {"results": results}

    async def _handle_info(self, context: CallContext, args: Any) -> dict[str, Any]:
        expert = self.checker.expert_for(args)
        self._served["info"] += 1
        self._rpc_calls[calls.INFO] += 1
        return expert.info(self.max_batch_size)

    def _admit(self, context: CallContext, mode: str) -> None:
        """Refuse the whole call, before anything is decoded or computed, when the caller may not make it."""
        policy = self.trainers if mode == "backward" else self.forward_from
        if not policy.allows(context):
            self._errors["not_allowed"] += 1
            what = "train the experts" if mode == "backward" else "call the experts' forward"
            raise NotAllowed(f"peer {context.peer_id.hex()} may not {what} here (not in {policy.source})")

    async def _handle_forward(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._rpc_calls[calls.FORWARD] += 1
        self._admit(context, "forward")
        return await self._serve_one("forward", args, self.checker.codec(args), context.peer_id.hex())

    async def _handle_backward(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._rpc_calls[calls.BACKWARD] += 1
        self._admit(context, "backward")
        return await self._serve_one("backward", args, self.checker.codec(args), context.peer_id.hex())

    async def _handle_forward_batch(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._admit(context, "forward")
        return await self._serve_batch("forward", calls.FORWARD_BATCH, args, context.peer_id.hex())

    async def _handle_backward_batch(self, context: CallContext, args: Any) -> dict[str, Any]:
        self._admit(context, "backward")
        return await self._serve_batch("backward", calls.BACKWARD_BATCH, args, context.peer_id.hex())

    # ---------------------------------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        runtime = self.runtime.stats()
        return {
            "experts": sorted(self.experts),
            "running": self._running,
            "requests": dict(self._served),
            "requests_total": sum(self._served.values()),
            "rpc_calls": dict(self._rpc_calls),
            "batches": runtime["batches"],
            "samples": runtime["samples"],
            "errors": dict(self._errors),
            "errors_total": sum(self._errors.values()),
            "declarations": dict(self._declarations),
            "checkpoints": dict(self._checkpoints),
            "per_expert": runtime["per_expert"],
            "kept": vars(self.kept.stats()),
        }
