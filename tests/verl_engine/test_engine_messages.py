"""TreepackFSDPEngine tells its user what packing does: the first packed step says it verifies
packing on the model and how long that took; the engine's tally adds up every plan for the
summary printed when the worker exits."""

from __future__ import annotations

from engines import build, flags, grpo_batch

from treepack.trainer.verl import TreepackFSDPEngine


def test_the_first_step_says_it_verifies_and_the_tally_counts_the_plans(capsys):
    eng = build(TreepackFSDPEngine)
    td = flags(grpo_batch(seed=2), dynamic=False, rmpad=True, temperature=1.0, compute_loss=False)
    with eng.eval_mode():
        eng.infer_batch(td)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("treepack:")]
    tally = eng.packing_tally
    assert lines[0].startswith("treepack: verifying packing on this model (") and lines[0].endswith(", sdpa)...")
    assert lines[1] == f"treepack: verifying packing on this model... done in {tally.verify_s:.1f} s"
    assert tally.plans >= 1 and 0 < tally.packed_tokens < tally.unpacked_tokens and tally.rows >= tally.plans
    with eng.eval_mode():  # said once: a second batch only adds to the tally
        eng.infer_batch(flags(grpo_batch(seed=3), dynamic=False, rmpad=True, temperature=1.0, compute_loss=False))
    assert "treepack: verifying" not in capsys.readouterr().out and tally.plans >= 2
    assert tally.summary().startswith(f"treepack: {tally.plans} packed batches in {tally.rows} rows computed ")
