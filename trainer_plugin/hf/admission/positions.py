"""Static check of positions: every sequence's positions, and its rotary table, are its own.

Two ways a packed row would hand a sequence positions that are not its own, each refused:

- a model (or base model) whose forward takes no ``position_ids`` numbers the row's tokens
  0..L-1 itself, so positions would run over the whole row instead of restarting per
  sequence; refused unless nothing in the model reads positions (a pure state-space model);
- length-dependent RoPE (:func:`rope_refusals`): HF's ``dynamic_rope_update`` recomputes the
  rotary frequencies of a ``dynamic`` (NTK) or ``longrope`` rotary module from the longest
  position of the whole call, so one long sequence would change the others' rotary
  embedding. Judged by the type each rotary module resolved, which is what that wrapper
  reads at call time: HunYuan's checkpoints label their RoPE ``dynamic`` but carry a fixed
  ``alpha``, which HF's HunYuan rotary module resolves to ``ntk_alpha``, a static base, so
  it is accepted. A config that declares a length-dependent type with no rotary module
  telling what it resolved to is refused by the config. Exact would need every sequence's
  scaling regime in the plan's keys and one rotary table per sequence in a row, which HF's
  rotary module does not take (see docs/models.md).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from treepack.trainer.hf.admission.attention_checks import ATTENTION_NAME, dispatches_attention
from treepack.trainer.hf.admission.config_checks import model_configs, rope_dicts
from treepack.trainer.hf.admission.report import Refusal

__all__ = ["position_refusals", "rope_refusals", "length_dependent_rope"]


_POSITION_NAME = re.compile(r"pos|wpe|rotary|Rotary|Position|ALiBi|alibi", re.I)
_ROPE_REASON = (
    "length-dependent RoPE {kind!r}: HF scales it by the longest position of the whole packed call, so sequences "
    "would change each other's rotary embedding"
)


def position_refusals(model: Any) -> list[Refusal]:
    """Positions that would not be each sequence's own: a forward without ``position_ids``
    (:func:`_forward_refusals`) and length-dependent RoPE (:func:`rope_refusals`)."""
    return _forward_refusals(model) + rope_refusals(model)


def _forward_refusals(model: Any) -> list[Refusal]:
    """A model (or base model) whose forward takes no ``position_ids`` numbers the row's tokens 0..L-1 itself."""
    out: list[Refusal] = []
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


def length_dependent_rope(kind: str) -> bool:
    """Whether HF's ``dynamic_rope_update`` recomputes a rotary module of type ``kind`` from the call's positions."""
    return "dynamic" in kind or kind == "longrope"


def _resolved_types(mod: torch.nn.Module) -> list[str] | None:
    """The RoPE types a rotary module resolved (``rope_type``, per layer type for hybrid models), or None."""
    t = getattr(mod, "rope_type", None)
    if isinstance(t, str):
        return [t]
    if isinstance(t, dict) and t and all(isinstance(v, str) for v in t.values()):
        return list(t.values())
    return None


def rope_refusals(model: Any) -> list[Refusal]:
    """Rotary modules whose resolved RoPE type is length-dependent; else, when no rotary module
    tells its resolved type, the config's length-dependent RoPE types.

    Args:
        model: the unwrapped HF model.

    Returns:
        One refusal per length-dependent rotary module (path, class), or per config entry.
    """
    rotary = [(path, m, kinds) for path, m in model.named_modules() if (kinds := _resolved_types(m)) is not None]
    out = [
        Refusal(path, type(m).__name__, _ROPE_REASON.format(kind=kind))
        for path, m, kinds in rotary
        for kind in dict.fromkeys(kinds)
        if length_dependent_rope(kind)
    ]
    if rotary:
        return out
    for config in model_configs(model):
        for rope in rope_dicts(config):
            kind = str(rope.get("rope_type", rope.get("type", "default")))
            if length_dependent_rope(kind):
                out.append(Refusal("config.rope_parameters", type(config).__name__, _ROPE_REASON.format(kind=kind)))
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
