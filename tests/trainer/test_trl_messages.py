"""The TRL drop-ins tell their user what packing does: on the first packed step that it
verifies packing on the model (and how long that took), after ``train()`` what it saved."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from helpers.extras import require

trl = require("trl")

from treepack.trainer.planning.tally import PackingTally  # noqa: E402
from treepack.trainer.trl import PackingConfig, TreepackSFTTrainer  # noqa: E402

from helpers.tiny_trl import run_sft  # noqa: E402


def test_the_tally_by_hand():
    lines: list[str] = []
    t = PackingTally(say=lines.append)
    assert t.summary() == "treepack: nothing was packed"
    t.add(SimpleNamespace(rows=2, unpacked_tokens=1000, packed_tokens=400), 3.0)
    t.add(SimpleNamespace(rows=1, unpacked_tokens=500, packed_tokens=350), 5.0)
    assert t.summary() == (
        "treepack: 2 packed batches in 3 rows computed 750 of 1,500 tokens (50.0% saved, 750 tokens not computed); "
        "planning took 0.01 s (4.0 ms per batch)"
    )
    model = SimpleNamespace()
    with t.first_step(model, "sdpa"):
        pass
    with t.first_step(model, "sdpa"):  # said once
        pass
    assert lines[0] == "treepack: verifying packing on this model (SimpleNamespace, sdpa)..."
    assert re.fullmatch(r"treepack: verifying packing on this model\.\.\. done in \d+\.\d s", lines[1])
    assert len(lines) == 2 and t.verify_s is not None
    quiet = PackingTally(say=None)
    with quiet.first_step(model, "flex", verify=False):
        quiet.report()  # nothing to say it to


def test_sft_says_it_verifies_on_the_first_step_and_sums_up_after_training(tmp_path, capsys):
    out = run_sft(TreepackSFTTrainer, workdir=str(tmp_path / "p"), steps=2)
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("treepack:")]
    tally = out["trainer"].packing_tally
    assert printed[0] == "treepack: verifying packing on this model (Qwen3ForCausalLM, sdpa)..."
    assert printed[1] == f"treepack: verifying packing on this model... done in {tally.verify_s:.1f} s"
    assert printed[2:] == [tally.summary()] and len(printed) == 3
    # The summary adds up what TRL logged, plan by plan.
    logged = [h for h in out["logs"] if "treepack/rows" in h]
    assert tally.plans == 2 and tally.rows == sum(h["treepack/rows"] for h in logged)
    assert tally.plan_ms == pytest.approx(sum(h["treepack/plan_ms"] for h in logged))
    saved = 1 - tally.packed_tokens / tally.unpacked_tokens
    assert saved == pytest.approx(sum(h["treepack/saved_fraction"] for h in logged) / 2, abs=0.1) and saved > 0.15
    assert f"({saved:.1%} saved" in printed[2]


def test_a_quiet_config_prints_nothing(tmp_path, capsys):
    out = run_sft(
        TreepackSFTTrainer,
        workdir=str(tmp_path / "q"),
        steps=1,
        trainer_kwargs={"packing": PackingConfig(verbose=False)},
    )
    assert "treepack:" not in capsys.readouterr().out
    assert out["trainer"].packing_tally.plans == 1  # still counted
