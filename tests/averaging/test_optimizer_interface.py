"""Both swarm optimizers implement `SwarmOptimizer` with the same signatures, so a loop written against it (the
`peer train` runner among them) runs either; the DiLoCo and collaborative end-to-end tests drive that loop."""

from __future__ import annotations

import inspect

import pytest

from averaging.collaborative import CollaborativeOptimizer
from averaging.diloco import DiLoCoOptimizer
from averaging.optimizer import SwarmOptimizer

MEMBERS = [name for name in vars(SwarmOptimizer) if not name.startswith("_")]


@pytest.mark.parametrize("cls", [DiLoCoOptimizer, CollaborativeOptimizer])
def test_each_optimizer_has_every_member_with_the_same_signature(cls):
    assert {"step", "more_steps", "shortfall", "finish", "report", "close", "lock", "param_groups"} <= set(MEMBERS)
    for name in MEMBERS:
        ours, theirs = getattr(SwarmOptimizer, name), getattr(cls, name, None)
        assert theirs is not None, f"{cls.__name__} lacks {name}"
        assert isinstance(theirs, property) == isinstance(ours, property), name
        if callable(ours) and not isinstance(ours, property):
            assert list(inspect.signature(theirs).parameters) == list(inspect.signature(ours).parameters), name
