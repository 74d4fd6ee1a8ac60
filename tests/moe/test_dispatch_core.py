"""The MoE client's forward and backward rounds as sans-I/O cores (moe/dispatch.py), without sockets or trio.

Scripted tests feed the cores events with an explicit `now` and check the actions they give back (searches,
sends, the stop) and their deadlines: k_min, the grace period after it, replacement of failed experts up to
k_best, hedging of hung samples, the deadline, what counts as an answer. A hypothesis test then plays any order
of answers, failures and timeouts and checks the invariants.
"""

from __future__ import annotations

from hypothesis import given, note
from hypothesis import strategies as st

from moe.beam_search import ExpertChoice
from moe.declare import ExpertLocation
from moe.dispatch import BackwardRound, Call, Done, ForwardRound, Search, Send, Short, Stop, by_server


def choice(uid: str, server: int = 0) -> ExpertChoice:
    return ExpertChoice(uid, (0,), 1.0, ExpertLocation("127.0.0.1", 7000 + server, f"{server:02x}" * 20))


def forward(batch: int = 2, *, k_best: int = 2, k_min: int = 1, timeout: float = 30.0, grace: float = 2.0
            ) -> ForwardRound[Call]:
    return ForwardRound(batch, k_best=k_best, k_min=k_min, now=0.0, forward_timeout=timeout,
                        timeout_after_k_min=grace, new_call=Call)


def sent(actions: list) -> list[Call]:
    return [call for action in actions if isinstance(action, Send) for group in action.groups for call in group]


def search_of(actions: list) -> Search:
    (search,) = [action for action in actions if isinstance(action, Search)]
    return search


def by_uid(calls: list[Call]) -> dict[str, Call]:
    return {call.uid: call for call in calls}


def test_the_core_imports_neither_trio_nor_torch_io():
    import moe.dispatch

    source = open(moe.dispatch.__file__).read()
    assert "import trio" not in source and "import torch" not in source
    assert "trio" not in vars(moe.dispatch)


def test_first_search_asks_k_best_per_sample_and_groups_calls_by_server():
    core = forward(2, k_best=2)
    search = search_of(core.start(0.0))
    assert search.need == [2, 2] and search.kind == "initial" and search.exclude == [set(), set()]
    actions = core.search_results([[choice("a", 0), choice("b", 1)], [choice("a", 0), choice("c", 0)]], 0.1)
    (send,) = [a for a in actions if isinstance(a, Send)]
    assert sorted(sorted(c.uid for c in group) for group in send.groups) == [["a", "c"], ["b"]]
    calls = by_uid(sent(actions))
    assert calls["a"].samples == [0, 1] and calls["a"].slots == [0, 0] and calls["b"].slots == [1]
    assert core.in_flight == [2, 2] and core.next_deadline() == 30.0  # nobody answered: only the deadline


def test_k_min_then_grace_period_then_stop_cuts_the_slow_calls():
    core = forward(1, k_best=2, k_min=1, grace=2.0)
    core.start(0.0)
    calls = by_uid(sent(core.search_results([[choice("a"), choice("b", 1)]], 0.0)))
    core.call_answered(calls["a"], 1.0)
    assert core.tick(1.0) == [] and core.next_deadline() == 3.0  # k_min reached at 1.0: grace until 3.0
    assert core.tick(2.5) == []
    assert core.tick(3.0) == [Stop()]
    assert core.close(3.0) == [calls["b"]] and core.state_of(calls["b"]) == "cut"
    assert core.answered == [1] and core.outcome() == Done()


def test_all_answered_stops_at_once():
    core = forward(1, k_best=2)
    core.start(0.0)
    calls = sent(core.search_results([[choice("a"), choice("b", 1)]], 0.0))
    for call in calls:
        core.call_answered(call, 0.5)
    assert core.tick(0.5) == [Stop()] and core.close(0.5) == [] and core.outcome() == Done()


