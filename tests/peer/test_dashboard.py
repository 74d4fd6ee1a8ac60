"""`peer dashboard` without a browser: in-process daemons on 127.0.0.1, the watcher and the HTTP app served by
Hypercorn in this trio loop; /api/v1/state against its schema, 404s, is_reachable, a swarm that is not there yet,
and the view's core on its own."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import pytest
import trio

from peer.daemon import Daemon, DaemonConfig
from peer.dashboard.http import serve_asgi
from peer.dashboard.server import build_app, load_schema
from peer.dashboard.view import SwarmView
from peer.dashboard.watcher import Watcher
from peer.directory import PeerEntry
from peer.options import DASHBOARD
from peer.p2p.net import RealNetwork


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def get(base: str, path: str) -> tuple[int, bytes]:
    return await trio.to_thread.run_sync(fetch, base + path)


async def state(base: str) -> dict:
    status, body = await get(base, "/api/v1/state")
    assert status == 200
    return json.loads(body)


async def wait_for(base: str, predicate, timeout: float = 30.0) -> dict:
    with trio.fail_after(timeout):
        while True:
            current = await state(base)
            if predicate(current):
                return current
            await trio.sleep(0.2)


async def start_daemon(nursery: trio.Nursery, **config) -> Daemon:
    daemon = Daemon(DaemonConfig(host="127.0.0.1", hidden_dim=8, **config))
    await nursery.start(daemon.run)
    return daemon


async def daemon_in_own_scope(config: dict, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A daemon whose life the test ends by cancelling the scope passed to `started`."""
    async with trio.open_nursery() as inner:
        await inner.start(Daemon(DaemonConfig(host="127.0.0.1", hidden_dim=8, **config)).run)
        task_status.started(inner.cancel_scope)


async def serve(nursery: trio.Nursery, watcher: Watcher) -> str:
    await nursery.start(watcher.run)
    host, port = await nursery.start(serve_asgi, build_app(watcher), "127.0.0.1", 0, "dashboard")
    return f"http://{host}:{port}"


async def test_state_api_follows_the_swarm_and_matches_its_schema():
    schema = load_schema()
    async with trio.open_nursery() as nursery:
        first = await start_daemon(nursery, experts="ffn.[0:2]")
        second = await start_daemon(nursery, experts="ffn.[2:4]", initial_peers=[first.rpc.address])
        watcher = Watcher([first.rpc.address], refresh=0.3, timeout=2.0)
        base = await serve(nursery, watcher)
        current = await wait_for(base, lambda s: sum(p["state"] == "online" for p in s["peers"]) == 2)
        jsonschema.validate(current, schema)
        assert current["dashboard"]["async_library"] == "trio"  # served by Hypercorn's trio worker
        assert current["swarm"]["reachable"]
        cells = current["experts"]["ffn"]["cells"]
        assert [cell["uid"] for cell in cells] == ["ffn.0", "ffn.1", "ffn.2", "ffn.3"]
        assert {cell["hosts"][0]["peer_id"] for cell in cells} == {str(first.identity.peer_id),
                                                                  str(second.identity.peer_id)}
        assert current["cost"]["per_peer_per_refresh"] is not None

        # a peer that joins later is found in the directory replicas the peers return with their status: the
        # refreshes after the first cost one status call per peer and no DHT lookup
        third = await start_daemon(nursery, experts="ffn.[4:5]", initial_peers=[first.rpc.address])
        before = await wait_for(base, lambda s: sum(p["state"] == "online" for p in s["peers"]) == 3)
        after = await wait_for(base, lambda s: s["swarm"]["refreshes"] >= before["swarm"]["refreshes"] + 5)
        assert after["cost"]["dht_requests"] == before["cost"]["dht_requests"]
        assert after["cost"]["last_per_peer"] == 1.0
        assert after["cost"]["rpc_calls"] - before["cost"]["rpc_calls"] == 3 * (
            after["swarm"]["refreshes"] - before["swarm"]["refreshes"])
        assert "ffn.4" in [cell["uid"] for cell in after["experts"]["ffn"]["cells"]]
        assert str(third.identity.peer_id) in {peer["peer_id"] for peer in after["peers"]}

        peer_id = str(second.identity.peer_id)
        status, body = await get(base, f"/api/v1/is_reachable/{peer_id}")
        assert status == 200 and json.loads(body)["reachable"] is True
        assert (await get(base, "/api/v1/is_reachable/" + "0" * 40))[0] == 404
        for path in ("/nope", "/api/v2/state", "/static/missing.js", "/api/v1/state/extra"):
            assert (await get(base, path))[0] == 404, path
        status, body = await get(base, "/")
        assert status == 200 and b"/static/dashboard.js" in body
        assert (await get(base, "/static/dashboard.js"))[0] == 200
        nursery.cancel_scope.cancel()


