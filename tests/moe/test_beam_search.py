"""The grid search must return the true top-k among alive experts, in few oracle rounds."""

from __future__ import annotations

import itertools
import random
from contextlib import asynccontextmanager

import pytest

from moe.beam_search import GridSearch, find_best_experts, normalize_prefix
from moe.declare import ExpertLocation, parse_location


def brute_force_top_k(prefix, grid_size, scores, k, alive):
    """Reference: score every alive expert and sort."""
    prefix = normalize_prefix(prefix)
    out = []
    for b in range(len(scores[0])):
        scored = []
        for uid in alive:
            coords = tuple(int(c) for c in uid[len(prefix):].split("."))
            scored.append((sum(scores[d][b][c] for d, c in enumerate(coords)), uid))
        scored.sort(key=lambda item: (-item[0], item[1]))
        out.append([uid for _, uid in scored[:k]])
    return out


def grid_children(prefix, alive):
    """What the DHT prefix entries say for a set of alive experts: prefix -> {coordinate: value}."""
    prefix = normalize_prefix(prefix)
    table = {}
    for uid, location in alive.items():
        coords = uid[len(prefix):].split(".")
        for depth in range(len(coords)):
            key = prefix + "".join(f"{c}." for c in coords[:depth])
            table.setdefault(key, {})[int(coords[depth])] = [uid, location.host, location.port, location.peer_id_hex]
    return table


class TableOracle:
    """Answers like the DHT would, and counts rounds."""

    def __init__(self, table):
        self.table = table
        self.rounds = 0
        self.keys_asked = 0

    async def children(self, prefixes):
        self.rounds += 1
        self.keys_asked += len(prefixes)
        return {key: self.table.get(key) for key in prefixes}


def run_sync(search: GridSearch, table) -> int:
    rounds = 0
    while not search.done:
        search.provide({key: table.get(key) for key in search.wanted()})
        rounds += 1
    return rounds


def random_alive(rng, grid_size, fraction):
    alive = {}
    for coords in itertools.product(*(range(g) for g in grid_size)):
        if rng.random() < fraction:
            uid = "ffn." + ".".join(map(str, coords))
            alive[uid] = ExpertLocation("127.0.0.1", 1000 + rng.randrange(5), "ab" * 20)
    return alive


def random_scores(rng, grid_size, batch):
    return [[[rng.gauss(0, 1) for _ in range(g)] for _ in range(batch)] for g in grid_size]


@pytest.mark.parametrize("grid_size", [(8,), (4, 5), (3, 4, 5), (2, 2, 2, 3)])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.15])
def test_search_equals_brute_force(grid_size, fraction):
    rng = random.Random(hash((grid_size, fraction)) & 0xFFFF)
    for _trial in range(10):
        alive = random_alive(rng, grid_size, fraction)
        scores = random_scores(rng, grid_size, batch=7)
        for k in (1, 3, 6):
            search = GridSearch("ffn", grid_size, scores, k)
            run_sync(search, grid_children("ffn", alive))
            got = [[choice.uid for choice in sample] for sample in search.results()]
            assert got == brute_force_top_k("ffn", grid_size, scores, k, alive)


def test_search_reports_scores_coords_and_locations():
    alive = {"ffn.1.2": ExpertLocation("10.0.0.1", 31337, "cd" * 20)}
    scores = [[[0.0, 1.5]], [[0.0, 0.0, 2.25]]]
    search = GridSearch("ffn.", (2, 3), scores, 2)
    run_sync(search, grid_children("ffn", alive))
    [[choice]] = search.results()
    assert choice.uid == "ffn.1.2" and choice.coords == (1, 2)
    assert choice.score == pytest.approx(3.75)
    assert choice.location.address == ("10.0.0.1", 31337) and choice.location.peer_id_hex == "cd" * 20


