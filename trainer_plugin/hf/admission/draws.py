"""What one forward really does: the random numbers it draws, by module, and the precision it computes in.

:func:`watch_forward` runs the model once on one sequence under a torch dispatch mode that
sees every operator below autograd and autocast:

- **random draws**: every operator torch tags ``nondeterministic_seeded`` (``uniform_``,
  ``exponential_``, ``bernoulli_``, ``rand_like``, ``randn``, ``multinomial``, ``randperm``,
  attention with dropout ...), whatever generator it draws from, recorded with the innermost
  module running when it was called (a hook on every module keeps the stack). Draws that
  cannot change a value are left out: a ``dropout_p`` or ``p`` of 0, ``train=False``,
  ``uniform_(a, a)`` (DBRX draws it with ``moe_jitter_eps=0``), a ``normal_`` of std 0
  (SDPA takes a dropout seed even at ``dropout_p=0``). On packed rows every sharer of a
  prefix would get one draw where each sequence alone draws its own: a different random
  function, refused by name, like dropout;
- **the compute precision**: the coarsest floating dtype of any operator's output (bf16
  under bf16 autocast; float32 inside a float64 model whose norms compute in float32). The
  probe's rounding floors are in its units (:mod:`~treepack.trainer.hf.admission.tolerance`).

:func:`draws_off` puts the modules that draw in eval mode for the probe when the caller
accepted random draws (``allow_stochastic``): the probe then proves the rest of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ForwardWatch", "watch_forward", "draws_off", "draw_refusals"]

# Arguments that make a seeded operator draw nothing when they are 0 (or False).
_NO_DRAW_IF_ZERO = ("dropout_p", "p", "train", "std")


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardWatch:
    """What :func:`watch_forward` saw.

    Attributes:
        draws: ``{module path: operator names}`` of every random draw, in call order
            (``""``: the model's own forward).
        compute_dtype: the coarsest floating dtype an operator produced.
    """

    draws: dict[str, tuple[str, ...]]
    compute_dtype: torch.dtype


def _argument(schema: Any, args: tuple, kwargs: dict, name: str) -> Any:
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, a.default_value if a.has_default_value() else None)
    return None


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the operator draws random numbers that can change its result."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    schema = func._schema
    for name in _NO_DRAW_IF_ZERO:
        v = _argument(schema, args, kwargs, name)
        if isinstance(v, (bool, int, float)) and not v:
            return False
    if func.__name__.startswith("uniform"):
        lo, hi = _argument(schema, args, kwargs, "from"), _argument(schema, args, kwargs, "to")
        return not (isinstance(lo, (int, float)) and lo == hi)
    return True


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


class _Watch(TorchDispatchMode):
    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.draws: dict[str, list[str]] = {}
        self.dtype: torch.dtype | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _draws(func, args, kwargs):
            self.draws.setdefault(self.stack[-1] if self.stack else "", []).append(func.__name__.split(".")[0])
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.dtype = t.dtype if self.dtype is None else _coarser(self.dtype, t.dtype)
        return out


@contextmanager
def _module_stack(hf: torch.nn.Module) -> Iterator[list[str]]:
    """The paths of the modules running now, innermost last (hooks on every module)."""
    stack: list[str] = []
    handles = []
    for name, mod in hf.named_modules():

        def push(m: Any, args: Any, name: str = name) -> None:
            stack.append(name)

        def pop(m: Any, args: Any, out: Any, name: str = name) -> None:
            if stack and stack[-1] == name:
                stack.pop()

        handles.append(mod.register_forward_pre_hook(push))
        handles.append(mod.register_forward_hook(pop, always_call=True))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def watch_forward(hf: torch.nn.Module, seq: torch.Tensor) -> ForwardWatch:
    """Run ``hf`` once on ``seq`` alone (no gradients) and report its random draws and precision.

    Args:
        hf: the unwrapped HF model, in the caller's mode (under the caller's autocast).
        seq: [n] token ids.

    Returns:
        The :class:`ForwardWatch`.
    """
    with _module_stack(hf) as stack, torch.no_grad():
        watch = _Watch(stack)
        with watch:
            hf(input_ids=seq[None], use_cache=False)
    p = next(hf.parameters())
    dtype = watch.dtype or (p.dtype if p.is_floating_point() else torch.float32)
    return ForwardWatch(draws={k: tuple(dict.fromkeys(v)) for k, v in watch.draws.items()}, compute_dtype=dtype)


def draw_refusals(hf: torch.nn.Module, watch: ForwardWatch) -> list[tuple[str, str, str]]:
    """``(path, class, reason)`` of every module that drew random numbers in ``watch``."""
    mode = "while training" if hf.training else "in eval mode"
    out = []
    for path, ops in watch.draws.items():
        mod = hf.get_submodule(path) if path else hf
        out.append(
            (
                path,
                type(mod).__name__,
                f"draws random numbers {mode} ({', '.join(ops)}): every sharer of a packed prefix would get the "
                "same draw where each sequence alone draws its own; call model.eval(), switch the draw off, or "
                "pass allow_stochastic=True to accept one draw per shared prefix (not exact)",
            )
        )
    return out


@contextmanager
def draws_off(hf: torch.nn.Module, paths: list[str]) -> Iterator[None]:
    """The modules at ``paths`` (not their children) in eval mode inside the block, as found."""
    mods = [hf.get_submodule(p) if p else hf for p in paths]
    saved = [m.training for m in mods]
    for m in mods:
        m.training = False
    try:
        yield
    finally:
        for m, t in zip(mods, saved):
            m.training = t
