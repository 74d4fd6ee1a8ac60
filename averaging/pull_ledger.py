"""Who still needs the mean of the part a member reduces: the serving phase of `averaging.allreduce_core`.

Why a module of its own: once a reducer's mean is written, the round stays open here only to serve it, and when
to stop is a question of its own: every committed member must get its copy, but a member that left, gave up on
us or stopped pulling must not hold the round forever. This ledger keeps what that takes (what each member
pulled and when, whose watch call is still open, whom we stopped serving) and answers when serving is over.
`RoundCore` decides whom it serves at all (the committed members it does not count as failed) and how long a
pull may take (its transfer budget). Sans-I/O like the core: times are arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class PullLedger:
    """Serving one part's mean. `pulled`: member -> the chunks it pulled; `last_pull`: member -> when it last
    pulled; `watching`: members whose watch call is open; `gone`: members no longer served (left, abandoned
    their commit, or late to pull: not failures of the round); `released_at`: when the mean was written (a
    member that never pulled is late counting from then)."""

    def __init__(self) -> None:
        self.pulled: dict[int, set[int]] = {}
        self.last_pull: dict[int, float] = {}
        self.watching: set[int] = set()
        self.gone: set[int] = set()
        self.released_at: float | None = None

    def served(self, member: int, chunk: int, now: float) -> None:
        """`member` pulled `chunk` of the mean."""
        self.pulled.setdefault(member, set()).add(chunk)
        self.last_pull[member] = now

    def watch_ended(self, member: int) -> None:
        """`member`'s watch call ended: it needs nothing more from us."""
        self.watching.discard(member)
        self.gone.add(member)

    def next_due(self, served: Iterable[int], n_chunks: int, timeout: Callable[[int], float],
                 now: float) -> float | None:
        """None once every member of `served` has its copy or is gone, else when the next one falls due; the late
        ones are gone from now on. A member is done when it pulled all `n_chunks` chunks AND ended its watch call:
        a pull handler returns before its reply has crossed the network, so leaving at that point could cut the
        last reply off. `timeout(n)`: how long a pull may take while `n` members are pulling."""
        released_at = self.released_at if self.released_at is not None else now
        members = list(served)
        while True:
            waiting = [m for m in members if m not in self.gone
                       and (m in self.watching or len(self.pulled.get(m, ())) < n_chunks)]
            if not waiting:
                return None
            limit = timeout(len(waiting))
            deadlines = {m: self.last_pull.get(m, released_at) + limit for m in waiting}
            late = [m for m, due in deadlines.items() if due <= now]
            if not late:
                return min(deadlines.values())
            self.gone.update(late)
