"""Uid grammar, grid patterns and choosing uids that do not collide."""

import random

import pytest

from moe.grid import (
    GridPattern,
    InvalidUID,
    choose_free_uids,
    expand_pattern,
    is_valid_uid,
    make_uid,
    parse_uid,
    prefix_entries,
)


def test_parse_and_make_uid():
    assert parse_uid("ffn.3.17") == ("ffn", (3, 17))
    assert parse_uid("my_expert-2.0") == ("my_expert-2", (0,))
    assert make_uid("ffn", [3, 17]) == "ffn.3.17"
    for bad in ["ffn", "ffn.", "ffn.3.", ".3", "ffn.03", "ffn.-1", "ffn.a", "f.f.1", "3ffn.1", "ffn..1", 7, None,
                "ffn." + "1" * 300]:
        assert not is_valid_uid(bad), bad
        with pytest.raises(InvalidUID):
            parse_uid(bad)
    with pytest.raises(InvalidUID):
        make_uid("a.b", [1])


def test_prefix_entries_walk_the_grid():
    assert prefix_entries("ffn.3.17") == [("ffn.", 3), ("ffn.3.", 17)]
    assert prefix_entries("e.0") == [("e.", 0)]


def test_expand_pattern():
    assert expand_pattern("ffn.[0:2].[5:7]") == ["ffn.0.5", "ffn.0.6", "ffn.1.5", "ffn.1.6"]
    assert expand_pattern("ffn.3.[0:3]") == ["ffn.3.0", "ffn.3.1", "ffn.3.2"]
    grid = GridPattern.parse("ffn.[0:8].[0:8]")
    assert grid.size == 64 and "ffn.7.7" in grid and "ffn.8.0" not in grid and "ffn.1" not in grid
    for bad in ["ffn", "ffn.[3:3]", "ffn.[a:b]", "ffn.[0:4", "a.b.[0:2]", "ffn.x"]:
        with pytest.raises(InvalidUID):
            GridPattern.parse(bad)
    with pytest.raises(InvalidUID, match="limit"):
        expand_pattern("ffn.[0:1000].[0:1000].[0:1000]")


def test_choose_free_uids_avoids_taken_and_is_exact_on_small_grids():
    rng = random.Random(0)
    taken = {"ffn.0.0", "ffn.0.1", "ffn.1.0"}
    chosen = choose_free_uids("ffn.[0:2].[0:2]", 1, taken, rng)
    assert chosen == ["ffn.1.1"]
    with pytest.raises(InvalidUID, match="free"):
        choose_free_uids("ffn.[0:2].[0:2]", 2, taken, rng)
    many = choose_free_uids("ffn.[0:8].[0:8]", 61, taken, rng)
    assert len(set(many)) == 61 and not set(many) & taken


def test_choose_free_uids_samples_huge_grids():
    rng = random.Random(1)
    taken = {f"big.{i}.{i}" for i in range(100)}
    chosen = choose_free_uids("big.[0:100000].[0:100000]", 50, taken, rng)
    assert len(set(chosen)) == 50
    assert all(uid in GridPattern.parse("big.[0:100000].[0:100000]") and uid not in taken for uid in chosen)
