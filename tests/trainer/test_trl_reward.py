"""``trl.RewardTrainer`` and ``TreepackRewardTrainer`` side by side: a chosen and a rejected
completion share their prompt on tree rows; the reward model reads each at its own last token.

Three SGD steps on 8 preference pairs (prompts of 20 words, completions of 2 to 6 words plus
TRL's EOS): the loss, the gradient norm and TRL's reward metrics equal stock's. Negative
control: the same packed rows read with HF's own pooling of each row (one score per row,
what a packed call gave before the heads were read per sequence) miss stock's loss.
"""

from __future__ import annotations

import pytest
import torch

from helpers.extras import require

trl = require("trl")

from treepack.trainer.hf import run as run_mod  # noqa: E402
from treepack.trainer.hf.task_head import TaskHead  # noqa: E402
from treepack.trainer.trl import TreepackRewardTrainer  # noqa: E402

from helpers.tiny_trl import run_reward  # noqa: E402

METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def test_reward_trainer_matches_stock(tmp_path):
    stock = run_reward(trl.RewardTrainer, workdir=str(tmp_path / "s"))
    packed = run_reward(TreepackRewardTrainer, workdir=str(tmp_path / "p"))
    assert len(stock["loss"]) == 3 and len(set(stock["loss"])) == 3  # the model moves
    assert packed["loss"] == pytest.approx(stock["loss"], abs=1e-6, rel=1e-5)
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], abs=1e-6, rel=1e-5)
    for key in METRICS:
        got = [h[key] for h in packed["logs"] if key in h]
        want = [h[key] for h in stock["logs"] if key in h]
        assert got and got == pytest.approx(want, abs=1e-5, rel=1e-4), key
    saved = [h["treepack/saved_fraction"] for h in packed["logs"] if "treepack/saved_fraction" in h]
    assert saved and min(saved) > 0.3, saved  # each pair's prompt once


def test_negative_control_row_pooling_misses_stock(tmp_path, monkeypatch):
    stock = run_reward(trl.RewardTrainer, workdir=str(tmp_path / "s"), steps=1)

    def rows_pooled(model, batch, **kw):
        """HF's own sequence-classification forward on the rows: one score per row, read per sequence."""
        monkeypatch.setattr(run_mod, "task_head", lambda hf: TaskHead(kind="lm", cls="plain"))
        rows = real(model, batch, verify=False)
        monkeypatch.undo()
        return torch.stack([rows[batch.local_row_of(s)] for s in range(batch.plan.num_sequences)])

    import treepack.trainer.trl.reward as reward_mod

    real = reward_mod.packed_forward
    monkeypatch.setattr(reward_mod, "packed_forward", rows_pooled)
    packed = run_reward(TreepackRewardTrainer, workdir=str(tmp_path / "p"), steps=1)
    assert abs(packed["loss"][0] - stock["loss"][0]) > 1e-3, (packed["loss"], stock["loss"])
