"""Tree attention on packed rows: SDPA (dense reference), FlexAttention, FlashAttention varlen.

All three compute, for every row position, attention over exactly the keys the tree mask
allows (:mod:`treepack.trainer.kernels.masks`), so they agree within float tolerance:

- ``sdpa``: ``scaled_dot_product_attention`` with the dense [K, 1, L, L] bool mask. Runs
  everywhere, forward and backward; memory O(L^2) per row: the reference and the CPU path.
- ``flex``: ``flex_attention`` with the BlockMask built from ``subtree_end`` (compiled on
  CUDA by default; PyTorch has no CPU backward for it).
- ``flash``: FlashAttention-2 ``flash_attn_varlen_func`` over gathered ancestor K/V: each
  segment is one varlen sequence whose keys are its ancestor chain plus itself, causal
  aligned bottom-right. ``flash_attn`` is imported only when this backend runs;
  :func:`naive_varlen_attention` has the same signature and runs on CPU, so the gather
  and the metadata are tested without a GPU.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.index import scatter_filled
from treepack.trainer.kernels.masks import VarlenMeta

__all__ = ["tree_attention", "naive_varlen_attention", "BACKENDS", "TreeMasks"]


class TreeMasks(Protocol):
    """What :func:`tree_attention` reads from the rows it runs on (a
    :class:`~treepack.trainer.data.PackedBatch` is one): their shape and the tree mask in
    each kernel's form (:mod:`treepack.trainer.kernels.masks`)."""

    @property
    def num_rows(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    def dense_mask(self, sliding_window: int | None = None) -> torch.Tensor: ...

    def block_mask(self, block_size: int = 128, sliding_window: int | None = None) -> Any: ...

    def varlen_meta(self) -> VarlenMeta: ...


BACKENDS = ("sdpa", "flex", "flash")
_COMPILED_FLEX: dict[str, Callable] = {}


def _repeat_kv(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    return x if n_rep == 1 else torch.repeat_interleave(x, n_rep, dim=dim)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: TreeMasks) -> None:
    K, L = batch.num_rows, batch.seq_len
    if q.ndim != 4 or q.shape[0] != K or q.shape[2] != L:
        raise RequestError(f"query must have shape [{K}, heads, {L}, head_dim], got {tuple(q.shape)}", path="$.query", rule="shape")
    if k.shape[0] != K or k.shape[2] != L or v.shape[:3] != k.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise RequestError(f"key/value shapes {tuple(k.shape)} / {tuple(v.shape)} do not match query {tuple(q.shape)}", path="$.key", rule="shape")
    if q.shape[1] % k.shape[1]:
        raise RequestError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}", path="$.key", rule="gqa")


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: TreeMasks,
    *,
    backend: str = "sdpa",
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    varlen_fn: Callable | None = None,
    compile: bool | None = None,
) -> torch.Tensor:
    """Attention of packed rows under the tree mask.

    Args:
        q: [K, H, L, D] queries (K rows, H heads).
        k: [K, Hkv, L, D] keys, H a multiple of Hkv (grouped-query attention).
        v: [K, Hkv, L, Dv] values.
        batch: the rows' masks (a :class:`~treepack.trainer.data.PackedBatch`).
        backend: ``sdpa`` | ``flex`` | ``flash``.
        scale: softmax scale (default ``D ** -0.5``).
        sliding_window: optional window w (keys at most w-1 positions back).
        softcap: optional logit soft-capping ``c * tanh(s / c)``.
        varlen_fn: ``flash`` only: the varlen kernel (default ``flash_attn_varlen_func``;
            :func:`naive_varlen_attention` on CPU).
        compile: ``flex`` only: run ``torch.compile(flex_attention)`` (default: on CUDA).

    Returns:
        [K, H, L, Dv] attention output.
    """
    _check(q, k, v, batch)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend == "sdpa":
        return _sdpa(q, k, v, batch, scale, sliding_window, softcap)
    if backend == "flex":
        return _flex(q, k, v, batch, scale, sliding_window, softcap, compile)
    if backend == "flash":
        return _flash(q, k, v, batch, scale, sliding_window, softcap, varlen_fn)
    raise RequestError(f"backend must be one of {BACKENDS}, got {backend!r}", path="$.backend", rule="enum")


