"""``examples/grpo_trl.py`` and ``docs/trl.md``: the CPU form runs with ``--check`` (fp32, and
``--bf16`` within bf16's noise), the check can fail, and the guide names every ``PackingConfig``
field and every metric the run logs."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from treepack.trainer.trl import PackingConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "trl.md").read_text()


def _example():
    spec = importlib.util.spec_from_file_location("grpo_trl_example", ROOT / "examples" / "grpo_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cpu_example_matches_stock_trl(capsys):
    assert _example().main(["--check", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    steps = re.findall(r"^step \d+: loss \S+  grad_norm \S+  saved (\S+)%  rows (\d+)  plan \S+ ms$", out, re.M)
    assert len(steps) == 2 and all(float(saved) > 30 for saved, _ in steps), out  # prompts were shared
    assert "check: ok: 2 steps" in out


def test_the_check_reports_a_mismatch():
    ex = _example()
    run = {"loss": [0.5, 0.25], "grad_norm": [1.0, 2.0], "completions": ["w1 w2", "w3"]}
    assert ex.compare(run, dict(run)) == []
    off = ex.compare(run, {**run, "grad_norm": [1.0, 2.001]})
    assert off == ["step 2: grad_norm 2 (treepack) vs 2.001 (stock)"]
    assert len(ex.compare(run, {**run, "completions": ["w1 w2", "w4"]})) == 1


def test_the_bf16_example_matches_stock_within_bf16_noise(capsys):
    ex = _example()
    assert ex.main(["--bf16", "--check", "--steps", "1"]) == 0
    assert "check: ok: 1 steps, loss and grad_norm within 1e-5 abs / 0.0156 rel (4x bf16 rounding)" in (
        capsys.readouterr().out
    )
    run = {"loss": [0.5], "grad_norm": [1.0], "completions": ["w1"]}
    assert ex.compare(run, {**run, "grad_norm": [1.01]}, ex.BF16_TOL) == []  # within 4x bf16's unit
    assert len(ex.compare(run, {**run, "grad_norm": [1.03]}, ex.BF16_TOL)) == 1  # the check can fail


def test_the_guide_names_every_packing_field_and_metric():
    table = GUIDE.split("## `PackingConfig`")[1].split("##")[0]
    fields = {f.name: f.default for f in dataclasses.fields(PackingConfig)}
    for name, default in fields.items():
        shown = f'"{default}"' if isinstance(default, str) else repr(default)
        assert re.search(rf"^\| `{name}` \| `{re.escape(shown)}` \|", table, re.M), (name, shown)
    assert len(re.findall(r"^\| `", table, re.M)) == len(fields)  # no field the code lacks
    source = "".join(p.read_text() for p in sorted((ROOT / "trainer_plugin" / "trl").glob("*.py")))
    logged = set(re.findall(r'"(treepack/\w+)"', source))
    assert logged and logged == set(re.findall(r"`(treepack/\w+)`", GUIDE))
