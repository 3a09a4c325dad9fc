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
- mamba_ssm ``mamba_chunk_scan_combined`` (Triton): initial states are per *batch row*,
  not per varlen sequence, and varlen final states have no backward. The level is run as
  a batch of segments, each LEFT-padded to its bucket's longest segment with ``dt = 0``
  and ``x = B = C = 0`` (decay ``exp(0 * A) = 1``, no write), so the state reaches every
  segment's last token untouched; ``dt_bias`` / softplus / ``dt_limit`` are applied in
  torch first (the kernel's own order). Segments are bucketed by length so that padding
  stays below the real tokens of each bucket (:func:`length_buckets`).
- mamba_ssm ``selective_scan_fn`` (Mamba1, CUDA only): no initial state and a final
  state without gradient. Same padded batches; the initial state's contribution to the
  outputs and the final state are added in torch (the scan is linear in its state), at
  ``O(n * D * N * L)`` memory per bucket.
- causal-conv1d ``causal_conv1d_fn`` (CUDA) or fla ``causal_conv1d`` (Triton): a short
  conv needs inputs, not outputs, of the ancestors, so all segments of all levels run in
  one call: each segment is prefixed with its ``W - 1`` context inputs (gathered along the
  ancestor chain, zeros before a root) whose outputs are dropped.

:func:`available` says which kernels import here, and why not the others.
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
    "length_buckets",
    "gated_delta_rule_level",
    "kda_level",
    "mamba2_level",
    "selective_scan_level",
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


def length_buckets(lens: list[int], max_pad_ratio: float = 1.0) -> list[list[int]]:
    """Group segment indices, longest first, so each group pads to its first length.

    A segment joins the open group while the group's padding (``count * longest - real``)
    stays at most ``max_pad_ratio`` times its real tokens. Returns index lists covering
    every segment once.
    """
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    out: list[list[int]] = []
    real = 0
    for i in order:
        if out and (len(out[-1]) + 1) * lens[out[-1][0]] - (real + lens[i]) <= max_pad_ratio * (real + lens[i]):
            out[-1].append(i)
            real += lens[i]
        else:
            out.append([i])
            real = lens[i]
    return out


def _left_pad_index(cu: list[int], group: list[int], device: torch.device) -> torch.Tensor:
    """[b, Lmax] flat token index of each segment of ``group``, left-padded with -1."""
    lens = torch.tensor([cu[i + 1] - cu[i] for i in group], dtype=torch.int64)
    starts = torch.tensor([cu[i] for i in group], dtype=torch.int64)
    L = int(lens.max())
    j = torch.arange(L)[None, :] - (L - lens)[:, None]  # offset inside the segment
    return torch.where(j >= 0, starts[:, None] + j, -1).to(device)


def _gather_padded(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [T, ...] -> [b, L, ...] with zeros where ``idx`` is -1."""
    xe = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return xe[torch.where(idx < 0, x.shape[0], idx)]


def _f32(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (fp64 stays fp64): the precision the kernels keep states in."""
    return torch.promote_types(dtype, torch.float32)


def _mamba_dt(dt, dt_bias, dt_softplus, dt_limit):
    """mamba_ssm's dt preprocessing (bias, softplus with threshold 20, clamp), in >= fp32."""
    dt = dt.to(_f32(dt.dtype))
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def mamba2_level(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=256,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    initial_state=None,
    output_final_state=True,
    cu_seqlens=None,
    max_pad_ratio=1.0,
    kernel=None,
):
    """mamba_ssm's ``mamba_chunk_scan_combined`` on one tree level (module docstring).

    Args:
        x: [1, T, H, P]. dt: [1, T, H] (raw; bias/softplus/limit applied here). A: [H].
        B, C: [1, T, G, N]. D: [H] or [H, P]. z: [1, T, H, P] gate or None.
        initial_state: [n, H, P, N] per segment, or None (zeros).
        cu_seqlens: [n+1] segment boundaries in T.

    Returns:
        (y [1, T, H, P] in x's dtype, final state [n, H, P, N] fp32).
    """
    fn = kernel or load_kernel("mamba_ssm.mamba_chunk_scan_combined")
    T, H, P = x.shape[1:]
    N = B.shape[-1]
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    n = len(cu) - 1
    dt = _mamba_dt(dt[0], dt_bias, dt_softplus, dt_limit).to(x.dtype)
    y = x.new_zeros(T, H, P)
    finals = [None] * n
    for group in length_buckets([cu[i + 1] - cu[i] for i in range(n)], max_pad_ratio):
        idx = _left_pad_index(cu, group, x.device)
        xs, dts, Bs, Cs = (_gather_padded(t, idx) for t in (x[0], dt, B[0], C[0]))
        zs = None if z is None else _gather_padded(z[0], idx)
        h0 = None if initial_state is None else initial_state[group].to(_f32(x.dtype)).contiguous()
        out, fin = fn(xs, dts, A, Bs, Cs, chunk_size, D=D, z=zs, initial_states=h0, return_final_states=True)
        keep = idx >= 0
        y = y.index_put((idx[keep],), out[keep].to(y.dtype))
        for r, i in enumerate(group):
            finals[i] = fin[r]
    final = torch.stack(finals) if n else x.new_zeros(0, H, P, N, dtype=torch.float32)
    return y[None], final.to(_f32(final.dtype))


def selective_scan_level(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    output_final_state=True,
    cu_seqlens=None,
    max_pad_ratio=1.0,
    kernel=None,
):
    """mamba_ssm's ``selective_scan_fn`` (Mamba1) on one tree level (module docstring).

    Args:
        u, delta: [1, T, Dm] (token-major; the kernel's [b, Dm, L] layout is made here).
        A: [Dm, N]. B, C: [1, T, N]. D: [Dm]. z: [1, T, Dm] or None. delta_bias: [Dm].
        initial_state: [n, Dm, N] or None. cu_seqlens: [n+1].

    Returns:
        (y [1, T, Dm] in u's dtype, final state [n, Dm, N] fp32).
    """
    fn = kernel or load_kernel("mamba_ssm.selective_scan_fn")
    T, Dm = u.shape[1:]
    N = A.shape[-1]
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    n = len(cu) - 1
    delta = _mamba_dt(delta[0], delta_bias, delta_softplus, (0.0, float("inf")))
    f32 = _f32(u.dtype)
    y = u.new_zeros(T, Dm, dtype=f32)
    finals = [None] * n
    Af = A.to(f32)
    for group in length_buckets([cu[i + 1] - cu[i] for i in range(n)], max_pad_ratio):
        idx = _left_pad_index(cu, group, u.device)
        us, ds, Bs, Cs = (_gather_padded(t, idx).transpose(1, 2) for t in (u[0], delta, B[0], C[0]))
        out = fn(us.to(u.dtype).contiguous(), ds.to(u.dtype).contiguous(), A, Bs.contiguous(), Cs.contiguous(), D=D).to(
            f32
        )
        us, ds, Bs, Cs = (t.to(f32) for t in (us, ds, Bs, Cs))
        cum = ds.cumsum(-1)  # [b, Dm, L]
        decay_in = torch.exp(Af[None, :, :, None] * cum[:, :, None, :])  # [b, Dm, N, L]
        if initial_state is not None:
            h0 = initial_state[group].to(f32)
            out = out + torch.einsum("bdn,bnl,bdnl->bdl", h0, Cs, decay_in)
        tail = torch.exp(Af[None, :, :, None] * (cum[:, :, None, -1:] - cum[:, :, None, :]))  # [b, Dm, N, L]
        fin = torch.einsum("bdnl,bdl,bnl->bdn", tail, ds * us, Bs)
        if initial_state is not None:
            fin = fin + h0 * decay_in[..., -1]
        keep = idx >= 0
        y = y.index_put((idx[keep],), out.transpose(1, 2)[keep])
        for r, i in enumerate(group):
            finals[i] = fin[r]
    if z is not None:
        y = y * F.silu(z[0].to(f32))
    final = torch.stack(finals) if n else u.new_zeros(0, Dm, N, dtype=f32)
    return y.to(u.dtype)[None], final


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
    final = None
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
