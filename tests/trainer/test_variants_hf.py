"""The oracle on stock HF GPT-OSS (attention sinks) and Llama4 (chunked attention), fp32, CPU.

Tiny random models; a tree plan (depth >= 3, several trees per row, padding, segments
crossing chunk boundaries); every sequence alone through the stock model (eager: HF's own
sink softmax and chunked mask) against the packed rows: logprobs <= 1e-5 on SDPA, the
varlen path (reference kernel) and flex (forward), parameter gradients <= 1e-4 relative
on SDPA and varlen. Negative controls: without the sinks, or without the chunk, the packed
run is far off.
"""

from __future__ import annotations

import pytest
import torch

import treepack.trainer.hf.attention as hf_attention
from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.hf import packed_forward

from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import tiny_gpt_oss, tiny_llama4
from helpers.trees import param_grads, per_sequence_logprobs, scored_loss_pair, tree_plan

VOCAB = 97
CHUNK = 16


FAMILIES = {"gpt_oss": tiny_gpt_oss, "llama4": tiny_llama4}


@pytest.fixture(scope="module")
def plan_case():
    seqs, trainable, plan = tree_plan(40, seq_len=128, trees=3, depth=3, max_len=110, tail=4)
    assert (plan.segments.row_len < plan.seq_len).any(), "no padding"
    assert max(len(s) for s in seqs) > 3 * CHUNK
    return seqs, trainable, materialize(plan, seqs, trainable=trainable)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, FAMILIES[request.param]()


def _alone(model, seqs, grad=False):
    model.set_attn_implementation("eager")
    with torch.set_grad_enabled(grad):
        return [
            torch.log_softmax(
                model(input_ids=torch.as_tensor(s, dtype=torch.int64)[None], use_cache=False).logits[0], -1
            )
            for s in seqs
        ]


def _packed(model, batch, backend, grad=False):
    with torch.set_grad_enabled(grad):
        return torch.log_softmax(packed_forward(model, batch, backend=backend, varlen_fn=naive_varlen_attention), -1)


@pytest.mark.parametrize("backend", ["sdpa", "flash", "flex"])
def test_logprobs_equal_alone(family, plan_case, backend):
    name, model = family
    seqs, _, batch = plan_case
    ref = _alone(model, seqs)
    assert_close(
        f"{name} {backend} logprobs", ref, per_sequence_logprobs(batch, _packed(model, batch, backend)), atol=1e-5
    )


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_grads_equal_alone(family, plan_case, backend):
    name, model = family
    seqs, trainable, batch = plan_case
    ref = _alone(model, seqs, grad=True)
    loss, loss_ref = scored_loss_pair(seqs, trainable, ref, batch, _packed(model, batch, backend, grad=True))
    assert_close(f"{name} {backend} loss", loss_ref.detach(), loss.detach(), atol=1e-5, ratio=1e-5)
    got, want = param_grads(model, loss, loss_ref)
    assert any("sinks" in n for n in want) or name != "gpt_oss"
    assert_close(f"{name} {backend} grads", want, got, ratio=1e-4)


def test_dropping_the_variant_is_caught(family, plan_case, monkeypatch):
    """Negative control: tree attention without the sinks (GPT-OSS) or the chunk (Llama4)."""
    name, model = family
    seqs, _, batch = plan_case
    ref = _alone(model, seqs)
    real = hf_attention.tree_attention
    monkeypatch.setattr(
        hf_attention, "tree_attention", lambda *a, **kw: real(*a, **{**kw, "sinks": None, "chunk_size": None})
    )
    assert_not_close(
        f"{name} variant dropped", ref, per_sequence_logprobs(batch, _packed(model, batch, "sdpa")), atol=1e-3
    )
