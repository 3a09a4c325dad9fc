"""``make help`` (and ``make`` alone) lists every command docs/development.md documents, each
with what it does, and nothing else."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _listed(*argv: str) -> dict[str, str]:
    out = subprocess.run(["make", "-s", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    return dict(re.findall(r"^  ([a-z-]+) +(\S.*)$", out, re.M))


def test_make_help_lists_the_documented_commands():
    if shutil.which("make") is None:
        pytest.skip("needs make on PATH")
    listed = _listed("help")
    documented = set(re.findall(r"^\| `make ([a-z-]+)`", (ROOT / "docs" / "development.md").read_text(), re.M))
    assert set(listed) == documented and {"demo", "test", "help"} <= documented, set(listed) ^ documented
    assert all(len(what) > 10 for what in listed.values()), listed
    assert _listed() == listed  # `make` alone is `make help`: it sets up nothing
