"""Fault-tolerant mixture-of-experts layers whose experts live on other peers.

`RemoteMixtureOfExperts` scores every grid coordinate with a linear gate, finds each sample's k best alive experts
(`moe.beam_search`), calls them in parallel and mixes their outputs with a softmax over the gate scores of the
experts that answered. Calls are batched twice: all samples routed to one expert travel together, and all experts
of one server travel in one RPC packed in one tensor (`moe.calls.forward_packed` / `backward_packed`: one gather
of the inputs per server, one reply tensor checked as a whole), so a layer's forward and backward cost one call
per server, not one per expert. A forward under autograd asks the servers to keep their graphs, and the backward
sends the tokens back, so the experts do not recompute their forward (`moe.kept`).

Fault tolerance is the point, and it lives in `MixtureClient`, the trio side of the layer, and in the sans-I/O
rounds it drives (`moe.dispatch`: who is asked, when to stop waiting, what counts as an answer):
- the forward proceeds once every sample has `k_min` answers, then waits at most `timeout_after_k_min` for the
  rest; slow or failed experts are masked and the gate renormalised over the survivors (so a dead peer never
  produces a NaN: the softmax only ever sees experts that answered);
- a sample whose expert failed is given the next best expert right away (a new search that skips what was
  tried), up to `k_best`, so a peer that died since the last step costs one failed connect, neither a lost step
  nor a thinner mixture;
- a sample whose experts hang (a partitioned peer never answers, and no error arrives) is given its next best
  experts once the others answered a grace period ago (hedging), so one silent peer costs two grace periods,
  not `forward_timeout`;
- faults stay per expert: an expert's own error fails it alone, a server's failure (unreachable, too slow)
  fails all its experts in that call, and the logic below treats each failed expert as before;
- the backward asks the experts that answered the forward for input gradients and tolerates failures likewise:
  a missing expert contributes a zero gradient, and `backward_k_min` answers per sample are required;
- experts that failed are banned for `ban_time` seconds (the whole peer when it could not be reached), so the
  following steps do not pay for the same dead peer again; an expert that was only late is banned for a second,
  doubled each time it is late again (see `ExpertBlacklist`), so a hung peer is soon avoided as long and a live
  one slow once is back within a few steps;
- replies are checked for size once a step's calls are in (`moe.trust.ExpertTrust`: against the other experts of
  the same samples, or the expert's own record): an outlier's reply is left out of the step like a failed one,
  and an expert that keeps lying is banned for the run (published in the DHT for `peer status`);
- when even that is not enough, `NotEnoughExperts` says how many answered and which experts failed, and why.

The torch side (`RemoteMixtureOfExperts.forward`) runs in the user's thread and reaches the trio thread through
the bridge once per forward and once per backward: the search, the calls and the assembly of the outputs all
happen in one hop.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import torch
import trio
from torch import nn

from dht.client import DHTClient, SwarmHandle
from moe import calls
from moe.bans import BANS_KEY, BANS_TTL, bans_value
from moe.beam_search import ChildrenOracle, DHTGridOracle, find_best_experts, normalize_prefix
from moe.declare import ExpertLocation
from moe.dispatch import Action, BackwardRound, Call, ForwardRound, Search, Send, Short
from moe.errors import BadExpertOutput, NotEnoughExperts
from moe.trust import ExpertTrust, row_norms
from peer.p2p import wire
from peer.p2p.identity import PeerID
from peer.p2p.net import Address
from peer.p2p.relay import is_relayed
from peer.p2p.rpc import CallTimeout, RPCNode

logger = logging.getLogger(__name__)
BANS_PUBLISH_TIMEOUT = 5.0  # seconds a forward or backward may spend publishing a new ban


# ------------------------------------------------------------------------------------------------- blacklist


class ExpertBlacklist:
    """Experts (by uid) and peers (by address) to avoid for a while after they failed.

    A peer that cannot be reached is banned as a whole: all its experts would fail the same way. An expert that
    answered with an error is banned alone for `ban_time`. Bans expire, so a peer that comes back is used again.
    Lives in the trio thread and reads trio's clock (MockClock in simulated tests).

    An expert that was only late (cut by the grace period or the deadline, no error) is banned for
    `first_late_ban`, doubled each time it is late again, up to `ban_time`; an answer in time resets it. One call
    cannot tell a peer that hangs from one that was slow once (a busy CPU, a burst on its link), and the two need
    opposite treatment: a hung peer must stop costing every step a grace period (after a handful of doublings it
    is avoided as long as a failed one), while a live expert that was late once must be back within a few steps.
    Banning it for the full `ban_time` kept it out of a third of a short run on a loaded machine (live experts
    were cut this way a few times per run of tests/scenarios/test_netns.py with both cores busy): the rest of the model
    learned without it, and its return moved the routing of its samples at once."""

    def __init__(self, ban_time: float = 30.0, first_late_ban: float = 1.0):
        self.ban_time = ban_time
        self.first_late_ban = min(first_late_ban, ban_time)
        self._experts: dict[str, float] = {}
        self._late_until: dict[str, float] = {}  # uid -> end of its late ban (kept apart: `is_banned(late=False)`)
        self._addresses: dict[Address, float] = {}
        self._late: dict[str, int] = {}  # uid -> late bans in a row

    def ban_expert(self, uid: str) -> None:
        self._experts[uid] = trio.current_time() + self.ban_time

    def ban_late_expert(self, uid: str) -> float:
        """Ban an expert that did not answer in time (see the class doc); returns the ban's length."""
        strikes = self._late.get(uid, 0)
        self._late[uid] = strikes + 1
        length = min(self.ban_time, self.first_late_ban * 2.0 ** strikes)
        self._late_until[uid] = trio.current_time() + length
        return length

    def answered(self, uid: str) -> None:
        """The expert answered in time: its next late answer is banned for `first_late_ban` again."""
        self._late.pop(uid, None)

    def ban_address(self, address: Address) -> None:
        self._addresses[(address[0], int(address[1]))] = trio.current_time() + self.ban_time

    def is_banned(self, uid: str, location: ExpertLocation, *, late: bool = True,
                  forgive_late_once: bool = False) -> bool:
        """Whether to avoid this expert now. With `late=False`, bans for lateness alone do not count (a slow
        expert beats none: `MixtureClient` asks them when nobody else is left). With `forgive_late_once`, only
        the ban of an expert late once in a row does not count: one late answer is the machine's load, while
        one late again and again (unreachable for a while: a partitioned peer) has been out of training for
        seconds, so the rest of the model learned without it (see `MixtureClient.forward`'s `patient`)."""
        now = trio.current_time()
        late_until = self._late_until.get(uid, -math.inf)
        if late and late_until > now and not (forgive_late_once and self._late.get(uid, 0) <= 1):
            return True
        until = self._experts.get(uid)
        if until is not None:
            if until > now:
                return True
            del self._experts[uid]
        until = self._addresses.get(location.address)
        if until is not None:
            if until > now:
                return True
            del self._addresses[location.address]
        return False

    def banned_count(self) -> int:
        now = trio.current_time()
        return sum(1 for t in [*self._experts.values(), *self._late_until.values(), *self._addresses.values()]
                   if t > now)


