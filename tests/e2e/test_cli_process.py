"""``python -m treepack.service.cli`` as a process: the benchmark prints progress and writes its records."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np


def test_bench_runs_with_progress(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "treepack.service.cli", "bench", "--only", "golden", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[golden] generated 32 sequences" in proc.stdout
    recs = json.loads(out.read_text())
    assert {r["placement"] for r in recs} == {"auto", "bfd", "in_order", "no_share"}
    assert all(r["naive_bfd_ms"] is not None for r in recs)
    assert np.isfinite([r["total_ms"] for r in recs]).all()
