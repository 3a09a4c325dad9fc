"""A tiny Qwen3.5 vision-language model (``model_type`` ``qwen3_5``) in TreepackFSDPEngine: refused.

Run in its own process by ``test_hybrids.py``: for this model type verl replaces the forward
methods of transformers' Qwen3.5 classes (``Qwen3_5Model``, ``Qwen3_5DecoderLayer``,
``Qwen3_5GatedDeltaNet``, ...) for the whole process, which would leak into the text-only
Qwen3.5 tests. Prints ``REFUSED <message>`` or ``RAN``, then whether the model ran.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cpu_shim  # noqa: E402

cpu_shim.install(init_file=tempfile.mktemp(prefix="treepack-verl-vlm-gloo-"))

import torch  # noqa: E402
from engines import VOCAB, build, flags, grpo_batch  # noqa: E402
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration  # noqa: E402

from treepack.proto.errors import UnsupportedModelError  # noqa: E402
from treepack.trainer.hf.admission.guards import trust_hook  # noqa: E402
from treepack.trainer.verl import TreepackFSDPEngine  # noqa: E402

text = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
)
vision = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, num_position_embeddings=16
)
cfg = Qwen3_5Config(
    text_config=text,
    vision_config=vision,
    image_token_id=VOCAB - 4,
    video_token_id=VOCAB - 3,
    vision_start_token_id=VOCAB - 2,
    vision_end_token_id=VOCAB - 1,
)
torch.manual_seed(0)
path = tempfile.mkdtemp(prefix="treepack-verl-qwen3_5-vlm-")
Qwen3_5ForConditionalGeneration(cfg).save_pretrained(path)
eng = build(TreepackFSDPEngine, path=path)
td = flags(grpo_batch(seed=1), dynamic=False, rmpad=True, temperature=0.7, calculate_entropy=True, compute_loss=False)
calls = []
eng.module.register_forward_pre_hook(trust_hook(lambda *a: calls.append(1)))
try:
    with eng.eval_mode():
        eng.infer_batch(td)
    print("RAN")
except UnsupportedModelError as e:
    print("REFUSED", str(e).replace("\n", " "))
print("MODEL RAN:", bool(calls))
