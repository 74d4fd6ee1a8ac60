"""The MoE client's forward and backward rounds as sans-I/O cores: who is asked, when to stop waiting, what counts.

`ForwardRound` is one forward of `moe.mixture.MixtureClient`: every sample wants its `k_best` best alive experts
and needs `k_min` answers. The driver feeds it events -- the choices a search returned (`search_results`), calls
that answered (`answered`) or failed with an error (`failed`), and the time (`tick`) -- and performs the actions
it gives back:
- `Search(need, exclude)`: find `need[b]` more experts for each sample b, none of `exclude[b]` (those tried);
- `Send(groups)`: start these calls, one RPC per group (the experts of one server);
- `Stop()`: the round is decided: cancel what is in flight, then `close()`, which returns the calls that neither
  answered nor failed (cut: too slow; the driver's blacklist decides how long to avoid them). A call that
  answers between the two still counts.
and waits for the next event or `next_deadline()`. The rules (the module doc of `moe.mixture` tells why):
- a sample whose expert failed gets the next best at once, up to `k_best` (a `replace` search), unless a search
  already found nobody more for it;
- once a sample cannot reach `k_min` even if everything in flight answers, the round stops;
- once every sample has `k_min` answers, the round waits at most `timeout_after_k_min` more (the grace period);
- a sample still short of `k_min` when the others answered a grace period ago (and twice as long ago as the first
  answer took) is given its next best experts too, once (a `hedge` search);
- the round stops at `forward_timeout` whatever happens; only a call with outputs is an answer, never one that
  failed or was cut.
After `close()` the driver checks the replies and `reject`s the outliers (they count as failed), then reads
`outcome()`: `Done()` or `Short(answered)`.

`BackwardRound` is one backward: the calls that answered the forward (merged per expert) are asked for input
gradients; each sample needs `min(backward_k_min, its forward answers)` of them, then the round waits one grace
period more for the rest, and stops at `backward_timeout`.

Plain objects: no trio, no torch, time as a float (the driver's clock). Bans, reply checks, the search's view of
the grid (which the driver invalidates after a forward that ends `Short`, so the next search reads the DHT again)
and the tensors stay in the driver (`moe.mixture`), which owns the clock the blacklist reads and the RPC node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, Literal, Sequence, TypeVar, Union

if TYPE_CHECKING:  # only the type: moe.beam_search's module imports trio
    from moe.beam_search import ExpertChoice


@dataclass(eq=False)
class Call:
    """One batched call to one expert: the samples routed to it and the output slot each occupies."""

    choice: ExpertChoice
    samples: list[int]
    slots: list[int]

    @property
    def uid(self) -> str:
        return self.choice.uid


C = TypeVar("C", bound=Call)
NewCall = Callable[["ExpertChoice", list[int], list[int]], C]


def by_server(calls: Sequence[C]) -> list[list[C]]:
    """The calls grouped by the server that hosts their experts: one RPC per server carries all of its experts."""
    groups: dict[tuple[tuple[str, int], str], list[C]] = {}
    for call in calls:
        location = call.choice.location
        groups.setdefault(((location.address[0], int(location.address[1])), location.peer_id_hex), []).append(call)
    return list(groups.values())


# ----------------------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Search:
    """Find `need[b]` more experts for sample b, none of `exclude[b]`. `kind`: "initial", "replace" (experts
    failed) or "hedge" (experts hang); `hedged` samples are given extra experts for the first time."""

    need: list[int]
    exclude: list[set[str]]  # copies: the round's own sets grow as it assigns
    kind: Literal["initial", "replace", "hedge"]
    hedged: int = 0


@dataclass(frozen=True)
class Send(Generic[C]):
    """Start these calls: one RPC per group (the experts of one server)."""

    groups: list[list[C]]


@dataclass(frozen=True)
class Stop:
    """The round is decided: cancel what is in flight, then `close()` the round."""


Action = Union[Search, Send[C], Stop]


@dataclass(frozen=True)
class Done:
    """Every sample has enough answers."""


@dataclass(frozen=True)
class Short:
    """Some samples have too few answers: `answered[b]` per sample, `needed` each (per sample in the backward)."""

    answered: list[int]
    needed: list[int]

    @property
    def samples_short(self) -> int:
        return sum(1 for a, n in zip(self.answered, self.needed) if a < n)


Outcome = Union[Done, Short]

_IN_FLIGHT, _ANSWERED, _FAILED, _CUT, _REJECTED = "in flight", "answered", "failed", "cut", "rejected"


class _Round(Generic[C]):
    """What both rounds share: per-sample answers and calls in flight, each call's state, the stop."""

    def __init__(self, batch_size: int, deadline: float, grace: float):
        self.answered = [0] * batch_size
        self.in_flight = [0] * batch_size
        self.deadline = deadline
        self.grace = grace  # seconds to wait once every sample has its answers (timeout_after_k_min)
        self.grace_deadline = math.inf
        self.state: dict[C, str] = {}
        self.stopped = False  # decided: the driver cancels what is in flight
        self.closed = False  # over: what was still in flight is cut, later events are ignored

    def state_of(self, call: C) -> str:
        return self.state[call]

    def _end(self, call: C, state: str) -> bool:
        if self.state.get(call) != _IN_FLIGHT or self.closed:
            return False  # unknown, already over, or after the close (then it was cut)
        self.state[call] = state
        for sample in call.samples:
            self.in_flight[sample] -= 1
            if state == _ANSWERED:
                self.answered[sample] += 1
        return True

    def call_failed(self, call: C, now: float) -> None:
        """The call ended with an error (its server's or its expert's own)."""
        self._end(call, _FAILED)

    def reject(self, call: C) -> None:
        """After the stop: this answer was found to be an outlier, and counts as a failure."""
        if self.state.get(call) == _ANSWERED:
            self.state[call] = _REJECTED
            for sample in call.samples:
                self.answered[sample] -= 1

    def _stop(self) -> list[Action[C]]:
        if self.stopped:
            return []
        self.stopped = True
        return [Stop()]

    def close(self, now: float) -> list[C]:
        """The round is over (after `Stop`, or the driver's own deadline or cancellation): returns the calls cut,
        those that neither answered nor failed."""
        self.stopped = self.closed = True
        cut = [call for call, state in self.state.items() if state == _IN_FLIGHT]
        for call in cut:
            self.state[call] = _CUT
            for sample in call.samples:
                self.in_flight[sample] -= 1
        return cut

    def next_deadline(self) -> float:
        return math.inf if self.stopped else min(self._wake_at(), self.deadline)

    def _wake_at(self) -> float:
        return self.grace_deadline

    def _outcome(self, needed: list[int]) -> Outcome:
        if any(a < n for a, n in zip(self.answered, needed)):
            return Short(list(self.answered), needed)
        return Done()


