"""TRL's default precision, ``bf16=True``: the drop-ins train next to stock TRL within bf16's noise.

``GRPOConfig`` and ``SFTConfig`` default to bf16 mixed precision (on CPU: bf16 autocast).
``TreepackGRPOTrainer`` and ``TreepackSFTTrainer`` pass the probe at that precision, sample
the same completions as stock TRL, and log loss and grad_norm within the probe's multiple
(4) of bf16's rounding unit (eps / 2 = 2^-8, relative) of stock's; a broken mask is still
refused before the first step (the negative control). ``report_parity`` prints the parity
table once, at the first packed step, without changing the run.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

import trl  # noqa: E402
from trl import GRPOConfig, SFTConfig  # noqa: E402

from treepack.proto.errors import UnsupportedModelError  # noqa: E402
from treepack.trainer.hf.admission.tolerance import MULTIPLE  # noqa: E402
from treepack.trainer.trl import PackingConfig, TreepackGRPOTrainer, TreepackSFTTrainer  # noqa: E402

from helpers.precision import broken_mask  # noqa: E402
from helpers.tiny_trl import run_grpo, run_sft  # noqa: E402

REL = MULTIPLE * torch.finfo(torch.bfloat16).eps / 2  # 4 x bf16's rounding unit


def _default_bf16() -> bool:
    """TRL's default ``bf16`` on this machine (the run helpers pin it: here it is set to it)."""
    grpo = GRPOConfig(output_dir="unused", use_cpu=True).bf16
    assert grpo == SFTConfig(output_dir="unused", use_cpu=True).bf16
    return grpo


def _close(treepack: dict, stock: dict) -> None:
    assert len(treepack["loss"]) == len(stock["loss"]) == 3
    for name in ("loss", "grad_norm"):
        for i, (p, s) in enumerate(zip(treepack[name], stock[name]), start=1):
            assert math.isclose(p, s, rel_tol=REL, abs_tol=1e-5), f"step {i}: {name} {p} vs stock {s}"
    assert treepack["grad_norm"] != stock["grad_norm"], "bf16 rounds: the comparison is not vacuous"


def test_grpo_default_bf16_matches_stock_within_its_noise(tmp_path, capsys):
    bf16 = _default_bf16()
    assert bf16 is True
    stock = run_grpo(trl.GRPOTrainer, workdir=str(tmp_path / "stock"), bf16=bf16)
    packing = PackingConfig(report_parity=True)
    ours = run_grpo(TreepackGRPOTrainer, workdir=str(tmp_path / "ours"), bf16=bf16, trainer_kwargs={"packing": packing})
    assert ours["completions"] == stock["completions"]
    _close(ours, stock)
    out = capsys.readouterr().out
    assert out.count("treepack parity report: Qwen3ForCausalLM") == 1 and "computes in bfloat16" in out
    assert "autocast bfloat16" in out and "checkpointing" in out  # TRL's defaults, as the step runs


def test_sft_default_bf16_matches_stock_within_its_noise(tmp_path):
    bf16 = _default_bf16()
    stock = run_sft(trl.SFTTrainer, workdir=str(tmp_path / "stock"), bf16=bf16)
    ours = run_sft(TreepackSFTTrainer, workdir=str(tmp_path / "ours"), bf16=bf16)
    _close(ours, stock)


def test_a_broken_mask_is_refused_under_bf16_before_the_first_step(tmp_path):
    with broken_mask(), pytest.raises(UnsupportedModelError, match="beyond 4x the bfloat16 noise floor"):
        run_grpo(TreepackGRPOTrainer, workdir=str(tmp_path / "broken"), bf16=_default_bf16(), steps=1)
