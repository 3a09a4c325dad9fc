"""Temperature, entropy, and the chunked head with the model's own final logit transforms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.head import output_head

from helpers.tolerance import assert_close
from helpers.trainer_cases import VOCAB, mixed_batch, plan_of, tiny_model


@pytest.fixture(scope="module")
def case():
    c = mixed_batch()
    return c, materialize(plan_of(c), c["sequences"])


def _common():
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def _model(family):
    import transformers as tf

    torch.manual_seed(1)
    if family == "cohere":
        m = tf.CohereForCausalLM(tf.CohereConfig(logit_scale=0.37, **_common()))
    elif family == "granite":
        m = tf.GraniteForCausalLM(tf.GraniteConfig(logits_scaling=3.5, **_common()))
    elif family == "gemma2":
        m = tf.Gemma2ForCausalLM(
            tf.Gemma2Config(head_dim=8, final_logit_softcapping=0.8, query_pre_attn_scalar=8, **_common())
        )
    else:
        return tiny_model(family, seed=1)
    m.set_attn_implementation("eager" if family == "gemma2" else "sdpa")
    return m.float().eval()


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _reference(model, case, temperature):
    """Each scored entry from its sequence alone: (logprob, entropy) of logits / temperature."""
    c, batch = case
    lps, ents = [], []
    for s, p in zip(batch.score_seq.tolist(), batch.score_pos.tolist()):
        x = torch.as_tensor(np.asarray(c["sequences"][s][:p]), dtype=torch.int64)[None]
        logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits[0, -1] / temperature, -1)
        lps.append(logp[int(c["sequences"][s][p])])
        ents.append(-(logp.exp() * logp).sum())
    return torch.stack(lps), torch.stack(ents)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_temperature_and_entropy_equal_each_sequence_alone(case, temperature):
    _, batch = case
    model = _model("qwen3")
    with torch.no_grad():
        want_lp, want_ent = _reference(model, case, temperature)
        lp, ent = batch.target_logprobs(packed_forward(model, batch), temperature=temperature, with_entropy=True)
    assert_close("logprobs", want_lp, lp.reshape(-1)[batch.score_flat], atol=1e-5)
    assert_close("entropy", want_ent, ent.reshape(-1)[batch.score_flat], atol=1e-5)
    assert float(ent[~batch.loss_mask].abs().max()) == 0.0
    if temperature != 1.0:
        plain = batch.target_logprobs(packed_forward(model, batch).detach())
        assert float((plain - lp).abs().max()) > 1e-2  # the temperature is applied


@pytest.mark.parametrize(
    "family,names",
    [
        ("cohere", ("logit_scale",)),
        ("granite", ("logits_scaling",)),
        ("gemma2", ("final_logit_softcapping",)),
        ("qwen3", ()),
    ],
)
def test_chunked_head_applies_the_models_logit_transforms(case, family, names):
    """output='hidden' + output_head == the model's logits: values, entropy and gradients."""
    _, batch = case
    model = _model(family)
    head = output_head(model)
    assert head.names == names
    kw = dict(temperature=0.9, with_entropy=True)
    lp, ent = batch.target_logprobs(
        packed_forward(model, batch, backend="flash", varlen_fn=naive_varlen_attention), **kw
    )
    (lp.sum() + 0.1 * ent.sum()).backward()
    want = _grads(model)
    hidden = packed_forward(model, batch, backend="flash", varlen_fn=naive_varlen_attention, output="hidden")
    lp2, ent2 = batch.target_logprobs_from_hidden(hidden, head, chunk_size=13, **kw)
    assert_close("chunked logprobs", lp, lp2, atol=1e-6)
    assert_close("chunked entropy", ent, ent2, atol=1e-6)
    (lp2.sum() + 0.1 * ent2.sum()).backward()
    # A floor at fp32 rounding of the largest gradient: a gradient that is 0 in exact arithmetic
    # (OPT's k_proj bias: softmax ignores a constant per query) is rounding on both sides.
    floor = 1e-7 * max(float(g.abs().max()) for g in want.values())
    assert_close("grad", want, _grads(model), atol=floor, ratio=1e-5, nonzero_ref=True)
    if names:  # the transform matters: the bare projection is off
        with torch.no_grad():
            bare = batch.target_logprobs_from_hidden(hidden.detach(), model.lm_head)
        assert float((bare - lp.detach()).abs().max()) > 1e-2


