"""The model walk of a packed call (checks, hooks, patches, probe), done once per model state.

:func:`~treepack.trainer.hf.packed_forward` must refuse a model that cannot run exactly,
before any compute, on every call: a hook registered, a forward patched, a module swapped,
dropout switched on or the mode changed after the first call must still be refused. The
full check (:func:`~treepack.trainer.hf.admission.check.check_static`: source reads,
regexes, the guards) and the hook installation walk the whole model, milliseconds per call that grow
with depth (pure host time on a GPU). So the walk's result is remembered per model and
setup (a key of :class:`~treepack.trainer.hf.admission.setup.PackedSetup`), together with
:func:`model_state`, a cheap fingerprint of everything the walk reads, taken after the
walk; a later call whose fingerprint is equal skips the walk, any other runs it again.

The fingerprint holds, per module: its identity, class and the class's ``forward``, its
training flag, an instance ``forward``, its checkpointing function and flag, how many
attributes, children, parameters, buffers, forward hooks and pre-hooks it has, and the
values of its dropout-like and other random-draw attributes; torch's count of hooks ever registered (any new
hook, global or per module, changes it) and the global hooks; every attribute of the model's
configs (containers by their ``repr``); and the layer registry. What it does not see is
an edit inside a module that changes none of these (a new value of a conv's kernel size,
an attribute replaced by another of the same count): such code is expected to rebuild
the module, as HF's own conversions do, or to call :func:`forget_walks`.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from treepack.trainer.hf.admission.guards import DROPOUT_NAME, STOCHASTIC_NAME
from treepack.trainer.hf.layers import registered

__all__ = ["model_state", "fingerprint", "walked", "walk_info", "remember_walk", "forget_walks"]

_CONFIG_ATTRS = ("text_config", "decoder", "language_config", "llm_config")
# model -> (dropout-like attributes watched, {setup key: (fingerprint after the walk, info)})
_WALKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, dict[Hashable, tuple[tuple, Any]]]] = (
    weakref.WeakKeyDictionary()
)


def _frozen(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (dict, list, tuple, set)):
        return repr(v)
    return (type(v), id(v))


def _config_state(model: torch.nn.Module) -> tuple:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return ()
    out = []
    for c in (cfg, *(getattr(cfg, a, None) for a in _CONFIG_ATTRS)):
        if c is not None and hasattr(c, "__dict__"):
            out.append(tuple((k, _frozen(v)) for k, v in vars(c).items()))
    return tuple(out)


def _dropout_attrs(model: torch.nn.Module) -> tuple:
    """(module, attribute) pairs named like a dropout rate or another random draw's (what the guards read)."""
    return tuple(
        (m, name)
        for m in model.modules()
        for name in vars(m)
        if not name.startswith("_") and (DROPOUT_NAME.search(name) or STOCHASTIC_NAME.search(name))
    )


def model_state(model: torch.nn.Module, watched: tuple = ()) -> tuple:
    """The fingerprint of ``model`` that a walk's result depends on (module docstring).

    Args:
        model: the unwrapped HF model.
        watched: (module, attribute) pairs whose values are part of it (dropout-like rates).
    """
    mods = tuple(
        (
            id(m),
            type(m),
            type(m).forward,
            m.training,
            m.__dict__.get("forward"),
            m.__dict__.get("_gradient_checkpointing_func"),
            m.__dict__.get("gradient_checkpointing"),
            m.__dict__.get("p"),
            len(m.__dict__),
            len(m._modules),
            len(m._parameters),
            len(m._buffers),
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
        )
        for m in model.modules()
    )
    rates = tuple(_frozen(getattr(m, name, None)) for m, name in watched)
    hooks = (RemovableHandle.next_id, tuple(_module._global_forward_hooks), tuple(_module._global_forward_pre_hooks))
    return (mods, rates, hooks, _config_state(model), tuple(id(layer) for layer in registered()))


def fingerprint(model: torch.nn.Module) -> tuple | None:
    """``model``'s :func:`model_state` over the attributes its last walk watched, or None
    when it was never walked (then nothing is to be compared)."""
    entry = _WALKED.get(model)
    return None if entry is None else model_state(model, entry[0])


def walked(model: torch.nn.Module, setup: Hashable, state: tuple | None) -> bool:
    """Whether ``model`` passed the walk of ``setup`` and its :func:`fingerprint` ``state`` is
    the one it had after that walk (nothing it depends on changed since)."""
    entry = _WALKED.get(model)
    return state is not None and entry is not None and setup in entry[1] and entry[1][setup][0] == state


def walk_info(model: torch.nn.Module, setup: Hashable) -> Any:
    """What :func:`remember_walk` kept with ``model``'s walk of ``setup`` (None if none)."""
    entry = _WALKED.get(model)
    return None if entry is None or setup not in entry[1] else entry[1][setup][1]


def remember_walk(model: torch.nn.Module, setup: Hashable, info: Any = None) -> None:
    """Record that ``model``, as it is now, passed the walk of ``setup`` (``info``: what the
    walk found that later calls need, :func:`walk_info`)."""
    entry = _WALKED.get(model)
    watched = _dropout_attrs(model)
    states = entry[1] if entry is not None and entry[0] == watched else {}
    states[setup] = (model_state(model, watched), info)
    _WALKED[model] = (watched, states)


def forget_walks(model: torch.nn.Module | None = None) -> None:
    """Drop the remembered walks (of ``model``, or all): the next packed call walks again."""
    if model is None:
        _WALKED.clear()
    else:
        _WALKED.pop(model, None)
