"""Static checks of the model's config: settings with no tree-exact path.

Llama4's NoPE temperature tuning on rows at least ``floor_scale`` long, ALiBi, MoE auxiliary
losses (``output_router_logits``) and, for ``output="hidden"`` unless the caller applies
them, the final logit transforms. (Length-dependent RoPE is a check of positions:
:mod:`~treepack.trainer.hf.admission.positions`.)
"""

from __future__ import annotations

from typing import Any

from treepack.trainer.hf.admission.report import Refusal

__all__ = ["config_refusals", "model_configs", "rope_dicts"]


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def config_refusals(
    config: Any, *, output: str, hidden_transforms: bool, kwargs: dict, row_len: int | None = None
) -> list[Refusal]:
    """Model-wide settings with no tree-exact path (NoPE temperature tuning, ALiBi, aux losses,
    logit transforms)."""
    out: list[Refusal] = []
    name = type(config).__name__
    floor_scale = getattr(config, "floor_scale", None)
    if (
        getattr(config, "attn_temperature_tuning", False)
        and floor_scale
        and row_len is not None
        and row_len >= floor_scale
    ):
        # Llama4 scales NoPE queries by log1p(floor((i + 1) / floor_scale)) of the ROW index i, not
        # of position_ids: every index below floor_scale - 1 gets scale 1 whatever the sequence, so
        # rows shorter than floor_scale are exact; longer rows would scale by the wrong position.
        out.append(
            Refusal(
                "config.attn_temperature_tuning",
                name,
                "NoPE attention temperature tuning reads the row index, not the position: exact only for rows "
                f"shorter than floor_scale={floor_scale}, got rows of {row_len}; use seq_len < {floor_scale}",
            )
        )
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        out.append(Refusal("config.alibi", name, "ALiBi biases are not applied by tree attention"))
    if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
        out.append(
            Refusal(
                "output_router_logits",
                name,
                "MoE auxiliary (load-balancing) loss: HF averages it over the packed positions, where a shared "
                "prefix counts once for all its sharers, so it differs from the unpacked batch's; pass "
                "output_router_logits=False",
            )
        )
    if output == "hidden" and not hidden_transforms:
        for attr in _LOGIT_TRANSFORMS:
            v = getattr(config, attr, None)
            if v not in (None, 0, 0.0, 1, 1.0):
                out.append(
                    Refusal(
                        f"config.{attr}",
                        name,
                        f"output='hidden' returns states before the model's logit transform {attr}={v}; use "
                        "output='logits'",
                    )
                )
    return out


def rope_dicts(config: Any) -> list[dict]:
    """The RoPE settings of ``config`` (``rope_parameters`` / ``rope_scaling``), one dict per layer
    type, each once (``rope_scaling`` is often an alias of ``rope_parameters``)."""
    out: list[dict] = []
    for attr in ("rope_parameters", "rope_scaling"):
        v = getattr(config, attr, None)
        if not isinstance(v, dict) or not v:
            continue
        per_layer_type = all(isinstance(x, dict) for x in v.values())
        out.extend(d for d in (v.values() if per_layer_type else [v]) if d not in out)
    return out


def model_configs(model: Any) -> list[Any]:
    """The model's config and its nested text/decoder configs."""
    config = getattr(model, "config", None)
    out = [config] if config is not None else []
    for attr in ("text_config", "decoder", "language_config", "llm_config"):
        sub = getattr(config, attr, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out.append(sub)
    return out