# -------------------------------------------------------------------------------------------- calls, results


@dataclass(eq=False)
class ExpertCall(Call):
    """One batched call to one expert (`moe.dispatch.Call`: its choice, samples and slots) and what it brought."""

    outputs: torch.Tensor | None = None
    error: BaseException | None = None
    cold: bool = False  # no connection to its server was open when the call went out (see `_cut_short`)
    kept: int = 0  # the server's token for the graph of this forward (0: none kept)


@dataclass(eq=False)
class ForwardResult:
    """Outputs of every (sample, slot) pair, which pairs answered, and the calls that produced them (the
    backward sends gradients to exactly those calls)."""

    inputs: torch.Tensor  # [B, in] detached
    outputs: torch.Tensor  # [B, k, *out_shape], zeros where no expert answered
    mask: torch.Tensor  # [B, k] bool, True where an expert answered
    coords: torch.Tensor  # [B, k, ndim] long, grid coordinates of each slot's expert (0 where empty)
    calls: list[ExpertCall]  # successful calls only
    failures: dict[str, str] = field(default_factory=dict)  # uid -> why it failed


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# ----------------------------------------------------------------------------------------------- trio side


class MixtureClient:
    """The trio side of a remote mixture: search, parallel calls, quorum and grace logic, bans.

    Everything here runs in the trio thread that owns `rpc` and `dht`; the torch module calls `forward` and
    `backward` through the bridge. Tests drive it directly under trio (MemoryNetwork, MockClock)."""

    def __init__(
        self,
        rpc: RPCNode,
        oracle: ChildrenOracle,
        uid_prefix: str,
        grid_size: Sequence[int],
        *,
        blacklist: ExpertBlacklist | None = None,
        out_shape: Sequence[int] | None = None,
        compression: wire.Compression = wire.Compression.NONE,
        trust: ExpertTrust | None = None,
        dht: DHTClient | None = None,
        compress_min_bytes: int = 1024,
    ):
        """`trust` keeps the statistics of the experts' replies and the bans of lying experts (a new
        `ExpertTrust` by default; share one between layers to share bans); with `dht`, bans are published under
        `moe.bans.BANS_KEY` for `peer status`.

        `compression` is the codec of the calls' tensors (activations in the forward, gradients in the
        backward; the server answers in the same codec), chosen per call: a call whose inputs hold fewer than
        `compress_min_bytes` goes exact, since there the message's envelope (method, uids, rows, headers: a few
        hundred bytes) outweighs what the codec saves and its fixed CPU cost (tens of us a tensor) buys nothing.
        A backward decides on its inputs alone, as the forward of the same rows did, so a server that recomputes
        the forward sees the inputs it was sent the first time. `stats` counts the tensor bytes as sent and
        received (`tensor_bytes`) against the same tensors exact (`tensor_bytes_exact`), and the calls compressed
        (`compressed_rpcs`). Error bounds: `peer.p2p.wire.Compression` (int8: at most 1/254 of each block of
        256 values' largest magnitude)."""
        self.rpc = rpc
        self.oracle = oracle
        self.uid_prefix = normalize_prefix(uid_prefix)
        self.grid_size = tuple(int(g) for g in grid_size)
        self.blacklist = blacklist if blacklist is not None else ExpertBlacklist()
        self.out_shape = tuple(out_shape) if out_shape is not None else None
        self.compression = compression
        self.compress_min_bytes = compress_min_bytes
        self.trust = trust if trust is not None else ExpertTrust()
        self.dht = dht
        self._bans_published: tuple[int, float] = (0, -math.inf)  # (bans published, trio time)
        # private servers whose cold calls were cut and not held against them -> when the first such cut was
        self._forgiven_cold: dict[Address, float] = {}
        self.stats: dict[str, float] = {
            "outlier_replies": 0, "trust_bans": 0, "cold_calls_forgiven": 0,
            "forward_calls": 0, "forward_failures": 0, "backward_calls": 0, "backward_failures": 0,
            "forward_rpcs": 0, "backward_rpcs": 0,
            "replacement_searches": 0, "hedged_samples": 0, "backward_skipped": 0, "late_experts_asked": 0,
            "search_seconds": 0.0, "forward_seconds": 0.0, "backward_seconds": 0.0,
            "tensor_bytes": 0, "tensor_bytes_exact": 0, "compressed_rpcs": 0,
        }

    # ------------------------------------------------------------------------------------------- forward

    async def forward(
        self,
        inputs: torch.Tensor,
        scores: Sequence[Sequence[Sequence[float]]],
        *,
        k_best: int,
        k_min: int,
        forward_timeout: float,
        timeout_after_k_min: float,
        keep: bool = False,
        patient: bool = False,
    ) -> ForwardResult:
        """Route each sample to its k_best best alive experts and collect their outputs (see module doc). `keep`:
        a backward will follow, so the servers keep their graphs for it.

        `patient` (evaluation): no grace period (every chosen expert is waited for until `forward_timeout`) and
        experts banned for being late once are asked like the others. The grace period trades a sample's
        slowest experts for a step's pace, which training can afford and a measurement cannot: on a loaded
        machine a held-out evaluation cut a whole live daemon's experts and rerouted their samples, and
        reported 0.81 accuracy for a model that measured 0.93 on the next try. An expert late again and again
        stays out (unless nobody else is left), as in training: a peer partitioned for seconds was, and the
        rest of the model learned without it; asking its stale experts cost tests/scenarios/test_netns.py's
        evaluation 0.84-0.89 accuracy for models that trained to 0.95 (2 runs in 7). A dead expert still fails at
        once (refused connection), and one banned for an error or for lying is still avoided; a peer whose expert
        does not answer within `forward_timeout` is banned like an unreachable one, so a frozen daemon costs an
        evaluation one timeout, not one per batch."""
        started = trio.current_time()
        if patient:
            timeout_after_k_min = forward_timeout
        core: ForwardRound[ExpertCall] = ForwardRound(
            inputs.shape[0], k_best=k_best, k_min=k_min, now=started, forward_timeout=forward_timeout,
            timeout_after_k_min=timeout_after_k_min, new_call=ExpertCall)
        failures: dict[str, str] = {}

        async def run_group(group: list[ExpertCall]) -> None:
            try:
                await self._forward_group(group, inputs, core.deadline, failures, keep)
            finally:  # cut by the grace period or the deadline: neither outputs nor an error, and not reported
                for call in group:
                    if call.outputs is not None:
                        core.call_answered(call, trio.current_time())
                    elif call.error is not None:
                        core.call_failed(call, trio.current_time())

        async def search(action: Search) -> list[Action[ExpertCall]]:
            self.stats["replacement_searches"] += action.kind == "replace"
            self.stats["hedged_samples"] += action.hedged
            t0 = trio.current_time()
            choices = await find_best_experts(self.oracle, self.uid_prefix, self.grid_size, scores, action.need,
                                              banned=self._avoided_when_patient if patient else self._avoided,
                                              exclude=action.exclude)
            short = [max(0, n - len(c)) for n, c in zip(action.need, choices)]
            if any(short):
                # everyone else left was late lately (a loaded machine cuts live experts): a slow expert beats
                # none, which failed every sample of the step
                exclude = [set(e) | {c.uid for c in chosen} for e, chosen in zip(action.exclude, choices)]
                more = await find_best_experts(self.oracle, self.uid_prefix, self.grid_size, scores, short,
                                               banned=self._avoided_firmly, exclude=exclude)
                self.stats["late_experts_asked"] += sum(len(m) for m in more)
                choices = [[*c, *m] for c, m in zip(choices, more)]
            self.stats["search_seconds"] += trio.current_time() - t0
            return core.search_results(choices, trio.current_time())

        for call in await self._drive(core, run_group, search):
            self._cut_short(call, failures)
            if patient:  # it had the whole forward_timeout: its peer hangs, so it is avoided like an unreachable
                self.blacklist.ban_address(call.choice.location.address)  # one (a frozen daemon: one timeout)
        self.stats["forward_seconds"] += trio.current_time() - started
        answers = [(call, call.outputs) for call in core.calls if call.outputs is not None]
        liars = self._check_replies("outputs", answers, failures)
        for call, _ in answers:
            if call.uid in liars:
                core.reject(call)
                call.outputs, call.error = None, liars[call.uid]
        await self._publish_bans()
        outcome = core.outcome()
        if isinstance(outcome, Short):
            # the experts this step could find were not enough (all banned or failing, or the grid read when only
            # some servers had declared): the next step reads the grid again, not the same view for up to the
            # search cache's ttl (a kill then cost every step of those seconds: bench_moe, 70 steps in one run)
            self.oracle.invalidate()
            raise self._not_enough("forward", outcome.answered, k_min, failures)
        return self._assemble(inputs, core.calls, k_best, failures)

    async def _drive(self, core: ForwardRound[ExpertCall] | BackwardRound[ExpertCall],
                     run_group: Callable[[list[ExpertCall]], Awaitable[None]],
                     search: Callable[[Search], Awaitable[list[Action[ExpertCall]]]] | None = None,
                     ) -> list[ExpertCall]:
        """Run a round's core: start its calls, run its searches, feed it the calls' ends and the time until it
        stops or its deadline passes; returns the calls cut (in flight at the end)."""
        changed = [trio.Event()]

        async def run(group: list[ExpertCall]) -> None:
            try:
                await run_group(group)  # which tells the core how each call ended
            finally:
                changed[0].set()
                changed[0] = trio.Event()

        with trio.move_on_at(core.deadline):
            async with trio.open_nursery() as nursery:
                actions = core.start(trio.current_time())
                while True:
                    for action in actions:
                        if isinstance(action, Send):
                            for group in action.groups:
                                nursery.start_soon(run, group)
                    wanted = [action for action in actions if isinstance(action, Search)]
                    if core.stopped:
                        break
                    if wanted and search is not None:
                        actions = await search(wanted[0])
                        continue
                    with trio.move_on_at(core.next_deadline()):
                        await changed[0].wait()
                    actions = core.tick(trio.current_time())
                nursery.cancel_scope.cancel()
        return core.close(trio.current_time())

    @staticmethod
    def _gain(call: ExpertCall, grad_inputs: torch.Tensor, grad_outputs: torch.Tensor
              ) -> tuple[ExpertCall, torch.Tensor]:
        """What the backward check compares: each row's input gradient divided by the size of the output
        gradient sent for it (the expert's gain). The raw sizes differ between honest experts of one sample by
        their gate weights (0.9 and 0.01 are 90x apart); the gains do not. Rows sent a zero gradient say
        nothing and are left out (a call with only such rows is not checked)."""
        sizes = row_norms(grad_outputs)
        keep = sizes > 0
        if bool(keep.all()):
            shape = (-1,) + (1,) * (grad_inputs.ndim - 1)
            return call, grad_inputs / sizes.to(grad_inputs.dtype).view(shape)
        rows = keep.nonzero().flatten()
        kept = ExpertCall(call.choice, [call.samples[int(r)] for r in rows], [call.slots[int(r)] for r in rows])
        shape = (-1,) + (1,) * (grad_inputs.ndim - 1)
        return kept, grad_inputs[rows] / sizes[rows].to(grad_inputs.dtype).view(shape)

    def _avoided(self, uid: str, location: ExpertLocation) -> bool:
        """Whether the search skips this expert: banned for lying (for the run) or failed recently (a while)."""
        return self.trust.is_banned(uid) or self.blacklist.is_banned(uid, location)

    def _avoided_firmly(self, uid: str, location: ExpertLocation) -> bool:
        """`_avoided`, except for experts that were only late."""
        return self.trust.is_banned(uid) or self.blacklist.is_banned(uid, location, late=False)

    def _avoided_when_patient(self, uid: str, location: ExpertLocation) -> bool:
        """`_avoided`, except for experts late only once in a row (an evaluation's search: `forward`)."""
        return self.trust.is_banned(uid) or self.blacklist.is_banned(uid, location, forgive_late_once=True)

    def _check_replies(self, kind: str, replies: list[tuple[ExpertCall, torch.Tensor]],
                       failures: dict[str, str]) -> dict[str, BadExpertOutput]:
        """Check one step's accepted replies of `kind` ("outputs" or "grad_inputs") with `self.trust` (sizes
        against each expert's record and against the other experts of the same samples); returns the experts
        whose replies are outliers, with the error to record for them: their replies are not used this step
        (it is cheaper to lose one expert's answer than to mix in garbage). They are not put on the temporary
        blacklist: the trust record decides, over several steps, whether to ban them for the run."""
        replies = [(call, tensor) for call, tensor in replies if call.samples]
        if not replies:
            return {}
        merged: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        for call, tensor in replies:
            samples, tensors = merged.setdefault(call.uid, ([], []))
            samples.extend(call.samples)
            tensors.append(tensor)
        verdicts = self.trust.check({uid: (samples, torch.cat(tensors) if len(tensors) > 1 else tensors[0])
                                     for uid, (samples, tensors) in merged.items()}, kind=kind)
        liars: dict[str, BadExpertOutput] = {}
        for uid, verdict in verdicts.items():
            if verdict.banned_now:
                self.stats["trust_bans"] += 1
                logger.warning("expert %s banned for this run: %s", uid, self.trust.bans()[uid])
            if verdict.outlier:
                self.stats["outlier_replies"] += 1
                liars[uid] = BadExpertOutput(uid, f"{kind} {verdict.ratio:.3g}x the usual size (by {verdict.basis})")
                failures[uid] = _describe(liars[uid])
        return liars

    async def _publish_bans(self) -> None:
        """Store this client's bans in the DHT (`moe.bans.BANS_KEY`, under its own signed subkey) when a new one
        was made, and refresh them before they expire. Inline and bounded: a new ban is rare, and the store is
        cut after a few seconds (a DHT hiccup costs one missed publication, retried at the next new ban or
        refresh)."""
        bans = self.trust.bans()
        count, published_at = self._bans_published
        now = trio.current_time()
        if self.dht is None or not bans or (len(bans) == count and now - published_at < BANS_TTL / 2):
            return
        self._bans_published = (len(bans), now)
        try:
            with trio.move_on_after(BANS_PUBLISH_TIMEOUT):
                await self.dht.store(BANS_KEY, bans_value(bans), self.dht.now() + BANS_TTL,
                                     subkey=bytes(self.rpc.peer_id), signed=True)
        except Exception as error:  # noqa: BLE001 (the DHT's failure modes are many; a missed publication only)
            logger.debug("publishing expert bans failed: %s", error)

    def _assemble(
        self, inputs: torch.Tensor, expert_calls: list[ExpertCall], k_best: int, failures: dict[str, str]
    ) -> ForwardResult:
        batch_size = inputs.shape[0]
        answers = [(c, c.outputs) for c in expert_calls if c.outputs is not None]
        succeeded = [c for c, _ in answers]
        if self.out_shape is not None:
            out_shape = self.out_shape
        else:  # an empty batch has no answers to learn the shape from: experts usually keep the input's shape
            out_shape = tuple(answers[0][1].shape[1:]) if answers else tuple(inputs.shape[1:])
        width = max([k_best, *(slot + 1 for call in succeeded for slot in call.slots)])
        outputs = inputs.new_zeros((batch_size, width, *out_shape))
        mask = torch.zeros(batch_size, width, dtype=torch.bool)
        coords = torch.zeros(batch_size, width, len(self.grid_size), dtype=torch.long)
        if answers:  # one scatter for all the experts' answers
            samples = torch.tensor([s for call in succeeded for s in call.samples], dtype=torch.long)
            slots = torch.tensor([s for call in succeeded for s in call.slots], dtype=torch.long)
            outputs[samples, slots] = torch.cat([answer for _, answer in answers]).to(outputs.dtype)
            mask[samples, slots] = True
            coords[samples, slots] = torch.tensor([call.choice.coords for call in succeeded for _ in call.samples],
                                                  dtype=torch.long).view(-1, len(self.grid_size))
        return ForwardResult(inputs, outputs, mask, coords, succeeded, failures)

    # ------------------------------------------------------------------------------------------ backward

    async def backward(
        self,
        result: ForwardResult,
        grad_outputs: torch.Tensor,
        *,
        backward_k_min: int,
        backward_timeout: float,
        timeout_after_k_min: float,
    ) -> torch.Tensor:
        """Send each answering expert the gradients of its outputs; returns the gradient w.r.t. the inputs, with
        zeros from experts that failed now. Each expert applies its optimizer step on the way."""
        inputs = result.inputs
        started = trio.current_time()
        # one backward call (one optimizer step) per expert, even if a replacement round called it twice
        by_uid: dict[str, ExpertCall] = {}
        for call in result.calls:
            entry = by_uid.get(call.uid)
            if entry is None:
                entry = by_uid[call.uid] = ExpertCall(call.choice, [], [], kept=call.kept)
            else:  # two forwards of one expert: one backward call for both, through a recomputed forward
                entry.kept = 0
            entry.samples.extend(call.samples)
            entry.slots.extend(call.slots)
        merged = list(by_uid.values())
        grad_inputs = torch.zeros_like(inputs)
        failures: dict[str, str] = {}
        sent: list[ExpertCall] = []
        skipped: list[ExpertCall] = []
        received: list[tuple[ExpertCall, torch.Tensor]] = []  # summed once all are checked together
        requests: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for call in merged:
            samples = torch.tensor(call.samples, dtype=torch.long)
            grads = grad_outputs[samples, torch.tensor(call.slots, dtype=torch.long)].contiguous()
            if not bool(grads.any()):
                # nothing to learn (e.g. a hedged expert whose output was not used): no call, no step
                skipped.append(call)
                self.stats["backward_skipped"] += 1
                continue
            requests[id(call)] = (samples, grads)
            sent.append(call)
        core: BackwardRound[ExpertCall] = BackwardRound(
            inputs.shape[0], sent, skipped=skipped, backward_k_min=backward_k_min, now=started,
            backward_timeout=backward_timeout, timeout_after_k_min=timeout_after_k_min)

        async def run_group(group: list[ExpertCall]) -> None:
            location = group[0].choice.location
            try:
                rows = [len(call.samples) for call in group]
                sent_inputs = [inputs.index_select(0, torch.cat([requests[id(call)][0] for call in group]))]
                sent_grads = [torch.cat([requests[id(call)][1] for call in group])]
                codec = self._call_codec(sent_inputs)  # judged as the forward of the same rows was
                reply = await calls.backward_packed(
                    self.rpc, location.address, PeerID.from_hex(location.peer_id_hex), [call.uid for call in group],
                    rows, sent_inputs, sent_grads, timeout=self._timeout(core.deadline),
                    compression=codec, kept=[call.kept for call in group])
                self._count_tensor_bytes(codec, [*sent_inputs, *sent_grads, *reply.tensors])
                answers = calls.unpack(reply, rows)
                self.stats["backward_rpcs"] += 1
                for call, answer in zip(group, answers):
                    if isinstance(answer, Exception):
                        self._failed(call, answer, failures, "backward")
                        core.call_failed(call, trio.current_time())
                        continue
                    received.append((call, answer[0]))
                    self.blacklist.answered(call.uid)
                    core.call_answered(call, trio.current_time())
                    self.stats["backward_calls"] += 1
            except calls.CALL_FAILURES as error:  # the whole server failed: every expert of it in this call
                for call in group:
                    self._failed(call, error, failures, "backward")
                    core.call_failed(call, trio.current_time())

        for call in await self._drive(core, run_group):  # cut by the grace period or the deadline: too slow
            self._failed(call, trio.TooSlowError("no answer before the backward deadline or grace period"),
                         failures, "backward")
        self.stats["backward_seconds"] += trio.current_time() - started
        liars = self._check_replies("grad_inputs", [self._gain(call, grads, requests[id(call)][1])
                                                    for call, grads in received], failures)
        for call, grads in received:
            if call.uid in liars:  # a lying expert's gradient is left out, as a failed one's
                core.reject(call)
            else:
                grad_inputs.index_add_(0, requests[id(call)][0], grads.to(inputs.dtype))
        await self._publish_bans()
        if isinstance(outcome := core.outcome(), Short):
            raise self._not_enough("backward", outcome.answered, backward_k_min, failures)
        return grad_inputs

    # ------------------------------------------------------------------------------------------- helpers

    @staticmethod
    def _timeout(deadline: float) -> float:
        return max(deadline - trio.current_time(), 1e-3)

    def _call_codec(self, tensors: Sequence[torch.Tensor]) -> wire.Compression:
        """The codec of one call (see `__init__`): the layer's, unless the request is too small to gain."""
        if self.compression == wire.Compression.NONE:
            return self.compression
        exact = sum(t.numel() * t.element_size() for t in tensors)
        return self.compression if exact >= self.compress_min_bytes else wire.Compression.NONE

    def _count_tensor_bytes(self, codec: wire.Compression, tensors: Sequence[torch.Tensor]) -> None:
        """A call's tensors, both ways: as the codec sent them and as they would have gone exact."""
        self.stats["tensor_bytes"] += sum(wire.data_nbytes(t, codec) for t in tensors)
        self.stats["tensor_bytes_exact"] += sum(t.numel() * t.element_size() for t in tensors)
        self.stats["compressed_rpcs"] += codec != wire.Compression.NONE

    async def _forward_group(self, group: list[ExpertCall], inputs: torch.Tensor, deadline: float,
                             failures: dict[str, str], keep: bool = False) -> None:
        """One server's experts in one call: each gets one finite floating tensor of the layer's output shape
        (the first valid answer fixes it when the layer was built without one) or fails alone; when the call
        itself fails, all of them fail with its error."""
        location = group[0].choice.location
        cold = not self.rpc.is_connected(location.address)
        for call in group:
            call.cold = cold
        try:
            rows = [len(call.samples) for call in group]
            index = torch.tensor([sample for call in group for sample in call.samples], dtype=torch.long)
            sent = [inputs.index_select(0, index)]
            codec = self._call_codec(sent)
            reply = await calls.forward_packed(
                self.rpc, location.address, PeerID.from_hex(location.peer_id_hex), [call.uid for call in group],
                rows, sent, timeout=self._timeout(deadline),
                compression=codec, out_shape=self.out_shape, keep=keep)
        except calls.CALL_FAILURES as error:
            for call in group:
                self._failed(call, error, failures, "forward")
            return
        self.stats["forward_rpcs"] += 1
        self._count_tensor_bytes(codec, [*sent, *reply.tensors])
        answers = calls.unpack(reply, rows)
        for call, answer, token in zip(group, answers, reply.kept):
            call.kept = token
            if not isinstance(answer, Exception) and self.out_shape is None:
                self.out_shape = tuple(answer[0].shape[1:])
            elif not isinstance(answer, Exception) and tuple(answer[0].shape[1:]) != self.out_shape:
                answer = BadExpertOutput(call.uid, f"output shape {tuple(answer[0].shape[1:])}, expected "
                                                   f"{self.out_shape} per sample")
            if isinstance(answer, Exception):
                self._failed(call, answer, failures, "forward")
            else:
                call.outputs = answer[0]
                self.blacklist.answered(call.uid)
                self.stats["forward_calls"] += 1

    def _cut_short(self, call: ExpertCall, failures: dict[str, str]) -> None:
        """A forward call cut by the grace period or the deadline: too slow to be useful now, so its expert is
        avoided for a while. Except calls to a private server (a relayed address) with no connection open yet:
        they wait for one to open (a circuit through a relay and a hole-punch attempt take a second or more,
        against a grace period of 0.2 s), which goes on in the RPC node's nursery, so a later step finds it
        warm. Avoiding its experts for `ban_time` instead kept private volunteers out of short runs. Forgiven
        for the RPC node's `connect_timeout` from the first such cut (a connect that fails bans the peer
        through its error anyway); after that, a cold cut counts as usual. A direct address has no such
        excuse: a connect that outlasts the grace period is a hung peer."""
        call.error = trio.TooSlowError("no answer before the forward deadline or grace period")
        address = call.choice.location.address
        now = trio.current_time()
        first = self._forgiven_cold.setdefault(address, now) if call.cold and is_relayed(address) else None
        if first is not None and now - first <= self.rpc.connect_timeout:
            self.stats["cold_calls_forgiven"] += 1
            failures[call.uid] = _describe(call.error)
            return
        self._failed(call, call.error, failures, "forward")

    def _failed(self, call: ExpertCall, error: BaseException, failures: dict[str, str], stage: str) -> None:
        call.error = error
        failures[call.uid] = _describe(error)
        self.stats[f"{stage}_failures"] += 1
        if calls.peer_unreachable(error):
            self.blacklist.ban_address(call.choice.location.address)
        elif isinstance(error, (trio.TooSlowError, CallTimeout)):  # no answer in time: late, not failed
            self.blacklist.ban_late_expert(call.uid)
        else:
            self.blacklist.ban_expert(call.uid)
        logger.debug("expert %s failed in %s: %s", call.uid, stage, _describe(error))

    def _not_enough(self, stage: str, answered: list[int], needed: int, failures: dict[str, str]) -> NotEnoughExperts:
        short = sum(1 for a in answered if a < needed)
        return NotEnoughExperts(
            stage=stage, needed=needed, answered=min(answered) if answered else 0, samples_short=short,
            samples=len(answered), failures=dict(failures),
        )


