"""The churn schedule (peer.testing.churn, also exported by peer.testing.wan) on dummy `sleep` processes: each
action lands on its process, in order, at its time or once its condition holds."""

from __future__ import annotations

import subprocess
import time

import pytest

from peer.testing.wan import Action, Churn


def state(process: subprocess.Popen) -> str:
    """The process's state letter from /proc: S sleeping, T stopped, Z exited (not reaped)."""
    with open(f"/proc/{process.pid}/stat") as file:
        return file.read().rpartition(")")[2].split()[0]


def wait_for_state(process: subprocess.Popen, wanted: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while (current := state(process)) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return current


@pytest.fixture
def sleepers():
    processes = {name: subprocess.Popen(["sleep", "60"]) for name in ("a", "b")}
    yield processes
    for process in processes.values():
        process.kill()
        process.wait()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_actions_wait_for_their_time_and_run_in_order(sleepers):
    clock = FakeClock()
    churn = Churn([Action("stop", "a", at=1.0), Action("cont", "a", at=2.0), Action("kill", "b", at=2.0)],
                  sleepers, clock=clock)
    assert churn.poll() == []
    clock.now = 1.5
    assert [applied.action.kind for applied in churn.poll()] == ["stop"]
    assert wait_for_state(sleepers["a"], "T") == "T"
    clock.now = 2.0
    assert [(applied.action.kind, applied.time) for applied in churn.poll()] == [("cont", 2.0), ("kill", 2.0)]
    assert wait_for_state(sleepers["a"], "S") == "S"
    assert sleepers["b"].wait(timeout=5) == -9
    assert churn.done


def test_a_condition_holds_back_its_action_and_every_later_one(sleepers):
    flag = {"go": False}
    clock = FakeClock()
    churn = Churn([Action("kill", "a", when=lambda: flag["go"]), Action("kill", "b", at=0.0)], sleepers, clock=clock)
    clock.now = 10.0
    assert churn.poll() == [] and sleepers["b"].poll() is None  # b's time has come, but it follows a's kill
    flag["go"] = True
    assert [applied.action.target for applied in churn.poll()] == ["a", "b"]


def test_spawn_adds_a_named_process_that_later_actions_reach():
    churn = Churn([Action("spawn", "c", start=lambda: subprocess.Popen(["sleep", "60"])), Action("kill", "c")])
    applied = churn.run(timeout=5)
    assert [a.action.kind for a in applied] == ["spawn", "kill"]
    assert churn.processes["c"].wait(timeout=5) == -9
    assert applied[0].pid == applied[1].pid == churn.processes["c"].pid


def test_signalling_an_exited_process_is_recorded_not_raised():
    done = subprocess.Popen(["true"])
    done.wait()
    applied = Churn([Action("kill", "x")], {"x": done}).run(timeout=5)
    assert applied[0].outcome == "exited"


def test_run_gives_up_after_its_timeout_naming_what_is_left(sleepers):
    churn = Churn([Action("kill", "a", when=lambda: False)], sleepers)
    with pytest.raises(TimeoutError, match="kill a"):
        churn.run(timeout=0.2, interval=0.02)


def test_malformed_actions_are_refused():
    with pytest.raises(ValueError):
        Action("pause", "a")
    with pytest.raises(ValueError):
        Action("spawn", "a")
    with pytest.raises(ValueError):
        Action("kill", "a", start=lambda: subprocess.Popen(["true"]))


def test_pick_chooses_the_target_when_applied_and_none_skips(sleepers):
    chosen = {"name": None}
    churn = Churn([Action("kill", "oldest", pick=lambda: chosen["name"]),
                   Action("kill", "oldest", pick=lambda: "b")], sleepers)
    applied = churn.run(timeout=5)
    assert [(a.outcome, a.target, a.pid) for a in applied] == [("skipped", "", 0),
                                                               ("done", "b", sleepers["b"].pid)]
    assert sleepers["b"].wait(timeout=5) == -9 and sleepers["a"].poll() is None
    with pytest.raises(ValueError):
        Action("spawn", "c", start=lambda: subprocess.Popen(["true"]), pick=lambda: "c")
