"""Reward models and value heads on tree rows: each sequence's score and values equal it run alone.

A ``*ForSequenceClassification`` (reward model) gives one score per sequence, read at the
sequence's own pooled token (HF's rule applied to the sequence alone: its last token that is
not the pad id); a ``*ForTokenClassification`` (a PPO value head) gives per-token values
unpacked per sequence. On a GRPO batch (two prompts of four completions, completions ending
in the pad id or holding it inside, one a prefix of another) of three families (Llama: RoPE
and GQA; Qwen3: q/k norm; GPT-2: learned absolute positions and its own head classes),
scores, values and parameter gradients equal each sequence alone with the probe on (the
first call of each model proves it). Negative controls: HF's own pooling of the rows (one
score per row: what the packed call gave before), a plain causal mask over the row, values
read as if the sequences lay end to end, and each sequence's last token without the pad
rule all differ; the probe refuses a planted position-mixing hook on the score module. Any
other head is refused by name before any compute.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.trainer import materialize
from treepack.trainer.data.values import naive_last_token
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf import run as run_mod
from treepack.trainer.hf.admission import forget_probes, verify_model
from treepack.trainer.hf.task_head import TaskHead, task_head

from helpers.families import model_support
from helpers.heads import PAD, alone_outputs, grpo_case, head_model, head_oracle
from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import plan_of, random_batch

ms = model_support()

FAMILIES = ("llama", "qwen3", "gpt2")
OUT_TOL = 1e-5  # fp32: scores and values within rounding of each sequence alone
GAP = 1e-3  # a negative control misses by more than this


@pytest.fixture(scope="module")
def case():
    c = grpo_case()
    batch = materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])
    assert batch.plan.stats.saved_fraction > 0.3  # the prompts are shared
    return c, batch


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("head", ["sequence", "token"])
def test_head_outputs_and_gradients_equal_each_sequence_alone(case, model_type, head):
    c, batch = case
    model = head_model(model_type, head)
    alone, packed, g_alone, g_packed = head_oracle(model, batch, c["sequences"])  # the probe runs first
    assert_close(f"{model_type} {head} outputs", alone, packed, atol=OUT_TOL, nonzero_ref=True)
    assert ms.grad_error(g_alone, g_packed) <= ms.GRAD_RTOL, ms.grad_error(g_alone, g_packed)
    if head == "sequence":
        assert all(a.shape == (1,) for a in alone)
    else:
        assert [a.shape[0] for a in alone] == [len(s) for s in c["sequences"]]


def _broken(batch):
    """The batch with a plain causal mask over each whole row (every token sees all before it)."""
    return dataclasses.replace(batch, subtree_end=torch.full_like(batch.subtree_end, batch.seq_len), _cache={})


@pytest.mark.parametrize("model_type", FAMILIES)
def test_negative_controls_reward_model(case, model_type, monkeypatch):
    c, batch = case
    model = head_model(model_type, "sequence")
    with torch.no_grad():
        alone = torch.stack(alone_outputs(model, c["sequences"]))
        assert_close("scores", alone, packed_forward(model, batch), atol=OUT_TOL)
        assert_not_close("broken mask", alone, packed_forward(model, _broken(batch), verify=False), atol=GAP)
        # HF's pooling of the rows (the call as a causal LM would make it): one score per row.
        monkeypatch.setattr(run_mod, "task_head", lambda hf: TaskHead(kind="lm", cls="plain"))
        rows = packed_forward(model, batch, verify=False)
        assert rows.shape == (batch.num_rows, 1)
        per_row = torch.stack([rows[batch.local_row_of(s)] for s in range(len(c["sequences"]))])
        assert_not_close("HF's pooling of the rows", alone, per_row, atol=GAP)
        # Each sequence at its last token, the pad rule left out: off exactly where a sequence ends in PAD.
        monkeypatch.setattr(run_mod, "task_head", lambda hf: dataclasses.replace(task_head(hf), pad_token_id=None))
        last = packed_forward(model, batch, verify=False)
    ends = torch.tensor([int(s[-1]) == PAD for s in c["sequences"]])
    assert bool(ends.any()) and not bool(ends.all())
    assert_close("last token, no pad at the end", alone[~ends], last[~ends], atol=OUT_TOL)
    assert_not_close("last token, pad rule left out", alone[ends], last[ends], atol=GAP)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_negative_controls_value_head(case, model_type):
    c, batch = case
    model = head_model(model_type, "token")
    with torch.no_grad():
        alone = alone_outputs(model, c["sequences"])
        values = packed_forward(model, batch)
        assert_close("values", alone, batch.unpack_values(values), atol=OUT_TOL)
        broken = packed_forward(model, _broken(batch), verify=False)
    assert_not_close("broken mask", alone, _broken(batch).unpack_values(broken), atol=GAP)
    # Read as if each sequence lay end to end from its first row position (no tree).
    linear = []
    for s in range(len(c["sequences"])):
        row, idx = batch.locate(s)
        linear.append(values[row, int(idx[0]) : int(idx[0]) + len(idx)])
    assert_not_close("sequences read end to end", alone, linear, atol=GAP)


def test_probe_refuses_a_position_mixing_hook_on_the_score_module():
    """A hook the guards trust (its code claims to be torch's) mixes positions after the score
    module: each row's scores then depend on the other sequences of the row. The probe compares
    the scores and names the module."""

    def mixing(module, args, out):
        return out + 0.1 * out.cumsum(1)

    mixing.__module__ = "torch.planted"
    for head in ("sequence", "token"):
        model = head_model("qwen3", head)
        verify_model(model)  # the clean model passes
        model.score.register_forward_hook(mixing)
        forget_probes(model)
        with pytest.raises(UnsupportedModelError, match=r"(scores|values) by .* first diverging forward output: score"):
            verify_model(model)


@pytest.mark.parametrize(
    "auto", ["AutoModelForQuestionAnswering", "AutoModelForMaskedLM"], ids=["question-answering", "masked-lm"]
)
def test_other_heads_are_refused_by_name_before_compute(case, auto):
    import transformers

    _, batch = case
    config = ms.shrink_config(transformers.AutoConfig.for_model("llama"))
    try:
        model = getattr(transformers, auto).from_config(config)
    except ValueError:  # no such head for Llama: a head class of its own
        model = transformers.LlamaForQuestionAnswering(config)
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    name = type(model).__name__
    with pytest.raises(UnsupportedModelError, match=rf"{name} is not a head treepack runs on tree rows") as e:
        packed_forward(model, batch)
    assert e.value.refusals[0][1] == name and calls == []


def test_classification_heads_refuse_hidden_output_and_labels(case):
    _, batch = case
    for head in ("sequence", "token"):
        model = head_model("llama", head)
        with pytest.raises(UnsupportedModelError, match=rf"a {head}-classification head gives its outputs with"):
            packed_forward(model, batch, output="hidden")
        with pytest.raises(RequestError, match="labels= passed to packed_forward: HF's loss shifts labels"):
            packed_forward(model, batch, labels=torch.zeros(batch.num_rows, dtype=torch.int64))


def test_a_sequence_head_pooling_otherwise_is_refused(case):
    _, batch = case
    model = head_model("llama", "sequence")

    def forward(self, input_ids=None, **kw):  # pools the first token: not HF's rule
        from transformers.modeling_outputs import SequenceClassifierOutputWithPast

        hidden = self.model(input_ids=input_ids, **kw).last_hidden_state
        return SequenceClassifierOutputWithPast(logits=self.score(hidden)[:, 0])

    model.__class__ = type("FirstTokenRM", (type(model),), {"forward": forward})
    with pytest.raises(UnsupportedModelError, match="does not pool at the last non-pad token"):
        packed_forward(model, batch)


def test_the_pad_id_is_left_as_found_when_none(case):
    c, batch = case
    model = head_model("llama", "sequence", pad_token_id=None)
    with torch.no_grad():
        alone = torch.stack(alone_outputs(model, c["sequences"]))
        assert_close("scores without a pad id (last token)", alone, packed_forward(model, batch), atol=OUT_TOL)
    assert model.config.pad_token_id is None
    with pytest.raises(ValueError, match="no padding token"):  # HF alone, as before: a batch of 2 refused
        model(input_ids=torch.ones(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("seed", range(12))
def test_last_token_positions_equal_the_naive_rule(seed):
    c = random_batch(seed)
    rng = np.random.default_rng(seed)
    pad = int(rng.choice(np.concatenate(c["sequences"])))  # a token the batch holds, often at sequence ends
    batch = materialize(plan_of(c), c["sequences"], trainable=c["trainable"], allow_empty_loss=True, advise=False)
    for p in (pad, None):
        got = batch.sequence_values(torch.arange(batch.num_rows * batch.seq_len).view(batch.num_rows, -1), p)
        want = []
        for s, seq in enumerate(c["sequences"]):
            row, idx = batch.locate(s)
            want.append(row * batch.seq_len + int(idx[naive_last_token(seq.tolist(), p)]))
        assert got.tolist() == want
    assert naive_last_token([PAD, PAD], PAD) == 0 and naive_last_token([5, PAD, 6, PAD], PAD) == 2


def test_classification_heads_on_cp_shards_are_refused():
    from treepack.trainer.hf.admission import PackedSetup, check_static

    for head in ("sequence", "token"):
        with pytest.raises(UnsupportedModelError, match=rf"a {head}-classification head on context-parallel shards"):
            check_static(head_model("llama", head), PackedSetup(cp_size=2))
    lm = ms.build_causal_lm("llama")
    assert not [r for r in check_static(lm, PackedSetup(cp_size=2), raise_error=False).refusals if "head" in r.reason]
