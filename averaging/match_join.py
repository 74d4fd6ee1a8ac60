"""`avg.mm.join`, both ways: a peer joins its collector with one long poll, and a collector answers joins.

Why a module of its own: the join is the one call that makes a group (the collector answers every held join with
the same `GroupInfo` at sealing), so both of its sides, the request's fields and the authenticated identity that
overrides the claimed one, are kept together and change together. What the collector answers is decided in
`averaging.assembly` (`Assembly.offer`, `Assembly.answer`); this module makes the call, holds the long polls
until the answer is final, and redirects a joiner when this peer follows another collector.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from averaging.assembly import Assembly, Decision, Declaration
from averaging.group import GroupInfo
from averaging.match_round import MatchCalls, MatchRound
from peer.p2p.rpc import CallContext, RemoteError, RPCError

logger = logging.getLogger("averaging.matchmaking")  # all of matchmaking logs under the driver's name

JOIN_METHOD = "avg.mm.join"


@dataclass(eq=False, kw_only=True)
class Joins(MatchCalls):
    """Joins collectors for a follower, and answers joins for a collector.

    `my_collector` is the matchmaker's plan for a round (whom I would join, possibly myself): a join that reaches
    a peer not collecting yet is redirected to a lower collector, or makes it collect. `banned` is the matchmaker's
    own set (shared, not copied); `stats` its counters. `last_group` is (key, group) of my last round: a late
    joiner under that key is told the group's members, so it skips them all at once."""

    min_size: int
    my_collector: Callable[[MatchRound], Declaration | None]
    last_group: tuple[str, GroupInfo] | None = field(init=False, default=None)

    async def join(self, state: MatchRound, collector: Declaration, deadline: float) -> Decision | None:
        """One long-poll join; None when the collector is unreachable (it is then excluded and reported)."""
        if collector.address is None or collector.peer_id in self.banned:  # client mode: nobody can join it
            state.excluded.add(collector.peer_id)
            return None
        state.following = collector  # (set before the return above, it stayed set for the rest of the round)
        args = {"key": state.key, "declaration": state.me.to_wire()}
        timeout = max(0.0, deadline - trio.current_time()) + self.pacing.grace
        t0 = trio.current_time()
        try:
            answer = await self.rpc.call(collector.address, JOIN_METHOD, args, timeout=timeout,
                                         peer_id=collector.peer_id)
            decision = Decision.from_wire(answer)
            if decision.kind != "group":
                self.pacing.rtt.update(trio.current_time() - t0)
            return decision
        except RemoteError as error:  # it runs no averaging, or refused us: not dead, just not a collector
            logger.debug("matchmaking: %s refused the join: %s", collector.peer_id.short(), error)
        except RPCError as error:  # dead, frozen or unreachable
            logger.debug("matchmaking: collector %s failed: %s", collector.peer_id.short(), error)
            state.failed.append(collector.peer_id)
            self.stats["dead_peers"] += 1
        except (ValueError, KeyError, TypeError) as error:
            logger.debug("matchmaking: bad answer from %s: %s", collector.peer_id.short(), error)
        finally:
            state.following = None
        state.excluded.add(collector.peer_id)
        return None

    async def answer(self, state: MatchRound | None, ctx: CallContext, args: Any) -> dict[str, Any]:
        """The answer to a join from `ctx.peer_id`, given my current round (None between rounds): at once when
        it is a rejection or a redirect, else held until my assembly's answer is final."""
        claimed = Declaration.from_wire(ctx.peer_id, args.get("declaration")) if isinstance(args, dict) else None
        if claimed is None:
            return Decision("reject", reason="malformed join").to_wire()
        if ctx.peer_id in self.banned:
            return Decision("reject", reason="banned").to_wire()
        key = args.get("key")
        if state is None or key != state.key:
            if self.last_group is not None and self.last_group[0] == key:
                # my group for this key is sealed and gone: name its members so the joiner skips them all
                return Decision("reject", reason="sealed", busy=tuple(self.last_group[1].peer_ids)).to_wire()
            return Decision("reject", reason="not matching").to_wire()
        # who is calling and where it listens come from the authenticated connection, not from the claim
        client_mode = claimed.client_mode or ctx.address is None
        joiner = Declaration(ctx.peer_id, None if client_mode else ctx.address, claimed.bandwidth, client_mode,
                             claimed.schema, claimed.round, claimed.deadline, claimed.declared_at)
        self.stats["joins_served"] += 1
        if state.assembly is None:
            following = state.following or self.my_collector(state)
            if following is not None and following.peer_id < self.peer_id:
                return Decision("redirect", redirect=following).to_wire()
            # nobody lower in my view: the joiner saw me as its collector, so collect (my loop notices)
            state.assembly = Assembly(state.me, key=state.key, target_group_size=self.target,
                                      min_group_size=self.min_size)
        assembly = state.assembly
        decision = assembly.offer(joiner, key)
        if decision is not None:
            return decision.to_wire()
        state.view.setdefault(joiner.peer_id, joiner)
        state.join_arrived = True
        state.poke()
        return (await state.answer_of(assembly, joiner.peer_id)).to_wire()
