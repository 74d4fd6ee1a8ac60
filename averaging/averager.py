"""The averager a peer owns: registered tensors, and `step()` = matchmaking + butterfly all-reduce.

    async with Averager(rpc, dht, tensors, prefix="mymodel", target_group_size=4) as averager:
        result = await averager.step(weight=1.0, timeout=30)      # StepResult
        with averager.lock: ...                                   # training code takes the same lock

Why it is shaped like this:
- The averager owns a nursery (the `async with` block): it installs the all-reduce and matchmaking handlers on
  the peer's RPC node and runs background work (declaration withdrawals, the state server and its DHT
  announcement) there; leaving the block cancels all of it.
- State for newcomers: a reachable averager serves (metadata, tensors) snapshots (`averaging.state`) and
  announces itself under `<prefix>.state` in the DHT; `load_state_from_peers()` asks the most advanced of those
  peers first and adopts its averaging round, so the newcomer is in phase with the swarm's group keys.
- One step at a time: steps are serialised, because the group key, the round counter and the registered tensors
  belong to the whole averager. Training code that wants to keep computing during a step runs the step through
  the bridge (`bridge.run(averager.step)`) from its own thread.
- Tensors are averaged in place. The all-reduce reads them without the lock and writes each averaged part back
  under `lock`, so training is never blocked for a whole round (hivemind issue #445).
- Trust: `aggregation` ("mean", "centered_clip", "trimmed_mean" or an `averaging.robust.Aggregation`) is how
  this peer's reducer combines the parts it receives and how much it believes of the parts others reduce for it.
  A member whose part our reducer rejected, or a reducer that returned an implausible part, gets one strike per
  round; after `ban_after` rounds with a strike it is banned from our matchmaking (`Matchmaker.ban`). Strikes
  and bans are this peer's own: nothing is voted on, so liars cannot get honest peers banned elsewhere.
- Time: a step has one budget (`timeout`); matchmaking takes at most `matchmaking_time` of it (usually a small
  fraction: see matchmaking.py), the all-reduce gets the rest and adapts its own deadlines to measured rates.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import torch
import trio

from averaging import state as state_download
from averaging.allreduce import AllReduceServer, install_allreduce
from averaging.allreduce_core import AllReduceConfig, AllReduceResult
from averaging.errors import AveragingError
from averaging.group import GroupInfo
from averaging.group_keys import GroupKeyManager
from averaging.locking import TensorLock, check_lock
from averaging.matchmaking import Matchmaker
from averaging.robust import Aggregation, Strikes, aggregation_of
from averaging.schema import describe, schema_hash
from dht.client import DHTClient
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.periodic import run_periodic
from peer.p2p.rpc import RPCNode

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one `step()` did.

    group: the members (None when no group assembled). finished: the all-reduce completed and every part of the
    vector now holds the group mean (False: no group, or some parts kept local values because their reducer
    failed; see `allreduce.averaged`). failed_peers: peers seen failing during matchmaking or the all-reduce.
    """

    group: GroupInfo | None
    finished: bool
    failed_peers: list[PeerID] = field(default_factory=list)
    round: int = 0
    key: str = ""
    reason: str = ""
    matchmaking_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    allreduce: AllReduceResult | None = None

    @property
    def group_size(self) -> int:
        return self.group.size if self.group is not None else 0

    @property
    def seconds(self) -> float:
        return self.matchmaking_seconds + self.allreduce_seconds


