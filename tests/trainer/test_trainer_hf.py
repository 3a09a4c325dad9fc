"""The oracle on stock HF models: packed rows == each sequence alone (logprobs, loss, grads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.hf import packed, packed_forward
from treepack.trainer.hf.admission import trust_hook
from treepack.trainer.hf.forward import RESERVED_KWARGS
from treepack.trainer.losses import naive_ppo_clip_loss, ppo_clip_loss

from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import mixed_batch, plan_of, reference_logprobs, tiny_model, trainable_flags

LOGPROB_TOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def case():
    c = mixed_batch()
    plan = plan_of(c)
    rng = np.random.default_rng(7)
    # Behaviour logprobs a little off the current policy, so that some ratios clip.
    old = [torch.from_numpy(rng.normal(-4.6, 0.4, len(s))).float() for s in c["sequences"]]
    adv = torch.from_numpy(rng.normal(0, 1, len(c["sequences"]))).float()
    batch = materialize(plan, c["sequences"], payloads={"old": old}, trainable=c["trainable"], groups=c["groups"])
    return dict(case=c, plan=plan, batch=batch, old=old, adv=adv, flags=trainable_flags(c))


def _loss_kwargs():
    return dict(clip_low=0.2, clip_high=0.28, normalization="sequence")


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _reference(model, c, impl):
    seq_lp = reference_logprobs(model, c["case"]["sequences"], c["flags"], impl=impl)
    loss = naive_ppo_clip_loss(
        [torch.nan_to_num(x) for x in seq_lp],
        c["flags"],
        advantages=c["adv"],
        old_logprobs=c["old"],
        groups=c["case"]["groups"],
        **_loss_kwargs(),
    )
    loss.backward()
    return [x.detach() for x in seq_lp], loss.detach(), _grads(model)


def _packed(model, c, backend, **kw):
    batch = c["batch"]
    logits = packed_forward(model, batch, backend=backend, varlen_fn=naive_varlen_attention, **kw)
    assert logits.shape == (batch.num_rows, batch.seq_len, model.config.vocab_size)
    lp = batch.target_logprobs(logits)
    loss = ppo_clip_loss(lp, batch, advantages=c["adv"], old_logprobs="old", **_loss_kwargs())
    loss.backward()
    seq_lp = [x.detach() for x in batch.unpack_logprobs(lp)]
    return seq_lp, loss.detach(), _grads(model)


def _assert_grads_equal(got, want):
    assert len(want) > 0
    assert_close("grad", want, got, ratio=GRAD_RTOL, nonzero_ref=True)


@pytest.mark.parametrize(
    "family,backend",
    [
        ("qwen3", "sdpa"),
        ("qwen3", "flash"),
        ("llama", "sdpa"),
        ("llama", "flash"),
        ("gemma2", "sdpa"),
        ("gemma2", "flash"),
    ],
)
def test_oracle_logprobs_loss_gradients(case, family, backend):
    model = tiny_model(family)
    impl = "eager" if family == "gemma2" else "sdpa"
    ref_lp, ref_loss, ref_grads = _reference(model, case, impl)
    lp, loss, grads = _packed(model, case, backend)
    assert_close("logprobs", ref_lp, lp, atol=LOGPROB_TOL)
    assert torch.allclose(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-7), (float(loss), float(ref_loss))
    assert abs(float(ref_loss)) > 1e-3
    _assert_grads_equal(grads, ref_grads)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_oracle_flex_forward(case, family):
    """FlexAttention has no CPU backward: forward only (uncompiled kernel on CPU)."""
    model = tiny_model(family)
    ref_lp = reference_logprobs(
        model, case["case"]["sequences"], case["flags"], impl="eager" if family == "gemma2" else "sdpa"
    )
    with torch.no_grad():
        logits = packed_forward(model, case["batch"], backend="flex", compile=False)
    assert_close("logprobs", ref_lp, case["batch"].unpack_logprobs(logits), atol=LOGPROB_TOL)


def test_negative_controls_linear_packing_differs(case):
    """The oracle can fail: the same packed rows under HF's own masks give other logprobs."""
    model = tiny_model("qwen3")
    batch = case["batch"]
    ref_lp = reference_logprobs(model, case["case"]["sequences"], case["flags"])
    with torch.no_grad():
        # HF infers (linear) packing from position_ids when given no mask.
        inferred = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        L = batch.seq_len
        causal = torch.ones(L, L, dtype=torch.bool).tril()[None, None].expand(batch.num_rows, 1, L, L)
        plain = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=causal, use_cache=False
        ).logits
    for wrong in (inferred, plain):
        assert_not_close("HF's own masks", ref_lp, batch.unpack_logprobs(wrong), atol=1e-2)


