"""The run-time probe (:mod:`treepack.trainer.hf.admission.probe`): it proves what is exact and names what is not.

Planted discrepancies of each kind, each in code the structural checks accept (a hook whose
code claims to be torch's, the window or mask check switched off, a replay without the
context), are caught by the probe, which names the module where packed and alone first
part: a hook, a dropped window, a model-built bias, dropout, a wrong checkpoint replay.
A passing probe runs once per setup, leaves the caller's random stream and ``.grad``
alone, and holds fp32 to a bound far below any of the planted errors.
"""

from __future__ import annotations

import pytest
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.hf import attention as tree_attention_mod
from treepack.trainer.hf import dispatch, packed_forward
from treepack.trainer.hf.admission.probe_inputs import declared_sizes, probe_sequences
from treepack.trainer.hf.admission.prove import verify_model

from helpers.families import model_support, window_case
from helpers.trainer_cases import plan_of

ms = model_support()


def _known_looking(fn):
    fn.__module__ = "torch.planted"  # the guards trust torch's own hooks; the probe trusts nothing
    return fn


def _refused(model, match, **kw):
    with pytest.raises(UnsupportedModelError, match=match) as e:
        verify_model(model, **kw)
    assert e.value.kind == "unsupported_model"
    return str(e.value)


def test_probe_names_a_mixing_hook():
    model = ms.build_causal_lm("qwen3")
    model.model.layers[1].mlp.register_forward_hook(_known_looking(lambda m, a, out: out + 1e-3 * out.cumsum(1)))
    _refused(model, r"first diverging forward output: model\.layers\.1\.mlp \(Qwen3MLP\)")


def test_probe_names_a_dropped_window(monkeypatch):
    monkeypatch.setattr(tree_attention_mod, "mask_builder_window", lambda module: None)
    model = ms.build_causal_lm(
        "qwen2_moe", use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]
    )
    _refused(model, r"first diverging forward output: model\.layers\.0\.self_attn \(Qwen2MoeAttention\)")


def test_probe_names_a_model_built_bias(monkeypatch):
    monkeypatch.setattr(tree_attention_mod, "TREE_MASK_OPTION", "no-such-option")  # the run-time mask check off
    model = ms.build_causal_lm("doge")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".A"):
                p.normal_()
    _refused(model, r"first diverging forward output: model\.layers\.0\.self_attn \(DogeAttention\)")


def test_probe_names_dropout_the_guards_cannot_see():
    model = ms.build_causal_lm("qwen3")
    model.train()
    model.model.layers[0].mlp.register_forward_hook(
        _known_looking(lambda m, a, out: torch.nn.functional.dropout(out, 0.1, training=True))
    )
    _refused(model, r"model\.layers\.0\.mlp \(Qwen3MLP\): draws random numbers while training \(bernoulli_\)")


def test_probe_names_a_wrong_checkpoint_replay(monkeypatch):
    monkeypatch.setattr(dispatch, "_replaying", lambda fn, layer: fn)  # the replay without the context
    model = ms.build_causal_lm("stablelm")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    msg = _refused(
        model,
        r"first diverging parameter gradients: model\.layers\.1\.",
        backend="flash",
        varlen_fn=naive_varlen_attention,
    )
    assert "checkpointing=True, reentrant=True" in msg


def test_probe_batch_crosses_every_declared_size():
    model = ms.build_causal_lm(
        "qwen2_moe", use_sliding_window=True, sliding_window=40, layer_types=["sliding_attention", "full_attention"]
    )
    assert declared_sizes(model)["sliding_window"] == 40
    seqs, span = probe_sequences(model)
    assert span == 40 and max(len(s) for s in seqs) > 40 + span // 2
    assert sum(len(s) > span for s in seqs) >= 2  # a shared prompt's completion and a lone sequence


def test_probe_runs_once_per_setup_and_leaves_the_caller_alone():
    c = window_case(ms.VOCAB)
    batch = materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])
    model = ms.build_causal_lm("qwen3")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    state = torch.get_rng_state()
    first = verify_model(model)
    assert torch.equal(torch.get_rng_state(), state), "the probe drew from the caller's random stream"
    assert all(bool((p.grad == 7.0).all()) for p in model.parameters()), "the probe left gradients in .grad"
    assert first.logprob_err <= first.logprob_tol < 1e-4 and first.grad_err <= 1.0
    assert verify_model(model) is first  # cached per setup
    model.eval()
    assert verify_model(model) is not first  # another setup: proven again
    calls = []
    model.model.layers[0].mlp.register_forward_hook(_known_looking(lambda m, a, out: calls.append(1)))
    packed_forward(model, batch, verify=False)
    assert len(calls) == 1  # verify=False: the packed call alone, no probe


def test_probe_derives_its_bound_from_the_dtype():
    model = ms.build_causal_lm("qwen3").to(torch.bfloat16)
    report = verify_model(model)  # bf16 packing is within bf16's own noise
    fp32 = verify_model(ms.build_causal_lm("qwen3"))
    assert report.logprob_tol > 10 * fp32.logprob_tol