async def test_dashboard_says_the_swarm_is_unreachable_and_recovers_when_it_comes():
    from peer.p2p.addresses import pick_free_port

    port = pick_free_port("127.0.0.1")
    async with trio.open_nursery() as nursery:
        watcher = Watcher([("127.0.0.1", port)], refresh=0.3, timeout=1.0,
                          network=RealNetwork())
        base = await serve(nursery, watcher)
        lost = await wait_for(base, lambda s: s["events"] and not s["swarm"]["reachable"])
        assert "unreachable" in lost["swarm"]["message"]
        jsonschema.validate(lost, load_schema())
        await start_daemon(nursery, experts="ffn.[0:1]", port=port)
        found = await wait_for(base, lambda s: s["swarm"]["reachable"] and s["experts"], timeout=60)
        assert [cell["uid"] for cell in found["experts"]["ffn"]["cells"]] == ["ffn.0"]
        nursery.cancel_scope.cancel()


def _entry(n: int) -> PeerEntry:
    return PeerEntry(f"{n:040x}", ("127.0.0.1", 7000 + n), {"experts": 1, "grid": "ffn.[0:4]", "hidden_dim": 8},
                     1e9)


def _row(n: int, reachable: bool, served: int = 0) -> dict:
    return {"peer_id": f"{n:040x}", "address": f"127.0.0.1:{7000 + n}", "reachable": reachable,
            "error": None if reachable else "timed out", "experts": [f"ffn.{n}"] if reachable else [],
            "requests_served": served, "expert_requests": {f"ffn.{n}": served}, "averaging_failures": 0}


def test_view_marks_a_silent_peer_unreachable_then_forgets_it():
    view = SwarmView(["127.0.0.1:7001"], started_at=0.0)
    entries = [_entry(1), _entry(2)]
    view.observe({"peers": [_row(1, True, 10), _row(2, True, 0)]}, entries, [], {}, 1.0, requests=2)
    view.observe({"peers": [_row(1, True, 30), _row(2, False)]}, entries, [], {}, 3.0, requests=2)
    snapshot = view.snapshot(3.0)
    states = {peer["peer_id"][-1]: peer["state"] for peer in snapshot["peers"]}
    assert states == {"1": "online", "2": "unreachable"}
    assert snapshot["peers"][0]["requests_per_s"] == 10.0
    assert [cell["uid"] for cell in snapshot["experts"]["ffn"]["cells"]] == ["ffn.1"]  # ffn.2 left the grid
    assert snapshot["experts"]["ffn"]["grid"] == [4]
    view.observe({"peers": [_row(1, True, 30)]}, entries[:1], [], {}, 40.0, requests=1)
    kinds = [event["kind"] for event in view.snapshot(40.0)["events"]]
    assert kinds == ["peer_joined", "peer_joined", "peer_unreachable", "peer_expired"]
    assert view.snapshot(40.0)["cost"]["per_peer_per_refresh"] == 1.0
    jsonschema.validate(view.snapshot(40.0), load_schema())


def test_a_private_peer_shows_as_relayed_with_its_relayed_address_as_written():
    from peer.p2p.identity import PeerID
    from peer.p2p.relay import RelayedAddress, show_address

    relayed = RelayedAddress(PeerID(bytes([3]) * 20), ((PeerID(bytes([1]) * 20), ("127.0.0.1", 7001)),
                                                       (PeerID(bytes([2]) * 20), ("127.0.0.1", 7002)))).to_address()
    private = PeerEntry(f"{3:040x}", relayed, {"experts": 1, "grid": "ffn.[0:4]", "hidden_dim": 8}, 1e9)
    assert show_address(relayed).endswith("@127.0.0.1:7002")  # each relay's port once, not the tuple's again
    assert show_address(("127.0.0.1", 7001)) == "127.0.0.1:7001"
    view = SwarmView(["127.0.0.1:7001"], started_at=0.0)
    row = {**_row(3, True, 5), "address": show_address(relayed)}  # as `peer.status` writes it
    view.observe({"peers": [_row(1, True, 10), row]}, [_entry(1), private], [], {}, 1.0, requests=2)
    peers = {peer["peer_id"][-1]: peer for peer in view.snapshot(1.0)["peers"]}
    assert (peers["1"]["reachability"], peers["3"]["reachability"]) == ("direct", "relayed")
    assert peers["3"]["address"] == show_address(relayed)
    jsonschema.validate(view.snapshot(1.0), load_schema())


