"""Length-dependent RoPE is judged by the type each rotary module resolved, not by the config's label.

HunYuan's checkpoints say ``rope_type: "dynamic"`` with a fixed ``alpha``; HF's HunYuan rotary
module resolves that to ``ntk_alpha``, a static base, so a sequence's rotary table does not
depend on the longest position of the call: accepted, and the packed forward equals every
sequence alone. Real dynamic NTK scaling (no ``alpha``) stays refused, naming the rotary
module; a config that declares it with no rotary module telling what it resolved to is
refused by the config.
"""

from __future__ import annotations

import pytest
import torch

from treepack.trainer import materialize
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.admission import check_model

from helpers.tolerance import assert_close
from helpers.trainer_cases import VOCAB, mixed_batch, plan_of, reference_logprobs, trainable_flags

ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}  # as the checkpoints
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}


def _hunyuan(rope: dict) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.HunYuanDenseV1Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,  # below the test's longest position: dynamic NTK would rescale
        rope_parameters=dict(rope),
    )
    model = tf.HunYuanDenseV1ForCausalLM(cfg).float().eval()
    model.set_attn_implementation("sdpa")
    return model


def _prefix_drift(model: torch.nn.Module) -> float:
    """max |logit| difference of a 20-token prefix alone and inside a 60-token sequence."""
    x = torch.randint(0, VOCAB, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((model(input_ids=x[:, :20]).logits - model(input_ids=x).logits[:, :20]).abs().max())


def test_hunyuan_fixed_alpha_rope_is_static_and_runs_exact():
    model = _hunyuan(ALPHA)
    assert model.model.rotary_emb.rope_type == "ntk_alpha"
    assert _prefix_drift(model) < 1e-6  # the rotary table does not depend on the call's length
    assert check_model(model, raise_error=False).refusals == []
    c = mixed_batch()
    batch = materialize(plan_of(c), c["sequences"])
    ref = reference_logprobs(model, c["sequences"], trainable_flags(c))
    with torch.no_grad():
        lp = batch.target_logprobs(packed_forward(model, batch))
    assert_close("hunyuan fixed-alpha logprobs", ref, batch.unpack_logprobs(lp), atol=1e-5)


def test_real_dynamic_ntk_stays_refused_naming_the_rotary_module():
    """Negative control: without ``alpha`` HunYuan's "dynamic" is real dynamic NTK, whose table
    does depend on the longest position of the call."""
    model = _hunyuan(DYNAMIC)
    assert model.model.rotary_emb.rope_type == "dynamic"
    assert _prefix_drift(model) > 1e-3
    (r,) = check_model(model, raise_error=False).refusals
    assert (r.path, r.cls) == ("model.rotary_emb", "HunYuanDenseV1RotaryEmbedding")
    assert "length-dependent RoPE 'dynamic'" in r.reason


@pytest.mark.parametrize("rope", [ALPHA, DYNAMIC], ids=["alpha", "dynamic"])
def test_a_declared_dynamic_rope_without_a_resolved_rotary_module_is_refused_by_the_config(rope):
    model = _hunyuan(rope)
    del model.model.rotary_emb.rope_type  # nothing tells what the label resolved to: fail closed
    (r,) = check_model(model, raise_error=False).refusals
    assert (r.path, r.cls) == ("config.rope_parameters", "HunYuanDenseV1Config")