class Averager:
    """Decentralized averaging of a list of tensors with the other peers of the same `prefix` and model schema."""

    def __init__(
        self,
        rpc: RPCNode,
        dht: DHTClient,
        tensors: Sequence[torch.Tensor],
        *,
        prefix: str,
        target_group_size: int = 4,
        min_group_size: int = 2,
        nbits: int = 0,
        matchmaking_time: float = 5.0,
        allreduce_timeout: float = 60.0,
        compression: wire.Compression = wire.Compression.NONE,
        bandwidth: float = 1.0,
        client_mode: bool | None = None,
        lock: TensorLock | None = None,
        names: Sequence[str] | None = None,
        allreduce_config: AllReduceConfig | None = None,
        serve_state: bool | None = None,
        state_ttl: float = 30.0,
        metadata: Any = None,
        aggregation: str | Aggregation | None = None,
        ban_after: int = 3,
    ):
        self.rpc = rpc
        self.dht = dht
        self.tensors = list(tensors)
        if not self.tensors:
            raise ValueError("register at least one tensor")
        self.prefix = prefix
        self.schema = schema_hash(self.tensors, names)
        self.description = describe(self.tensors, names)  # told to peers of another model, so they can say why
        self.lock: TensorLock = threading.Lock() if lock is None else lock
        check_lock(self.lock)
        self.allreduce_timeout = allreduce_timeout
        self.compression = wire.Compression(compression)
        self.client_mode = client_mode
        self.bandwidth = bandwidth
        self.target_group_size = target_group_size
        self.min_group_size = min_group_size
        self.matchmaking_time = matchmaking_time
        config = allreduce_config or AllReduceConfig()
        if aggregation is not None:  # the keyword wins over a config's aggregation
            config = dataclasses.replace(config, aggregation=aggregation_of(aggregation))
        self.allreduce_config = config
        self.aggregation = config.aggregation
        self.strikes = Strikes(ban_after=ban_after)
        self.serve_state = serve_state  # None: serve unless this RPC node already serves someone's state
        self.state_ttl = state_ttl
        self.metadata = metadata  # sent with the state to newcomers (e.g. the training step)
        self.state_server: state_download.StateServer | None = None
        self.keys = GroupKeyManager(prefix, target_group_size=target_group_size, nbits=nbits)
        self.matchmaker: Matchmaker | None = None
        self.allreduce_server: AllReduceServer | None = None
        self._nursery: trio.Nursery | None = None
        self._step_lock = trio.Lock()
        self._lifetime: AbstractAsyncContextManager[trio.Nursery] | None = None
        self.last_result: StepResult | None = None
        self.counters = {"steps": 0, "succeeded": 0, "partial": 0, "no_group": 0, "errors": 0,
                         "bytes_sent": 0, "bytes_received": 0,  # all-reduce payloads as encoded
                         "rejected_parts": 0, "lying_reducers": 0}

    # ------------------------------------------------------------------------------------------- lifetime

    async def __aenter__(self) -> "Averager":
        self._lifetime = trio.open_nursery()
        nursery = await self._lifetime.__aenter__()
        try:
            self._start(nursery)
        except BaseException:
            nursery.cancel_scope.cancel()
            await self._lifetime.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._nursery is not None and self._lifetime is not None
        self._nursery.cancel_scope.cancel()
        try:
            return await self._lifetime.__aexit__(*exc_info)
        finally:
            self._stop()

    async def serve(self, *, task_status: trio.TaskStatus[Averager] = trio.TASK_STATUS_IGNORED) -> None:
        """Alternative to `async with`: `await nursery.start(averager.serve)`; runs until cancelled."""
        async with self:
            task_status.started(self)
            await trio.sleep_forever()

    def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        client_mode = self.rpc.announced_address is None if self.client_mode is None else self.client_mode
        self.client_mode = client_mode
        self.allreduce_server = install_allreduce(self.rpc, config=self.allreduce_config)
        self.matchmaker = Matchmaker(
            self.rpc, self.dht, schema=self.schema, target_group_size=self.target_group_size,
            min_group_size=self.min_group_size, matchmaking_time=self.matchmaking_time,
            bandwidth=self.bandwidth, client_mode=client_mode, nursery=nursery, description=self.description,
        )
        self.matchmaker.register()
        if self.serve_state is not False and not client_mode:
            try:
                self.state_server = state_download.install_state_server(self.rpc, self._get_state, lock=self.lock)
            except ValueError:  # the owner (e.g. CollaborativeOptimizer) serves its own state on this node
                if self.serve_state:
                    raise
            if self.state_server is not None:
                nursery.start_soon(self._announce_state)

    @property
    def state_key(self) -> str:
        return f"{self.prefix}.state"

    def _get_state(self) -> tuple[Any, list[torch.Tensor]]:
        """Called under the lock by the state server: a consistent snapshot of round, metadata and tensors."""
        return {"round": self.keys.round, "metadata": self.metadata}, self.tensors

    async def _announce_state(self) -> None:
        """Keep `<prefix>.state` pointing at me while I serve: refreshed every third of its expiration."""

        async def announce() -> None:
            address = self.rpc.announced_address
            if address is not None:
                await self.dht.store(self.state_key, [address[0], address[1], self.keys.round],
                                     self.dht.now() + self.state_ttl, subkey=bytes(self.peer_id), signed=True)

        interval = self.state_ttl / 3
        await run_periodic(announce, interval, name=f"announcing state under {self.state_key}",
                           retry=interval / 4, max_retry=interval, log=logger)

    async def load_state_from_peers(self, timeout: float = 60.0) -> state_download.DownloadedState | None:
        """Download the registered tensors from a peer that serves them (the most advanced round first), copy
        them in place under the lock, and adopt that peer's round. Returns None when nobody serves state;
        raises StateDownloadFailed when every provider failed. `.metadata` of the result is the provider's
        `averager.metadata`, which is also adopted here."""
        record = await self.dht.get(self.state_key, latest=True)
        now = self.dht.now()
        providers = []
        for subkey, entry in (getattr(record, "subkeys", None) or {}).items():
            value = entry.value
            if entry.expiration_time < now or not isinstance(subkey, bytes) or len(subkey) != 20 \
                    or subkey == bytes(self.peer_id) or not isinstance(value, list) or len(value) != 3:
                continue
            try:
                providers.append((int(value[2]), PeerID(subkey), (str(value[0]), int(value[1]))))
            except (TypeError, ValueError):
                continue
        if not providers:
            return None
        providers.sort(key=lambda item: -item[0])
        downloaded = await state_download.load_state_from_peers(
            self.rpc, [(peer_id, address) for _, peer_id, address in providers], into=self.tensors,
            lock=self.lock, timeout=timeout, compression=self.compression)
        info = downloaded.metadata if isinstance(downloaded.metadata, dict) else {}
        if isinstance(info.get("round"), int):
            self.keys.set_round(info["round"])
        self.metadata = info.get("metadata")
        downloaded.metadata = self.metadata
        return downloaded

    def _stop(self) -> None:
        if self.state_server is not None:
            self.state_server.uninstall()
            self.state_server = None
        if self.matchmaker is not None:
            self.matchmaker.unregister()
        if self.allreduce_server is not None:
            self.allreduce_server.uninstall()
        self._nursery = None

    @property
    def peer_id(self) -> PeerID:
        return self.rpc.peer_id

    # ------------------------------------------------------------------------------------------- step

    async def step(self, weight: float = 1.0, timeout: float | None = None, expected: int = 0,
                   left_behind: Callable[[], Awaitable[bool]] | None = None) -> StepResult:
        """Find a group and average the registered tensors with it (in place). Never raises for other peers'
        failures: they are in the result. `timeout` bounds the whole step (matchmaking + all-reduce);
        `expected`: peers known to be on their way; `left_behind`: whether they went on without us
        (`Matchmaker.find_group`)."""
        if self.matchmaker is None or self.allreduce_server is None:
            raise RuntimeError("use the averager inside `async with averager:` (or nursery.start(averager.serve))")
        async with self._step_lock:
            started = trio.current_time()
            budget = self.matchmaking_time + self.allreduce_timeout if timeout is None else timeout
            key, round_ = self.keys.key, self.keys.round
            self.counters["steps"] += 1
            match = await self.matchmaker.find_group(key, round_, timeout=min(self.matchmaking_time, budget),
                                                     expected=expected, left_behind=left_behind)
            matchmaking_seconds = trio.current_time() - started
            if match.group is None or match.group.size < 2:
                self.keys.on_failure()
                self.counters["no_group"] += 1
                result = StepResult(match.group, False, list(match.failed_peers), round_, key,
                                    match.reason or "no group", matchmaking_seconds)
                return self._remember(result)
            group = match.group
            self.keys.on_group(group.peer_ids, self.peer_id, match.round)
            remaining = max(0.0, started + budget - trio.current_time())
            result = await self._average(group, weight, min(self.allreduce_timeout, max(remaining, 0.001)),
                                         list(match.failed_peers), match.round, key, matchmaking_seconds)
            if self.matchmaker is not None:
                self.matchmaker.forget(result.failed_peers)
            return result

    async def average_in(self, group: GroupInfo, weight: float = 1.0, timeout: float | None = None,
                         tensors: Sequence[torch.Tensor] | None = None) -> StepResult:
        """Average the registered tensors, or `tensors` (in place), with a group formed elsewhere (DiLoCo's outer
        rounds form theirs with `averaging.rounds`, and average one fragment of the model at a time): the
        all-reduce half of `step()`, with the same judging of members."""
        if self.allreduce_server is None:
            raise RuntimeError("use the averager inside `async with averager:` (or nursery.start(averager.serve))")
        async with self._step_lock:
            self.counters["steps"] += 1
            return await self._average(group, weight, self.allreduce_timeout if timeout is None else timeout,
                                       [], 0, "", 0.0, tensors)

    async def _average(self, group: GroupInfo, weight: float, timeout: float, failed_before: list[PeerID],
                       round_: int, key: str, matchmaking_seconds: float,
                       tensors: Sequence[torch.Tensor] | None = None) -> StepResult:
        assert self.allreduce_server is not None
        allreduce_started = trio.current_time()
        try:
            outcome = await self.allreduce_server.run(
                group, self.tensors if tensors is None else list(tensors), weight=weight,
                compression=self.compression, timeout=timeout, lock=self.lock,
            )
        except AveragingError as error:
            self.counters["errors"] += 1
            logger.warning("averaging round %s failed: %s", group.group_id.hex()[:8], error)
            result = StepResult(group, False, failed_before, round_, key, str(error), matchmaking_seconds,
                                trio.current_time() - allreduce_started)
            return self._remember(result)
        self.counters["bytes_sent"] += outcome.bytes_sent
        self.counters["bytes_received"] += outcome.bytes_received
        self._judge(outcome, [bytes(member.peer_id) for member in group.members])
        failed = list(dict.fromkeys([*failed_before, *sorted(outcome.failed_peers)]))
        finished = outcome.fully_averaged
        self.counters["succeeded" if finished else "partial"] += 1
        reason = "" if finished else ("deadline" if not outcome.finished else "some parts kept local values")
        result = StepResult(group, finished, failed, round_, key, reason, matchmaking_seconds,
                            trio.current_time() - allreduce_started, outcome)
        return self._remember(result)

    def _judge(self, outcome: AllReduceResult, members: list[bytes]) -> None:
        """One strike per offender of this round, a clean round for the other members; peers with `ban_after`
        strikes within the strikes' window leave our matchmaking."""
        self.counters["rejected_parts"] += len(outcome.rejected_peers)
        self.counters["lying_reducers"] += len(outcome.lying_peers)
        newly = self.strikes.record_round(outcome.rejected_peers | outcome.lying_peers, members)
        if newly and self.matchmaker is not None:
            logger.warning("averaging: banning %s (misbehaved in %d rounds)",
                           ", ".join(PeerID(p).short() for p in sorted(newly)), self.strikes.ban_after)
            self.matchmaker.ban(newly)

    @property
    def banned(self) -> set[PeerID]:
        """Peers this averager will not group with again (see `_judge`)."""
        return {PeerID(p) for p in self.strikes.banned}

    def _remember(self, result: StepResult) -> StepResult:
        self.last_result = result
        return result

    # ------------------------------------------------------------------------------------------- status

    def stats(self) -> dict[str, Any]:
        """For `peer status`: counters, the last group and timings, and the matchmaking's adaptive figures."""
        last = self.last_result
        stats: dict[str, Any] = {
            "prefix": self.prefix,
            "schema": self.schema.hex(),
            "round": self.keys.round,
            "key": self.keys.key,
            "client_mode": bool(self.client_mode),
            "aggregation": self.aggregation.kind,
            "banned": sorted(str(p) for p in self.banned),
            "serving_state": self.state_server is not None,
            **self.counters,
            "last_group": [str(p) for p in last.group.peer_ids] if last and last.group else [],
            "last_finished": bool(last.finished) if last else None,
            "last_failed_peers": [str(p) for p in last.failed_peers] if last else [],
            "last_matchmaking_s": round(last.matchmaking_seconds, 4) if last else None,
            "last_allreduce_s": round(last.allreduce_seconds, 4) if last else None,
        }
        if self.matchmaker is not None:
            stats["matchmaking"] = {**self.matchmaker.stats, "quiet_period_s": round(self.matchmaker.quiet_period, 4),
                                    "rtt_s": round(self.matchmaker.rtt.value, 4)}
        return stats