class ForwardRound(_Round[C]):
    """One forward (see the module doc). `new_call` makes the call objects (the driver's own subclass of `Call`)."""

    def __init__(
        self, batch_size: int, *, k_best: int, k_min: int, now: float, forward_timeout: float,
        timeout_after_k_min: float, new_call: NewCall[C],
    ):
        if not 1 <= k_min <= k_best:
            raise ValueError(f"need 1 <= k_min <= k_best, got k_min={k_min}, k_best={k_best}")
        super().__init__(batch_size, now + forward_timeout, timeout_after_k_min)
        self.k_best, self.k_min, self.started = k_best, k_min, now
        self.new_call = new_call
        self.tried: list[set[str]] = [set() for _ in range(batch_size)]
        self.free_slots: list[list[int]] = [list(range(k_best - 1, -1, -1)) for _ in range(batch_size)]
        self.next_slot = [k_best] * batch_size  # hedged calls may need more than k_best slots
        self.calls: list[C] = []
        self.exhausted: set[int] = set()  # samples for which the search found nobody more to ask
        self.hedged: set[int] = set()  # samples already given extra experts because theirs were slow
        self.first_answer_at: float | None = None
        self.searching: Search | None = None
        self._hedge_at = math.inf

    # events

    def start(self, now: float) -> list[Action[C]]:
        need = [self.k_best] * len(self.answered)
        return self._search(need, "initial") if any(need) else self._decide(now)  # an empty batch asks nobody

    def search_results(self, choices: Sequence[Sequence[ExpertChoice]], now: float) -> list[Action[C]]:
        """The search asked for by the last `Search` returned: `choices[b]` for sample b (best first)."""
        search, self.searching = self.searching, None
        if search is None or self.stopped:
            return []
        for sample, (wanted, chosen) in enumerate(zip(search.need, choices)):
            if len(chosen) < wanted:
                self.exhausted.add(sample)
        new_calls = self._assign(choices)
        actions: list[Action[C]] = [Send(by_server(new_calls))] if new_calls else []
        return actions + self._decide(now)

    def call_answered(self, call: C, now: float) -> None:
        """The call answered (outputs for all its samples)."""
        if self._end(call, _ANSWERED) and self.first_answer_at is None:
            self.first_answer_at = now

    def tick(self, now: float) -> list[Action[C]]:
        """Something changed (calls ended) or `next_deadline()` passed."""
        if self.stopped or self.searching is not None:
            return []
        if now >= self.deadline or now >= self.grace_deadline:
            return self._stop()
        return self._decide(now)

    def outcome(self) -> Outcome:
        return self._outcome([self.k_min] * len(self.answered))

    # decisions

    def short_of(self, k: int) -> list[int]:
        """How many more experts each sample must be given to still reach k (0 for most)."""
        return [max(0, k - a - f) for a, f in zip(self.answered, self.in_flight)]

    def _decide(self, now: float) -> list[Action[C]]:
        if self.stopped or self.searching is not None:
            return []
        if now >= self.deadline:
            return self._stop()
        # a sample whose expert failed (an error: a late one stays in flight until the grace period cuts it) gets
        # the next best at once, up to k_best, so it keeps as many experts as it trained with
        retry = [0 if s in self.exhausted else n for s, n in enumerate(self.short_of(self.k_best))]
        if any(retry):
            return self._search(retry, "replace")
        if any(self.short_of(self.k_min)):
            return self._stop()  # some sample cannot reach k_min even if everything in flight answers
        if self.grace_deadline == math.inf and all(a >= self.k_min for a in self.answered):
            self.grace_deadline = now + self.grace
        if sum(self.in_flight) == 0:
            return self._stop()
        self._hedge_at = math.inf
        if self.grace_deadline == math.inf and self.first_answer_at is not None:
            # others answered a grace period ago (and twice as long ago as the first answer took, so a slow
            # network does not trigger it), yet some samples still wait: their experts hang. Ask the next best too.
            hedge_at = max(self.first_answer_at + self.grace, self.started + 2 * (self.first_answer_at - self.started))
            waiting = [b for b, a in enumerate(self.answered)
                       if a < self.k_min and b not in self.hedged and b not in self.exhausted]
            if waiting and now >= hedge_at:
                self.hedged.update(waiting)
                wanted = set(waiting)
                need = [self.k_min - a if b in wanted else 0 for b, a in enumerate(self.answered)]
                return self._search(need, "hedge", hedged=len(waiting))
            if waiting:
                self._hedge_at = hedge_at
        return []

    def _wake_at(self) -> float:
        return self.grace_deadline if self.grace_deadline < math.inf else self._hedge_at

    def _search(self, need: list[int], kind: Literal["initial", "replace", "hedge"], hedged: int = 0
                ) -> list[Action[C]]:
        self.searching = Search(need, [set(t) for t in self.tried], kind, hedged)
        return [self.searching]

    def _slot(self, sample: int) -> int:
        if self.free_slots[sample]:
            return self.free_slots[sample].pop()
        self.next_slot[sample] += 1
        return self.next_slot[sample] - 1

    def _assign(self, choices: Sequence[Sequence[ExpertChoice]]) -> list[C]:
        """Group the chosen (sample, expert) pairs into one call per expert."""
        by_uid: dict[str, C] = {}
        for sample, chosen in enumerate(choices):
            for choice in chosen:
                call = by_uid.get(choice.uid)
                if call is None:
                    call = by_uid[choice.uid] = self.new_call(choice, [], [])
                    self.state[call] = _IN_FLIGHT
                call.samples.append(sample)
                call.slots.append(self._slot(sample))
                self.tried[sample].add(choice.uid)
                self.in_flight[sample] += 1
        new_calls = list(by_uid.values())
        self.calls.extend(new_calls)
        return new_calls

    def _end(self, call: C, state: str) -> bool:
        ended = super()._end(call, state)
        if ended and state != _ANSWERED:
            for sample, slot in zip(call.samples, call.slots):
                self.free_slots[sample].append(slot)
        return ended


