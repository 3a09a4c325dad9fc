"""``treepack.trainer.parity_report`` and ``treepack check``: the figures, the table, the command.

The report's packed drift stays within the probe's multiple of the noise floor in fp32 and
under bf16 autocast, while a broken mask (the negative control) lands far above it and
crosses a PPO clip band the packed rows do not; the caller's random stream and ``.grad``
are left alone. ``treepack check`` prints the same table for a model saved on disk, and
without torch says which extra to install.
"""

from __future__ import annotations

import builtins
import re

import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.service.cli import main
from treepack.trainer import materialize, parity_report
from treepack.trainer.hf.admission.tolerance import MULTIPLE
from treepack.trainer.hf.parity import parameter_group

from helpers.families import model_support, window_case
from helpers.precision import broken_mask
from helpers.trainer_cases import plan_of

ms = model_support()


@pytest.fixture(scope="module")
def batch():
    c = window_case(ms.VOCAB)
    return materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_packed_within_the_noise_floor_and_a_broken_mask_far_above(batch, autocast):
    model = ms.build_causal_lm("qwen3").train()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    state = torch.get_rng_state()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        rep = parity_report(model, batch, epsilon=0.01)
        with broken_mask():
            bad = parity_report(model, batch, epsilon=0.01, grads=False)
    assert torch.equal(torch.get_rng_state(), state) and all(bool((p.grad == 7.0).all()) for p in model.parameters())
    assert rep.compute_dtype == ("bfloat16" if autocast else "float32")
    assert rep.sequences == 4 and rep.tokens == sum(
        int((~torch.isnan(x)).sum())
        for x in batch.unpack_logprobs(batch.target_logprobs(torch.zeros(*batch.input_ids.shape, ms.VOCAB)))
    )
    assert set(rep.drift) == {"packed", "right-padded", "reordered, 2 batches"}
    assert rep.ratio <= MULTIPLE and rep.grad_ratio <= MULTIPLE and rep.drift["packed"].clipped == 0
    assert bad.drift["packed"].max / rep.noise_floor > 10 * MULTIPLE and bad.drift["packed"].clipped > 0
    assert rep.drift["packed"].p50 <= rep.drift["packed"].p99 <= rep.drift["packed"].max
    groups = [g for g, _, _ in rep.grads]
    assert "model.layers.*.mlp.up_proj.weight" in groups and len(groups) == len(set(groups))
    table = rep.table()
    assert "| packed |" in table and "| right-padded |" in table and "PPO clip crossings (eps 0.01)" in table
    assert re.search(r"packed max logprob drift = [\d.]+x the noise floor \(the probe accepts up to 4x\)", table)


def test_bad_arguments_are_refused(batch):
    model = ms.build_causal_lm("qwen3")
    with pytest.raises(RequestError, match="epsilon must be > 0"):
        parity_report(model, batch, epsilon=0.0)
    with pytest.raises(RequestError, match="sequences must be >= 1"):
        parity_report(model, batch, sequences=0)
    assert parameter_group("model.layers.12.mlp.up_proj.weight") == "model.layers.*.mlp.up_proj.weight"
    assert parameter_group("lm_head.weight") == "lm_head.weight"


def test_treepack_check_prints_the_table(tmp_path, capsys):
    from helpers.tiny_trl import tiny_model

    tiny_model(vocab=200, hidden=32).save_pretrained(tmp_path / "m")
    rc = main(["check", "--model", str(tmp_path / "m"), "--autocast", "bf16", "--sequences", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "computes in bfloat16; 4 sequences" in out and "| reordered, 2 batches |" in out
    assert "| model.layers.*.self_attn.q_proj.weight |" in out
    assert main(["check", "--model", str(tmp_path / "nothing-here")]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_treepack_check_without_torch_names_the_extra(monkeypatch, capsys):
    real = builtins.__import__

    def no_torch(name, *a, **kw):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'", name="torch")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert main(["check", "--model", "any"]) == 2
    err = capsys.readouterr().err
    assert "needs the trainer extra (torch is missing)" in err and "treepack[trainer]" in err
