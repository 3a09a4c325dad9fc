"""Static check of PEFT adapters: every PEFT method and LoRA variant is exact on tree rows, or refused by name.

PEFT's code is trusted by the module walk (a known library: its layers, hooks and patched
forwards pass :mod:`~treepack.trainer.hf.admission.guards`), so what each method *does* with
the tokens of a call is judged here, by the method: :data:`PEFT_METHODS` classifies every
``PeftType`` of the installed PEFT, and :data:`LORA_VARIANTS` every LoRA variant class
(``lora.Linear.lora_variants``: DoRA, aLoRA, ...), as

- ``exact``: the method works per token (a weight update of targeted layers, a scaling, a
  learned key/value per attention layer, per-token routing) and its packed logprobs and
  gradients equal every sequence alone (tests/trainer/test_peft_methods.py, one test per
  method); some only in a mode: :func:`peft_refusals` refuses the others by the module's
  state (PVeRA and MonteCLoRA sample while training, VeLoRA averages its projection over
  each training call);
- ``refused``: what the method does with a call's tokens has no tree-row form (virtual
  tokens in front of each row, routing by one task id per example, a router averaged over
  the whole call), with the reason.

A method or variant the table does not hold (a newer PEFT) is refused, naming it: neither
proven exact nor known to be wrong. The adapters judged are every adapter configured on the
model as the caller holds it (``PeftModel.peft_config`` up its wrappers, and the tuner's on
the HF model), active or not, and every LoRA variant instantiated in its layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from treepack.trainer.hf.admission.report import Refusal
from treepack.trainer.hf.wrapped import wrapper_levels

__all__ = ["PeftMethod", "PEFT_METHODS", "LORA_VARIANTS", "peft_refusals"]


@dataclass(frozen=True, slots=True)
class PeftMethod:
    """How a PEFT method (or LoRA variant) runs on tree rows.

    Attributes:
        status: ``exact`` (proven by its test) or ``refused``.
        why: for ``exact``, what makes it per token (and the mode it needs, if any); for
            ``refused``, the reason the refusal gives.
    """

    status: str
    why: str


def _exact(why: str) -> PeftMethod:
    return PeftMethod("exact", why)


def _refused(why: str) -> PeftMethod:
    return PeftMethod("refused", why)


_WEIGHTS = "a learned change of the targeted layers' weights, applied per token"
_PROMPT = (
    "prompt learning puts {what} in front of every input row, and a packed row holds several sequences: only "
    "the row's first sequence would follow them, and the rows' positions and tree mask would no longer be the "
    "plan's; train an adapter that changes weights (LoRA, ...) or run this one unpacked"
)
_UNTESTED = "not tested on tree rows ({what}); run it unpacked"

#: Every ``PeftType`` of PEFT 0.21 (by value), exact or refused; tests hold each to it.
PEFT_METHODS: dict[str, PeftMethod] = {
    "LORA": _exact(_WEIGHTS + " (its variants: LORA_VARIANTS)"),
    "ADALORA": _exact(_WEIGHTS + " (SVD-form LoRA with rank allocation)"),
    "ADAMSS": _exact(_WEIGHTS + " (subspaces of the weights' SVD)"),
    "ADAPTION_PROMPT": _exact(
        "learned keys and values every query of an adapted attention layer attends, gated: the same for every "
        "position, so per token"
    ),
    "BEFT": _exact(_WEIGHTS),
    "BOFT": _exact(_WEIGHTS + " (butterfly orthogonal)"),
    "C3A": _exact(_WEIGHTS + " (circular convolution over features, not tokens)"),
    "CARTRIDGE": _refused(_PROMPT.format(what="a trained KV-cache prefix (past_key_values)")),
    "CPT": _refused(_PROMPT.format(what="context-aware prompt tokens")),
    "DEFT": _exact(_WEIGHTS),
    "DELORA": _exact(_WEIGHTS),
    "FOURIERFT": _exact(_WEIGHTS + " (a sparse Fourier spectrum of the weights)"),
    "FROD": _exact(_WEIGHTS),
    "GLORA": _exact(_WEIGHTS),
    "GRALORA": _exact(_WEIGHTS),
    "HIRA": _exact(_WEIGHTS),
    "HRA": _exact(_WEIGHTS + " (Householder reflections)"),
    "IA3": _exact("learned per-feature scalings of keys, values and feed-forward activations, per token"),
    "LILY": _refused(
        "Lily mixes its B experts by the router's mean over every token of the call (all rows and positions, "
        "padding included), so a sequence's adapter depends on the sequences packed with it"
    ),
    "LN_TUNING": _exact("trains the targeted norm layers' own parameters, per token"),
    "LOHA": _exact(_WEIGHTS + " (Hadamard product of low-rank factors)"),
    "LOKR": _exact(_WEIGHTS + " (Kronecker product)"),
    "MISS": _exact(_WEIGHTS),
    "OFT": _exact(_WEIGHTS + " (orthogonal)"),
    "SHIRA": _exact(_WEIGHTS + " (sparse)"),
    "PROMPT_TUNING": _refused(_PROMPT.format(what="virtual prompt tokens")),
    "MULTITASK_PROMPT_TUNING": _refused(_PROMPT.format(what="virtual prompt tokens chosen by task_ids")),
    "OSF": _exact(_WEIGHTS + " (orthogonal subspace)"),
    "P_TUNING": _refused(_PROMPT.format(what="virtual tokens from a prompt encoder")),
    "PEANUT": _exact(_WEIGHTS),
    "POLY": _refused(
        "Poly mixes its adapter modules by a task id per example (task_ids), and a packed row holds the "
        "sequences of several examples: one routing per row would be wrong for the others"
    ),
    "PREFIX_TUNING": _refused(_PROMPT.format(what="learned key/value prefixes (past_key_values)")),
    "PSOFT": _exact(_WEIGHTS),
    "PVERA": _exact(
        _WEIGHTS + "; in eval mode without sample_at_inference only (it uses the mean): sampling is refused"
    ),
    "RANDLORA": _exact(_WEIGHTS),
    "ROAD": _exact("a learned rotation and scaling of each token's output features"),
    "SHADOW": _refused(
        "ShadowPEFT runs its own shadow backbone on the input ids, whose attention never sees the tree: it attends "
        "over the whole row, across the sequences packed in it"
    ),
    "SUPERTUNING": _exact(_WEIGHTS + " (sparse support)"),
    "TINYLORA": _exact(_WEIGHTS),
    "TRAINABLE_TOKENS": _exact("trains the embeddings of chosen token ids, per token"),
    "UNILORA": _exact(_WEIGHTS),
    "VBLORA": _exact(_WEIGHTS + " (a shared vector bank)"),
    "VERA": _exact(_WEIGHTS + " (shared random matrices, trained scalings)"),
    "WAVEFT": _exact(_WEIGHTS + " (sparse wavelet coefficients)"),
    "XLORA": _exact(
        "a scaling pass of the same call (adapters off), then per-token mixing scalings from its last hidden states"
    ),
}

#: Every LoRA variant class of PEFT 0.21 (``lora.Linear.lora_variants`` and the embedding /
#: conv forms), exact or refused; a layer running a variant not listed here is refused.
LORA_VARIANTS: dict[str, PeftMethod] = {
    "DoraLinearVariant": _exact("DoRA: a weight-norm decomposition of the weight update, per token"),
    "DoraEmbeddingVariant": _exact("DoRA on an embedding, per token"),
    "DoraConv1dVariant": _refused(_UNTESTED.format(what="DoRA on a Conv1d")),
    "DoraConv2dVariant": _refused(_UNTESTED.format(what="DoRA on a Conv2d")),
    "DoraConv3dVariant": _refused(_UNTESTED.format(what="DoRA on a Conv3d")),
    "QALoraLinearVariant": _refused(_UNTESTED.format(what="QA-LoRA needs a GPTQ-quantized base")),
    "ALoraLinearVariant": _exact(
        "aLoRA: the adapter switches on from each sequence's own last invocation match, computed per sequence "
        "and mapped into the rows (treepack.trainer.hf.alora); sharers that disagree are refused at run time"
    ),
    "ArrowLinearVariant": _exact("Arrow: per-token top-k routing over task adapters"),
    "BdLoraLinearVariant": _exact("BD-LoRA: block-diagonal LoRA factors, per token"),
    "VeloraLinearVariant": _exact(
        "VeLoRA: plain LoRA forward; its backward projection is refused while training unless init_type='random'"
    ),
    "MontecloraLinearVariant": _exact("MonteCLoRA: the mean adapter in eval mode; sampling while training is refused"),
    "MiCALinearVariant": _exact("MiCA: LoRA with a singular-vector initialization, per token"),
    "MiCAEmbeddingVariant": _exact("MiCA on an embedding, per token"),
    "KasaLinearVariant": _exact("KaSA: SVD-based LoRA, per token"),
}


def _configs(model: Any) -> Iterator[tuple[str, Any]]:
    """(path, PeftConfig) of every adapter configured on ``model`` or on a wrapper around it, each once."""
    seen: set[int] = set()
    for depth, m in enumerate(wrapper_levels(model)):
        cfgs = getattr(m, "peft_config", None)
        if not isinstance(cfgs, dict):
            continue
        where = "peft_config" if depth == 0 else f"<wrapper {depth}>.peft_config"
        for name, cfg in cfgs.items():
            if id(cfg) not in seen and hasattr(cfg, "peft_type"):
                seen.add(id(cfg))
                yield f"{where}[{name!r}]", cfg


def _method_refusals(model: Any) -> list[Refusal]:
    out = []
    for path, cfg in _configs(model):
        kind = getattr(cfg.peft_type, "value", str(cfg.peft_type))
        method = PEFT_METHODS.get(kind)
        if method is None:
            why = (
                f"PEFT method {kind} is not known to treepack: neither proven exact on tree rows nor refused for a "
                "reason (a PEFT newer than the one treepack was tested with); run it unpacked"
            )
            out.append(Refusal(path, type(cfg).__name__, why))
        elif method.status == "refused":
            out.append(Refusal(path, type(cfg).__name__, f"PEFT method {kind}: {method.why}"))
    return out


def _variant_reason(mod: torch.nn.Module, name: str, variant: Any) -> str | None:
    cls = variant if isinstance(variant, type) else type(variant)
    known = LORA_VARIANTS.get(cls.__name__)
    if known is None:
        return (
            f"LoRA variant {cls.__name__} (adapter {name!r}) is not known to treepack: neither proven exact on tree "
            "rows nor refused for a reason; run it unpacked"
        )
    if known.status == "refused":
        return f"LoRA variant {cls.__name__} (adapter {name!r}): {known.why}"
    if cls.__name__ == "MontecloraLinearVariant" and mod.training:
        return (
            f"MonteCLoRA (adapter {name!r}) samples its adapter's weights on every training call: one draw for the "
            "whole packed call, where each sequence alone draws its own; call model.eval() or run it unpacked"
        )
    init = getattr(mod, "lora_velora_init_type", {}).get(name)
    if cls.__name__ == "VeloraLinearVariant" and mod.training and init != "random":
        return (
            f"VeLoRA (adapter {name!r}, init_type={init!r}) projects its backward on a vector averaged over every "
            "token of a training call (or of the first one), so gradients depend on what the call packs together; "
            "use init_type='random'"
        )
    return None


def _layer_refusals(model: torch.nn.Module) -> list[Refusal]:
    out = []
    for path, mod in model.named_modules():
        variants = getattr(mod, "lora_variant", None)
        if isinstance(variants, dict):
            for name, variant in variants.items():
                if (why := _variant_reason(mod, name, variant)) is not None:
                    out.append(Refusal(path, type(mod).__name__, why))
        sample = getattr(mod, "sample_at_inference", None)
        if isinstance(sample, dict) and hasattr(mod, "pvera_lambda_d"):
            for name in mod.pvera_lambda_d:
                if mod.training or sample.get(name):
                    why = (
                        f"PVeRA (adapter {name!r}) samples its adapter output per token "
                        f"({'while training' if mod.training else 'sample_at_inference=True'}): one draw for all "
                        "sharers of a packed prefix, where each sequence alone draws its own; in eval mode without "
                        "sample_at_inference it uses the mean and runs exact"
                    )
                    out.append(Refusal(path, type(mod).__name__, why))
    return out


def peft_refusals(model: Any, hf: torch.nn.Module) -> list[Refusal]:
    """The PEFT methods and LoRA variants of ``model`` that have no exact tree-row form, or that
    treepack does not know.

    Args:
        model: the model as the caller holds it (a ``PeftModel`` and any wrappers around it).
        hf: its unwrapped HF model (the tuner layers PEFT injected, in their modes).

    Returns:
        One refusal per refused adapter (``peft_config[name]``, its config class, why) and per
        tuner layer whose variant or mode is refused (path, class, why).
    """
    return _method_refusals(model) + _layer_refusals(hf)
