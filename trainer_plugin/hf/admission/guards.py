"""Refusals a walk of the layer classes misses: dropout and other random draws while training, patched forwards, hooks.

:func:`~treepack.trainer.hf.admission.check.check_static` judges each module by its class, and
adds these refusals. Two things change what runs without changing a class, and each is refused
before any compute, naming the module, its class and why:

- **dropout while training** (:func:`dropout_refusals`): on packed rows all sharers of a
  prefix get one dropout mask between them, where each sequence alone draws its own, so
  the result is a different random function. Refused, in training mode, for every
  ``nn.Dropout`` module with ``p > 0`` (residual, embedding, hidden, MLP, LoRA's
  ``lora_dropout``), every float attribute named ``*dropout*`` / ``*pdrop*`` a module
  holds for functional dropout (``self.dropout = config.dropout``), and every config
  field of that kind that the model's own code reads (``resid_pdrop``, ``embd_pdrop``,
  ``hidden_dropout``, GPT-2's ``attn_pdrop``, named as the config names it). With
  ``allow_dropout=True`` the caller accepts one shared mask per shared prefix (not exact;
  attention dropout stays refused: tree attention runs none);
- **other random draws while training** (:func:`stochastic_refusals`): router jitter
  (Mixtral's and MiniMax's ``router_jitter_noise``, DBRX's ``moe_jitter_eps``, PhiMoE's
  ``input_jitter_noise`` and its router's Gumbel sampling), layerdrop, stochastic depth
  (``drop_path``), Gumbel or noisy gating: every sharer of a packed prefix would get one
  draw where each sequence alone draws its own. Refused, in training mode, for every
  module attribute and every config field the model's code reads whose name says so
  (:data:`STOCHASTIC_NAME`) and whose value is positive; the probe also refuses, by
  behaviour, any module that draws random numbers in the mode it runs in
  (:mod:`~treepack.trainer.hf.admission.draws`). With ``allow_stochastic=True`` the caller
  accepts one draw per shared prefix (not exact);
- **patched forwards and hooks** (:func:`patch_refusals`): a ``forward`` set on an
  instance, a library class whose ``forward`` was replaced (a monkeypatch), and forward
  or pre-forward hooks (per module or global), unless their code comes from a known
  library (torch, transformers, PEFT, accelerate, TRL, treepack) or marked with
  :func:`trust_hook` (the caller states it works per position; the probe still checks):
  such code may mix positions of the row (a ``cumsum``, a ``roll``) and treepack cannot
  read it.

With dropout accepted, the probe runs with every rate at 0 (:func:`dropout_off`): no shared
mask can equal the alone runs.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "dropout_refusals",
    "dropout_off",
    "stochastic_refusals",
    "patch_refusals",
    "trust_hook",
    "KNOWN_CODE",
    "DROPOUT_NAME",
    "STOCHASTIC_NAME",
]

KNOWN_CODE = ("torch", "transformers", "peft", "accelerate", "trl", "treepack")
DROPOUT_NAME = re.compile(r"dropout|pdrop|drop_rate|drop_prob", re.I)
# Random draws other than dropout that the forward makes while training, by the names HF
# gives their rates: router jitter, layerdrop, stochastic depth, Gumbel or noisy gating.
STOCHASTIC_NAME = re.compile(
    r"jitter|layerdrop|layer_drop|drop_path|stochastic_depth|gumbel|noisy_gat|noise_std|noise_eps", re.I
)
# Dropout-named config fields that are not probabilities of the model's own forward.
_NOT_A_RATE = re.compile(r"classifier|summary|^use_|_type$", re.I)

Triple = tuple[str, str, str]


_TRUSTED = "_treepack_trusted"


def trust_hook(fn: Any) -> Any:
    """Mark a hook (or forward) as the caller's statement that it works per position (it
    reads or records values, it does not mix tokens); :func:`patch_refusals` then accepts it.
    The run-time probe still checks the model with it. Returns ``fn``."""
    setattr(getattr(fn, "__func__", fn), _TRUSTED, True)
    return fn


def _known(fn: Any) -> bool:
    if getattr(getattr(fn, "__func__", fn), _TRUSTED, False):
        return True
    mod = _code_module(fn)
    return mod is not None and mod.split(".")[0] in KNOWN_CODE


def _code_module(fn: Any) -> str | None:
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        else:
            break
    return getattr(fn, "__module__", None)


def _describe(fn: Any) -> str:
    base = fn
    while isinstance(base, functools.partial):
        base = base.func
    base = getattr(base, "__func__", base)
    return f"{_code_module(fn)}.{getattr(base, '__qualname__', type(base).__name__)}"


def _rate(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


@functools.cache
def _class_source(cls: type) -> str:
    out = []
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        try:
            out.append(inspect.getsource(base))
        except (OSError, TypeError):
            continue
    return "\n".join(out)


def _source_of(model: torch.nn.Module) -> str:
    """The source of every class of the model's modules (what its code can read)."""
    return "\n".join(_class_source(cls) for cls in {type(m) for m in model.modules()})


