"""Which token mixers of an HF model the tree path reproduces, found by mechanism (issue 10).

:func:`mixer_kind` reads a module's parameters and attributes (a depthwise causal conv, a
state-space ``A_log``, delta-rule projections, ...) to say which recurrence it runs, with no
class-name list; :func:`is_handled` then requires its ``forward`` to be the code of a stock
HF layer of that kind (:data:`STOCK_LAYERS`): inherited unchanged, or an identical copy
under another name (HF's modular converter makes those), compared as bytecode, constants
and names, without file or line information, together with every module-level function
it calls (:func:`forward_fingerprint`). A subclass that changes the computation is
therefore a mixer that is not handled, and :func:`unhandled_reason` says why; the support
check refuses it by name.

Kinds: ``gdn`` (Qwen3-Next / Qwen3.5 Gated DeltaNet), ``gdn_olmo`` (OLMo-hybrid's
variant), ``mamba2`` (Bamba, Nemotron-H, Granite-4, Falcon-H1; the pure Mamba2 model and
Zamba2 run the same code and match), ``mamba`` (Jamba), ``kda`` (Kimi-Linear),
``short_conv`` (LFM2, LFM2-MoE). A structure match whose code differs (e.g. the pure
``MambaMixer`` and ``FalconMambaMixer``: no dt/B/C norms) has a kind and is not handled.
"""

from __future__ import annotations

import importlib
import inspect
import types
from functools import lru_cache
from typing import Any, Callable

import torch

__all__ = ["STOCK_LAYERS", "MIXER_KINDS", "mixer_kind", "is_handled", "unhandled_reason", "stock_layer", "forward_fingerprint"]

# kind -> stock HF layers (module, class) whose forward the tree forward reproduces.
STOCK_LAYERS: dict[str, tuple[tuple[str, str], ...]] = {
    "gdn": (
        ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
        ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
        ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    ),
    "gdn_olmo": (("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet"),),
    "mamba2": (
        ("transformers.models.bamba.modeling_bamba", "BambaMixer"),
        ("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"),
        ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer"),
        ("transformers.models.falcon_h1.modeling_falcon_h1", "FalconH1Mixer"),
    ),
    "mamba": (("transformers.models.jamba.modeling_jamba", "JambaMambaMixer"),),
    "kda": (("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention"),),
    "short_conv": (
        ("transformers.models.lfm2.modeling_lfm2", "Lfm2ShortConv"),
        ("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeShortConv"),
    ),
}
MIXER_KINDS = tuple(STOCK_LAYERS)
CONV_ACTIVATIONS = (None, "silu", "swish")


def _has(module: torch.nn.Module, *names: str) -> bool:
    return all(hasattr(module, n) for n in names)


