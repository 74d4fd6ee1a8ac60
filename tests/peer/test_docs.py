"""The documentation stays true: the generated CLI reference matches peer/options.py, README stays short and its
links resolve, the commands and Python examples shown in README.md and docs/ parse, every metric is documented,
no page keeps a commit hash, and nothing points outside the repository.

The site itself (broken links and anchors between pages, pages missing from the nav, API references that do not
resolve) is checked by `make docs` (mkdocs build --strict), which `make test` runs.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from peer.cli import build_parser
from peer.options import UsageError

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README = ROOT / "README.md"
BENCHMARKS = ROOT / "benchmarks" / "README.md"
README_LIMIT = 10 * 1024


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_generated_from_the_current_options():
    gen_cli = _gen_cli()
    committed = (DOCS / "reference" / "cli.md").read_text()
    assert committed == gen_cli.render(), "docs/reference/cli.md is stale: run `python docs/gen_cli.py`"


def test_the_cli_reference_names_every_option_of_every_command():
    from peer.options import COMMANDS

    page = (DOCS / "reference" / "cli.md").read_text()
    for command, option_set in COMMANDS.items():
        assert f"## `peer {command}`" in page
        for option in option_set.options:
            assert f"`{option.flag}" in page or f"<code>{option.flag}" in page, (command, option.flag)


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it under {README_LIMIT} (details go in docs/)"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [README, BENCHMARKS], ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_outside_the_site_resolve(page):
    for target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"


def _code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [body for language, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S) if language in languages]


def _peer_commands() -> list[tuple[str, str]]:
    """Every `peer ...` line of a bash block in README.md and docs/, with the file it is in."""
    commands = []
    for page in [README, *PAGES]:
        for block in _code_blocks(page.read_text(), ("bash",)):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line.startswith("peer "):  # (a line that sets PYTHONPATH first names the user's own module)
                    commands.append((str(page.relative_to(ROOT)), line))
    return commands


def test_the_commands_shown_in_the_docs_parse():
    commands = _peer_commands()
    assert len(commands) > 10
    for page, line in commands:
        words = shlex.split(line, comments=True)
        words = words[: words.index(">")] if ">" in words else words  # output redirected to a file
        try:
            build_parser().parse_args(words[1:])
        except (UsageError, SystemExit) as error:
            pytest.fail(f"{page}: `{line}` does not parse: {error}")


def test_the_python_examples_in_the_docs_compile():
    blocks = [(page, block) for page in [README, *PAGES] for block in _code_blocks(page.read_text(), ("python",))]
    assert len(blocks) > 5
    for page, block in blocks:
        try:
            compile(block, str(page), "exec", flags=0x2000)  # PyCF_ALLOW_TOP_LEVEL_AWAIT: examples may await
        except SyntaxError as error:
            pytest.fail(f"{page.relative_to(ROOT)}: a Python example does not compile: {error}")


def test_every_metric_is_documented():
    names = set(re.findall(r'"(swarmd_[a-z_]+)"', (ROOT / "peer" / "metrics.py").read_text()))
    assert names
    page = (DOCS / "reference" / "metrics.md").read_text()
    missing = sorted(name for name in names if f"`{name}`" not in page)
    assert not missing, f"docs/reference/metrics.md lacks {missing}"


def _commits(words: set[str]) -> list[str]:
    """The words that name a commit of this repository (none when git or the history is not there)."""
    if not words or not (ROOT / ".git").exists():
        return []
    result = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True,
                            input="".join(f"{word}^{{commit}}\n" for word in sorted(words)))
    if result.returncode != 0:
        return []
    # one line per word, in order: "<sha> commit <size>" for a commit, "<word>^{commit} missing" otherwise
    return [word for word, line in zip(sorted(words), result.stdout.splitlines()) if line.split()[1:2] == ["commit"]]


def test_no_page_keeps_commit_hashes():
    """The history lives in git, not in the pages: no README, docs page or benchmark figure names a commit."""
    for page in [README, BENCHMARKS, *PAGES]:
        words = set(re.findall(r"\b[0-9a-f]{7,40}\b", page.read_text()))
        found = _commits({word for word in words if re.search(r"[a-f]", word) and re.search(r"[0-9]", word)})
        assert not found, f"{page.relative_to(ROOT)} names commits {found}: the history stays in git"


def test_nothing_points_at_a_folder_outside_the_repository():
    outside = "../" + "shared"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.is_file() and path.suffix in {".md", ".py", ".toml", ".yml", ".yaml", ".sh", ".cfg", ".txt", ""}:
            try:
                if outside in path.read_text():
                    offenders.append(name)
            except UnicodeDecodeError:
                continue
    assert not offenders, f"{offenders} point at {outside}"