# ---------------------------------------------------------------------------------------------- torch side


class _DispatchFunction(torch.autograd.Function):
    """Ties the experts' outputs into autograd: its backward runs `MixtureClient.backward` through the bridge."""

    @staticmethod
    def forward(
        ctx: Any, dummy: torch.Tensor, inputs: torch.Tensor, layer: "_GridMixture", result: ForwardResult
    ) -> torch.Tensor:
        ctx.layer, ctx.result = layer, result
        return result.outputs

    @staticmethod
    def backward(ctx: Any, grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_inputs = ctx.layer._backward(ctx.result, grad_outputs)
        return None, grad_inputs.to(grad_outputs.dtype) if ctx.needs_input_grad[1] else None, None, None


class _GridMixture(nn.Module):
    """What both mixtures share: the gate over grid coordinates, the client, and the bridge hops."""

    def __init__(
        self,
        in_features: int,
        grid_size: Sequence[int],
        uid_prefix: str,
        *,
        swarm: SwarmHandle | None,
        k_best: int,
        k_min: int,
        timeout_after_k_min: float,
        forward_timeout: float,
        backward_k_min: int,
        backward_timeout: float,
        out_features: int | None,
        ban_time: float,
        search_cache_ttl: float,
        blacklist: ExpertBlacklist | None,
        compression: wire.Compression,
        oracle: ChildrenOracle | None,
        trust: ExpertTrust | None,
    ):
        super().__init__()
        if swarm is None:
            raise ValueError("a remote mixture needs a swarm handle (an object with .bridge, .rpc and .dht)")
        if oracle is None:
            if getattr(swarm, "dht", None) is None:
                raise ValueError("the swarm has no DHT to find experts in: pass oracle= (e.g. StaticGridOracle)")
            oracle = DHTGridOracle(swarm.dht, ttl=search_cache_ttl)
        if not 1 <= k_min <= k_best:
            raise ValueError(f"need 1 <= k_min <= k_best, got k_min={k_min}, k_best={k_best}")
        self.in_features = in_features
        self.grid_size = tuple(int(g) for g in grid_size)
        self.uid_prefix = normalize_prefix(uid_prefix)
        self.k_best, self.k_min, self.backward_k_min = k_best, k_min, backward_k_min
        self.timeout_after_k_min = timeout_after_k_min
        self.forward_timeout, self.backward_timeout = forward_timeout, backward_timeout
        self.out_features = out_features if out_features is not None else in_features
        self.swarm = swarm
        self.gate = nn.Linear(in_features, sum(self.grid_size))
        self.client = MixtureClient(
            swarm.rpc, oracle, self.uid_prefix, self.grid_size,
            blacklist=blacklist if blacklist is not None else ExpertBlacklist(ban_time),
            out_shape=(self.out_features,), compression=compression, trust=trust,
            dht=getattr(swarm, "dht", None),
        )
        # autograd calls the dispatch backward only if some input requires grad: this one always does, so the
        # experts are trained even when the layer's inputs are plain data
        self._dummy = torch.empty(0, requires_grad=True)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, grid_size={self.grid_size}, uid_prefix={self.uid_prefix!r}, "
                f"k_best={self.k_best}")

    def _dispatch(
        self, x: torch.Tensor, k_best: int, k_min: int
    ) -> tuple[list[torch.Tensor], ForwardResult, torch.Tensor]:
        """Gate, search and call the experts; returns per-dimension gate logits, the raw result and the
        experts' outputs wired into autograd ([B, k, out])."""
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected inputs of shape [batch, {self.in_features}], got {tuple(x.shape)}")
        logits = self.gate(x).split(self.grid_size, dim=-1)
        scores = [s.detach().float().tolist() for s in logits]
        sent = x.detach().to(torch.float32).contiguous()
        result = self.swarm.bridge.run(functools.partial(
            self.client.forward, sent, scores, k_best=k_best, k_min=k_min,
            forward_timeout=self.forward_timeout, timeout_after_k_min=self.timeout_after_k_min,
            keep=torch.is_grad_enabled(), patient=not self.training,
        ))
        # torch declares autograd.Function.apply without annotations
        dispatched: torch.Tensor = _DispatchFunction.apply(self._dummy, x, self, result)  # type: ignore[no-untyped-call]
        return list(logits), result, dispatched.to(x.dtype)

    def _backward(self, result: ForwardResult, grad_outputs: torch.Tensor) -> torch.Tensor:
        return self.swarm.bridge.run(functools.partial(
            self.client.backward, result, grad_outputs.detach().to(torch.float32).contiguous(),
            backward_k_min=self.backward_k_min, backward_timeout=self.backward_timeout,
            timeout_after_k_min=self.timeout_after_k_min,
        ))

    @staticmethod
    def _chosen_logits(logits: list[torch.Tensor], coords: torch.Tensor) -> torch.Tensor:
        """Gate score of each slot's expert: the sum of its coordinates' scores ([B, k])."""
        chosen = sum(dim_logits.gather(1, coords[:, :, d]) for d, dim_logits in enumerate(logits))
        assert isinstance(chosen, torch.Tensor), "a grid has at least one dimension"  # sum() starts from 0
        return chosen


