"""Issue 40: long-lived junk and matchmaking squat under a training run's keys made training 8-20x slower and split
the swarm into 2 states (the storing nodes evicted honest entries first and took any expiration).

Ten attacker identities on the run's DHT keep storing, round after round, 8 KiB values that expire in ten years
under the run's progress key and its matchmaking keys (the storers refuse values that large under training keys),
and matchmaking declarations that point at an address that never answers, all signed by themselves and sent
without the honest client's checks. Three DiLoCo trainers on
the same in-memory network then train as they do without the attack: every outer step, every round with all
three of them (nobody timed out of a round or read a stale view of the others), and one state at the end -- the
same outer steps and group sizes as the clean run beside it. The wall-time ratio of the two runs is a benchmark
figure (`benchmarks/bench_budgets.py`, `outer_steps_ratio_under_junk`), not asserted here.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from averaging.assembly import Declaration
from averaging.progress import progress_key
from peer.p2p.bridge import Bridge
from peer.p2p.identity import Identity
from peer.testing.sim_peers import start_peers
from tests.averaging.diloco_sim import close_all, run_threads, start_trainers, train_steps
from tests.dht.dht_swarm import forge_store

RUN = "sim"  # the run id `make_trainer` gives its trainers
TEN_YEARS = 10 * 365 * 86400.0
INNER_STEPS, OUTER_STEPS = 5, 6


@pytest.fixture
def bridge():
    with Bridge.start() as bridge:
        yield bridge


def _attack(bridge: Any, memory: Any, bootstrap: list) -> tuple[Any, dict[str, int]]:
    """Ten squatting identities on the run's DHT, storing until the returned cancel scope is cancelled."""
    keys = [progress_key(RUN), f"{RUN}.diloco.averaging", f"{RUN}.gradients.averaging"]
    counts = {"tried": 0, "acknowledged": 0, "rounds": 0}
    first_round = trio.Event()
    rounds = [0] * 10

    async def squat(index: int, peer: Any, signer: Identity) -> None:
        rng = random.Random(index)
        junk = rng.randbytes(8000)
        nowhere = ("junk-tarpit", 9)
        while True:
            now = peer.dht.now()
            declaration = Declaration(signer.peer_id, nowhere, 1e9, False, rng.randbytes(32), 0, now + TEN_YEARS,
                                      now)
            async with trio.open_nursery() as stores:
                for key in keys:
                    for subkey, value in ((f"junk.{index}", junk), (bytes(signer.peer_id), declaration.to_wire())):
                        stores.start_soon(store, peer, key, value, now + TEN_YEARS, subkey, signer)
            rounds[index] += 1
            counts["rounds"] = min(rounds)
            if min(rounds) == 1:
                first_round.set()
            await trio.sleep(0.2)

    async def store(peer: Any, key: str, value: Any, expiration: float, subkey: Any, signer: Identity) -> None:
        with trio.move_on_after(10):
            counts["tried"] += 1
            acknowledged = await forge_store(peer.dht, key, value, expiration, subkey=subkey, signer=signer)
            counts["acknowledged"] += acknowledged  # after the await: concurrent stores must not race on it

    async def run(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                signers = {}

                def identity_for(name: str, seed: int) -> Identity:
                    signers[name] = Identity.from_seed(f"squatter {name}".encode())
                    return signers[name]

                squatters = await start_peers(nursery, 10, memory=memory, seed=9, prefix="junk",
                                              bootstrap=bootstrap, identity_for=identity_for)
                for index, peer in enumerate(squatters):
                    nursery.start_soon(squat, index, peer, signers[peer.name])
                with trio.fail_after(60):
                    await first_round.wait()
                task_status.started(scope)

    return bridge.start_and_wait(run), counts


def _train_run(bridge: Any, attacked: bool) -> dict[str, Any]:
    memory, peers, made = start_trainers(bridge, 3, start_with=3)
    scope, counts = None, {}
    try:
        if attacked:
            scope, counts = _attack(bridge, memory, [peers[0].dht.address])
        run_threads([lambda m=m, o=o, i=i: train_steps(m, o, INNER_STEPS * OUTER_STEPS, seed=i) for i, (m, o) in
                     enumerate(made)])
        return {"outer_steps": {opt.outer_step for _, opt in made}, "hashes": {opt.hash for _, opt in made},
                "group_sizes": [opt.stats()["group_sizes"] for _, opt in made], "stores": counts}
    finally:
        if scope is not None:
            bridge.run(_cancel, scope)
        close_all(made)


async def _cancel(scope: trio.CancelScope) -> None:
    scope.cancel()


def test_junk_and_squat_from_ten_identities_leave_a_diloco_run_as_it_is_without_them(bridge):
    clean = _train_run(bridge, attacked=False)
    attacked = _train_run(bridge, attacked=True)
    # every squatter stored a full round before the training started (and went on storing during it), and the
    # storers took the declarations (clamped to their own expiration limit) while refusing the 8 KiB values
    assert attacked["stores"]["rounds"] >= 1 and attacked["stores"]["acknowledged"] > 0, attacked["stores"]
    assert clean["outer_steps"] == attacked["outer_steps"] == {OUTER_STEPS}, (clean, attacked)
    assert len(attacked["hashes"]) == 1, attacked
    assert attacked["group_sizes"] == clean["group_sizes"] == [{3: OUTER_STEPS}] * 3, (clean, attacked)
