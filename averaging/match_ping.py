"""`avg.mm.ping`, both ways: a collector asks the members of its chunk where they stand, and every peer answers.

Why a module of its own: the probe is how views that differ converge (dead and frozen peers are dropped, stale
declarations leave the plan, rival collectors merge or hand joiners over, followers of other collectors are
waited for a while), and its request and answer fields are one small protocol; the calling side and the
answering side are kept together so they change together. What an answer means for the assembly is decided in
`averaging.assembly` (`read_probe_answer`, `Assembly.probed_by`); this module makes the calls and applies the
verdicts to the round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from averaging.assembly import Assembly, Declaration, read_probe_answer
from averaging.match_round import MatchCalls, MatchRound
from peer.p2p.identity import PeerID
from peer.p2p.rpc import CallContext, CallTimeout, RemoteError, RPCError

logger = logging.getLogger("averaging.matchmaking")  # all of matchmaking logs under the driver's name

PING_METHOD = "avg.mm.ping"


@dataclass(eq=False)
class Prober(MatchCalls):
    """Probes chunk members for a collector, and answers other collectors' probes.

    `banned` is the matchmaker's own set (shared, not copied): a banned prober is told "not matching", so it
    cannot talk me into merging into it. `stats` is the matchmaker's counters (dead peers are counted here)."""

    async def probe(self, state: MatchRound, declaration: Declaration, assembly: Assembly) -> None:
        """Ask one chunk member I wait for where it stands, and apply the answer to my assembly."""
        if declaration.address is None:  # a client-mode peer cannot be called: it answers nobody's probes
            return
        t0 = trio.current_time()
        try:
            answer = await self.rpc.call(declaration.address, PING_METHOD,
                                         {"key": state.key, "joined": len(assembly.joined),
                                          "patient": state.patient},
                                         timeout=self.pacing.probe_timeout, peer_id=declaration.peer_id)
            self.pacing.rtt.update(trio.current_time() - t0)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("matchmaking %s: probed %s: %s", self.peer_id.short(), declaration.peer_id.short(),
                             {k: (bytes(v).hex()[:12] if isinstance(v, bytes) else v) for k, v in answer.items()}
                             if isinstance(answer, dict) else answer)
            verdict = read_probe_answer(answer, self.peer_id)
            if verdict.kind == "handover":  # a rival collector passes some of its joiners to me: wait for them
                assembly.expect(verdict.members)
                state.merging.update(verdict.members)
                assembly.drop(declaration.peer_id)
            elif verdict.kind == "merging":  # it steps down into my group: wait for it and for its joiners
                assembly.expect(verdict.members)
                state.merging.update(verdict.members)
            elif verdict.kind in ("stale", "busy"):
                if verdict.kind == "stale":
                    # a declaration left over from its previous round (it is averaging, its withdrawal not read
                    # yet): out of the plan until it declares again, and still expected (it will come back)
                    state.stale[declaration.peer_id] = declaration.declared_at
                    if verdict.between_rounds:
                        state.returning.add(declaration.peer_id)
                    if state.view.get(declaration.peer_id) is declaration:
                        del state.view[declaration.peer_id]
                        state.last_change = trio.current_time()
                assembly.drop(declaration.peer_id)
            elif verdict.kind == "follows_other":
                # It follows another collector, which may be full and turn it away (views differ for a moment):
                # then it comes here, and sealing without it would strand it (a 4 + 3 + 1 round). Keep waiting
                # for it (it is probed again every quiet period) until it has followed others for `follow_wait`.
                now = trio.current_time()
                since = state.following_since.setdefault(declaration.peer_id, now)
                if now - since >= self.pacing.follow_wait:
                    assembly.drop(declaration.peer_id)
                    state.last_drop = now
                    state.following_others.add(declaration.peer_id)
        except RemoteError:
            assembly.drop(declaration.peer_id)
        except CallTimeout as error:
            count = state.probe_timeouts[declaration.peer_id] = state.probe_timeouts.get(declaration.peer_id, 0) + 1
            logger.debug("matchmaking: %s timed out a probe (%d): %s", declaration.peer_id.short(), count, error)
            if count >= 2:
                assembly.drop(declaration.peer_id)
        except RPCError as error:
            logger.debug("matchmaking: %s failed a probe: %s", declaration.peer_id.short(), error)
            state.excluded.add(declaration.peer_id)  # dead: plan without it from now on
            if declaration.peer_id not in state.failed:
                state.failed.append(declaration.peer_id)
                self.stats["dead_peers"] += 1
            assembly.drop(declaration.peer_id)
        state.poke()

    async def recheck_followers(self, state: MatchRound, assembly: Assembly) -> bool:
        """Before sealing a group with room left: ask the peers that followed other collectors once more. True
        (keep waiting) when one of them is free again, e.g. turned away by a full collector."""
        followers = sorted(p for p in state.following_others if p not in assembly.joined)
        if not followers:
            return False
        freed = []

        async def ask(peer_id: PeerID) -> None:
            declaration = state.view.get(peer_id)
            if declaration is None or declaration.address is None:
                return
            try:
                answer = await self.rpc.call(declaration.address, PING_METHOD, {"key": state.key, "joined": 0},
                                             timeout=self.pacing.probe_timeout, peer_id=peer_id)
            except RPCError:
                return
            following = answer.get("following") if isinstance(answer, dict) else None
            if isinstance(answer, dict) and answer.get("matching") and not answer.get("collecting") \
                    and (following is None or bytes(following) == bytes(self.peer_id)):
                freed.append(peer_id)

        state.following_others.clear()
        async with trio.open_nursery() as nursery:
            for peer_id in followers:
                nursery.start_soon(ask, peer_id)
        for peer_id in freed:
            assembly.dropped.discard(peer_id)
        return bool(freed)

    def answer(self, state: MatchRound | None, ctx: CallContext, args: Any) -> dict[str, Any]:
        """The answer to a probe from `ctx.peer_id`, given my current round (None between rounds). A lower
        collector that counts me in may make me merge into it or hand it joiners (`Assembly.probed_by`)."""
        if ctx.peer_id in self.banned:  # not a collector to merge into, nor one to wait for
            return {"matching": False, "following": None, "between_rounds": False, "collecting": False}
        key = args.get("key") if isinstance(args, dict) else None
        matching = state is not None and key == state.key
        their_size = args.get("joined", 1) if isinstance(args, dict) else 1
        patient = bool(args.get("patient", False)) if isinstance(args, dict) else False
        assembly = state.assembly if state is not None and matching else None
        verdict = assembly.probed_by(ctx.peer_id, their_size, reachable=ctx.address is not None,
                                     prober_patient=patient) \
            if assembly is not None else None
        if verdict is not None and state is not None and assembly is not None:
            prober = state.view.get(ctx.peer_id)
            if prober is None:  # not in my view yet: the authenticated caller is enough to join it
                me = state.me
                prober = Declaration(ctx.peer_id, ctx.address, 1.0, False, me.schema, me.round, me.deadline,
                                     me.declared_at)
            if verdict == "merge":  # I step down into it (my loop notices), taking my joiners along
                state.invited_by = prober
                state.poke()
                return {"matching": True, "following": bytes(ctx.peer_id), "collecting": False,
                        "merging": [bytes(p) for p in assembly.joined]}
            moved = assembly.hand_over(prober, self.target - their_size)
            state.poke()
            logger.debug("matchmaking %s: handing %d joiner(s) over to %s", self.peer_id.short(), len(moved),
                         ctx.peer_id.short())
            return {"matching": True, "following": None, "collecting": True, "handover": [bytes(p) for p in moved]}
        following = state.following.peer_id if state is not None and matching and state.following is not None \
            else None
        return {"matching": matching, "following": bytes(following) if following is not None else None,
                "between_rounds": state is None,  # averaging or training: it will declare again
                # a collector nobody joined yet steps down as soon as it sees a lower peer: not a rival yet
                "collecting": matching and assembly is not None and not assembly.closed and len(assembly.joined) > 1}
