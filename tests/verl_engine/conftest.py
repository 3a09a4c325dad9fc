"""The verl test env: ``make test-verl`` (``.venv-verl``: verl 0.9.1, CPU torch, no TRL).

The main ``make test`` run never collects this folder (``tests/conftest.py`` ignores it
unless named). Named without verl installed, the folder is skipped with the reason, except
with ``CI`` set, where a missing verl is a collection error (a red run, never a silent skip).

One process, one gloo rank: the CPU shim (``cpu_shim.install``) is installed once here.
"""

from __future__ import annotations

import os
import tempfile

import pytest

try:
    import verl  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("verl is not installed: run `make test-verl` (.venv-verl)", allow_module_level=True)

import cpu_shim  # noqa: E402  (tests/verl_engine is on sys.path through rootdir-relative conftest import)

cpu_shim.install(init_file=tempfile.mktemp(prefix="treepack-verl-gloo-"))


def pytest_terminal_summary(terminalreporter):
    """The parity table of this run: max abs error per config (log-probs, entropies, update)."""
    import sys

    rows = getattr(sys.modules.get("engines"), "PARITY", [])
    if rows:
        terminalreporter.section("treepack vs stock verl (max abs error)")
        for name, lp, ent, grad in rows:
            terminalreporter.write_line(f"{name:60s} logp {lp:.2e}  entropy {ent:.2e}  update {grad:.2e}")
