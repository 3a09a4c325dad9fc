"""packed_forward leaves the model as it found it; checkpointing still replays the tree path."""

from __future__ import annotations

import pytest
import torch

from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.hf import packed, packed_forward

from helpers.tolerance import assert_close
from helpers.trainer_cases import mixed_batch, plan_of, tiny_model

CASES = [
    ("qwen3", "sdpa"),
    ("qwen3", "flash"),
    ("qwen3", "flex"),
    ("llama", "sdpa"),
    ("gemma2", "flash"),
    ("gemma2", "sdpa"),
]


@pytest.fixture(scope="module")
def batch():
    c = mixed_batch()
    return materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])


def _unpacked(model):
    """Logits of a padded unpacked batch and a greedy generate() (the calls TRL makes)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(1, 97, (2, 9), generator=g)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=mask).logits
        gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return logits, gen


def _packed_once(model, batch, backend):
    kw = dict(backend=backend, varlen_fn=naive_varlen_attention, compile=False)
    if backend == "flex":  # no CPU backward for flex
        with torch.no_grad():
            return packed_forward(model, batch, **kw)
    logits = packed_forward(model, batch, **kw)
    batch.target_logprobs(logits).sum().backward()
    return logits


@pytest.mark.parametrize("family,backend", CASES)
def test_unpacked_calls_unchanged_after_packed_forward(batch, family, backend):
    model = tiny_model(family)
    impl = model.config._attn_implementation
    before = _unpacked(model)
    _packed_once(model, batch, backend)
    assert model.config._attn_implementation == impl
    after = _unpacked(model)
    assert torch.equal(before[0], after[0])
    assert torch.equal(before[1], after[1])


def test_model_state_restored_when_the_packed_call_raises(batch):
    model = tiny_model("qwen3")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention dropout"):
        packed_forward(model, batch)
    assert model.config._attn_implementation == "sdpa"
    model.eval()
    model(input_ids=torch.zeros(1, 5, dtype=torch.int64))


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_exact_and_model_restored(batch, backend, reentrant):
    """Recomputation in backward runs after packed_forward returned: still tree attention."""
    model = tiny_model("gemma2")  # sliding window: a wrong replay (stock mask) would differ
    model.train()
    lp = batch.target_logprobs(packed_forward(model, batch, backend=backend, varlen_fn=naive_varlen_attention))
    lp.sum().backward()
    want = _grads(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    lp2 = batch.target_logprobs(packed_forward(model, batch, backend=backend, varlen_fn=naive_varlen_attention))
    assert model.config._attn_implementation == "eager"
    lp2.sum().backward()
    assert torch.equal(lp, lp2)
    assert len(want) > 0
    assert_close("grad", want, _grads(model), ratio=1e-5, nonzero_ref=True)
    model.eval()
    assert model.config._attn_implementation == "eager"


def test_context_manager_form(batch):
    model = tiny_model("qwen3")
    want = packed_forward(model, batch, backend="flash", varlen_fn=naive_varlen_attention)
    with packed(model, batch, backend="flash", varlen_fn=naive_varlen_attention) as run:
        got = run()
        hidden = run(output="hidden")
    assert torch.equal(want, got)
    assert hidden.shape == (batch.num_rows, batch.seq_len, model.config.hidden_size)
    assert model.config._attn_implementation == "sdpa"


# Every kind of the layer registry, by the model-support row whose tiny model holds it.
KIND_FAMILY = {
    "gdn": "Qwen3.5",
    "gdn_olmo": "OLMo-hybrid",
    "kda": "Kimi-Linear",
    "mamba": "Jamba",
    "mamba2": "Bamba",
    "short_conv": "LFM2",
    "dsa": "DeepSeek-V3.2",
    "dsa_indexer": "DeepSeek-V3.2",
    "glm_dsa": "GLM-MoE-DSA",
}


def test_every_registered_layer_kind_has_an_as_found_case():
    """A kind added to the registry without a case here fails: its patch must be shown to leave
    unpacked calls as they were."""
    from treepack.trainer.hf.layers import registered

    assert sorted(KIND_FAMILY) == sorted(layer.kind for layer in registered())


def _stock_family(name):
    """The row's tiny model as a user holds it: eager attention, nothing of treepack installed yet."""
    from helpers.families import model_support

    ms = model_support()
    row = next(r for r in ms.FAMILIES if r.name == name)
    model = ms.build_causal_lm(row.model_type, **row.overrides)
    model.set_attn_implementation("eager")
    return ms, model


# Slow (about 2 minutes on 2 CPU cores in all): eight hybrid tiny models, each probed on its
# first packed call, since what runs in that call (patches, probe, backward) is what must
# leave no trace.
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(KIND_FAMILY.values())))
def test_every_patched_layer_kind_leaves_unpacked_calls_bitwise_as_found(family):
    """Unpacked logits before the first packed call (the layers still stock) and after a packed
    step (patches installed, the probe run, forward and backward) are bitwise equal."""
    from treepack.service.planner import plan_batch
    from treepack.trainer.hf.layers import handled_layer, reference_rules

    ms, model = _stock_family(family)
    x = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(input_ids=x, use_cache=False).logits
    c = ms.small_case()
    plan = plan_batch(
        c["sequences"], seq_len=c["seq_len"], min_shared_len=c["min_shared_len"], trainable=c["trainable"]
    )
    packed_batch = materialize(plan, c["sequences"], trainable=c["trainable"])
    packed_batch.target_logprobs(packed_forward(model, packed_batch)).sum().backward()
    kinds = {layer.kind for m in model.modules() if (layer := handled_layer(m)) is not None}
    assert {k for k, f in KIND_FAMILY.items() if f == family} <= kinds  # the row does hold its kinds
    with torch.no_grad():
        after = model(input_ids=x, use_cache=False).logits
        with reference_rules():
            ruled = model(input_ids=x, use_cache=False).logits
    assert torch.equal(before, after)
    if "dsa_indexer" in kinds:
        # Negative control: the reference rule (ties by position) does change this model's
        # unpacked logits, so a rule left switched on after the packed call would show above.
        assert not torch.equal(before, ruled)
    else:
        assert torch.equal(before, ruled)
