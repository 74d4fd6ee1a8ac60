"""The layering rule and the absence of import cycles, checked on the code itself (every import statement, at any
depth, of every module).

    peer.p2p (foundation)  imports nothing of dht, moe, averaging or the application modules of peer
    dht                    imports only the foundation
    moe, averaging         import dht and the foundation, never each other nor the application
    peer (application)     may import anything but peer.testing
    peer.testing           harnesses for tests and benchmarks: the top floor, may import anything; nothing of the
                           product imports it

No import cycles between modules either, counting imports inside functions (a function-level import hides a cycle
from Python at import time, not from the reader: the two modules still cannot be understood or changed apart).
Imports under `if TYPE_CHECKING:` are left out of the cycle check (they never run); the layering check sees them.

No file under tests/ or benchmarks/ imports a test module (one named test_*): helpers and fixtures that several
test modules share live in harness modules (peer.testing for those the benchmarks use too, e.g.
peer/testing/sim_peers.py; tests/averaging/diloco_sim.py...) or a conftest.py, so a test module can be run, read and
changed alone, and pytest never imports one test module under two names. Code in string constants (scripts run with
`python -c`) counts too.

Why a test: the rule is what lets the foundation and the features be read, tested and replaced on their own; it
erodes one convenient import at a time unless something fails when it is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(tree: ast.AST, *, runtime_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth (`runtime_only`: not those under `if TYPE_CHECKING:`)."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif runtime_only and _is_type_checking(node):
            assert isinstance(node, ast.If)
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda node: node.lineno)


def imported_modules(path: Path, *, runtime_only: bool = False) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in _import_nodes(tree, runtime_only=runtime_only):
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
            elif runtime_only:  # `from package import module` depends on that module
                found += [(node.lineno, f"{module}.{alias.name}") if _is_module(f"{module}.{alias.name}")
                          else (node.lineno, module) for alias in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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


def import_graph() -> dict[str, set[str]]:
    """module -> the product modules it imports at run time (at any depth)."""
    modules = {module_name(path): path for path in source_files()}
    return {name: {imported for _, imported in imported_modules(path, runtime_only=True)
                   if imported in modules and imported != name}
            for name, path in modules.items()}


def import_cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return sorted(cycles)


# Cycles known and being taken apart: none left (the application layer's went when the tasks' shared pieces moved
# to peer.tasks, the --model value type to peer.options and the training epilog out of the CLI). A cycle listed
# here may only shrink or split; a new one, or one that grows, fails. Remove an entry once its cycle is gone.
KNOWN_CYCLES: list[set[str]] = []


def test_no_new_import_cycles():
    cycles = import_cycles()
    new = [cycle for cycle in cycles if not any(set(cycle) <= known for known in KNOWN_CYCLES)]
    assert new == [], f"import cycles (function-level imports included): {new}"
    gone = [sorted(known) for known in KNOWN_CYCLES if not any(set(cycle) <= known for cycle in cycles)]
    assert gone == [], f"these cycles are gone: remove them from KNOWN_CYCLES in tests/peer/test_layers.py: {gone}"


def test_the_cycle_check_sees_function_level_imports_and_skips_type_checking_ones(tmp_path, monkeypatch):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "a.py").write_text("from moe import b\n")
    (tmp_path / "moe" / "b.py").write_text("def f():\n    from moe.a import g\n")
    (tmp_path / "moe" / "c.py").write_text("from moe.a import g\n")
    (tmp_path / "moe" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from moe.c import h\nelse:\n    import moe.e\n")
    (tmp_path / "moe" / "e.py").write_text("import moe.d\n")
    for package in ("peer", "dht", "averaging"):
        (tmp_path / package).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_cycles() == [["moe.a", "moe.b"], ["moe.d", "moe.e"]]


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


# ------------------------------------------------------------------------------------------- tests' own imports

TEST_TREES = ("tests", "benchmarks")


def _code_in(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """The module itself and every string constant in it that parses as code importing something (a script run
    with `python -c`), each with the line it starts on."""
    found: list[tuple[int, ast.AST]] = [(0, tree)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                found.append((node.lineno - 1, ast.parse(node.value)))
            except SyntaxError:
                continue
    return found


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split("."))


def _module_file_in(folders: list[Path], name: str) -> bool:
    return any((folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file() for folder in folders)


def imports_of_test_modules(path: Path) -> list[str]:
    """'FILE:LINE: IMPORT' for each import in `path` (at any depth, strings of code included) of a module named
    test_*: `import tests.test_x`, `from tests.test_x import y`, `from tests import test_x`, `from .test_x import y`,
    `from test_x import y` (the test's own folder is on sys.path under pytest)."""
    where = path.relative_to(ROOT)
    found: list[tuple[int, str]] = []
    for offset, tree in _code_in(ast.parse(path.read_text(), str(path))):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad = any(_is_test_module(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative: from the importing file's folder, one level up per extra dot
                    folders = [path.parents[node.level - 1].joinpath(*module.split(".") if module else ())]
                else:
                    folders = [ROOT.joinpath(*module.split(".")), path.parent.joinpath(*module.split("."))]
                bad = _is_test_module(module) or any(
                    alias.name.startswith("test_") and _module_file_in(folders, alias.name) for alias in node.names)
            else:
                continue
            if bad:
                found.append((offset + node.lineno, ast.unparse(node)))
    return [f"{where}:{line}: {statement}" for line, statement in sorted(found)]


def imported_test_modules() -> list[str]:
    """`imports_of_test_modules` of every file under tests/ and benchmarks/."""
    return [problem for tree in TEST_TREES for path in sorted((ROOT / tree).rglob("*.py"))
            for problem in imports_of_test_modules(path)]


def test_no_test_imports_a_test_module():
    imports = imported_test_modules()
    assert imports == [], ("these files import test modules: move what they share into a harness module (a name "
                           "not starting with test_) or a conftest.py, and import it from there in every user:\n"
                           + "\n".join(imports))


def test_the_test_import_check_sees_every_form_of_import(tmp_path, monkeypatch):
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("x = 1\n")
    (tmp_path / "tests" / "sub" / "test_b.py").write_text("x = 1\n")
    (tmp_path / "tests" / "harness.py").write_text("def test_like():\n    pass\n")
    name, other = "test_a", "test_b"  # (the checker reads this file's strings of code too)
    (tmp_path / "tests" / "sub" / "test_c.py").write_text(
        f"import tests.{name}\n"
        f"from tests.{name} import x\n"
        f"from tests import {name}, harness\n"
        f"from .. import {name}\n"
        f"from ..{name} import x\n"
        f"from test_b import x\n"
        f"from tests.harness import test_like\n"  # a function named test_*, not a module: allowed
        f"def f():\n    import tests.sub.test_b\n"
        f"SCRIPT = 'import sys; from tests.{name} import x'\n")
    (tmp_path / "benchmarks" / "bench.py").write_text(f"from tests.sub.{other} import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imported_test_modules() == [
        "tests/sub/test_c.py:1: import tests.test_a",
        "tests/sub/test_c.py:2: from tests.test_a import x",
        "tests/sub/test_c.py:3: from tests import test_a, harness",
        "tests/sub/test_c.py:4: from .. import test_a",
        "tests/sub/test_c.py:5: from ..test_a import x",
        "tests/sub/test_c.py:6: from test_b import x",
        "tests/sub/test_c.py:9: import tests.sub.test_b",
        "tests/sub/test_c.py:10: from tests.test_a import x",
        "benchmarks/bench.py:1: from tests.sub.test_b import x",
    ]


# ------------------------------------------------------------------------------------------------ room sizes

MAX_CLASS_LINES = 500  # issue 37: a class past this holds several jobs; split it into collaborators it owns


def oversized_classes(limit: int = MAX_CLASS_LINES) -> list[str]:
    """Every class of the product packages longer than `limit` lines (docstring included), as path:line name."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    length = node.end_lineno - node.lineno + 1
                    if length > limit:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_class_is_over_500_lines():
    assert oversized_classes() == []


def test_the_size_check_counts_a_class_from_its_header_to_its_last_line(tmp_path, monkeypatch):
    (tmp_path / "peer").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(9))
    (tmp_path / "peer" / "big.py").write_text(f'class Big:\n    """doc"""\n{body}\n\n\nclass Small:\n    y = 1\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert oversized_classes(limit=10) == ["peer/big.py:1 Big (11 lines)"]
