"""Fixtures of the application's tests."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], Path]:
    """`importable(name, source)`: a module a user wrote, saved in tmp_path and importable as `name` (as
    `peer train --model name:factory` imports it) for this test only; returns its folder."""

    def write(name: str, source: str) -> Path:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return tmp_path

    return write
