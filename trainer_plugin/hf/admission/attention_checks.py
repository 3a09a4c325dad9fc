"""Static checks of attention: does a layer dispatch through HF's attention interface, and what it refuses.

A layer whose ``forward`` dispatches through HF's ``AttentionInterface``
(``ALL_ATTENTION_FUNCTIONS``) runs the tree attention; its forward must come from known code,
and the variants the kernels do not run are refused (bidirectional attention, attention
dropout while training). The ``flex`` backend hands the model a ``BlockMask``, which a model
that reads its mask as a tensor cannot take.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import torch

from treepack.trainer.hf.admission.report import Refusal

__all__ = [
    "ATTENTION_NAME",
    "dispatches_attention",
    "forward_origin",
    "is_known_class",
    "has_dispatching_child",
    "attention_refusals",
    "backend_refusals",
]


ATTENTION_NAME = re.compile(r"Attention$|Attn$|SelfAttention")


_KNOWN_PREFIXES = ("torch.", "transformers.", "treepack.", "peft.", "accelerate.")


@functools.cache
def dispatches_attention(cls: type) -> bool:
    """True when ``cls.forward`` calls HF's attention interface (so the tree attention runs it)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src or "attention_interface" in src


def forward_origin(cls: type, attr: str = "forward") -> type | None:
    for base in cls.__mro__:
        if attr in base.__dict__:
            return base
    return None


def is_known_class(cls: type) -> bool:
    return cls.__module__.startswith(_KNOWN_PREFIXES) or cls.__module__ == "torch"


def has_dispatching_child(mod: torch.nn.Module) -> bool:
    return any(dispatches_attention(type(m)) for m in mod.modules() if m is not mod)


def attention_refusals(mod: torch.nn.Module, config: Any) -> list[str]:
    out = []
    if getattr(mod, "is_causal", True) is False:
        out.append("bidirectional attention (is_causal=False): tree attention is causal")
    drop = getattr(mod, "attention_dropout", 0.0)
    if mod.training and isinstance(drop, (int, float)) and drop > 0:
        out.append(f"attention dropout {drop} while training; set attention_dropout=0 or call model.eval()")
    return out


def backend_refusals(model: Any, backend: str) -> list[Refusal]:
    """``flex`` hands the model a ``BlockMask``; a model that inspects its mask as a tensor cannot take one."""
    if backend != "flex":
        return []
    for mod in (model, getattr(model, "base_model", None)):
        try:
            src = inspect.getsource(type(mod).forward)
        except (OSError, TypeError):
            continue
        if re.search(r"\battention_mask\.(ndim|dim\(\))", src):
            return [
                Refusal(
                    "",
                    type(mod).__name__,
                    "its forward reads the attention mask as a tensor (ndim); the flex BlockMask is not one: use "
                    "backend='sdpa' or 'flash'",
                )
            ]
    return []
