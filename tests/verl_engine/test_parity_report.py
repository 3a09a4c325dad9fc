"""``TREEPACK_VERL_REPORT_PARITY``: the engine prints the parity report once, at its first packed forward.

The report runs on the FSDP-wrapped module, under the engine's autocast, on the first
micro-batch: packed drift within the probe's multiple of the noise floor. Its negative
control: with a broken mask (plain causal packing) the printed drift is far above the
multiple, and the probe then refuses the forward.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from engines import build, flags, grpo_batch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer.hf.admission.tolerance import MULTIPLE
from treepack.trainer.verl import TreepackFSDPEngine, VerlPacking

from helpers.precision import broken_mask


def _reporting_engine() -> TreepackFSDPEngine:
    eng = build(TreepackFSDPEngine)
    eng.packing = dataclasses.replace(eng.packing, report_parity=True)
    return eng


def _infer(eng) -> None:
    td = flags(grpo_batch(seed=1), dynamic=False, rmpad=True, calculate_entropy=False, compute_loss=False)
    with eng.eval_mode():
        eng.infer_batch(td)


def _ratio(out: str) -> float:
    return float(re.search(r"packed max logprob drift = ([\d.]+)x the noise floor", out).group(1))


def test_the_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("TREEPACK_VERL_REPORT_PARITY", "1")
    assert VerlPacking.from_env().report_parity is True
    monkeypatch.setenv("TREEPACK_VERL_REPORT_PARITY", "0")
    assert VerlPacking.from_env().report_parity is False


def test_the_report_is_printed_once_within_the_noise_floor(capsys):
    eng = _reporting_engine()
    _infer(eng)
    _infer(eng)
    out = capsys.readouterr().out
    assert out.count("treepack parity report: Qwen2ForCausalLM") == 1, out
    assert "| packed |" in out and "| right-padded |" in out
    assert _ratio(out) <= MULTIPLE


def test_a_broken_mask_is_reported_far_above_the_floor_and_refused(capsys):
    eng = _reporting_engine()
    with broken_mask(), pytest.raises(UnsupportedModelError, match="noise floor"):
        _infer(eng)
    assert _ratio(capsys.readouterr().out) > 10 * MULTIPLE
