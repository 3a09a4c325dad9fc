"""Models inside wrappers: DDP, FSDP2, PEFT/LoRA, accelerate, ``torch.compile``.

The configuration (vocabulary, attention implementation, the head and its logit transforms)
is read from the HF model inside the wrapper (:func:`unwrap_model`), while the forward runs
through the wrapper itself, so its hooks (FSDP all-gathers, DDP gradient synchronisation,
LoRA adapters, accelerate's autocast) stay in the call.

``output="hidden"`` through a wrapper (:func:`forward_hidden`): the wrapper's forward is
called as usual, with ``logits_to_keep`` an empty index tensor so the head runs on no
position, and a forward hook on the inner base model (:func:`inner_model`) takes its final
hidden states (or on the one model inside it that ran, where the causal LM calls that
instead: OPT's ``model.decoder``). Such a hook of treepack's own (:func:`transient_hook`) lives for one call and
leaves torch's hook counter as it found it, so the walk cache
(:mod:`~treepack.trainer.hf.admission.walk_cache`, which reads that counter to see a hook the
caller registers) does not take it for a change of the model.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from treepack.proto.errors import RequestError

__all__ = [
    "unwrap_model",
    "wrapper_levels",
    "wrapper_chain",
    "no_sync",
    "inner_model",
    "transient_hook",
    "forward_hidden",
    "forward_logits",
]

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


def wrapper_levels(model: Any) -> Iterator[Any]:
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
    *_, m = wrapper_levels(model)
    if not hasattr(m, "config") or not isinstance(m, torch.nn.Module):
        raise RequestError(
            f"{type(model).__name__} holds no HF model (no .config inside its wrappers)",
            path="$.model",
            rule="unsupported",
        )
    return m


def wrapper_chain(model: Any) -> str:
    """The classes of the wrappers around the HF model, outermost first (``"DistributedDataParallel>PeftModel..."``;
    ``""`` for a bare model): what a proof through ``model`` holds for."""
    *wrappers, _ = wrapper_levels(model)
    return ">".join(type(m).__name__ for m in wrappers)


def no_sync(model: Any) -> Any:
    """DDP's ``no_sync()`` context: backward passes inside synchronise no gradient (measurements
    that are not training steps); a null context for any other model."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def inner_model(hf: Any) -> Any:
    """The decoder stack whose final hidden states ``hf``'s head reads (``hf`` itself for a bare base model).

    HF's ``base_model`` is that module, except where a model's ``base_model_prefix`` names
    no attribute of it (Llama 4's and mllama's causal LMs: ``language_model`` while the stack
    is ``model``) and ``base_model`` is the model itself; a model with output embeddings is
    then read through its one child that carries an HF config.

    Args:
        hf: the unwrapped HF model.

    Raises:
        RequestError: a model with output embeddings whose stack is not found that way.
    """
    base = getattr(hf, "base_model", hf)
    get_out = getattr(hf, "get_output_embeddings", None)
    if base is not hf or not callable(get_out) or get_out() is None:
        return base
    stacks = [m for m in hf.children() if hasattr(m, "config")]
    if len(stacks) != 1:
        raise RequestError(
            f"{type(hf).__name__}: its base_model is the model itself and {len(stacks)} of its children carry a "
            "config, so its decoder stack is not known; use output='logits'",
            path="$.model",
            rule="unsupported",
        )
    return stacks[0]


@contextmanager
def transient_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> Iterator[None]:
    """``module.register_forward_hook(hook)`` for the block only; torch's hook counter is put
    back when no other hook was registered meanwhile (module docstring)."""
    before = RemovableHandle.next_id
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        if RemovableHandle.next_id == before + 1:
            RemovableHandle.next_id = before


def _last_hidden(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def forward_logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """[K, L, V] logits of ``model(**inputs)`` called through its wrappers."""
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out[0]


def forward_hidden(model: Any, hf: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """[K, L, d] final hidden states of the base model, the forward running through ``model``.

    The hidden states are the output of :func:`inner_model`; where the causal LM's forward
    calls a model inside it instead (OPT calls ``self.model.decoder``, not ``self.model``),
    the one child model of it that ran (whose output is what OPT's ``lm_head`` reads).

    Args:
        model: the model as held (possibly wrapped); its forward is what runs.
        hf: :func:`unwrap_model` of it.
        inputs: the keyword arguments of the call.

    Raises:
        RequestError: the causal LM's forward takes no ``logits_to_keep`` (it would compute
            [K, L, V] logits that ``output="hidden"`` exists to avoid); neither the stack nor
            exactly one child model of it ran exactly once.
    """
    base = inner_model(hf)
    if base is hf:  # a bare base model: its output is the hidden states
        return _last_hidden(model(**inputs))
    if "logits_to_keep" not in inspect.signature(type(hf).forward).parameters:
        raise RequestError(
            f"{type(hf).__name__}.forward takes no logits_to_keep, so output='hidden' through it would "
            "compute full logits; use output='logits'",
            path="$.output",
            rule="unsupported",
        )
    stacks = [base, *(m for m in base.children() if _is_hf_model(m))]
    seen: list[list[torch.Tensor]] = [[] for _ in stacks]
    with ExitStack() as hooks:
        for m, got in zip(stacks, seen):
            hooks.enter_context(transient_hook(m, lambda mod, args, out, got=got: got.append(_last_hidden(out))))
        keep = torch.zeros(0, dtype=torch.int64, device=inputs["input_ids"].device)
        model(**inputs, logits_to_keep=keep)
    if len(seen[0]) == 1:
        return seen[0][0]
    ran = [got[0] for got in seen[1:] if len(got) == 1]
    if not seen[0] and len(ran) == 1 and all(len(got) <= 1 for got in seen[1:]):
        return ran[0]
    counts = ", ".join(f"{type(m).__name__} {len(got)}" for m, got in zip(stacks, seen))
    raise RequestError(
        f"the decoder stack of {type(hf).__name__} is not one model run once in one forward (runs: {counts}); "
        "use output='logits'",
        path="$.model",
        rule="unsupported",
    )


def _is_hf_model(m: Any) -> bool:
    """Whether ``m`` is an HF model (a ``PreTrainedModel``: a config and a base-model prefix)."""
    return hasattr(m, "config") and hasattr(m, "base_model_prefix")