def test_prefix_with_high_score_but_no_alive_children_does_not_hide_better_experts():
    # dimension 0 prefers rows 0 and 1, but only row 2 has an expert whose second coordinate scores high:
    # a beam of width 2 over rows would never look at row 2; the search must.
    alive = {
        "ffn.0.0": ExpertLocation("h", 1, "00"),
        "ffn.1.0": ExpertLocation("h", 1, "00"),
        "ffn.2.3": ExpertLocation("h", 1, "00"),
    }
    scores = [[[10.0, 9.0, 0.0]], [[0.0, 0.0, 0.0, 100.0]]]
    search = GridSearch("ffn", (3, 4), scores, 2)
    run_sync(search, grid_children("ffn", alive))
    assert [c.uid for c in search.results()[0]] == ["ffn.2.3", "ffn.0.0"]


@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("grid_size", [(8,), (8, 8), (16, 16)])
def test_full_grid_costs_one_round_per_level(batch, grid_size):
    for seed in range(10):
        rng = random.Random(seed)
        alive = random_alive(rng, grid_size, 1.0)
        search = GridSearch("ffn", grid_size, random_scores(rng, grid_size, batch=batch), 4)
        assert run_sync(search, grid_children("ffn", alive)) == len(grid_size)


def test_deep_sparse_grid_needs_a_bounded_number_of_rounds():
    # exactness can cost extra rounds (an unexplored prefix may still beat explored ones), but few
    for seed in range(20):
        rng = random.Random(seed)
        grid_size = (4, 4, 4)
        alive = random_alive(rng, grid_size, 0.5)
        search = GridSearch("ffn", grid_size, random_scores(rng, grid_size, batch=8), 4)
        assert run_sync(search, grid_children("ffn", alive)) <= 3 * len(grid_size)


def test_banned_and_excluded_experts_are_skipped_for_the_next_best():
    rng = random.Random(9)
    grid_size = (3, 3)
    alive = random_alive(rng, grid_size, 1.0)
    scores = random_scores(rng, grid_size, batch=2)
    first = brute_force_top_k("ffn", grid_size, scores, 9, alive)
    banned_uid = first[0][0]
    excluded = {first[1][1]}
    search = GridSearch(
        "ffn", grid_size, scores, 3, banned=lambda uid, loc: uid == banned_uid, exclude=[set(), excluded]
    )
    run_sync(search, grid_children("ffn", alive))
    got = [[c.uid for c in sample] for sample in search.results()]
    assert got[0] == [u for u in first[0] if u != banned_uid][:3]
    assert got[1] == [u for u in first[1] if u != banned_uid and u not in excluded][:3]


def test_per_sample_k_and_fewer_alive_than_k():
    alive = {"ffn.0": ExpertLocation("h", 1, "00"), "ffn.5": ExpertLocation("h", 2, "00")}
    scores = [[[float(i) for i in range(8)]] * 3]
    search = GridSearch("ffn", (8,), scores, [0, 1, 4])
    run_sync(search, grid_children("ffn", alive))
    assert [[c.uid for c in s] for s in search.results()] == [[], ["ffn.5"], ["ffn.5", "ffn.0"]]


def test_garbage_from_the_dht_is_ignored():
    table = {
        "ffn.": {0: ["ffn.0", "h", 1, "00"], 1: "junk", 7: ["ffn.7", "h", 1, "00"], 99: ["ffn.99", "h", 1, "00"],
                 -1: ["ffn.-1", "h", 1, "00"], 2: ["ffn.2", "h", "port", "00"], 3: ["ffn.3", "h", 0, "00"]},
    }
    scores = [[[float(i) for i in range(8)]]]
    search = GridSearch("ffn", (8,), scores, 8)
    run_sync(search, table)
    assert [c.uid for c in search.results()[0]] == ["ffn.7", "ffn.0"]


def test_unfinished_search_refuses_to_give_results():
    search = GridSearch("ffn", (2,), [[[0.0, 1.0]]], 1)
    assert search.wanted() == ["ffn."]
    with pytest.raises(RuntimeError):
        search.results()


def test_parse_location_accepts_both_entry_layouts():
    assert parse_location(["ffn.1", "h", 5, "aa"]) == ExpertLocation("h", 5, "aa")
    assert parse_location(["h", 5, "aa"]) == ExpertLocation("h", 5, "aa")
    for bad in (None, ["h", 5], ["h", True, "aa"], ["h", 70000, "aa"], [1, 5, "aa"], ["h", 5, 7]):
        assert parse_location(bad) is None


