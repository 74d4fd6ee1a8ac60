"""No product module reads an environment variable, except the documented ones below.

Why: a variable read by product code is a setting nobody sees in `--help` or the docs, and a test hook read from
the environment can change any user's peer (one used to turn any DiLoCo trainer Byzantine). Test hooks are
constructor arguments or hook objects that tests pass in; settings are options (peer/options.py).

A grep, not an import-time check: it sees every spelling (`os.environ`, `os.getenv`, `from os import environ`,
`os.environb`) in every branch, including code no test runs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("peer", "dht", "moe", "averaging")
TEST_TOOLS = ("peer/testing/",)  # harnesses for tests and benchmarks, never imported by the product
READS = re.compile(r"\b(environb?|getenv|getenvb|putenv|unsetenv)\b")

# file -> why it may touch the environment (it reads no setting from it)
ALLOWED = {
    "peer/swarm.py": "`peer swarm up` hands its own environment on to the peers it starts (adding "
                     "PYTHONUNBUFFERED and OMP_NUM_THREADS)",
}


def environment_reads() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative in ALLOWED or relative.startswith(TEST_TOOLS):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if READS.search(code):
                    found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_product_module_reads_the_environment():
    assert environment_reads() == [], "pass a constructor argument or add an option instead"


def test_every_allowed_file_still_needs_its_exception():
    for relative in ALLOWED:
        assert READS.search((ROOT / relative).read_text()), f"{relative} no longer touches the environment: " \
                                                             f"remove it from ALLOWED"


def test_the_grep_sees_every_spelling(tmp_path, monkeypatch):
    (tmp_path / "dht").mkdir()
    (tmp_path / "dht" / "hook.py").write_text(
        "import os\nfrom os import environ as e\nX = os.getenv('SWARMD_X')  # a hook\n"
        "# os.environ in a comment is fine\nsettings = {}\n")
    for package in ("peer", "moe", "averaging"):
        (tmp_path / package).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [line.split(":")[1] for line in environment_reads()] == ["2", "3"]
