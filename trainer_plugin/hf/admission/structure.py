"""The static walk of the model's modules: how each runs on tree rows, or why it is refused.

:func:`classify` judges one module (a layer of the registry, an attention layer, a token
mixer, unknown code); :func:`layer_type_refusals` holds every non-attention entry of
``config.layer_types`` to a handled mixer; :func:`conv_width_refusals` refuses handled layers
whose causal conv is wider than the plan's ``conv_width``.
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.trainer.hf.admission.attention_checks import (
    ATTENTION_NAME,
    attention_refusals,
    dispatches_attention,
    forward_origin,
    has_dispatching_child,
    is_known_class,
)
from treepack.trainer.hf.admission.mixers import conv_reason, mixer_reason, patched_classes
from treepack.trainer.hf.admission.report import Refusal, SupportReport
from treepack.trainer.hf.layer_masks import ATTENTION_LAYER_TYPES
from treepack.trainer.hf.layers import handled_layer, is_handled, mixer_kind
from treepack.trainer.kernels.tree_scan import conv_width_refusal

__all__ = ["PER_TOKEN_LAYER_TYPES", "classify", "layer_type_refusals", "conv_width_refusals"]


# Layer types that hold only per-token work (an MLP or MoE block: Nemotron-H's "mlp" / "moe").
# Their modules are still walked, so a token mixer hidden inside one is refused by mechanism.
PER_TOKEN_LAYER_TYPES = frozenset({"mlp", "moe", "ffn", "dense", "feed_forward"})


def classify(path: str, mod: torch.nn.Module, config: Any, report: SupportReport, patch_layers: bool) -> bool:
    """Record how ``mod`` runs; returns True when its children are covered by it (skip them)."""
    cls = type(mod)
    patches = patched_classes()
    if cls.__name__ in patches:
        if not patch_layers:
            report.refusals.append(
                Refusal(
                    path,
                    cls.__name__,
                    "its tree patch is off (patch_layers=False): the stock forward scans the whole row",
                )
            )
        else:
            report.handled[path] = f"patch:{cls.__name__}"
        return True
    if is_handled(mod):
        if not patch_layers:
            report.refusals.append(
                Refusal(
                    path,
                    cls.__name__,
                    f"its tree forward ({mixer_kind(mod)}) is off (patch_layers=False): the stock forward scans "
                    "the whole row",
                )
            )
        else:
            report.handled[path] = f"mixer:{mixer_kind(mod)}"
        return True
    patched_base = next((b.__name__ for b in cls.__mro__[1:] if b.__name__ in patches), None)
    if patched_base is not None:
        report.refusals.append(
            Refusal(
                path,
                cls.__name__,
                f"subclass of {patched_base}, whose tree patch matches that exact class only (its forward may differ)",
            )
        )
        return True
    origin = forward_origin(cls)
    if dispatches_attention(cls):
        if origin is not None and not is_known_class(origin):
            report.refusals.append(
                Refusal(path, cls.__name__, f"attention forward overridden in {origin.__module__}.{origin.__name__}")
            )
        for reason in attention_refusals(mod, config):
            report.refusals.append(Refusal(path, cls.__name__, reason))
        report.handled[path] = "tree_attention"
        return False
    reason = mixer_reason(mod) or conv_reason(mod)
    if (
        reason is None
        and ATTENTION_NAME.search(cls.__name__)
        and any(True for _ in mod.parameters())
        and not has_dispatching_child(mod)
    ):
        reason = (
            "attention that does not dispatch through HF's AttentionInterface (its own mask and softmax run "
            "over the whole row)"
        )
    if reason is None and origin is not None and not is_known_class(origin):
        reason = (
            f"forward defined outside torch / transformers ({origin.__module__}.{origin.__qualname__}): "
            "treepack cannot tell whether it mixes tokens"
        )
    if reason is not None:
        report.refusals.append(Refusal(path, cls.__name__, reason))
        return True
    return False


def layer_type_refusals(model: torch.nn.Module, config: Any, report: SupportReport) -> None:
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or not types:
        return
    layers = next(
        (
            m
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.ModuleList) and len(m) == len(types) and n.endswith("layers")
        ),
        None,
    )
    prefix = next((n for n, m in model.named_modules() if m is layers), "")
    for i, kind in enumerate(types):
        if kind in ATTENTION_LAYER_TYPES or kind in PER_TOKEN_LAYER_TYPES:
            continue
        root = f"{prefix}.{i}"
        covered = layers is not None and any(
            p == root or p.startswith(root + ".") for p, how in report.handled.items() if how != "tree_attention"
        )
        refused = any(r.path == root or r.path.startswith(root + ".") for r in report.refusals)
        if not covered and not refused:
            report.refusals.append(
                Refusal(
                    root if layers is not None else "config.layer_types",
                    str(kind),
                    f"layer type {kind!r} (config.layer_types[{i}]) has no tree-exact mixer",
                )
            )


def conv_width_refusals(model: Any, report: SupportReport, conv_width: int) -> list[Refusal]:
    """Handled layers whose causal conv is wider than the plan's ``conv_width`` (their tree conv
    would need more context than the plan's conv metadata holds)."""
    out = []
    for path, how in report.handled.items():
        if how == "tree_attention":
            continue
        mod = model.get_submodule(path)
        layer = handled_layer(mod)
        reason = (
            None if layer is None or layer.conv_width is None else conv_width_refusal(layer.conv_width(mod), conv_width)
        )
        if reason is not None:
            out.append(Refusal(path, type(mod).__name__, reason))
    return out
