"""Tiny vision-language models built in code (no downloads) and image prompts for them.

Each family gives a 2-layer fp32 model with random weights and a function that makes one
image's inputs as the HF processor gives them for a sequence holding that image alone
(``pixel_values``, and ``image_grid_thw`` for the Qwen families), plus the number of
placeholder tokens the image takes in the text.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

VOCAB = 128
IMAGE_TOKEN = 100
VIDEO_TOKEN = 103
VISION_START = 101
VISION_END = 102
# Text tokens are drawn below this, so they never collide with the special ids above.
TEXT_VOCAB = 96

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
FAMILIES = (*QWEN_FAMILIES, "llava")


def _text(**extra: Any) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **extra,
    )


def tiny_vlm(family: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer fp32 VLM of ``family`` with a 2-block vision tower, in train mode."""
    import transformers as tf

    torch.manual_seed(seed)
    ids = dict(
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    if family == "qwen2_vl":
        vision = dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            mlp_ratio=2,
            num_heads=4,
            patch_size=2,
            temporal_patch_size=2,
            spatial_merge_size=2,
        )
        text = _text(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
        model = tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
    elif family == "qwen2_5_vl":
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            patch_size=2,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=8,
            fullatt_block_indexes=[1],
            out_hidden_size=32,
        )
        text = _text(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
        model = tf.Qwen2_5_VLForConditionalGeneration(
            tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        )
    elif family == "qwen3_vl":
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            patch_size=2,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=32,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        )
        text = _text(
            head_dim=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
        model = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids))
    elif family == "qwen3_5":
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            patch_size=2,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=32,
            num_position_embeddings=64,
        )
        text = _text(
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
                "partial_rotary_factor": 1.0,
            },
        )
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision, **ids))
    elif family == "llava":
        vision = tf.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=8, patch_size=2
        )
        text = tf.LlamaConfig(**_text())
        cfg = tf.LlavaConfig(
            vision_config=vision,
            text_config=text,
            image_token_id=IMAGE_TOKEN,
            projector_hidden_act="gelu",
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        )
        model = tf.LlavaForConditionalGeneration(cfg)
    else:
        raise ValueError(family)
    return model.float().train()


def image(family: str, seed: int, size: int = 4) -> dict[str, Any]:
    """One random image's processor outputs for ``family``.

    Returns:
        ``pixel_values`` (Qwen: [patches, C*T*P*P] rows of the grid; LLaVA: [1, 3, 8, 8]),
        ``image_grid_thw`` ([1, 3] for Qwen, else None) and ``n_tokens``, the placeholder
        tokens it takes in the text.
    """
    g = torch.Generator().manual_seed(seed)
    if family == "llava":
        return dict(pixel_values=torch.randn(1, 3, 8, 8, generator=g), image_grid_thw=None, n_tokens=16)
    h = w = size
    return dict(
        pixel_values=torch.randn(h * w, 3 * 2 * 2 * 2, generator=g),
        image_grid_thw=torch.tensor([[1, h, w]]),
        n_tokens=h * w // 4,
    )


def image_run(family: str, n_tokens: int) -> list[int]:
    """The placeholder run of one image in the text, with its delimiters (Qwen) or bare (LLaVA)."""
    if family == "llava":
        return [IMAGE_TOKEN] * n_tokens
    return [VISION_START, *[IMAGE_TOKEN] * n_tokens, VISION_END]


def join_images(imgs: list[dict[str, Any]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pixel_values, image_grid_thw) of a sequence holding ``imgs`` in order, as its processor call gives them."""
    if not imgs:
        return None, None
    pv = torch.cat([i["pixel_values"] for i in imgs])
    thw = None if imgs[0]["image_grid_thw"] is None else torch.cat([i["image_grid_thw"] for i in imgs])
    return pv, thw


def text(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, TEXT_VOCAB, n).tolist()


def reference_forward(model: torch.nn.Module, seq: np.ndarray, pixel_values: Any, image_grid_thw: Any) -> torch.Tensor:
    """[n, V] logits of one sequence alone through the stock model (as the processor feeds it)."""
    x = torch.as_tensor(np.asarray(seq), dtype=torch.int64)[None]
    kw: dict[str, Any] = {}
    if pixel_values is not None:
        kw["pixel_values"] = pixel_values
        if image_grid_thw is not None:
            kw["image_grid_thw"] = image_grid_thw
    if hasattr(model.model, "get_rope_index"):
        kw["mm_token_type_ids"] = (x == IMAGE_TOKEN).int()
    return model(input_ids=x, use_cache=False, **kw).logits[0].float()