def test_view_keeps_a_loss_history_point_per_new_step():
    view = SwarmView([], started_at=0.0)
    run = {"run_id": "digits", "epoch": 1, "trainers": 1, "trainers_in_epoch": 1, "samples": 10,
           "target_batch_size": 128, "samples_per_s": 5.0, "recent_groups": []}
    for t, step in ((1.0, 20), (2.0, 20), (3.0, 40)):
        point = {"step": step, "loss": 2.0 / step, "accuracy": 0.5, "samples_per_s": 100.0, "epoch": 1,
                 "averaging_rounds": step // 20, "averaging_failures": 0 if step < 40 else 1,
                 "averaging_seconds": 0.5 * (step // 20)}
        view.observe({"peers": [_row(1, True)]}, [_entry(1)], [run], {"digits": {"ab" * 20: point}}, t)
    snapshot = view.snapshot(3.0)
    history = snapshot["runs"][0]["history"]
    assert [point["step"] for point in history] == [20, 40]  # the same step twice is one point
    assert snapshot["runs"][0]["averaging"] == {"rounds": 2, "failures": 1, "mean_seconds": 0.5}
    failed = [event for event in snapshot["events"] if event["kind"] == "averaging_failed"]
    assert len(failed) == 1 and failed[0]["peer_id"] == "ab" * 20
    jsonschema.validate(snapshot, load_schema())


def test_training_points_are_read_only_from_their_signer_and_well_formed():
    from types import SimpleNamespace

    from peer.dashboard.training import parse_points, point_from_line
    from peer.p2p.identity import Identity

    honest, other = Identity.generate(), Identity.generate()
    good = point_from_line({"step": 40, "loss": 1.25, "accuracy": 0.5, "samples_per_s": 90.0, "epoch": 2},
                           {"averaging_rounds": 3, "averaging_failures": 1, "averaging_seconds": 1.5})

    def entry(owner, value, expiration=100.0):
        return SimpleNamespace(owner=owner.public_key if owner else None, value=value, expiration_time=expiration)

    record = SimpleNamespace(subkeys={
        bytes(honest.peer_id): entry(honest, good),
        bytes(other.peer_id): entry(honest, good),  # written for another trainer: refused
        bytes(Identity.generate().peer_id): entry(None, good),  # unsigned
        b"x" * 20: entry(honest, good),
        bytes(Identity.from_seed(b"1" * 32).peer_id): entry(Identity.from_seed(b"1" * 32), good, expiration=5.0),
        bytes(Identity.from_seed(b"2" * 32).peer_id): entry(Identity.from_seed(b"2" * 32), [*good[:7], "x"]),
        bytes(Identity.from_seed(b"3" * 32).peer_id): entry(Identity.from_seed(b"3" * 32), good[:5]),
        bytes(Identity.from_seed(b"4" * 32).peer_id): entry(Identity.from_seed(b"4" * 32),
                                                             [good[0], float("nan"), *good[2:]]),
    })
    points = parse_points(record, now=10.0)
    assert points == {honest.peer_id.hex(): {"step": 40, "loss": 1.25, "accuracy": 0.5, "samples_per_s": 90.0,
                                              "epoch": 2, "averaging_rounds": 3, "averaging_failures": 1,
                                              "averaging_seconds": 1.5}}


def test_dashboard_binds_loopback_by_default():
    assert DASHBOARD["host"].default == "127.0.0.1"


async def test_a_busy_port_is_one_clear_error():
    watcher = Watcher([("127.0.0.1", 9)], refresh=1.0)
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(serve_asgi, build_app(watcher), "127.0.0.1", 0, "dashboard")
        with pytest.raises(OSError, match="dashboard: cannot listen on 127.0.0.1"):
            await serve_asgi(build_app(watcher), "127.0.0.1", port, "dashboard")
        nursery.cancel_scope.cancel()


async def test_a_swarm_that_goes_away_and_comes_back_is_followed():
    from peer.p2p.addresses import pick_free_port

    port = pick_free_port("127.0.0.1")
    async with trio.open_nursery() as nursery:
        first_life = await nursery.start(daemon_in_own_scope, {"experts": "ffn.[0:1]", "port": port})
        watcher = Watcher([("127.0.0.1", port)], refresh=0.3, timeout=1.0)
        base = await serve(nursery, watcher)
        await wait_for(base, lambda s: s["swarm"]["reachable"] and s["experts"])
        first_life.cancel()  # the whole swarm stops
        gone = await wait_for(base, lambda s: not s["swarm"]["reachable"])
        assert not gone["experts"]
        await start_daemon(nursery, experts="ffn.[3:5]", port=port)  # a new swarm at the same address

        def served(s: dict) -> list[str]:
            return [cell["uid"] for cell in s["experts"].get("ffn", {}).get("cells", [])]

        back = await wait_for(base, lambda s: s["swarm"]["reachable"] and served(s) == ["ffn.3", "ffn.4"], timeout=90)
        kinds = [event["kind"] for event in back["events"]]
        assert "swarm_unreachable" in kinds and kinds.index("swarm_unreachable") < len(kinds) - 1
        nursery.cancel_scope.cancel()


def test_the_command_serves_on_loopback_and_stops_on_sigterm():
    import re
    import signal

    from peer.testing.peer_processes import PeerProcess

    process = PeerProcess(["dashboard", "--initial-peers", "127.0.0.1:9", "--port", "0", "--refresh", "0.5"])
    try:
        url = process.read_until(r"^dashboard at (http://\S+/)", timeout=60).group(1)
        assert re.match(r"http://127\.0\.0\.1:\d+/$", url)
        current = {}
        for _ in range(200):  # the first failed attach takes a few seconds (bootstrap attempts)
            status, body = fetch(url + "api/v1/state")
            current = json.loads(body)
            if current["events"]:
                break
            process.read_line(0.1)
        assert current["swarm"]["reachable"] is False and "unreachable" in current["swarm"]["message"]
        process.signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert process.process.stderr.read().strip().splitlines()[-1] == "peer: dashboard stopped"
    finally:
        process.kill()
