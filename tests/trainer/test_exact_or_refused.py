"""Setups a code-reading check cannot see: each one exact, or refused by name before compute.

Every case runs through ``packed_forward`` as a user calls it (the probe on), on a tiny
random fp32 model, against every sequence alone:

- gradient checkpointing (reentrant or not) on models whose decoder layers call their
  attention without ``**kwargs`` (StableLM, Nemotron): the replay in ``backward()`` runs
  tree attention again, so gradients are exact;
- sliding windows HF applies only through its mask builders (Qwen2-MoE's
  ``use_sliding_window``, PhiMoE's ``sliding_window``): applied per layer, exact; the window
  matters on this batch (the model without it differs: the negative control);
- a mask or bias the model builds for its attention function (Doge's learned dynamic mask):
  refused, naming the attention class;
- forwards patched on an instance or a library class, forward and pre-forward hooks
  (per module or global) from unknown code: refused, naming them, before the model runs;
- dropout while training (residual, embedding, MLP, LoRA, GPT-2's ``attn_pdrop``): refused
  by module path or config field; eval mode runs; ``allow_dropout=True`` opts in.
"""

from __future__ import annotations

import pytest
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer import check_model, materialize, naive_varlen_attention
from treepack.trainer.hf import packed_forward

from helpers.families import mixing_hook, model_support, oracle, window_case
from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import plan_of

ms = model_support()
LOGPROB_TOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def case():
    c = window_case(ms.VOCAB)
    batch = materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])
    return c, batch


def _assert_exact(model, case, grads=True, **kw):
    c, batch = case
    alone, packed, g_alone, g_packed = oracle(model, batch, c, grads=grads, **kw)
    assert_close("logprobs", alone, packed, atol=LOGPROB_TOL)
    if grads:
        floor = 1e-7 * max(float(g.abs().max()) for g in g_alone.values())
        assert_close("grad", g_alone, g_packed, atol=floor, ratio=GRAD_RTOL, nonzero_ref=True)
    return alone


@pytest.mark.parametrize(
    "model_type,reentrant,backend",
    [
        ("stablelm", True, "flash"),
        ("stablelm", False, "flash"),
        ("nemotron", True, "flash"),
        ("nemotron", False, "flash"),
        ("stablelm", False, "sdpa"),
    ],
)
def test_checkpoint_replay_runs_tree_attention(case, model_type, reentrant, backend):
    model = ms.build_causal_lm(
        model_type, **({"num_key_value_heads": 2, "head_dim": 8} if model_type == "nemotron" else {})
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    _assert_exact(model, case, backend=backend, varlen_fn=naive_varlen_attention)


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        (
            "qwen2_moe",
            dict(use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
        ),
        ("phimoe", dict(sliding_window=6)),
    ],
)
def test_mask_builder_windows_are_applied(case, model_type, overrides):
    model = ms.build_causal_lm(model_type, **overrides)
    alone = _assert_exact(model, case)
    # The window changes this batch's result: without it the model is another function.
    unwindowed = ms.build_causal_lm(model_type, **{**overrides, "sliding_window": 1000})  # wider than every sequence
    c, _ = case
    with torch.no_grad():
        full = [
            torch.cat([x.new_full((1,), float("nan")), x]) for x in ms.unpacked_logprobs(unwindowed, c["sequences"])
        ]
    assert_not_close("window", alone, [torch.where(torch.isnan(a), a, f) for a, f in zip(alone, full)], atol=1e-3)


def test_model_built_attention_bias_is_refused(case):
    model = ms.build_causal_lm("doge")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".A"):
                p.normal_()  # a trained dynamic mask
    with pytest.raises(
        UnsupportedModelError, match=r"DogeAttention \(layer 0\).*mask or bias that treepack did not build"
    ):
        packed_forward(model, case[1])


def _refused_before_compute(model, batch, match, calls):
    with pytest.raises(UnsupportedModelError, match=match) as e:
        packed_forward(model, batch)
    assert e.value.kind == "unsupported_model"
    assert calls == [], "the patched code ran: not refused before compute"


def test_instance_patched_forward_is_refused(case):
    model = ms.build_causal_lm("qwen3")
    mlp = model.model.layers[1].mlp
    calls = []
    stock = mlp.forward

    def cumsum_forward(x):
        calls.append(1)
        return stock(x).cumsum(1)

    mlp.forward = cumsum_forward
    _refused_before_compute(
        model,
        case[1],
        r"model\.layers\.1\.mlp \(Qwen3MLP\): forward replaced on the instance by .*cumsum_forward",
        calls,
    )


def test_class_patched_forward_is_refused(case, monkeypatch):
    import transformers.models.qwen3.modeling_qwen3 as q3

    model = ms.build_causal_lm("qwen3")
    calls = []
    stock = q3.Qwen3MLP.forward

    def rolled_forward(self, x):
        calls.append(1)
        return stock(self, x).roll(1, dims=1)

    monkeypatch.setattr(q3.Qwen3MLP, "forward", rolled_forward)
    _refused_before_compute(model, case[1], r"Qwen3MLP\.forward replaced by .*rolled_forward", calls)


@pytest.mark.parametrize("kind", ["forward", "pre", "global"])
def test_hooks_from_unknown_code_are_refused(case, kind):
    model = ms.build_causal_lm("qwen3")
    calls = []
    hook = mixing_hook(calls)
    mlp = model.model.layers[0].mlp
    if kind == "forward":
        handle = mlp.register_forward_hook(hook)
        match = r"model\.layers\.0\.mlp \(Qwen3MLP\): forward hook .*mixing_hook"
    elif kind == "pre":

        def shifting_pre_hook(module, args):
            calls.append(module)
            return (args[0].roll(1, dims=1),)

        handle = mlp.register_forward_pre_hook(shifting_pre_hook)
        match = r"forward pre-hook .*shifting_pre_hook"
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: calls.append(m))
        match = r"<global>.*global forward hook"
    try:
        _refused_before_compute(model, case[1], match, calls)
    finally:
        handle.remove()


@pytest.mark.parametrize(
    "model_type,field,match",
    [
        ("gpt2", "resid_pdrop", r"attn\.resid_dropout \(Dropout\): dropout p=0\.1"),
        ("gpt2", "embd_pdrop", r"transformer\.drop \(Dropout\).*config\.embd_pdrop=0\.1"),
        ("gpt2", "attn_pdrop", r"config\.attn_pdrop=0\.1"),
        ("opt", "dropout", r"dropout=0\.1"),
        ("phi", "resid_pdrop", r"resid_dropout \(Dropout\)"),
        ("starcoder2", "residual_dropout", r"residual_dropout=0\.1"),
    ],
)
def test_dropout_while_training_is_refused(case, model_type, field, match):
    model = ms.build_causal_lm(model_type, **{field: 0.1})
    model.train()
    with pytest.raises(UnsupportedModelError, match=match):
        check_model(model)  # at check time, by its own name
    with pytest.raises(UnsupportedModelError, match=match):
        packed_forward(model, case[1])
    model.eval()
    with torch.no_grad():
        packed_forward(model, case[1])  # the same model in eval mode runs


def test_lora_dropout_is_refused_and_the_opt_in_runs(case):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        ms.build_causal_lm("qwen3"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1),
    )
    model.train()
    with pytest.raises(UnsupportedModelError, match=r"lora_dropout\.default \(Dropout\): dropout p=0\.1"):
        packed_forward(model, case[1])
    logits = packed_forward(model, case[1], allow_dropout=True)  # accepted: one mask per shared prefix
    assert torch.isfinite(logits).all()