def test_a_failed_expert_is_replaced_at_once_up_to_k_best_skipping_those_tried():
    core = forward(2, k_best=2, k_min=1)
    core.start(0.0)
    calls = by_uid(sent(core.search_results([[choice("a"), choice("b", 1)], [choice("b", 1), choice("c")]], 0.0)))
    core.call_answered(calls["a"], 0.2)
    core.call_failed(calls["b"], 0.2)
    search = search_of(core.tick(0.2))
    assert search.kind == "replace" and search.need == [1, 1] and search.exclude == [{"a", "b"}, {"b", "c"}]
    replacements = by_uid(sent(core.search_results([[choice("d")], [choice("d")]], 0.3)))
    # the failed call's slots are reused: sample 0 keeps slots 0..k_best-1
    assert replacements["d"].samples == [0, 1] and replacements["d"].slots == [1, 0]
    assert core.in_flight == [1, 2]


def test_a_sample_nobody_more_can_serve_is_not_searched_again_and_the_round_fails_short():
    core = forward(1, k_best=2, k_min=2)
    core.start(0.0)
    calls = by_uid(sent(core.search_results([[choice("a"), choice("b", 1)]], 0.0)))
    core.call_failed(calls["b"], 0.1)
    assert search_of(core.tick(0.1)).need == [1]
    assert core.search_results([[]], 0.2) == [Stop()]  # exhausted, and short of k_min even if "a" answers
    assert core.close(0.2) == [calls["a"]]
    outcome = core.outcome()
    assert isinstance(outcome, Short) and outcome.answered == [0] and outcome.samples_short == 1


def test_a_hung_sample_is_hedged_once_after_the_others_answered_a_grace_period_ago():
    core = forward(2, k_best=1, k_min=1, grace=2.0)
    core.start(0.0)
    calls = by_uid(sent(core.search_results([[choice("a")], [choice("hung", 1)]], 0.0)))
    core.call_answered(calls["a"], 0.5)
    assert core.tick(0.5) == []
    # hedge at max(first answer + grace, 2 x the first answer's time) = max(2.5, 1.0)
    assert core.next_deadline() == 2.5 and core.tick(2.0) == []
    search = search_of(core.tick(2.5))
    assert search.kind == "hedge" and search.need == [0, 1] and search.hedged == 1
    hedge = by_uid(sent(core.search_results([[], [choice("b")]], 2.6)))
    assert hedge["b"].slots == [1]  # past k_best: a slot of its own
    core.call_answered(hedge["b"], 3.0)
    assert core.tick(3.0) == [] and core.next_deadline() == 5.0  # k_min everywhere at 3.0: grace until 5.0
    assert core.tick(5.0) == [Stop()] and core.close(5.0) == [calls["hung"]]
    assert core.outcome() == Done() and core.hedged == {1}


def test_hedging_waits_twice_as_long_as_the_first_answer_took():
    core = forward(2, k_best=1, k_min=1, grace=1.0)
    core.start(0.0)
    calls = by_uid(sent(core.search_results([[choice("a")], [choice("b", 1)]], 0.0)))
    core.call_answered(calls["a"], 3.0)  # a slow network: the first answer took 3 s
    assert core.tick(3.0) == [] and core.next_deadline() == 6.0


def test_the_deadline_stops_the_round_and_nothing_after_close_counts():
    core = forward(1, k_best=1, k_min=1, timeout=10.0)
    core.start(0.0)
    (call,) = sent(core.search_results([[choice("a")]], 0.0))
    assert core.next_deadline() == 10.0 and core.tick(10.0) == [Stop()]
    core.call_answered(call, 10.0)  # between the stop and the close: still counts
    assert core.close(10.0) == [] and core.answered == [1]

    core = forward(1, k_best=1, k_min=1, timeout=10.0)
    core.start(0.0)
    (call,) = sent(core.search_results([[choice("a")]], 0.0))
    assert core.close(10.0) == [call]  # the driver's own deadline fired
    core.call_answered(call, 10.5)
    assert core.answered == [0] and isinstance(core.outcome(), Short)


