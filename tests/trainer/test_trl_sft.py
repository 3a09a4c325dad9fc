"""``trl.SFTTrainer`` and ``TreepackSFTTrainer`` side by side: 4 completions per prompt share it."""

from __future__ import annotations

import pytest

from helpers.extras import require

trl = require("trl")

from treepack.proto.errors import RequestError  # noqa: E402
from treepack.trainer.trl import TreepackSFTTrainer  # noqa: E402

from helpers.tiny_trl import run_sft  # noqa: E402


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_matches_stock(tmp_path, loss_type):
    stock = run_sft(trl.SFTTrainer, workdir=str(tmp_path / "s"), loss_type=loss_type)
    packed = run_sft(TreepackSFTTrainer, workdir=str(tmp_path / "p"), loss_type=loss_type)
    assert len(stock["loss"]) == 3
    assert packed["loss"] == pytest.approx(stock["loss"], abs=1e-5, rel=1e-4)
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], abs=1e-5, rel=1e-4)
    ent = lambda r: [h["entropy"] for h in r["logs"] if "entropy" in h]  # noqa: E731
    assert ent(packed) == pytest.approx(ent(stock), abs=1e-5, rel=1e-4)
    saved = [h["treepack/saved_fraction"] for h in packed["logs"] if "treepack/saved_fraction" in h]
    assert saved and min(saved) > 0.15, saved  # the sampler mixes prompts: some rows of each batch share one


def test_sft_refuses_padding_free(tmp_path):
    with pytest.raises(RequestError, match="padding_free"):
        run_sft(TreepackSFTTrainer, workdir=str(tmp_path / "p"), padding_free=True, max_length=None, steps=1)
