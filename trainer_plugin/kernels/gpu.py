"""GPU kernels of the recurrent and convolutional mixers, called on tree levels.

Every kernel package is imported lazily, inside the function that calls it, so importing
this module needs only torch. Each ``*_level`` wrapper runs one tree depth level: the
level's segments are concatenated into one flat varlen sequence (``cu_seqlens [n+1]``),
each segment starts from ``initial_state[i]`` (its parent's final state; None = zeros)
and the wrapper returns ``(out [1, T, ...], final_state [n, ...])`` with the final state
differentiable, so a parent receives the sum of its children's state gradients.
:func:`scan_tree` runs such a wrapper level by level over a GDN-style schedule.

Kernels and what their stock API lacks (the wrappers make up for it exactly):

- fla ``chunk_gated_delta_rule`` / ``chunk_kda``: varlen with per-sequence initial and
  final states, used as is.
- mamba_ssm ``mamba_chunk_scan_combined`` and ``selective_scan_fn``: initial states per
  batch row, final states without gradient; their wrappers run padded batches
  (:mod:`~treepack.trainer.kernels.gpu_ssm`).
- causal-conv1d ``causal_conv1d_fn`` (CUDA) or fla ``causal_conv1d`` (Triton): a short
  conv needs inputs, not outputs, of the ancestors, so all segments of all levels run in
  one call: each segment is prefixed with its ``W - 1`` context inputs (gathered along the
  ancestor chain, zeros before a root) whose outputs are dropped.

:data:`KERNELS` names every kernel the trainer can call, :func:`load_kernel` imports one
and :func:`available` says which import here, and why not the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "KERNELS",
    "available",
    "load_kernel",
    "gated_delta_rule_level",
    "kda_level",
    "short_conv_level",
    "scan_tree",
    "tree_short_conv",
]

#: name -> (module, attribute) of every GPU kernel the trainer can call.
KERNELS: dict[str, tuple[str, str]] = {
    "fla.chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "fla.chunk_kda": ("fla.ops.kda", "chunk_kda"),
    "fla.causal_conv1d": ("fla.modules.causal_conv1d", "causal_conv1d"),
    "mamba_ssm.mamba_chunk_scan_combined": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "mamba_ssm.selective_scan_fn": ("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
    "causal_conv1d.causal_conv1d_fn": ("causal_conv1d", "causal_conv1d_fn"),
}


def load_kernel(name: str) -> Callable:
    """Import and return one kernel of :data:`KERNELS`.

    Raises:
        ImportError: the package (or its compiled extension) is not importable here; the
            message names the kernel and the original error.
        KeyError: ``name`` is not in :data:`KERNELS`.
    """
    module, attr = KERNELS[name]
    try:
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError:
            if not module.startswith("mamba_ssm.ops.triton."):
                raise
            _bare_package("mamba_ssm")
            return getattr(importlib.import_module(module), attr)
    except Exception as e:  # compiled extensions fail with OSError/RuntimeError too
        raise ImportError(f"GPU kernel {name} ({module}.{attr}) is not importable: {type(e).__name__}: {e}") from e


def _bare_package(top: str) -> None:
    """Register package ``top`` without running its ``__init__``.

    ``mamba_ssm/__init__.py`` imports the CUDA extension ``selective_scan_cuda``; built
    with ``MAMBA_SKIP_CUDA_BUILD=TRUE`` (no nvcc, or no time to compile) the package has
    only its Python and Triton code, and that import fails although the Triton SSD
    kernels (``mamba_ssm.ops.triton.*``) need nothing compiled. A failed import leaves
    no entry in ``sys.modules``, so the bare package takes its place (and stays: a later
    ``import mamba_ssm`` in this process gets it too).
    """
    if top in sys.modules:
        return
    spec = importlib.util.find_spec(top)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"No module named {top!r}")
    pkg = types.ModuleType(top)
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules[top] = pkg


def available() -> dict[str, str | None]:
    """Kernel name -> None when it imports, else the reason it does not."""
    out: dict[str, str | None] = {}
    for name in KERNELS:
        try:
            load_kernel(name)
            out[name] = None
        except ImportError as e:
            out[name] = str(e.__cause__ or e)
    return out


def gated_delta_rule_level(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=True,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    kernel=None,
):
    """fla's ``chunk_gated_delta_rule`` with the signature of ``gdn_ref.torch_chunk_gated_delta_rule``.

    Grouped values (fewer q/k heads than v heads) are expanded here, as HF's fallback does,
    so the head mapping does not depend on the installed fla version. Usable as the
    ``kernel=`` of ``tree_gated_delta_rule``. ``kernel``: a stand-in with the stock
    kernel's signature (tests on CPU); default the installed one, as in every wrapper here.
    """
    fn = kernel or load_kernel("fla.chunk_gated_delta_rule")
    if v.shape[2] != q.shape[2]:
        q = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
        k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    return fn(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
    )


def kda_level(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=True,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    kernel=None,
):
    """fla's ``chunk_kda`` (Kimi Delta Attention): as :func:`gated_delta_rule_level` with a
    per-channel decay ``g [1, T, Hv, K]`` (log space, precomputed: no gate fused in the kernel)."""
    fn = kernel or load_kernel("fla.chunk_kda")
    if v.shape[2] != q.shape[2]:
        q = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
        k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    return fn(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
    )


def short_conv_level(x, weight, bias, context, cu_seqlens, activation=None, backend="auto", kernel=None):
    """A depthwise causal conv of width W over varlen segments with given left context.

    Args:
        x: [T, Dc] the segments' inputs, concatenated. weight: [Dc, W]. bias: [Dc] or None.
        context: [n, W-1, Dc] the W-1 inputs before each segment (oldest first; zeros
            where the chain starts). cu_seqlens: [n+1].
        activation: None, ``silu`` or ``swish``.
        backend: ``causal_conv1d`` (CUDA), ``fla`` (Triton) or ``auto`` (the first that imports).
        kernel: a stand-in with the chosen backend's stock signature (default: installed).

    Returns:
        [T, Dc] in x's dtype.
    """
    W = weight.shape[1]
    cu = cu_seqlens.long().to(x.device)
    n, T = cu.numel() - 1, x.shape[0]
    lens = cu[1:] - cu[:-1]
    ext_lens = lens + (W - 1)
    ext_cu = torch.zeros(n + 1, dtype=torch.int64, device=x.device)
    ext_cu[1:] = ext_lens.cumsum(0)
    seg = torch.repeat_interleave(torch.arange(n, device=x.device), lens)
    own = torch.arange(T, device=x.device) - cu[seg] + ext_cu[seg] + (W - 1)  # own tokens' slots
    ctx_slot = ext_cu[:-1, None] + torch.arange(W - 1, device=x.device)[None, :]
    xe = x.new_zeros(int(ext_cu[-1]), x.shape[1])
    xe = xe.index_put((ctx_slot.reshape(-1),), context.reshape(-1, x.shape[1]).to(x.dtype))
    xe = xe.index_put((own,), x)
    if backend == "auto":
        backend = "causal_conv1d" if _imports("causal_conv1d.causal_conv1d_fn") else "fla"
    if backend == "causal_conv1d":
        fn = kernel or load_kernel("causal_conv1d.causal_conv1d_fn")
        seq_idx = torch.repeat_interleave(torch.arange(n, device=x.device, dtype=torch.int32), ext_lens)[None]
        y = fn(xe.T[None], weight, bias, seq_idx=seq_idx, activation=activation)[0].T  # channel-last layout
    elif backend == "fla":
        fn = kernel or load_kernel("fla.causal_conv1d")
        y, _ = fn(xe[None], weight, bias, activation=activation, cu_seqlens=ext_cu)
        y = y[0]
    else:
        raise ValueError(f"backend must be 'auto', 'causal_conv1d' or 'fla', got {backend!r}")
    return y[own]


def _imports(name: str) -> bool:
    try:
        load_kernel(name)
        return True
    except ImportError:
        return False


def scan_tree(level_fn: Callable, schedule, tensors: tuple[torch.Tensor, ...], **kw) -> torch.Tensor:
    """Run a ``*_level`` wrapper per depth level of a schedule, forking states at branches.

    Args:
        level_fn: a wrapper of this module (or a reference with the same contract).
        schedule: a ``TreeSchedule`` (levels with ``token_idx``, ``cu_seqlens``,
            ``parent_slot``; ``pad_idx``; ``num_positions``).
        tensors: per-token inputs, flat over rows ([N, ...] each, N = rows * seq_len),
            passed to ``level_fn`` positionally as [1, T_l, ...].
        **kw: passed to every call (weights such as ``A``, ``D``; flags).

    Returns:
        [N, ...] the first output of every level scattered back; padding is zero.
    """
    outs, idx = [], []
    final: torch.Tensor | None = None
    for lv in schedule.levels:
        sel = tuple(t.index_select(0, lv.token_idx)[None] for t in tensors)
        h0 = None if final is None else final.index_select(0, lv.parent_slot)
        o, final = level_fn(*sel, initial_state=h0, output_final_state=True, cu_seqlens=lv.cu_seqlens, **kw)
        outs.append(o[0])
        idx.append(lv.token_idx)
    o0 = outs[0]
    outs.append(o0.new_zeros(schedule.pad_idx.shape[0], *o0.shape[1:]))
    idx.append(schedule.pad_idx)
    out = torch.full((schedule.num_positions, *o0.shape[1:]), math.nan, dtype=o0.dtype, device=o0.device)
    return out.index_put((torch.cat(idx),), torch.cat(outs))


def tree_short_conv(x, weight, bias, schedule, activation=None, backend="auto", kernel=None) -> torch.Tensor:
    """The tree causal conv (``tree_causal_conv1d``'s contract) through :func:`short_conv_level`.

    Args:
        x: [N, Dc] flat row inputs. weight: [Dc, W]. bias: [Dc] or None.
        schedule: a ``TreeSchedule`` whose ``conv_window`` gives each token's W inputs.
        backend, kernel: as :func:`short_conv_level`.

    Returns:
        [N, Dc]; padding positions see only themselves, as a one-token sequence.
    """
    W = weight.shape[1]
    tok = torch.cat([lv.token_idx for lv in schedule.levels])
    lens = torch.cat([lv.cu_seqlens[1:] - lv.cu_seqlens[:-1] for lv in schedule.levels]).long()
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=x.device)
    cu[1:] = lens.cumsum(0)
    first = tok[cu[:-1]]
    xe = torch.cat([x, x.new_zeros(1, x.shape[1])])
    context = xe[schedule.conv_window[first, : W - 1]]  # [n, W-1, Dc]; index N = zeros
    y = short_conv_level(x[tok], weight, bias, context, cu, activation=activation, backend=backend, kernel=kernel)
    pad = schedule.pad_idx
    yp = x[pad].to(weight.dtype) * weight[:, -1] + (0 if bias is None else bias)
    if activation in ("silu", "swish"):
        yp = F.silu(yp)
    out = torch.full((schedule.num_positions, x.shape[1]), math.nan, dtype=y.dtype, device=x.device)
    return out.index_put((torch.cat([tok, pad]),), torch.cat([y, yp.to(y.dtype)]))
