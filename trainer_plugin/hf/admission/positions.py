"""Static check of positions: a model that reads positions must take the packed rows' ``position_ids``.

A model (or base model) whose forward takes no ``position_ids`` numbers the row's tokens
0..L-1 itself, so positions would run over the whole row instead of restarting per
sequence; refused unless nothing in the model reads positions (a pure state-space model).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from treepack.trainer.hf.admission.attention_checks import ATTENTION_NAME, dispatches_attention
from treepack.trainer.hf.admission.report import Refusal

__all__ = ["position_refusals"]


_POSITION_NAME = re.compile(r"pos|wpe|rotary|Rotary|Position|ALiBi|alibi", re.I)


def position_refusals(model: Any) -> list[Refusal]:
    """A model (or base model) whose forward takes no ``position_ids`` numbers the row's tokens 0..L-1 itself."""
    out = []
    if not _reads_positions(model):
        return out
    for path, mod in (("", model), ("base_model", getattr(model, "base_model", None))):
        if isinstance(mod, torch.nn.Module) and "position_ids" not in inspect.signature(mod.forward).parameters:
            out.append(
                Refusal(
                    path,
                    type(mod).__name__,
                    "its forward takes no position_ids: positions would run over the whole row, not restart per "
                    "sequence",
                )
            )
            break
    return out


def _reads_positions(model: Any) -> bool:
    """Whether anything in ``model`` depends on token positions: attention (causal masks, RoPE)
    or a positional embedding. A pure state-space model (Mamba2) reads none, so a forward
    without ``position_ids`` loses nothing there; its mixers follow the tree from the plan."""
    for name, mod in model.named_modules():
        cls = type(mod)
        if (
            dispatches_attention(cls)
            or ATTENTION_NAME.search(cls.__name__)
            or _POSITION_NAME.search(name)
            or _POSITION_NAME.search(cls.__name__)
        ):
            return True
    return False
