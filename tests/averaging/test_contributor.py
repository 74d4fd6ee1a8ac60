"""`Contributor.may_offer_behind`: where a contribution computed on an older outer state may still go."""

from types import SimpleNamespace
from typing import Any

from averaging.diloco_contribute import Contribution, Contributor
from averaging.quorum import QuorumPolicy


def contributor(step: int, fragments: int = 1) -> Contributor:
    outer: Any = SimpleNamespace(step=step, fragments=[[i] for i in range(fragments)])
    return Contributor(outer=outer, view=None, sync=None, member=None, tracker=None, rounds=None,  # type: ignore[arg-type]
                       ledger=None, policy=QuorumPolicy(max_staleness=2), averaging_timeout=1.0,  # type: ignore[arg-type]
                       load_state_timeout=1.0)


def test_a_late_contribution_goes_to_the_next_round_of_the_run_but_never_past_its_last():
    late = Contribution(base=11, samples=64, started=0.0, indices=[0])
    c = contributor(11)
    assert c.may_offer_behind(late, 12) and c.may_offer_behind(late, 13)  # the run's end not known yet
    assert not c.may_offer_behind(late, 14)  # staler than max_staleness
    c.final_step = 12  # round 11 makes the run's last outer step: round 12 is held by nobody
    assert not c.may_offer_behind(late, 12)
    c.final_step = 13
    assert c.may_offer_behind(late, 12) and not c.may_offer_behind(late, 13)


def test_only_whole_model_rounds_and_only_from_the_state_it_was_computed_on():
    late = Contribution(base=11, samples=64, started=0.0, indices=[0])
    assert not contributor(11, fragments=2).may_offer_behind(late, 12)  # a fragment's round must match it
    assert not contributor(12).may_offer_behind(late, 13)  # my state moved since: the pseudo-gradient is void
    assert not contributor(11).may_offer_behind(late, 11)  # not behind
