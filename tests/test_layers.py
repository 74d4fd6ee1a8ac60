"""The layering rule, checked on the code itself (every import statement, at any depth, of every module).

    peer.p2p (foundation)  imports nothing of dht, moe, averaging or the application modules of peer
    dht                    imports only the foundation
    moe, averaging         import dht and the foundation, never each other nor the application
    peer (application)     may import anything but peer.testing
    peer.testing           harnesses for tests and benchmarks: the top floor, may import anything; nothing of the
                           product imports it

Why a test: the rule is what lets the foundation and the features be read, tested and replaced on their own; it
erodes one convenient import at a time unless something fails when it is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("peer", "dht", "moe", "averaging")


def layer(module: str) -> str:
    top = module.split(".")[0]
    if top == "peer":
        for sub in ("p2p", "testing"):
            if module == f"peer.{sub}" or module.startswith(f"peer.{sub}."):
                return sub
        return "app"
    return top


ALLOWED = {
    "p2p": {"p2p"},
    "dht": {"p2p", "dht"},
    "moe": {"p2p", "dht", "moe"},
    "averaging": {"p2p", "dht", "averaging"},
    "app": {"p2p", "dht", "moe", "averaging", "app"},
    "testing": {"p2p", "dht", "moe", "averaging", "app", "testing"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "peer":  # `from peer import wire` names submodules
                found += [(node.lineno, f"peer.{alias.name}") if alias.name != "__version__" else (node.lineno, "peer")
                          for alias in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def source_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def violations() -> list[str]:
    problems = []
    for path in source_files():
        own = layer(module_name(path))
        for line, imported in imported_modules(path):
            if imported == "peer":  # the package itself holds only the version string
                continue
            if layer(imported) not in ALLOWED[own]:
                problems.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {imported} ({layer(imported)})")
    return problems


def test_every_import_respects_the_layers():
    assert violations() == []


def test_the_checker_sees_imports_at_any_depth(tmp_path, monkeypatch):
    """A violation inside a function body is found too (lazy imports are still dependencies)."""
    fake_root = tmp_path
    (fake_root / "dht").mkdir()
    (fake_root / "dht" / "sneaky.py").write_text("def f():\n    from moe.server import ExpertServer\n")
    for package in ("peer", "moe", "averaging"):
        (fake_root / package).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    assert violations() == ["dht/sneaky.py:2 (dht) imports moe.server (moe)"]


@pytest.mark.parametrize("package", ["peer.p2p", "dht", "moe", "averaging"])
def test_each_package_names_its_public_api(package):
    """Each package's __init__ says what it offers (a docstring, and `__all__` where it re-exports names)."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"{package}/__init__.py has no docstring naming its public API"
