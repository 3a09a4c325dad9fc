"""Tree attention chosen per call, by the presence of the packed context, not by model state.

HF layers pick their attention function from ``self.config._attn_implementation`` and the
model picks its mask builder the same way. :func:`install_dispatch` (idempotent) gives every
module of the model that holds a config a forward pre-hook and an always-called forward
hook: a call that carries the ``treepack_context`` keyword argument
(:data:`~treepack.trainer.hf.context.BATCH_KWARG`) switches that module's config to
``"treepack"`` for the duration of the call, and the hook restores the previous value when
the call returns or raises. A call without it is untouched.

So after :func:`~treepack.trainer.hf.packed_forward` returns the model is exactly as it was
(``generate()``, reference passes, any ``attn_implementation``).

Activation checkpointing replays a layer in ``backward()``, after ``packed_forward`` has
returned, and a decoder layer need not pass the context on to its attention (StableLM and
Nemotron call ``self.self_attn(...)`` without ``**kwargs``: there the attention found the
batch through the context variable and the switched config of the enclosing call, both
gone by the replay). So the replay carries the packed context itself, whatever the layer
forwards:

- HF's checkpointing (``gradient_checkpointing_enable``, reentrant or not) replays the
  function handed to the layer's ``_gradient_checkpointing_func``; :func:`install_dispatch`
  wraps that function (:func:`_replaying`) so that, when a packed context is current, the
  function runs, then and on replay, inside that context with the layer's configs switched;
- a checkpoint wrapper around the module call (``torch.utils.checkpoint`` of the layer,
  FSDP's ``checkpoint_wrapper``) replays ``layer(...)`` with the same keyword arguments: the
  layer carries the hooks too (every module with a ``gradient_checkpointing`` flag), and a
  call with the context keyword sets the context variable and switches every config under
  the layer for that call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import record_function

from treepack.proto.errors import RequestError
from treepack.trainer.hf.attention import ATTN_IMPLEMENTATION, register_tree_attention
from treepack.trainer.hf.context import BATCH_KWARG, current_packed, use_packed

__all__ = ["install_dispatch", "HOOKS_ATTR"]

# Where a hooked module keeps its hook handles and its stack of saved implementations
# (in its __dict__, outside nn.Module's registries, like the layer patches' stock forwards).
HOOKS_ATTR = "_treepack_dispatch_hooks"
_SAVED_ATTR = "_treepack_saved_impl"
_CONFIGS_ATTR = "_treepack_configs"
_REPLAY_MARK = "_treepack_replays"


def _has_config(module: torch.nn.Module) -> bool:
    cfg = module.__dict__.get("config")
    return cfg is not None and hasattr(cfg, "_attn_implementation_internal")


def _configs_under(module: torch.nn.Module) -> list[Any]:
    """Every distinct attention-dispatching config held by ``module`` or its descendants."""
    out: dict[int, Any] = {}
    for m in module.modules():
        if _has_config(m):
            out.setdefault(id(m.config), m.config)
    return list(out.values())


def _switch(configs: list[Any]) -> list[tuple[Any, str]]:
    saved = [(cfg, cfg._attn_implementation_internal) for cfg in configs]
    for cfg in configs:
        cfg._attn_implementation_internal = ATTN_IMPLEMENTATION
    return saved


def _restore(saved: list[tuple[Any, str]]) -> None:
    for cfg, prev in reversed(saved):
        cfg._attn_implementation_internal = prev


def _enter(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook: a call with the packed context runs as a packed call (context variable set,
    configs under the module ``"treepack"``) until :func:`_leave`."""
    ctx = kwargs.get(BATCH_KWARG)
    if ctx is None:
        return None
    with record_function("treepack::dispatch"):
        scope = use_packed(ctx)
        scope.__enter__()
        saved = _switch(module.__dict__.get(_CONFIGS_ATTR, ()))
        module.__dict__.setdefault(_SAVED_ATTR, []).append((scope, saved))
    return None


def _leave(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Always-called hook: restore what :func:`_enter` changed (also when the call raised)."""
    if kwargs.get(BATCH_KWARG) is None:
        return None
    stack = module.__dict__.get(_SAVED_ATTR)
    if stack:
        with record_function("treepack::dispatch"):
            scope, saved = stack.pop()
            _restore(saved)
            scope.__exit__(None, None, None)
    return None


def _replaying(checkpoint_fn: Any, layer: torch.nn.Module) -> Any:
    """``layer._gradient_checkpointing_func`` whose checkpointed function, called in a packed
    context, runs in that context (and with the layer's configs switched) also on replay."""
    if getattr(checkpoint_fn, _REPLAY_MARK, False):
        return checkpoint_fn
    configs = _configs_under(layer)

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = current_packed()
        if ctx is None:
            return checkpoint_fn(function, *args, **kwargs)

        def packed_function(*a: Any, **k: Any) -> Any:
            saved = _switch(configs)
            try:
                with use_packed(ctx):
                    return function(*a, **k)
            finally:
                _restore(saved)

        return checkpoint_fn(packed_function, *args, **kwargs)

    setattr(checkpoint, _REPLAY_MARK, True)
    checkpoint.__wrapped__ = checkpoint_fn
    # Kept readable for code that inspects the partial's options (use_reentrant).
    checkpoint.keywords = getattr(checkpoint_fn, "keywords", {})
    return checkpoint


def install_dispatch(model: torch.nn.Module) -> int:
    """Hook every config-holding (and checkpointable) module of ``model`` so packed calls
    dispatch to tree attention, and make checkpoint replays carry the packed context.

    Idempotent (run before every packed call, so a checkpointing function set later is
    wrapped too); registers the ``"treepack"`` implementation with HF on first use.

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
        fn = mod.__dict__.get("_gradient_checkpointing_func")
        if fn is not None:
            mod.__dict__["_gradient_checkpointing_func"] = _replaying(fn, mod)
        if not _has_config(mod) and not hasattr(mod, "gradient_checkpointing"):
            continue
        if HOOKS_ATTR not in mod.__dict__:
            mod.__dict__[_CONFIGS_ATTR] = _configs_under(mod)
            pre = mod.register_forward_pre_hook(_enter, with_kwargs=True)
            post = mod.register_forward_hook(_leave, with_kwargs=True, always_call=True)
            mod.__dict__[HOOKS_ATTR] = (pre, post)
        n += 1
    return n