def test_a_rejected_answer_counts_as_a_failure():
    core = forward(1, k_best=1, k_min=1)
    core.start(0.0)
    (call,) = sent(core.search_results([[choice("a")]], 0.0))
    core.call_answered(call, 0.1)
    core.tick(0.1)
    core.close(0.1)
    core.reject(call)
    assert core.answered == [0] and core.state_of(call) == "rejected" and isinstance(core.outcome(), Short)


def test_an_empty_batch_stops_at_once():
    core = forward(0)
    assert core.start(0.0) == [Stop()] and core.close(0.0) == [] and core.outcome() == Done()


def test_backward_waits_for_k_min_then_a_grace_period():
    calls = [Call(choice("a"), [0, 1], [0, 0]), Call(choice("b", 1), [0], [1]), Call(choice("c", 1), [1], [1])]
    core: BackwardRound[Call] = BackwardRound(2, calls, backward_k_min=1, now=0.0, backward_timeout=30.0,
                                              timeout_after_k_min=2.0)
    actions = core.start(0.0)
    assert sorted(c.uid for c in sent(actions)) == ["a", "b", "c"] and len(by_server(calls)) == 2
    assert core.next_deadline() == 30.0
    core.call_failed(calls[0], 1.0)
    assert core.tick(1.0) == []
    core.call_answered(calls[1], 1.5)
    assert core.tick(1.5) == [] and core.next_deadline() == 30.0  # sample 1 still waits for c
    core.call_answered(calls[2], 2.0)
    assert core.tick(2.0) == [Stop()] and core.close(2.0) == [] and core.outcome() == Done()


def test_backward_skipped_calls_count_as_answered_and_the_need_is_capped_by_the_forward_answers():
    skipped = [Call(choice("a"), [0], [0])]
    hung = [Call(choice("b", 1), [0, 1], [1, 0])]
    core: BackwardRound[Call] = BackwardRound(2, hung, skipped=skipped, backward_k_min=2, now=0.0,
                                              backward_timeout=30.0, timeout_after_k_min=2.0)
    assert core.need == [2, 1]
    assert core.start(0.0)[1:] == [] and core.next_deadline() == 30.0
    assert core.tick(30.0) == [Stop()] and core.close(30.0) == hung
    outcome = core.outcome()
    assert isinstance(outcome, Short) and outcome.answered == [1, 0] and outcome.samples_short == 2


def test_backward_with_nothing_to_send_stops_at_once():
    core: BackwardRound[Call] = BackwardRound(1, [], skipped=[Call(choice("a"), [0], [0])], backward_k_min=1,
                                              now=0.0, backward_timeout=30.0, timeout_after_k_min=2.0)
    assert Stop() in core.start(0.0) and core.outcome() == Done()


# ----------------------------------------------------------------------------------------------- properties

EVENTS = st.lists(st.tuples(st.sampled_from(["answer", "fail", "tick", "wait"]), st.integers(0, 10**6),
                            st.floats(0.0, 3.0)), max_size=60)


@given(batch=st.integers(0, 4), k_best=st.integers(1, 4), k_min_off=st.integers(0, 3), pool=st.integers(0, 12),
       grace=st.floats(0.0, 3.0), events=EVENTS, short_searches=st.lists(st.booleans(), max_size=20))
