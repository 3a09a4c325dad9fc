"""The ``treepack`` command as a process: ``python -m treepack.service.cli bench`` and the installed script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def test_bench_runs_with_progress(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "treepack.service.cli",
            "bench",
            "--only",
            "golden",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[golden] generated 32 sequences" in proc.stdout
    recs = json.loads(out.read_text())
    assert {r["placement"] for r in recs} == {"auto", "bfd", "in_order", "no_share"}
    assert all(r["naive_bfd_ms"] is not None for r in recs)
    assert np.isfinite([r["total_ms"] for r in recs]).all()


def test_the_installed_treepack_command_plans_stdin():
    script = Path(sys.executable).with_name("treepack")  # pyproject's [project.scripts] entry
    if not script.exists():
        pytest.skip("treepack is not installed in this environment (pip install -e .)")
    lines = "".join(json.dumps({"tokens": list(range(100)) + [500 + i], "prompt_len": 100}) + "\n" for i in range(3))
    proc = subprocess.run(
        [str(script), "plan", "-", "--seq-len", "512", "--json"],
        input=lines,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # 99 shared prompt tokens, then per sequence the join token (position 99) and its completion token.
    assert out["tree_tokens"] == 99 + 3 * 2 and out["rows"] == 1 and out["sequences"] == 3
