"""``examples/grpo_trl.py`` and ``docs/trl.md``: the CPU form runs with ``--check``, the check
can fail, and the guide names every ``PackingConfig`` field and every metric the run logs."""

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


def test_check_refuses_bf16(capsys):
    with pytest.raises(SystemExit) as exc:
        _example().main(["--check", "--bf16"])
    assert exc.value.code == 2 and "fp32" in capsys.readouterr().err


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