async def test_find_best_experts_batches_oracle_calls():
    rng = random.Random(3)
    grid_size = (4, 6)
    alive = random_alive(rng, grid_size, 0.7)
    scores = random_scores(rng, grid_size, batch=32)
    oracle = TableOracle(grid_children("ffn", alive))
    results = await find_best_experts(oracle, "ffn", grid_size, scores, 4)
    assert [[c.uid for c in s] for s in results] == brute_force_top_k("ffn", grid_size, scores, 4, alive)
    # 32 samples share the oracle: the rounds grow with depth, not with the batch
    assert oracle.rounds <= 3
    assert oracle.keys_asked <= 1 + grid_size[0]


async def _dht_node(network, host, initial, client_mode=False, *, task_status):
    """A DHT node on `host` of the in-memory `network`, `started` with the node, running until cancelled."""
    import trio

    from dht import DHTNode

    async with DHTNode.open(host, 4000, initial, network=network.host(host), clock=trio.current_time,
                            client_mode=client_mode, seed=len(host)) as dht:
        task_status.started(dht)
        await trio.sleep_forever()


async def test_dht_oracle_finds_the_true_top_k_caches_and_forgets_expired_experts(autojump_clock):
    import trio

    from moe.beam_search import DHTGridOracle
    from moe.declare import declaration_items
    from peer.p2p.net import MemoryNetwork

    network = MemoryNetwork(seed=5)
    rng = random.Random(11)
    grid_size = (4, 5)
    alive = random_alive(rng, grid_size, 0.6)
    locations = sorted({loc.address for loc in alive.values()})
    async with trio.open_nursery() as nursery:
        first = await nursery.start(_dht_node, network, "d0", [])
        servers = [first] + [await nursery.start(_dht_node, network, f"d{i}", [first.address]) for i in range(1, 4)]
        client = await nursery.start(_dht_node, network, "trainer", [first.address], True)
        # the long-lived experts expire in an hour, one short-lived expert in 10 s
        short_lived = sorted(alive)[0]
        for index, address in enumerate(locations):
            uids = [uid for uid, loc in alive.items() if loc.address == address]
            for uid in uids:
                expiration = client.now() + (10.0 if uid == short_lived else 3600.0)
                assert all(await servers[index % 4].store_many(
                    declaration_items([uid], address, alive[uid].peer_id_hex, expiration)))

        oracle = DHTGridOracle(client, ttl=5.0)
        scores = random_scores(rng, grid_size, batch=16)
        results = await find_best_experts(oracle, "ffn", grid_size, scores, 3)
        assert [[c.uid for c in s] for s in results] == brute_force_top_k("ffn", grid_size, scores, 3, alive)
        assert all(c.location.address == alive[c.uid].address for s in results for c in s)
        lookups = oracle.lookups
        await find_best_experts(oracle, "ffn", grid_size, scores, 3)
        assert oracle.lookups == lookups  # served from the cache

        await trio.sleep(20.0)  # past the cache period and the short-lived expert's expiration
        remaining = {uid: loc for uid, loc in alive.items() if uid != short_lived}
        results = await find_best_experts(oracle, "ffn", grid_size, scores, 3)
        assert oracle.lookups > lookups
        assert [[c.uid for c in s] for s in results] == brute_force_top_k("ffn", grid_size, scores, 3, remaining)
        nursery.cancel_scope.cancel()



@asynccontextmanager
async def _declared_grid(seed, wrap=lambda client: client):
    """A 3x3 grid of alive experts declared on DHT node d0, read by a trainer through `DHTGridOracle(wrap(client),
    ttl=5, refresh_timeout=0.5)` once (checked); yields (network, the wrapped client, the oracle, a search of the
    top 2 for 4 samples, the uids it must find)."""
    import trio

    from moe.beam_search import DHTGridOracle
    from moe.declare import declaration_items
    from peer.p2p.net import MemoryNetwork

    network = MemoryNetwork(seed=6)
    rng = random.Random(seed)
    grid_size = (3, 3)
    alive = random_alive(rng, grid_size, 1.0)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(_dht_node, network, "d0", [])
        client = wrap(await nursery.start(_dht_node, network, "trainer", [server.address], True))
        for uid, location in alive.items():
            await server.store_many(declaration_items([uid], location.address, location.peer_id_hex, 1e9))
        oracle = DHTGridOracle(client, ttl=5.0, refresh_timeout=0.5)
        scores = random_scores(rng, grid_size, batch=4)

        async def search():
            return [[c.uid for c in s] for s in await find_best_experts(oracle, "ffn", grid_size, scores, 2)]

        expected = brute_force_top_k("ffn", grid_size, scores, 2, alive)
        assert await search() == expected
        yield network, client, oracle, search, expected
        nursery.cancel_scope.cancel()


