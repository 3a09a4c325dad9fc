"""flash-attn's varlen kernels as a :class:`~treepack.trainer.kernels.varlen_merge.SplitVarlen` pair.

The copy-free varlen path (:mod:`~treepack.trainer.kernels.varlen_merge`) needs a forward
that returns the log-sum-exp and a backward that takes the output and log-sum-exp it is
given (the merged ones). flash-attn's ``flash_attn_varlen_func`` is an autograd function
over exactly such a pair, ``flash_attn.flash_attn_interface._flash_attn_varlen_forward``
and ``_flash_attn_varlen_backward`` (the pair ring-attention implementations call).
Their signatures moved between releases (``window_size`` became ``window_size_left`` /
``window_size_right``, ``softcap`` arrived, the forward returned 8 values and now 4, the
backward returned the gradients and now fills the buffers it is given), so
:func:`flash_split` binds every argument by name from the signature it finds and uses
the pair only when every parameter it has no value for has a default; else it answers
None and the caller runs the gathered path over ``flash_attn_varlen_func``.

Semantics relied on (flash-attn 2.x): ``cu_seqlens`` int32 offsets, bottom-right causal
alignment when a sequence's query and key counts differ (>= 2.1), the LSE as
``[heads, total_q]`` float32 in natural log (>= 2.6 for varlen), GQA by head groups,
gradients of keys shared by grouped heads summed; rows of a sequence without keys or
queries are never read back. ``kernel=`` takes a (forward, backward) stand-in with the
same signatures (CPU tests).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from treepack.trainer.kernels.varlen_merge import SplitVarlen

__all__ = ["flash_split", "FORWARD_ARGS", "BACKWARD_ARGS"]

#: Leading positional parameters of ``_flash_attn_varlen_forward`` (every release).
FORWARD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
#: Leading positional parameters of ``_flash_attn_varlen_backward`` (every release).
BACKWARD_ARGS = (
    "dout",
    "q",
    "k",
    "v",
    "out",
    "softmax_lse",
    "dq",
    "dk",
    "dv",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
)


def _parameters(fn: Callable) -> dict[str, inspect.Parameter] | None:
    # A torch.library custom op (flash-attn >= 2.7) hides its function behind (*args, **kwargs).
    try:
        return dict(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
    except (TypeError, ValueError):
        return None


def _keywords(params: dict[str, inspect.Parameter], lead: tuple[str, ...], values: dict[str, Any]) -> dict | None:
    """The keywords to pass after the leading positionals, or None when the signature is not one we know."""
    names = list(params)
    if tuple(names[: len(lead)]) != lead:
        return None
    kw: dict[str, Any] = {}
    for name in names[len(lead) :]:
        p = params[name]
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in values:
            kw[name] = values[name]
        elif p.default is p.empty:
            return None
    return kw


def _values(scale: float, causal: bool, softcap: float) -> dict[str, Any]:
    return dict(
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size=(-1, -1),
        window_size_left=-1,
        window_size_right=-1,
        softcap=softcap,
        alibi_slopes=None,
        return_softmax=False,
        deterministic=False,
        rng_state=None,
    )


def flash_split(kernel: tuple[Callable, Callable] | None = None) -> SplitVarlen | None:
    """flash-attn's split varlen pair (module docstring), or None when it is not usable here.

    Args:
        kernel: (forward, backward) with flash-attn's private signatures; default the
            installed flash-attn's.

    Returns:
        The pair, or None: flash-attn missing, or a signature this adapter does not know.
    """
    if kernel is None:
        try:
            from flash_attn.flash_attn_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward
        except ImportError:
            return None
        kernel = (_flash_attn_varlen_forward, _flash_attn_varlen_backward)
    fwd, bwd = kernel
    fp, bp = _parameters(fwd), _parameters(bwd)
    if fp is None or bp is None:
        return None
    probe = _values(1.0, True, 0.0)
    if _keywords(fp, FORWARD_ARGS, probe) is None or _keywords(bp, BACKWARD_ARGS, probe) is None:
        return None
    fwd_capped, bwd_capped = "softcap" in fp, "softcap" in bp

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, softcap):
        if softcap and not fwd_capped:
            raise RuntimeError("this flash-attn has no softcap in its varlen forward; use backend='sdpa' or 'flex'")
        kw = _keywords(fp, FORWARD_ARGS, _values(scale, causal, softcap))
        res = fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **kw)
        # >= 2.7: (out, lse, S_dmask, rng_state); earlier: (out, q, k, v, out_padded, lse, S_dmask, rng_state).
        return (res[0], res[1]) if len(res) == 4 else (res[0], res[5])

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, softcap):
        if softcap and not bwd_capped:
            raise RuntimeError("this flash-attn has no softcap in its varlen backward; use backend='sdpa' or 'flex'")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = _keywords(bp, BACKWARD_ARGS, _values(scale, causal, softcap))
        bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, int(max_q), int(max_k), **kw)
        return dq, dk, dv

    return SplitVarlen(forward=forward, backward=backward, name="flash-attn")