class RemoteMixtureOfExperts(_GridMixture):
    """A mixture-of-experts layer over a grid of remote experts, tolerant to experts failing (see module doc).

    `forward(x)` with x of shape [batch, in_features] returns [batch, out_features] (default in_features):
    the gate-weighted sum of the outputs of each sample's k_best best alive experts, weights = softmax of the
    gate scores over the experts that answered. In evaluation mode (`model.eval()`) the layer waits for every
    chosen expert instead of cutting the slow ones after `timeout_after_k_min` (`MixtureClient.forward`'s
    `patient`): a held-out metric measures the model, not the machine's load.

    `swarm` carries `.bridge`, `.rpc` and `.dht` (the trainer's `peer.client.Swarm`). Timeouts are in seconds.
    `oracle` replaces the DHT as the source of experts (e.g. `StaticGridOracle` for a fixed set); `blacklist`
    may be shared between layers so one layer's discovery of a dead peer spares the others; `compression`
    applies to tensors both ways; `trust` (`moe.trust.ExpertTrust`) checks every reply's size and bans lying
    experts for the run (see `MixtureClient`)."""

    def __init__(
        self,
        in_features: int,
        grid_size: Sequence[int],
        uid_prefix: str,
        k_best: int,
        k_min: int = 1,
        timeout_after_k_min: float = 1.0,
        forward_timeout: float = 10.0,
        backward_k_min: int = 1,
        backward_timeout: float = 10.0,
        swarm: SwarmHandle | None = None,
        *,
        out_features: int | None = None,
        ban_time: float = 30.0,
        search_cache_ttl: float = 5.0,
        blacklist: ExpertBlacklist | None = None,
        compression: wire.Compression = wire.Compression.NONE,
        oracle: ChildrenOracle | None = None,
        trust: ExpertTrust | None = None,
    ):
        super().__init__(
            in_features, grid_size, uid_prefix, swarm=swarm, k_best=k_best, k_min=k_min,
            timeout_after_k_min=timeout_after_k_min, forward_timeout=forward_timeout,
            backward_k_min=backward_k_min, backward_timeout=backward_timeout, out_features=out_features,
            ban_time=ban_time, search_cache_ttl=search_cache_ttl, blacklist=blacklist, compression=compression,
            oracle=oracle, trust=trust,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, result, outputs = self._dispatch(x, self.k_best, self.k_min)
        chosen = self._chosen_logits(logits, result.coords).masked_fill(~result.mask, float("-inf"))
        weights = torch.softmax(chosen, dim=1)  # renormalised over the experts that answered
        return torch.einsum("bk,bko->bo", weights, outputs)


class RemoteSwitchMixtureOfExperts(_GridMixture):
    """Switch (top-1) routing over a grid of remote experts, with the Switch Transformer's load-balancing loss.

    `forward(x)` returns `(output, balancing_loss)`. Each sample goes to its best alive expert (the next best when
    that one fails); the output is scaled by the expert's gate probability so the gate learns. On a grid the
    gate probability of an expert is the product of per-dimension softmaxes, and the loss balances each
    dimension: `sum_d grid_d * sum_j f_dj * P_dj` (f: fraction of samples routed to coordinate j of dimension
    d, P: mean gate probability of it); it equals the number of dimensions when routing is uniform.
    `hedge_after`: a sample whose expert has not answered this long after others did is also sent to its next
    best expert (the grace period of the k-best mixture)."""

    def __init__(
        self,
        in_features: int,
        grid_size: Sequence[int],
        uid_prefix: str,
        forward_timeout: float = 10.0,
        backward_timeout: float = 10.0,
        swarm: SwarmHandle | None = None,
        *,
        out_features: int | None = None,
        ban_time: float = 30.0,
        search_cache_ttl: float = 5.0,
        blacklist: ExpertBlacklist | None = None,
        compression: wire.Compression = wire.Compression.NONE,
        oracle: ChildrenOracle | None = None,
        hedge_after: float = 1.0,
        trust: ExpertTrust | None = None,
    ):
        super().__init__(
            in_features, grid_size, uid_prefix, swarm=swarm, k_best=1, k_min=1, timeout_after_k_min=hedge_after,
            forward_timeout=forward_timeout, backward_k_min=1, backward_timeout=backward_timeout,
            out_features=out_features, ban_time=ban_time, search_cache_ttl=search_cache_ttl, blacklist=blacklist,
            compression=compression, oracle=oracle, trust=trust,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, result, outputs = self._dispatch(x, 1, 1)
        probs = [torch.softmax(dim_logits, dim=-1) for dim_logits in logits]
        # the best expert that answered (a hedge may have added a second one; its output is not used)
        slot = self._chosen_logits(logits, result.coords).masked_fill(~result.mask, float("-inf")).argmax(dim=1)
        rows = torch.arange(x.shape[0])
        coords = result.coords[rows, slot]  # [B, ndim]
        gate_prob = torch.ones(x.shape[0], dtype=probs[0].dtype, device=x.device)
        balancing = x.new_zeros(())
        for d, dim_probs in enumerate(probs):
            gate_prob = gate_prob * dim_probs.gather(1, coords[:, d : d + 1]).squeeze(1)
            routed = torch.nn.functional.one_hot(coords[:, d], self.grid_size[d]).to(dim_probs.dtype).mean(0)
            balancing = balancing + self.grid_size[d] * (routed * dim_probs.mean(0)).sum()
        return gate_prob.unsqueeze(1) * outputs[rows, slot], balancing
