"""The static scan of the installed transformers' modeling code (``benchmarks/modeling_scan.py``).

Every ``models/*/modeling_*.py`` is read (not imported). Three patterns make a model's
packed run depend on more than its layer classes; each hit in a module that defines a
causal-LM class must be handled, and how is named per hit (docs/models.md lists them):

1. ``kwargs_dropped``, a decoder layer calling its attention without ``**kwargs``
   (StableLM, Nemotron): the packed context reaches attention through a context variable,
   and HF's checkpointing replays inside it (``treepack.trainer.hf.dispatch``); a module
   that calls torch's checkpoint itself replays outside it: unhandled;
2. ``window_by_mask_builder``, an attention class passing no ``sliding_window=`` while its
   module builds sliding-window masks (Qwen2-MoE, PhiMoE): tree attention reads the window
   from the config as the builders do (``mask_builder_window``); a window the config does
   not declare: unhandled;
3. ``model_built_mask``, a mask or bias built inside attention (Doge's dynamic mask): tree
   attention refuses any mask but its own at run time, and the bias keywords of
   ``REFUSED_KEYWORDS`` (``position_bias=``, ``sinks=``, ``block_indices=``); a mask modified
   in place, or a bias under any other keyword: unhandled.

An unhandled hit fails :func:`test_every_hit_in_a_causal_lm_module_is_handled`, so a
transformers upgrade that brings one surfaces it. Planted modules show each rule fires.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers.families import model_support

transformers = pytest.importorskip("transformers")
ms = model_support()
scan = ms.modeling_scan()


def _modules(pattern):
    return {h.module for h in scan.scan_transformers() if h.pattern == pattern}


def test_scan_finds_the_known_cases():
    assert {"stablelm", "nemotron"} <= _modules("kwargs_dropped")
    assert {"qwen2_moe", "phimoe"} <= _modules("window_by_mask_builder")
    assert "doge" in _modules("model_built_mask")
    assert len(scan.causal_lm_modules()) >= 150  # the whole of transformers was read, not a list


def test_every_hit_in_a_causal_lm_module_is_handled():
    bad = scan.unhandled(scan.scan_transformers())
    assert not bad, (
        "unhandled patterns in transformers' modeling code (handle or refuse them, then regenerate docs/models.md):\n"
        + "\n".join(map(str, bad))
    )


LAYER = """
class PlantedDecoderLayer(GradientCheckpointingLayer):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask)
        return hidden_states
"""

ATTENTION = """
class PlantedAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = 0.1

    def forward(self, hidden_states, attention_mask, **kwargs):
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        {body}
        out, w = attention_interface(self, q, k, v, {mask}, scaling=self.scaling, {extra}**kwargs)
        return out, w
"""


def _attention(mask="attention_mask", extra="", body="pass"):
    return ATTENTION.format(mask=mask, extra=extra, body=body)


def _hits(src, config_src="sliding_window = 4096"):
    return [(h.pattern, h.detail, h.handled is not None) for h in scan.scan_source(src, "planted", config_src)]


def test_planted_layer_dropping_kwargs():
    assert _hits(LAYER) == [("kwargs_dropped", "self.self_attn(...)", True)]
    # Its own torch checkpoint call replays the layer outside the packed context: unhandled.
    own = (
        "from torch.utils.checkpoint import checkpoint\n"
        + LAYER
        + "\ndef run(layer, x):\n    return checkpoint(layer, x)\n"
    )
    assert _hits(own) == [("kwargs_dropped", "self.self_attn(...)", False)]
    assert _hits(LAYER.replace("attention_mask=attention_mask)", "attention_mask=attention_mask, **kwargs)")) == []


def test_planted_window_applied_only_by_the_mask_builder():
    src = "from ...masking_utils import create_causal_mask, create_sliding_window_causal_mask\n" + _attention()
    assert _hits(src) == [("window_by_mask_builder", "builds sliding-window masks", True)]
    # A window the config does not declare: mask_builder_window cannot read it.
    assert _hits(src, config_src="attention_window = 4096") == [
        ("window_by_mask_builder", "builds sliding-window masks", False)
    ]
    assert (
        _hits(src.replace("scaling=self.scaling,", "scaling=self.scaling, sliding_window=self.sliding_window,")) == []
    )
    assert _hits(_attention()) == []  # no window anywhere


@pytest.mark.parametrize(
    "mask,extra,body,expected",
    [
        (
            "attention_mask + self.bias",
            "",
            "pass",
            [("model_built_mask", "attention_mask=attention_mask + self.bias", True)],
        ),
        (
            "attention_mask",
            "",
            "attention_mask = attention_mask * self.gate",
            [("model_built_mask", "attention_mask=attention_mask", True)],
        ),
        (
            "attention_mask",
            "",
            "attention_mask.add_(self.bias)",
            [("model_built_mask", "modifies attention_mask in place", False)],
        ),
        ("attention_mask", "position_bias=self.rel(q), ", "pass", [("model_built_mask", "position_bias=", True)]),
        ("attention_mask", "alibi=self.slopes, ", "pass", [("model_built_mask", "alibi=", False)]),
        ("attention_mask", "dropout=0.0, softcap=self.cap, position_ids=None, ", "pass", []),
    ],
)
def test_planted_mask_or_bias_built_inside_attention(mask, extra, body, expected):
    assert _hits(_attention(mask, extra, body)) == expected


def test_an_unhandled_hit_fails_the_scan_test():
    planted = scan.scan_source(_attention(extra="alibi=self.slopes, "), "llama")  # as if transformers' Llama did it
    assert scan.unhandled(planted) == planted and len(planted) == 1
    assert scan.unhandled(planted, modules=frozenset()) == []  # only causal-LM modules count


def test_refused_keywords_are_refused_by_tree_attention():
    """The run-time half of pattern 3's handling: a call carrying a bias keyword is refused."""
    from treepack.proto.errors import UnsupportedModelError
    from treepack.trainer import materialize
    from treepack.trainer.hf.attention import REFUSED_KEYWORDS, TREE_MASK_OPTION, treepack_attention
    from treepack.trainer.hf.context import BATCH_KWARG, PackedContext

    from helpers.trainer_cases import plan_of

    c = ms.small_case()
    batch = materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])
    mask = batch.dense_mask()
    ctx = PackedContext(batch=batch, backend="sdpa", options={TREE_MASK_OPTION: mask})
    K, L = batch.input_ids.shape
    q = torch.randn(K, 2, L, 8)
    module = torch.nn.Module()
    out, _ = treepack_attention(module, q, q, q, mask, scaling=0.3, **{BATCH_KWARG: ctx})
    assert out.shape == (K, L, 2, 8)
    assert set(REFUSED_KEYWORDS) == {"position_bias", "sinks", "block_indices"}
    for kw in REFUSED_KEYWORDS:
        with pytest.raises(UnsupportedModelError, match=rf"passes its attention function {kw}="):
            treepack_attention(module, q, q, q, mask, scaling=0.3, **{BATCH_KWARG: ctx, kw: torch.zeros(1)})


def test_vision_towers_are_not_part_of_a_causal_lm():
    """The scan skips vision-tower classes: a module's causal-LM class builds none (Qwen3.5's
    vision attention passes its own cu_seqlens; Qwen3_5ForCausalLM holds no vision module)."""
    assert "qwen3_5" in scan.causal_lm_modules()
    model = ms.build_causal_lm("qwen3_5_text")
    assert not [type(m).__name__ for m in model.modules() if re.search(r"Vision|Visual", type(m).__name__)]