async def test_dht_oracle_serves_the_previous_answer_when_a_refresh_hangs(autojump_clock):
    import trio

    async with _declared_grid(2) as (network, _, oracle, search, expected):
        network.freeze("d0")  # the only DHT peer hangs: lookups wait for their timeouts
        await trio.sleep(10.0)  # the cache is stale
        start = trio.current_time()
        assert await search() == expected
        assert trio.current_time() - start == pytest.approx(1.0)  # two levels, 0.5 s each, then stale answers
        assert oracle.stale_answers == 2


async def test_an_invalidated_oracle_refreshes_but_keeps_its_answer_when_the_dht_hangs(autojump_clock):
    """A forward short of experts invalidates the view (a daemon was just killed); the next search reads the DHT
    again, and when that read hangs (the dead node still in the routing tables, a loaded machine) it serves the
    previous children after `refresh_timeout` instead of an empty grid (which failed the next step too)."""
    import trio

    async with _declared_grid(3) as (network, _, oracle, search, expected):
        lookups = oracle.lookups
        network.freeze("d0")
        oracle.invalidate()  # well within the cache period
        start = trio.current_time()
        again = await search()
        assert oracle.lookups > lookups  # it did read again
        assert again == expected
        assert trio.current_time() - start == pytest.approx(1.0) and oracle.stale_answers == 2


class _Missing:
    """A DHT client, except that its reads find no record while `missing`."""

    def __init__(self, inner):
        self.inner, self.missing = inner, False

    async def get_many(self, keys):
        return {} if self.missing else await self.inner.get_many(keys)

    def now(self):
        return self.inner.now()


async def test_a_refresh_that_reads_no_children_for_a_known_prefix_keeps_the_known_ones(autojump_clock):
    """A lookup that misses the grid's record (its holder was just killed, a replica not yet merged) answers
    "no children": served as such, every sample of the next step would find no expert and the step would fail.
    The known children are served again, and read anew after `retry_after`."""
    import trio

    async with _declared_grid(4, wrap=_Missing) as (_, dht, oracle, search, expected):
        dht.missing = True
        oracle.invalidate()
        assert await search() == expected and oracle.stale_answers >= 1
        dht.missing = False
        await trio.sleep(1.5)  # past retry_after: read again, and what the DHT says now is taken
        assert await search() == expected


class _Partial:
    """A DHT client whose reads of the grid's top prefix lack the children in `drop` (a replica that never got
    their declarations)."""

    def __init__(self, inner):
        self.inner, self.drop = inner, set()

    async def get_many(self, keys):
        from types import SimpleNamespace

        records = await self.inner.get_many(keys)
        record = records.get("ffn.")
        if record is not None and self.drop:
            records["ffn."] = SimpleNamespace(subkeys={k: v for k, v in record.subkeys.items() if k not in self.drop})
        return records

    def now(self):
        return self.inner.now()


async def test_a_refresh_that_reads_only_some_children_keeps_the_others_for_a_while(autojump_clock):
    """A read that reaches only some replicas shows some experts alone: replacing the view with it left a step
    whose experts were all on a daemon just killed with nobody to fall back on. Children missing from reads are
    kept for `forget_after` (2 x ttl), then dropped."""
    import trio

    async with _declared_grid(5, wrap=_Partial) as (_, dht, oracle, search, expected):
        dht.drop = {0, 1}
        oracle.invalidate()
        assert await search() == expected  # rows 0 and 1 kept
        await trio.sleep(6.0)  # one ttl later, still within forget_after of the last read that showed them
        assert await search() == expected
        await trio.sleep(6.0)  # past forget_after: every read since lacked them
        assert all(uid.startswith("ffn.2.") for sample in await search() for uid in sample)
