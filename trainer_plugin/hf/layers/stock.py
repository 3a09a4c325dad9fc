"""Whether a layer runs the code of a stock HF layer: forward fingerprints.

A layer kind found by structure is handled only when the module's ``forward`` is the code
of one of the kind's stock HF layers: inherited unchanged, or an identical copy under
another name (HF's modular converter makes those), compared as bytecode, constants and
names, without file or line information, together with every module-level function it
calls (:func:`forward_fingerprint`). A subclass that changes the computation is therefore
a mixer that is not handled.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from functools import cache

import torch

__all__ = ["forward_fingerprint", "stock_class", "CONV_ACTIVATIONS", "depthwise_conv", "has_attrs"]

CONV_ACTIVATIONS = (None, "silu", "swish")


def has_attrs(module: torch.nn.Module, *names: str) -> bool:
    """True when ``module`` has every attribute in ``names``."""
    return all(hasattr(module, n) for n in names)


def depthwise_conv(conv: object) -> bool:
    """True for a depthwise ``nn.Conv1d`` (one filter per channel): a mixer's causal conv."""
    return (
        isinstance(conv, torch.nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and conv.weight.shape[1] == 1
    )


def _code_key(c: types.CodeType) -> tuple:
    consts = tuple(_code_key(k) if isinstance(k, types.CodeType) else k for k in c.co_consts)
    return (c.co_code, c.co_names, c.co_varnames, consts)


def _names(c: types.CodeType) -> set[str]:
    out = set(c.co_names)
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            out |= _names(k)
    return out


def forward_fingerprint(fn: Callable) -> tuple:
    """The code of a (decorator-unwrapped) function and of every module-level function it calls.

    Bytecode, names and constants, without names of places (file, lines); callees are the
    plain functions its global names resolve to, followed transitively, so a copy whose
    ``forward`` is identical but whose helper (e.g. ``mamba2_chunk_scan``) differs does not
    match.
    """
    seen: dict[str, tuple] = {}

    def visit(f: Callable) -> tuple:
        f = inspect.unwrap(f)
        code, glb = f.__code__, getattr(f, "__globals__", {})
        for name in sorted(_names(code)):
            obj = glb.get(name)
            if name not in seen and isinstance(obj, types.FunctionType):
                seen[name] = ()  # placeholder: recursion and cycles
                seen[name] = visit(obj)
        return _code_key(code)

    top = visit(fn)
    return (top, tuple(sorted(seen.items())))


@cache
def _stock_fingerprints(stock: tuple[tuple[str, str], ...]) -> dict:
    """fingerprint -> stock class name, for the installed ones of ``stock`` ((module, class) pairs)."""
    out = {}
    for mod_name, cls_name in stock:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError):
            continue
        out.setdefault(forward_fingerprint(cls.forward), cls_name)
    return out


@cache
def _class_fingerprint(fn: Callable) -> tuple:
    return forward_fingerprint(fn)  # per class forward, computed once (patched layers ask every call)


def stock_class(module: torch.nn.Module, stock: tuple[tuple[str, str], ...]) -> str | None:
    """The class among ``stock`` whose forward ``module`` runs (same code), or None."""
    return _stock_fingerprints(stock).get(_class_fingerprint(type(module).forward))