def _configs(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    yield "config", cfg
    for attr in ("text_config", "decoder", "language_config", "llm_config"):
        sub = getattr(cfg, attr, None)
        if sub is not None and hasattr(sub, "to_dict"):
            yield f"config.{attr}", sub


def dropout_refusals(model: torch.nn.Module, *, allow_dropout: bool = False) -> list[Triple]:
    """Active dropout while training, as ``(path, class, reason)`` triples (empty in eval mode).

    Args:
        model: the unwrapped HF model.
        allow_dropout: accept dropout outside attention (one mask per shared prefix; not exact).
    """
    if allow_dropout or not any(m.training for m in model.modules()):
        return []
    out: list[Triple] = []
    hint = (
        "; call model.eval(), set it to 0, or pass allow_dropout=True to accept one dropout mask per shared "
        "prefix (not exact)"
    )
    for path, mod in model.named_modules():
        if not mod.training:
            continue
        if isinstance(mod, torch.nn.modules.dropout._DropoutNd) and mod.p > 0:
            out.append(
                (
                    path,
                    type(mod).__name__,
                    f"dropout p={mod.p} while training: every sharer of a packed prefix would get the same mask{hint}",
                )
            )
            continue
        for name, v in vars(mod).items():
            # attention_dropout is check_model's own refusal (the attention kernels run none).
            if DROPOUT_NAME.search(name) and _rate(v) > 0 and not name.startswith("_") and name != "attention_dropout":
                out.append(
                    (
                        path,
                        type(mod).__name__,
                        f"functional dropout {name}={v} while training: every sharer of a packed prefix would "
                        f"get the same mask{hint}",
                    )
                )
    src = None
    for where, cfg in _configs(model):
        for name, v in vars(cfg).items():
            if not DROPOUT_NAME.search(name) or _NOT_A_RATE.search(name) or _rate(v) <= 0:
                continue
            src = _source_of(model) if src is None else src
            if re.search(rf"\b{re.escape(name)}\b", src):
                out.append(
                    (
                        f"{where}.{name}",
                        type(cfg).__name__,
                        f"{where}.{name}={v} while training: the model's dropout would give every sharer of a "
                        f"packed prefix one mask{hint}",
                    )
                )
    return out


def stochastic_refusals(model: torch.nn.Module, *, allow_stochastic: bool = False) -> list[Triple]:
    """Random draws other than dropout while training, by name, as ``(path, class, reason)`` triples.

    Every module attribute and every config field the model's code reads whose name says it
    draws (:data:`STOCHASTIC_NAME`: ``router_jitter_noise``, ``moe_jitter_eps``,
    ``layerdrop``, ``drop_path_rate`` ...) with a positive value, in training mode (empty in
    eval mode, where HF's layers draw nothing). What no name gives away (a router that samples
    whatever its fields say) the probe finds by behaviour
    (:mod:`~treepack.trainer.hf.admission.draws`).

    Args:
        model: the unwrapped HF model.
        allow_stochastic: accept one draw per shared prefix (not exact).
    """
    if allow_stochastic or not any(m.training for m in model.modules()):
        return []
    hint = (
        "; call model.eval(), set it to 0, or pass allow_stochastic=True to accept one draw per shared prefix "
        "(not exact)"
    )
    why = "every sharer of a packed prefix would get the same draw where each sequence alone draws its own"
    out: list[Triple] = []
    for path, mod in model.named_modules():
        if not mod.training:
            continue
        for name, v in vars(mod).items():
            if STOCHASTIC_NAME.search(name) and _rate(v) > 0 and not name.startswith("_"):
                out.append((path, type(mod).__name__, f"{name}={v} draws random numbers while training: {why}{hint}"))
    src = None
    for where, cfg in _configs(model):
        for name, v in vars(cfg).items():
            if not STOCHASTIC_NAME.search(name) or _rate(v) <= 0:
                continue
            src = _source_of(model) if src is None else src
            if re.search(rf"\b{re.escape(name)}\b", src):
                out.append(
                    (
                        f"{where}.{name}",
                        type(cfg).__name__,
                        f"{where}.{name}={v} while training: the model draws random numbers with it: {why}{hint}",
                    )
                )
    return out


def _hook_items(mod: torch.nn.Module) -> Iterator[tuple[str, Callable]]:
    for kind, hooks in (("forward hook", mod._forward_hooks), ("forward pre-hook", mod._forward_pre_hooks)):
        for fn in hooks.values():
            yield kind, fn


def patch_refusals(model: torch.nn.Module) -> list[Triple]:
    """Instance / class forward patches and forward hooks whose code is not a known library's.

    Returns:
        ``(path, class, reason)`` triples; ``<global>`` for torch's global module hooks.
    """
    from torch.nn.modules import module as _module

    out: list[Triple] = []
    for kind, hooks in (
        ("global forward hook", _module._global_forward_hooks),
        ("global forward pre-hook", _module._global_forward_pre_hooks),
    ):
        for fn in hooks.values():
            if not _known(fn):
                out.append(
                    (
                        "<global>",
                        "torch.nn.Module",
                        f"{kind} {_describe(fn)}: its code is not a known library's, so it may mix positions of "
                        "the packed row",
                    )
                )
    for path, mod in model.named_modules():
        cls = type(mod)
        inst = mod.__dict__.get("forward")
        if inst is not None and not _known(inst):
            out.append(
                (
                    path,
                    cls.__name__,
                    f"forward replaced on the instance by {_describe(inst)}: its code may mix positions of the "
                    "packed row",
                )
            )
        owner = next((b for b in cls.__mro__ if "forward" in b.__dict__), None)
        fn = owner.__dict__["forward"] if owner is not None else None
        if owner is not None and owner.__module__.split(".")[0] in KNOWN_CODE and fn is not None and not _known(fn):
            out.append(
                (
                    path,
                    cls.__name__,
                    f"{owner.__name__}.forward replaced by {_describe(fn)} (a patch of a library class): its "
                    "code may mix positions of the packed row",
                )
            )
        for kind, fn in _hook_items(mod):
            if not _known(fn):
                out.append(
                    (
                        path,
                        cls.__name__,
                        f"{kind} {_describe(fn)}: its code is not a known library's, so it may mix positions of "
                        "the packed row",
                    )
                )
    return out


@contextmanager
def dropout_off(hf: torch.nn.Module) -> Iterator[None]:
    """Every dropout rate of ``hf`` (modules, module attributes, config fields) at 0 inside the block."""
    saved: list[tuple[Any, str, Any]] = []
    objs: list[Any] = list(hf.modules()) + [c for _, c in _configs(hf)]
    for obj in objs:
        if isinstance(obj, torch.nn.modules.dropout._DropoutNd):
            saved.append((obj, "p", obj.p))
            obj.p = 0.0
        for name, v in list(vars(obj).items()):
            if DROPOUT_NAME.search(name) and isinstance(v, float) and v > 0:
                saved.append((obj, name, v))
                setattr(obj, name, 0.0)
    try:
        yield
    finally:
        for obj, name, v in reversed(saved):
            setattr(obj, name, v)
