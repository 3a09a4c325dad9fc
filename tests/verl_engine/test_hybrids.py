"""Hybrid models through TreepackFSDPEngine against stock verl: a GDN hybrid and a Mamba2 hybrid.

Tiny Qwen3.5 (text: Gated DeltaNet in 3 of 4 layers, full attention in 1) and Bamba (Mamba2 with one
attention layer), FSDP2 on one CPU gloo rank. This venv has neither flash-linear-attention nor
the mamba / causal-conv1d kernels, so stock verl runs transformers' torch fallbacks.

The reference is stock verl with ``use_remove_padding=False`` (one padded row per sequence,
each mixer scans one sequence). Stock verl's default, remove-padding, concatenates the
micro-batch into one row; on these fallbacks the conv and the recurrent state then run
across sequence boundaries (they get no ``cu_seqlens``), so its log-probs differ from the
padded ones (checked below: that is a limit of stock verl on this path, not a reference).
TreepackFSDPEngine runs the micro-batch on tree rows with treepack's tree conv and scan
(each sequence sees only its own prefix) whatever ``use_remove_padding`` says.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from engines import PARITY, VOCAB, build, flags, grpo_batch, response_values, update
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from treepack.trainer.verl import TreepackFSDPEngine

from helpers.tolerance import assert_close, assert_not_close

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    initializer_range=0.08,
    tie_word_embeddings=False,
)


def qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        **TINY,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    model = Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):  # long memory, so state crossing a boundary shows
                layer.linear_attn.A_log.uniform_(math.log(0.02), math.log(0.3))
    return model


def bamba():
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(
        **TINY,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=16,
    )
    return BambaForCausalLM(cfg)


@pytest.fixture(scope="module", params=[qwen3_5, bamba], ids=["qwen3_5-gdn", "bamba-mamba2"])
def engines(request):
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix=f"treepack-verl-{request.param.__name__}-")
    request.param().save_pretrained(path)
    return build(FSDPEngineWithLMHead, path=path), build(TreepackFSDPEngine, path=path), request.param.__name__


def test_no_fast_kernels_in_this_env():
    """The premise: stock verl runs the mixers on transformers' torch fallbacks here."""
    present = [
        m for m in ("fla", "mamba_ssm", "causal_conv1d", "flash_attn") if importlib.util.find_spec(m) is not None
    ]
    assert not present, f"kernel packages in the verl test env: {present}"


def _infer(eng, rmpad):
    return response_values(
        eng,
        flags(
            grpo_batch(seed=1), dynamic=False, rmpad=rmpad, temperature=0.7, calculate_entropy=True, compute_loss=False
        ),
    )


def _update(eng, rmpad):
    return update(
        eng, flags(grpo_batch(seed=2), dynamic=False, rmpad=rmpad, calculate_entropy=False, global_batch_size=8)
    )


def test_hybrid_infer_matches_stock_padded(engines):
    stock, tree, name = engines
    lp_ref, ent_ref, _ = _infer(stock, rmpad=False)
    lp, ent, metrics = _infer(tree, rmpad=True)
    assert_close(f"{name} log_probs", lp_ref, lp, atol=1e-5, nonzero_ref=True)
    assert_close(f"{name} entropy", ent_ref, ent, atol=1e-5, nonzero_ref=True)
    assert min(metrics["treepack/saved_fraction"].values) > 0
    # Stock verl's own remove-padding layout is no reference here: the fallbacks scan the
    # concatenated micro-batch as one sequence.
    lp_rmpad, _, _ = _infer(stock, rmpad=True)
    assert_not_close(f"{name} stock remove-padding vs stock padded", lp_ref, lp_rmpad, atol=1e-3)
    PARITY.append(
        (
            f"{name} infer (vs stock padded)",
            (lp - lp_ref).abs().max().item(),
            (ent - ent_ref).abs().max().item(),
            float("nan"),
        )
    )
    PARITY.append(
        (
            f"{name} stock remove-padding vs stock padded",
            (lp_rmpad - lp_ref).abs().max().item(),
            float("nan"),
            float("nan"),
        )
    )


def test_hybrid_update_matches_stock_padded(engines):
    stock, tree, name = engines
    ref, got = _update(stock, rmpad=False), _update(tree, rmpad=True)
    assert_close(f"{name} update", ref, got, ratio=1e-4, nonzero_ref=True)
    PARITY.append(
        (
            f"{name} update token-mean (vs stock padded)",
            float("nan"),
            float("nan"),
            max((ref[k] - got[k]).abs().max().item() for k in ref),
        )
    )


def test_qwen3_5_vlm_refused_by_name():
    """Qwen3.5 as verl loads it from a vision-language checkpoint: verl replaces the forwards of
    transformers' Qwen3.5 classes, and TreepackFSDPEngine refuses that code by name before
    the model runs. Its own process: verl's patches are process-wide."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_5_vlm.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    refused = next((ln for ln in lines if ln.startswith(("REFUSED", "RAN"))), "")
    assert refused.startswith("REFUSED"), out.stdout[-2000:]
    assert "Qwen3_5Model.forward replaced by verl.models.transformers.qwen3_5" in refused, refused
    assert "Qwen3_5GatedDeltaNet.forward replaced by verl.models.transformers.qwen3_5" in refused, refused
    assert "MODEL RAN: False" in lines, out.stdout[-2000:]