def _sdpa(q, k, v, batch, scale, sliding_window, softcap):
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep, 1), _repeat_kv(v, n_rep, 1)
    mask = batch.dense_mask(sliding_window)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # SDPA has no soft-capping: the same computation in plain ops.
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(v.dtype), v)


def _flex(q, k, v, batch, scale, sliding_window, softcap, compile):
    from torch.nn.attention.flex_attention import flex_attention

    use_compile = q.is_cuda if compile is None else compile
    fn = flex_attention
    if use_compile:
        if "fn" not in _COMPILED_FLEX:
            _COMPILED_FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        fn = _COMPILED_FLEX["fn"]
    score_mod = None
    if softcap is not None:
        c = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):
            return c * torch.tanh(score / c)

    with warnings.catch_warnings():
        # Uncompiled flex (the CPU path) warns that it materializes the scores: intended.
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return fn(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=batch.block_mask(sliding_window=sliding_window),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )


def _flash_varlen() -> Callable:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "backend='flash' needs the flash-attn package (pip install 'treepack[gpu]' on a CUDA machine); "
            "use backend='sdpa' or 'flex', or pass varlen_fn=naive_varlen_attention"
        ) from e
    return flash_attn_varlen_func


def _flash(q, k, v, batch, scale, sliding_window, softcap, varlen_fn):
    fn = varlen_fn if varlen_fn is not None else _flash_varlen()
    meta = batch.varlen_meta()
    K, H, L, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    qf = q.transpose(1, 2).reshape(K * L, H, D)
    kf = k.transpose(1, 2).reshape(K * L, Hkv, D)
    vf = v.transpose(1, 2).reshape(K * L, Hkv, Dv)
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)
    out = fn(
        qf[meta.q_index],
        kf[meta.k_index],
        vf[meta.k_index],
        meta.cu_seqlens_q,
        meta.cu_seqlens_k,
        meta.max_seqlen_q,
        meta.max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        softcap=0.0 if softcap is None else float(softcap),
    )
    # NaN first so that a position the kernel did not write shows up.
    res = scatter_filled(out, meta.q_index, K * L)
    # A padding token attends only itself: its output is its own value.
    pad_v = _repeat_kv(vf[meta.pad_index], H // Hkv, 1).to(out.dtype)
    res = res.index_put((meta.pad_index,), pad_v)
    return res.view(K, L, H, Dv).transpose(1, 2)


def naive_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    **unused: Any,
) -> torch.Tensor:
    """Pure-torch reference of ``flash_attn_varlen_func`` (same signature), a loop over sequences.

    Query i of a sequence with nq queries and nk keys sits at key index ``nk - nq + i``
    (bottom-right alignment); with ``causal`` it sees keys up to that index, and with
    ``window_size = (left, right)`` (-1: unbounded) only keys within ``left`` before and
    ``right`` after it.

    Args:
        q: [Tq, H, D]; k: [Tk, Hkv, D]; v: [Tk, Hkv, Dv] (H a multiple of Hkv).
        cu_seqlens_q, cu_seqlens_k: [N+1] int32 from 0.
        max_seqlen_q, max_seqlen_k: checked against the lengths.
        dropout_p: must be 0.
        softmax_scale: default ``D ** -0.5``.
        causal, window_size, softcap: as FlashAttention.

    Returns:
        [Tq, H, Dv].
    """
    if dropout_p:
        raise RequestError("naive_varlen_attention has no dropout", path="$.dropout_p", rule="unsupported")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    n_rep = q.shape[1] // k.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    left, right = window_size
    outs = []
    for b in range(len(cq) - 1):
        qs, ks, vs = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        assert nq <= max_seqlen_q and nk <= max_seqlen_k, "max_seqlen smaller than a sequence"
        ks, vs = _repeat_kv(ks, n_rep, 1), _repeat_kv(vs, n_rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        a = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        j = torch.arange(nk, device=q.device)[None, :]
        ok = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
        if causal:
            ok &= j <= a
        elif right >= 0:
            ok &= j <= a + right
        if left >= 0:
            ok &= j >= a - left
        s = s.masked_fill(~ok, -math.inf)
        p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(vs.dtype)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(outs)