def test_unknown_logit_transform_is_refused():
    import transformers as tf

    class ShiftedLlama(tf.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0 + 1.0  # a post-processing output_head does not know
            return out

    torch.manual_seed(0)
    model = ShiftedLlama(tf.LlamaConfig(**_common())).eval()
    with pytest.raises(RequestError, match="ShiftedLlama post-processes its logits") as e:
        output_head(model)
    assert e.value.rule == "unsupported_logit_transform"


def test_bad_temperature_refused(case):
    _, batch = case
    logits = torch.zeros(batch.num_rows, batch.seq_len, VOCAB)
    for t in (0, -1.0, float("inf"), True):
        with pytest.raises(RequestError, match="temperature"):
            batch.target_logprobs(logits, temperature=t)


@pytest.mark.parametrize(
    "model_type,overrides,names",
    [
        ("falcon_h1", dict(lm_head_multiplier=0.37), ("lm_head_multiplier",)),
        ("modernbert-decoder", {}, ("prediction_head",)),
        ("llama4_text", {}, ()),
        ("mllama", {}, ()),
        ("opt", dict(word_embed_proj_dim=16), ()),
    ],
)
def test_output_head_of_heads_beyond_a_projection(case, model_type, overrides, names):
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier``; ModernBERT-decoder runs a prediction
    head (dense, activation, norm) before its output embedding; Llama 4's and mllama's causal LMs have
    ``base_model`` the model itself (``output="hidden"`` gave logits); OPT's causal LM calls its base
    model's decoder, not the base model (its hidden states are projected to ``word_embed_proj_dim``).
    Each: hidden + output_head == the packed logits == every sequence alone, gradients included."""
    from helpers.families import model_support

    ms = model_support()
    _, batch = case
    model = ms.perturb(ms._with_patches(ms.build_causal_lm(model_type, **overrides)))
    head = output_head(model)
    assert head.names == names
    lp = batch.target_logprobs(packed_forward(model, batch))
    lp.sum().backward()
    want = _grads(model)
    hidden = packed_forward(model, batch, output="hidden")
    cfg = model.config.get_text_config()
    assert hidden.shape[-1] == getattr(cfg, "word_embed_proj_dim", cfg.hidden_size)
    lp2 = batch.target_logprobs_from_hidden(hidden, head, chunk_size=11)
    assert_close("hidden + output_head logprobs", lp, lp2, atol=1e-6)
    lp2.sum().backward()
    # A floor at fp32 rounding of the largest gradient: a gradient that is 0 in exact arithmetic
    # (OPT's k_proj bias: softmax ignores a constant per query) is rounding on both sides.
    floor = 1e-7 * max(float(g.abs().max()) for g in want.values())
    assert_close("grad", want, _grads(model), atol=floor, ratio=1e-5, nonzero_ref=True)
    if names:  # the step matters: the bare projection is off
        with torch.no_grad():
            bare = batch.target_logprobs_from_hidden(hidden.detach(), model.get_output_embeddings())
        assert float((bare - lp.detach()).abs().max()) > 1e-2


def test_hidden_of_a_stack_run_inside_the_base_model_is_found_or_refused(case, monkeypatch):
    """OPT's causal LM runs ``model.decoder``, not ``model``: the decoder's output is taken. Negative
    control: without looking inside the base model, the call is refused naming what ran."""
    import treepack.trainer.hf.wrapped as wrapped

    from helpers.families import model_support

    _, batch = case
    model = model_support().build_causal_lm("opt", word_embed_proj_dim=16)
    with torch.no_grad():
        want = batch.target_logprobs(packed_forward(model, batch))
        got = batch.target_logprobs_from_hidden(packed_forward(model, batch, output="hidden"), output_head(model))
    assert_close("OPT hidden + output_head", want, got, atol=1e-6)
    monkeypatch.setattr(wrapped, "_is_hf_model", lambda m: False)
    with pytest.raises(RequestError, match=r"decoder stack of OPTForCausalLM is not one model .*OPTModel 0"):
        packed_forward(model, batch, output="hidden")
