"""Matchmaking's DHT traffic: my declaration under the round's key, and the view read back from it.

Why a module of its own: this is the only part of matchmaking that talks to the DHT, and the part with the most
hard-won details (frugal reads, a view merged rather than replaced, shards for crowded keys, withdrawals that
must not delay shutdown). The driver (`averaging.matchmaking`) only declares, keeps the view fresh and withdraws;
what a declaration says and how a view is planned are `averaging.assembly`'s.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Literal

import trio

from averaging.assembly import WITHDRAWN, Declaration
from averaging.match_round import MatchRound
from averaging.match_waits import Pacing
from dht.client import DHTClient
from peer.p2p.identity import PeerID

logger = logging.getLogger("averaging.matchmaking")  # all of matchmaking logs under the driver's name

# One DHT record holds about 42 signed declarations (one datagram, about 190 bytes each): a key's declarations
# overflow into shards `key#1`, `key#2`... A declarer that finds a crowded shard without its own declaration (the
# holders trimmed it, dht.records.fit) moves to the next shard; a reader reads the next shard whenever the one it
# just read is crowded. Small swarms never read more than the one key.
SHARD_CROWDED = 32
MAX_SHARDS = 16


def shard_key(key: str, shard: int) -> str:
    """The DHT key of a matchmaking key's `shard` (0 is the key itself)."""
    return key if shard == 0 else f"{key}#{shard}"