def test_any_order_of_answers_failures_and_timeouts(batch, k_best, k_min_off, pool, grace, events, short_searches):
    """Whatever the order of answers, failures and timeouts: the round stops, by its deadline at the latest;
    no sample ever has more than k_best + k_min experts at once, nor is hedged twice; an expert is never asked
    twice for one sample; only answers count; a sample with k_min answers is never reported short."""
    k_min = max(1, k_best - k_min_off)
    timeout = 20.0
    core = forward(batch, k_best=k_best, k_min=k_min, timeout=timeout, grace=grace)
    experts = [choice(f"e{i}", i % 3) for i in range(pool)]
    answered: set[Call] = set()
    asked: list[list[str]] = [[] for _ in range(batch)]
    hedges: list[int] = []
    now = 0.0
    pending = core.start(now)
    steps = 0
    searches = iter(short_searches)

    def check() -> None:
        for b in range(batch):
            assert core.answered[b] + core.in_flight[b] <= k_best + k_min
            assert core.answered[b] == sum(1 for c in answered if b in c.samples)
            assert len(asked[b]) == len(set(asked[b]))

    while not core.stopped:
        steps += 1
        assert steps < 500 and now <= timeout
        search = next((a for a in pending if isinstance(a, Search)), None)
        if search is not None:
            assert all(n >= 0 for n in search.need) and len(search.need) == batch
            if search.kind == "hedge":
                hedges.extend(b for b, n in enumerate(search.need) if n)
            choices = []
            for b, n in enumerate(search.need):
                free = [e for e in experts if e.uid not in search.exclude[b]]
                take = n - 1 if next(searches, False) and n else n
                choices.append(free[:take])
                asked[b].extend(e.uid for e in free[:take])
            pending = core.search_results(choices, now)
            check()
            continue
        flying = [c for c in core.calls if core.state_of(c) == "in flight"]
        if not events:  # the scripted part is over: nobody answers any more, time passes
            now = min(core.next_deadline(), timeout)
            pending = core.tick(now)
            continue
        kind, pick, dt = events.pop(0)
        if kind in ("answer", "fail") and flying:
            call = flying[pick % len(flying)]
            if kind == "answer":
                core.call_answered(call, now)
                answered.add(call)
            else:
                core.call_failed(call, now)
        elif kind == "wait":
            now = min(now + dt, timeout)
        pending = core.tick(now)
        check()
    note(f"stopped at {now}, answered {core.answered}")
    cut = core.close(now)
    assert all(c not in answered and core.state_of(c) == "cut" for c in cut)
    assert sorted(hedges) == sorted(set(hedges))  # each sample hedged at most once
    check()
    outcome = core.outcome()
    if isinstance(outcome, Short):
        assert any(a < k_min for a in core.answered)
        assert outcome.samples_short == sum(1 for a in core.answered if a < k_min)
    else:
        assert all(a >= k_min for a in core.answered)


@given(batch=st.integers(0, 4), k_min=st.integers(1, 3), sizes=st.lists(st.integers(0, 3), max_size=6),
       events=EVENTS)
def test_backward_any_order(batch, k_min, sizes, events):
    """The backward round stops by its deadline at the latest, counts only answers, and a sample with its
    needed answers is never short."""
    calls = [Call(choice(f"e{i}"), sorted({(i + j) % batch for j in range(n)}) if batch else [], [])
             for i, n in enumerate(sizes)]
    calls = [c for c in calls if c.samples]
    core: BackwardRound[Call] = BackwardRound(batch, calls, backward_k_min=k_min, now=0.0, backward_timeout=20.0,
                                              timeout_after_k_min=1.0)
    now, answered = 0.0, set()
    core.start(now)
    while not core.stopped:
        flying = [c for c in calls if core.state_of(c) == "in flight"]
        if events:
            kind, pick, dt = events.pop(0)
        else:
            kind, pick, dt = "deadline", 0, 0.0
        if kind in ("answer", "fail") and flying:
            call = flying[pick % len(flying)]
            (core.call_answered if kind == "answer" else core.call_failed)(call, now)
            if kind == "answer":
                answered.add(call)
        elif kind == "wait":
            now = min(now + dt, 20.0)
        elif kind == "deadline":
            now = min(core.next_deadline(), 20.0)
        core.tick(now)
        assert now <= 20.0
    core.close(now)
    for b in range(batch):
        assert core.answered[b] == sum(1 for c in answered if b in c.samples)
    assert isinstance(core.outcome(), Short) == any(a < n for a, n in zip(core.answered, core.need))