def _depthwise_conv(conv: Any) -> bool:
    return isinstance(conv, torch.nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels and conv.weight.shape[1] == 1


def _structure_kind(module: torch.nn.Module) -> str | None:
    """The mixer kind a module's parameters and attributes describe, or None."""
    A_log = getattr(module, "A_log", None)
    gdn_params = isinstance(A_log, torch.Tensor) and A_log.dim() == 1 and _has(module, "dt_bias", "head_k_dim", "head_v_dim", "key_dim", "value_dim")
    if gdn_params and _depthwise_conv(getattr(module, "conv1d", None)):
        if _has(module, "in_proj_qkvz", "in_proj_ba", "norm", "out_proj") or _has(module, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj"):
            return "gdn"
        if _has(module, "q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_norm", "o_proj"):
            return "gdn_olmo"
    if (
        _has(module, "in_proj", "out_proj", "D", "dt_bias", "norm", "num_heads", "head_dim", "n_groups", "ssm_state_size", "chunk_size", "conv_dim", "intermediate_size")
        and _depthwise_conv(getattr(module, "conv1d", None))
        and isinstance(A_log, torch.Tensor)
        and A_log.dim() == 1
        and not _has(module, "x_proj", "dt_proj")
    ):
        return "mamba2"
    if (
        _has(module, "in_proj", "x_proj", "dt_proj", "out_proj", "D", "time_step_rank", "ssm_state_size", "intermediate_size")
        and _depthwise_conv(getattr(module, "conv1d", None))
        and isinstance(A_log, torch.Tensor)
        and A_log.dim() == 2
    ):
        return "mamba"
    gate = getattr(module, "forget_gate", None)
    if (
        _has(module, "q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj", "head_dim", "qkv_dim")
        and _depthwise_conv(getattr(module, "conv1d", None))
        and isinstance(getattr(gate, "A_log", None), torch.Tensor)
    ):
        return "kda"
    conv = getattr(module, "conv", None)
    in_proj = getattr(module, "in_proj", None)
    if (
        _depthwise_conv(conv)
        and isinstance(in_proj, torch.nn.Linear)
        and in_proj.out_features == 3 * conv.in_channels
        and _has(module, "out_proj")
        and A_log is None
    ):
        return "short_conv"
    return None


def _code_key(c: types.CodeType) -> tuple:
    consts = tuple(_code_key(k) if isinstance(k, types.CodeType) else k for k in c.co_consts)
    return (c.co_code, c.co_names, c.co_varnames, consts)


def _names(c: types.CodeType) -> set[str]:
    out = set(c.co_names)
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            out |= _names(k)
    return out


def forward_fingerprint(fn: Callable) -> tuple:
    """The code of a (decorator-unwrapped) function and of every module-level function it calls.

    Bytecode, names and constants, without names of places (file, lines); callees are the
    plain functions its global names resolve to, followed transitively, so a copy whose
    ``forward`` is identical but whose helper (e.g. ``mamba2_chunk_scan``) differs does not
    match.
    """
    seen: dict[str, tuple] = {}

    def visit(f: Callable) -> tuple:
        f = inspect.unwrap(f)
        code, glb = f.__code__, getattr(f, "__globals__", {})
        for name in sorted(_names(code)):
            obj = glb.get(name)
            if name not in seen and isinstance(obj, types.FunctionType):
                seen[name] = ()  # placeholder: recursion and cycles
                seen[name] = visit(obj)
        return _code_key(code)

    top = visit(fn)
    return (top, tuple(sorted(seen.items())))


@lru_cache(maxsize=None)
def _stock_fingerprints(kind: str) -> dict:
    """fingerprint -> stock class name, for the stock layers of ``kind`` that are installed."""
    out = {}
    for mod_name, cls_name in STOCK_LAYERS[kind]:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError):
            continue
        out.setdefault(forward_fingerprint(cls.forward), cls_name)
    return out


def _stock_forward(module: torch.nn.Module) -> Callable:
    return type(module).forward


@lru_cache(maxsize=None)
def _class_fingerprint(fn: Callable) -> tuple:
    return forward_fingerprint(fn)  # per class forward, computed once (patched layers ask every call)


def stock_layer(module: torch.nn.Module) -> str | None:
    """The stock HF class whose forward ``module`` runs (same code), or None."""
    kind = mixer_kind(module)
    return None if kind is None else _stock_fingerprints(kind).get(_class_fingerprint(_stock_forward(module)))


def mixer_kind(module: torch.nn.Module) -> str | None:
    """The recurrent / conv mixer kind of ``module`` by mechanism (structure), or None.

    A module with a kind is a token mixer that is wrong on tree rows unless
    :func:`is_handled` says its tree forward reproduces it.
    """
    return _structure_kind(module)


def unhandled_reason(module: torch.nn.Module) -> str | None:
    """Why a mixer cannot run exactly on tree rows, or None when it can (or is no mixer)."""
    kind = mixer_kind(module)
    if kind is None:
        return None
    if stock_layer(module) is None:
        return f"its forward is not the code of a stock {kind} layer ({', '.join(c for _, c in STOCK_LAYERS[kind])})"
    act = getattr(module, "activation", None)
    if act not in CONV_ACTIVATIONS:
        return f"conv activation {act!r} (tree conv supports {CONV_ACTIVATIONS})"
    return None


def is_handled(module: torch.nn.Module) -> bool:
    """True when ``module`` is a mixer whose tree forward reproduces it exactly."""
    return mixer_kind(module) is not None and unhandled_reason(module) is None
