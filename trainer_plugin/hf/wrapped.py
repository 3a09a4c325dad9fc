"""Models inside wrappers: DDP, FSDP2, PEFT/LoRA, accelerate, ``torch.compile``.

The configuration (vocabulary, attention implementation, the head and its logit transforms)
is read from the HF model inside the wrapper (:func:`unwrap_model`), while the forward runs
through the wrapper itself, so its hooks (FSDP all-gathers, DDP gradient synchronisation,
LoRA adapters, accelerate's autocast) stay in the call.

``output="hidden"`` through a wrapper (:func:`forward_hidden`): the wrapper's forward is
called as usual, with ``logits_to_keep`` an empty index tensor so the head runs on no
position, and a forward hook on the inner base model takes its final hidden states.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch

from treepack.proto.errors import RequestError

__all__ = ["unwrap_model", "wrapper_chain", "forward_hidden", "forward_logits"]

_MAX_DEPTH = 16


def _inner(m: Any) -> Any | None:
    """The model one wrapper level down, or None when ``m`` wraps nothing we know."""
    if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return m.module
    orig = getattr(m, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(orig, torch.nn.Module):
        return orig
    get_base = getattr(m, "get_base_model", None)  # PEFT's PeftModel
    if callable(get_base) and hasattr(m, "peft_config"):
        return get_base()
    return None


def wrapper_chain(model: Any) -> Iterator[Any]:
    """``model``, then each model one wrapper level down (DDP, ``torch.compile``, PEFT), innermost last."""
    m = model
    for _ in range(_MAX_DEPTH):
        yield m
        m = _inner(m)
        if m is None:
            return


def unwrap_model(model: Any) -> Any:
    """The HF ``PreTrainedModel`` inside DDP / DataParallel / ``torch.compile`` / PEFT wrappers.

    FSDP2 (``fully_shard``) and accelerate keep the model's own class (or a subclass) and
    need no unwrapping; DDP-wrapped accelerate models unwrap as DDP.

    Args:
        model: the model as the training loop holds it.

    Returns:
        The innermost module that carries an HF ``config``.

    Raises:
        RequestError: no HF model inside (nothing with a ``config``).
    """
    *_, m = wrapper_chain(model)
    if not hasattr(m, "config") or not isinstance(m, torch.nn.Module):
        raise RequestError(
            f"{type(model).__name__} holds no HF model (no .config inside its wrappers)",
            path="$.model",
            rule="unsupported",
        )
    return m


def _last_hidden(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def forward_logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """[K, L, V] logits of ``model(**inputs)`` called through its wrappers."""
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out[0]


def forward_hidden(model: Any, hf: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """[K, L, d] final hidden states of the base model, the forward running through ``model``.

    Args:
        model: the model as held (possibly wrapped); its forward is what runs.
        hf: :func:`unwrap_model` of it.
        inputs: the keyword arguments of the call.

    Raises:
        RequestError: the causal LM's forward takes no ``logits_to_keep`` (it would compute
            [K, L, V] logits that ``output="hidden"`` exists to avoid).
    """
    base = getattr(hf, "base_model", hf)
    if base is hf:  # a bare base model: its output is the hidden states
        return _last_hidden(model(**inputs))
    if "logits_to_keep" not in inspect.signature(type(hf).forward).parameters:
        raise RequestError(
            f"{type(hf).__name__}.forward takes no logits_to_keep, so output='hidden' through it would "
            "compute full logits; use output='logits'",
            path="$.output",
            rule="unsupported",
        )
    seen: list[torch.Tensor] = []

    def grab(module: Any, args: Any, output: Any) -> None:
        seen.append(_last_hidden(output))

    handle = base.register_forward_hook(grab)
    try:
        keep = torch.zeros(0, dtype=torch.int64, device=inputs["input_ids"].device)
        model(**inputs, logits_to_keep=keep)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise RequestError(
            f"the base model of {type(hf).__name__} ran {len(seen)} times in one forward",
            path="$.model",
            rule="unsupported",
        )
    return seen[0]
