"""Tree attention chosen per call, by the presence of the packed context, not by model state.

HF layers pick their attention function from ``self.config._attn_implementation`` and the
model picks its mask builder the same way. :func:`install_dispatch` (idempotent) gives every
module of the model that holds a config a forward pre-hook and an always-called forward
hook: a call that carries the ``treepack_context`` keyword argument
(:data:`~treepack.trainer.hf.context.BATCH_KWARG`) switches that module's config to
``"treepack"`` for the duration of the call, and the hook restores the previous value when
the call returns or raises. A call without it is untouched.

So after :func:`~treepack.trainer.hf.packed_forward` returns the model is exactly as it was
(``generate()``, reference passes, any ``attn_implementation``), and activation checkpointing
still replays the packed layers: the recomputation in ``backward()`` calls the attention
modules again with the same keyword arguments, so their hooks switch them to the tree path
again, for that call only. Checkpoint wrappers of any kind (HF's
``gradient_checkpointing_enable``, ``torch.utils.checkpoint``, FSDP's ``checkpoint_wrapper``)
replay the same way, because the decision travels with the arguments.
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.hf.attention import ATTN_IMPLEMENTATION, register_tree_attention
from treepack.trainer.hf.context import BATCH_KWARG

__all__ = ["install_dispatch", "HOOKS_ATTR"]

# Where a hooked module keeps its hook handles and its stack of saved implementations
# (in its __dict__, outside nn.Module's registries, like the layer patches' stock forwards).
HOOKS_ATTR = "_treepack_dispatch_hooks"
_SAVED_ATTR = "_treepack_saved_impl"
_KEEP = object()  # pushed when the config already said "treepack" (nested calls)


def _has_config(module: torch.nn.Module) -> bool:
    cfg = module.__dict__.get("config")
    return cfg is not None and hasattr(cfg, "_attn_implementation_internal")


def _enter(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook: a call with the packed context runs this module's config as ``"treepack"``."""
    if kwargs.get(BATCH_KWARG) is None:
        return None
    cfg = module.config
    stack = module.__dict__.setdefault(_SAVED_ATTR, [])
    prev = cfg._attn_implementation_internal
    if prev == ATTN_IMPLEMENTATION:
        stack.append(_KEEP)
    else:
        stack.append(prev)
        cfg._attn_implementation_internal = ATTN_IMPLEMENTATION
    return None


def _leave(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Always-called hook: restore what :func:`_enter` changed (also when the call raised)."""
    if kwargs.get(BATCH_KWARG) is None:
        return None
    stack = module.__dict__.get(_SAVED_ATTR)
    if stack:
        prev = stack.pop()
        if prev is not _KEEP:
            module.config._attn_implementation_internal = prev
    return None


def install_dispatch(model: torch.nn.Module) -> int:
    """Hook every config-holding module of ``model`` so packed calls dispatch to tree attention.

    Idempotent; registers the ``"treepack"`` implementation with HF on first use.

    Args:
        model: the unwrapped HF model (a ``PreTrainedModel``).

    Returns:
        How many modules carry the hooks.

    Raises:
        RequestError: the model does not dispatch attention through HF's ``AttentionInterface``
            (its attention implementation cannot be set), so tree attention would be ignored.
    """
    register_tree_attention()
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        raise RequestError(
            f"{type(model).__name__} does not accept a custom attention implementation "
            "(it does not dispatch through HF's AttentionInterface)",
            path="$.model",
            rule="unsupported",
        )
    n = 0
    for mod in model.modules():
        if not _has_config(mod):
            continue
        if HOOKS_ATTR not in mod.__dict__:
            pre = mod.register_forward_pre_hook(_enter, with_kwargs=True)
            post = mod.register_forward_hook(_leave, with_kwargs=True, always_call=True)
            mod.__dict__[HOOKS_ATTR] = (pre, post)
        n += 1
    return n