class BackwardRound(_Round[C]):
    """One backward (see the module doc): `calls` are the forward's answers, one per expert; `skipped` the ones
    that need no call (nothing to learn: they count as answered)."""

    def __init__(
        self, batch_size: int, calls: Sequence[C], *, skipped: Sequence[C] = (), backward_k_min: int, now: float,
        backward_timeout: float, timeout_after_k_min: float,
    ):
        super().__init__(batch_size, now + backward_timeout, timeout_after_k_min)
        alive = [0] * batch_size
        for call in [*calls, *skipped]:
            for sample in call.samples:
                alive[sample] += 1
        self.need = [min(backward_k_min, a) for a in alive]
        self.calls = list(calls)
        for call in self.calls:
            self.state[call] = _IN_FLIGHT
            for sample in call.samples:
                self.in_flight[sample] += 1
        for call in skipped:
            for sample in call.samples:
                self.answered[sample] += 1

    def start(self, now: float) -> list[Action[C]]:
        return [Send(by_server(self.calls))] + self.tick(now)

    def call_answered(self, call: C, now: float) -> None:
        """The call answered (input gradients for all its samples)."""
        self._end(call, _ANSWERED)

    def tick(self, now: float) -> list[Action[C]]:
        if self.stopped:
            return []
        if now >= self.deadline or now >= self.grace_deadline or sum(self.in_flight) == 0:
            return self._stop()
        if self.grace_deadline == math.inf and all(a >= n for a, n in zip(self.answered, self.need)):
            self.grace_deadline = now + self.grace
        return []

    def outcome(self) -> Outcome:
        return self._outcome(list(self.need))


__all__ = [
    "Action", "BackwardRound", "Call", "Done", "ForwardRound", "Outcome", "Search", "Send", "Short", "Stop",
    "by_server",
]