def test_gradient_checkpointing_replays_the_tree_mask(case):
    """Recomputation during backward (outside packed_forward) still runs tree attention."""
    model = tiny_model("llama")
    _, ref_loss, ref_grads = _packed(model, case, "flash")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _, loss, grads = _packed(model, case, "flash")
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    _assert_grads_equal(grads, ref_grads)


def test_attention_dropout_refused(case):
    model = tiny_model("qwen3")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention dropout"):
        packed_forward(model, case["batch"])


def test_logprobs_from_hidden_states_in_chunks(case):
    """Chunked head over scored positions == full logits, values and gradients."""
    model = tiny_model("qwen3")
    batch = case["batch"]
    lp_full = batch.target_logprobs(packed_forward(model, batch))
    lp_full.sum().backward()
    want = _grads(model)
    hidden = packed_forward(model, batch, output="hidden")
    assert hidden.shape == (batch.num_rows, batch.seq_len, model.config.hidden_size)
    lp = batch.target_logprobs_from_hidden(hidden, model.lm_head, chunk_size=7)
    assert_close("chunked logprobs", lp_full, lp, atol=1e-6)
    lp.sum().backward()
    _assert_grads_equal(_grads(model), want)


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_oracle_with_shared_trainable_positions(backend):
    """share_trainable plans: scored positions shared by sequences with different
    advantages give the per-sequence loss and gradients (positive and negative sums apart)."""
    from helpers.trainer_cases import shared_trainable_batch

    c = shared_trainable_batch()
    plan = plan_of(c, share_trainable=True)
    rng = np.random.default_rng(3)
    flags = trainable_flags(c)
    model = tiny_model("qwen3")
    ref_lp = reference_logprobs(model, c["sequences"], flags)
    # Behaviour logprobs: the policy's own, perturbed by a function of the context and
    # token only (sharers of a position agree), so that ratios clip on both sides.
    old = [
        torch.nan_to_num(x.detach()) + torch.from_numpy(np.cos(np.asarray(s, dtype=np.float64) * 1.7) * 0.3).float()
        for x, s in zip(ref_lp, c["sequences"])
    ]
    adv = torch.from_numpy(rng.normal(0, 1, len(c["sequences"]))).float()
    adv[0], adv[1] = 1.0, -1.0
    batch = materialize(plan, c["sequences"], payloads={"old": old}, trainable=c["trainable"], groups=c["groups"])
    assert batch.num_scored > int(batch.loss_mask.sum()), "the case shares no scored position"
    kw = dict(clip_low=0.2, clip_high=0.28, normalization="group")
    ref = naive_ppo_clip_loss(
        [torch.nan_to_num(x) for x in reference_logprobs(model, c["sequences"], flags)],
        flags,
        advantages=adv,
        old_logprobs=old,
        groups=c["groups"],
        **kw,
    )
    ref.backward()
    want = _grads(model)
    logits = packed_forward(model, batch, backend=backend, varlen_fn=naive_varlen_attention)
    lp = batch.target_logprobs(logits)
    loss = ppo_clip_loss(lp, batch, advantages=adv, old_logprobs="old", **kw)
    loss.backward()
    assert_close("logprobs", ref_lp, batch.unpack_logprobs(lp), atol=LOGPROB_TOL)
    assert torch.allclose(loss.detach().double(), ref.detach().double(), rtol=1e-6, atol=1e-7)
    _assert_grads_equal(_grads(model), want)


@pytest.mark.parametrize("name", sorted(RESERVED_KWARGS))
def test_reserved_model_kwargs_are_refused_by_name_before_any_compute(case, name):
    """``use_cache=True`` / ``attention_mask=`` / ``position_ids=`` used to collide with what
    packed_forward passes (Python's ``dict() got multiple values``); ``labels`` and
    ``logits_to_keep`` ran with a meaning tree rows do not have."""
    model = tiny_model("qwen3")
    calls = []
    handle = model.register_forward_hook(trust_hook(lambda m, a, o: calls.append(1)))
    value = {"use_cache": True, "logits_to_keep": 1}.get(name, case["batch"].input_ids)
    try:
        with pytest.raises(RequestError, match=rf"^{name}= passed to packed_forward: ") as err:
            packed_forward(model, case["batch"], **{name: value})
    finally:
        handle.remove()
    assert err.value.path == f"$.kwargs.{name}" and calls == []
    # The context-manager form refuses it the same way.
    with pytest.raises(RequestError, match=rf"^{name}= passed"), packed(model, case["batch"]) as run:
        run(**{name: value})


def test_unreserved_model_kwargs_still_reach_the_model(case):
    """Negative control for the refusal: a keyword packed_forward does not set goes through."""
    model = tiny_model("qwen3")
    with torch.no_grad():
        want = packed_forward(model, case["batch"])
        got = packed_forward(model, case["batch"], output_attentions=False, return_dict=True)
    assert torch.equal(want, got)