class DeclarationBoard:
    """Declares, reads and withdraws under a matchmaking key for one peer.

    `banned` is the matchmaker's own set (shared, not copied): a banned peer's declarations are skipped.
    `on_foreign` is told about each declaration of another schema (it is kept out of the view). `nursery`
    (optional) runs the declarations in further shards and the withdrawals; without one, a withdrawal is awaited
    (bounded) and a crowded shard is not left."""

    def __init__(self, dht: DHTClient, peer_id: PeerID, schema: bytes, *, pacing: Pacing, banned: set[PeerID],
                 on_foreign: Callable[[Declaration], None], nursery: trio.Nursery | None):
        self.dht = dht
        self.peer_id = peer_id
        self.schema = schema
        self.pacing = pacing
        self.banned = banned
        self.on_foreign = on_foreign
        self.nursery = nursery

    async def refresh_view(self, state: MatchRound) -> Literal["arrived", "left"] | None:
        """Read the key once and merge it into the view. Returns "arrived" when a compatible peer appeared (or came
        back), "left" when peers only left it, None when the set of peers did not change: an arrival means the
        view may still be filling, while a departure is a peer taken elsewhere (the driver judges whether it
        touches its own chunk).

        Merge, not replace: one read may reach only some replicas and miss a declaration another read saw, and a
        view that flickers never becomes quiet. A peer leaves the view only when its withdrawal (or a newer
        entry) is read, or when its declaration expires."""
        entries: list[tuple[Any, Any]] = []
        dht_latency = self.pacing.dht_latency
        for shard in range(MAX_SHARDS):
            t0 = trio.current_time()
            try:
                # A frugal read of the DHT's usual three replicas (my own copy counts as one, dht/node.py `get`):
                # no query beyond those it still lacks, where a default get keeps alpha in flight and a fourth
                # started before the third answered. These reads are most of a round's DHT traffic. Two replicas
                # (quorum=2) were cheaper still, but with views built from them 7 of 12 runs (trio scheduler
                # seeded) of test_back_to_back_rounds_with_jitter_form_full_groups had a round with a group short.
                record = await self.dht.get(shard_key(state.key, shard), latest=False, frugal=True)
            except Exception as error:  # a DHT hiccup is one stale view, not a failed round
                logger.debug("matchmaking: reading %s failed: %s", shard_key(state.key, shard), error)
                return None
            # one read stalled by a dead replica must not inflate every later quiet period
            dht_latency.update(min(trio.current_time() - t0, 2 * dht_latency.value + 0.01))
            subkeys = getattr(record, "subkeys", None) or {}
            entries.extend(subkeys.items())
            crowded = self.note_shard(state, shard, subkeys)
            if not crowded and shard >= state.shard:
                break
        now = self.dht.now()
        view = {p: d for p, d in state.view.items() if d.deadline + 1.0 >= now}
        readmitted = False
        for subkey, entry in entries:
            if not isinstance(subkey, (bytes, bytearray)) or len(subkey) != 20:
                continue
            declaration = Declaration.from_wire(bytes(subkey), entry.value)
            if declaration is not None and declaration.peer_id in self.banned:
                view.pop(declaration.peer_id, None)
                continue
            if declaration is None or entry.expiration_time < now or declaration.deadline < state.me.declared_at:
                view.pop(PeerID(bytes(subkey)), None)  # withdrawn, or only an old round's entry is left
            elif declaration.declared_at <= state.stale.get(declaration.peer_id, -math.inf):
                view.pop(declaration.peer_id, None)  # its owner said it is not matching: see Prober.probe
            elif declaration.schema != self.schema:
                self.on_foreign(declaration)
            else:
                view[declaration.peer_id] = declaration
                if declaration.declared_at > state.busy_as_of.get(declaration.peer_id, math.inf):
                    del state.busy_as_of[declaration.peer_id]  # back from its group's averaging: matching again
                    state.excluded.discard(declaration.peer_id)
                    readmitted = True
                if state.stale.pop(declaration.peer_id, None) is not None and state.assembly is not None:
                    # back from averaging with a new declaration: it is matching now, worth waiting for again
                    state.assembly.readmit(declaration.peer_id)
        view.pop(self.peer_id, None)
        state.seen.update(view)
        if state.assembly is not None:  # peers that joined me count even if their declaration isn't visible
            for peer_id, declaration in state.assembly.joined.items():
                view.setdefault(peer_id, declaration)
        arrived = bool(set(view) - set(state.view)) or readmitted
        left = bool(set(state.view) - set(view))
        state.view = view
        return "arrived" if arrived else "left" if left else None

    async def poll(self, state: MatchRound) -> None:
        """Keep the view fresh in the background: a slow read (a dead replica answering nothing) delays only the
        view, never a join or a seal."""
        while True:
            await trio.sleep(max(self.pacing.min_quiet, self.pacing.quiet_period / 2))
            # Also while my join is held by its collector: skipping those reads (most of matchmaking's DHT
            # traffic) left followers planning their next rounds on stale views: in 9 of 16 runs of
            # test_back_to_back_rounds_with_jitter_form_full_groups some peer's round then ended without a group.
            change = await self.refresh_view(state)
            if change == "arrived":
                state.last_change = trio.current_time()
            if change is not None:
                state.poke()

    async def declare(self, state: MatchRound, shard: int) -> None:
        """Store my declaration in `shard` (it runs beside everything else: a dead replica must not delay the
        round); under a crowded key, check at once that the holders kept it."""
        key = shard_key(state.key, shard)
        store_latency = self.pacing.store_latency
        t0 = trio.current_time()
        try:
            if not await self.dht.store(key, state.me.to_wire(), state.expiration, subkey=bytes(self.peer_id),
                                        signed=True):
                logger.debug("matchmaking: no replica acknowledged my declaration under %s", key)
            store_latency.update(min(trio.current_time() - t0, 2 * store_latency.value + 0.01))
        except Exception as error:  # joins still work: peers that see me find me; others I join myself
            logger.debug("matchmaking: declaring under %s failed: %s", key, error)
        finally:
            state.declared_in.add(shard)
            if state.declaring == shard:
                state.declaring = None
        if state.crowded and state.declaring is None and shard == state.shard:
            # under a crowded key the holders may have dropped it: check now, not at the next poll, so that the
            # peers planning with the others see me the sooner (uncrowded keys skip this read)
            try:
                record = await self.dht.get(key, latest=False, frugal=True)
            except Exception as error:
                logger.debug("matchmaking: reading %s failed: %s", key, error)
                return
            self.note_shard(state, shard, getattr(record, "subkeys", None) or {})

    def note_shard(self, state: MatchRound, shard: int, subkeys: dict[Any, Any]) -> bool:
        """What a read of `shard` says: whether it is crowded; and when it is my shard, my declaration has landed
        and the holders kept others' instead, declare in the next shard. The one place that decides to move."""
        crowded = len(subkeys) >= SHARD_CROWDED
        state.crowded = state.crowded or crowded
        if crowded and shard == state.shard and shard + 1 < MAX_SHARDS and state.declaring is None \
                and shard in state.declared_in and bytes(self.peer_id) not in subkeys:
            self._overflow(state, shard + 1)
        return crowded

    def _overflow(self, state: MatchRound, shard: int) -> None:
        """Declare again in `shard`: the previous one is full and its holders kept others' declarations."""
        logger.debug("matchmaking %s: %s is crowded, declaring in shard %d", self.peer_id.short(), state.key, shard)
        state.shard = state.declaring = shard
        if self.nursery is not None:
            try:
                self.nursery.start_soon(self.declare, state, shard)
                return
            except RuntimeError:  # the owner is shutting down
                pass
        state.declaring = None

    async def withdraw(self, key: str, expiration: float) -> None:
        """Overwrite my declaration so latecomers don't plan with me. 1 ms later expiration wins the merge
        against this declaration but loses against my next one."""

        async def withdraw() -> None:
            with trio.move_on_after(2.0):
                try:
                    await self.dht.store(key, WITHDRAWN, expiration + 1e-3, subkey=bytes(self.peer_id), signed=True)
                except Exception as error:  # costs latecomers one rejected join at most
                    logger.debug("matchmaking: withdrawing from %s failed: %s", key, error)

        if self.nursery is not None:
            try:
                self.nursery.start_soon(withdraw)
            except RuntimeError:  # the owner is shutting down: nobody will plan with a dead peer for long
                pass
        else:
            with trio.CancelScope(shield=True):
                await withdraw()
