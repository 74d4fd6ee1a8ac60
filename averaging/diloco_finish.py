"""`final_agreement`: the end of a DiLoCo run, where every live trainer settles on one outer state.

Why a step of its own: trainers that started apart (a loop of N local steps each, one of them started later)
end apart; without it the first to finish would leave with another model than the last. Each finishing trainer
publishes that it finished (`fin` in its progress record), takes the state the finished trainers hold when it is
not its own, and keeps serving its own until every live trainer of the run finished with the same outer step and
hash. `DiLoCoOptimizer.finish` bounds it and says what it means for the caller.
"""

from __future__ import annotations

import dataclasses

import trio

from averaging.diloco_background import BackgroundContribution
from averaging.diloco_ledger import DiLoCoLedger
from averaging.diloco_sync import StateSync
from averaging.diloco_view import SwarmView
from averaging.outer_state import OuterState
from averaging.progress import ProgressTracker

__all__ = ["final_agreement"]


async def final_agreement(timeout: float, *, outer: OuterState, tracker: ProgressTracker, view: SwarmView,
                          sync: StateSync, ledger: DiLoCoLedger, background: BackgroundContribution) -> str | None:
    """None when every live trainer of the run finished with my outer step and hash, else why not (by
    `timeout`). Polls the run's progress records (the others publish `fin` when they get here)."""
    why = "the run's progress records could not be read"
    with trio.move_on_after(timeout) as scope:
        # overlap: nothing else may write the outer state meanwhile (a third of the time at most)
        await background.settle(timeout / 3)
        tracker.info["fin"] = True
        published = await tracker.publish()
        while True:
            if not published:  # the others wait for this record: retried at once, not at the next refresh
                published = await tracker.publish()
            progress = await tracker.fetch()
            view.last_progress = progress
            others = view.other_trainers(progress.peers)
            finished = [p for p in others if p.info.get("fin")]
            # only finished trainers: their state is final, so the download is the last one
            if finished and await sync.resync(dataclasses.replace(progress, peers=tuple(finished)),
                                              timeout=max(0.0, scope.deadline - trio.current_time())):
                ledger.counts["final_resyncs"] += 1
                outer.reset_local()
                published = await tracker.publish()
                continue
            training = [p for p in others if not p.info.get("fin")]
            apart = [p for p in finished if p.epoch != outer.step or p.info.get("hash") != outer.hash]
            if not training and not apart:
                return None  # everyone agrees: nobody needs my state any more
            why = "; ".join(filter(None, [
                ", ".join(f"{p.peer_id.short()} still training at outer step {p.epoch}" for p in training[:4]),
                ", ".join(f"{p.peer_id.short()} finished at outer step {p.epoch} with another state"
                          for p in apart[:4])]))
            await trio.sleep(tracker.min_refresh)
    return why
