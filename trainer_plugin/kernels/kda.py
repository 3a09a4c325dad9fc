"""Kimi Delta Attention (KDA) in pure torch, with flash-linear-attention's ``chunk_kda`` signature.

KDA is the gated delta rule with a per-channel decay: per head, state ``S`` [K, V] and::

    S <- diag(exp(g_t)) S                             # g_t: [K] log-space decay (<= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = scale * S^T q_t

- :func:`naive_recurrent_kda`: the recurrence above, token by token, sequence by sequence.
- :func:`torch_chunk_kda`: the chunked (UT-transform) form of fla and HF's
  ``chunk_kimi_delta_attention``, vectorized over every chunk of every sequence (each
  sequence chunked from its own first token); the only loop runs over chunk index.

Both take fla's arguments ``q, k [B, T, H, K], v [B, T, HV, V], g [B, T, HV, K], beta
[B, T, HV], scale, initial_state [N, HV, K, V], output_final_state, use_qk_l2norm_in_kernel,
cu_seqlens`` (``g`` already in log space: fla's ``use_gate_in_kernel=False``), compute in
at least fp32 and return (o in q's dtype, final state or None). :func:`tree_kda` runs KDA
on tree rows.
"""

from __future__ import annotations

import torch

from treepack.proto.errors import InputTypeError, RequestError
from treepack.trainer.kernels.gdn_ref import l2norm
from treepack.trainer.kernels.gpu import kda_level
from treepack.trainer.kernels.short_conv import gpu_kernel_available
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_scan

__all__ = ["select_kda", "torch_chunk_kda", "naive_recurrent_kda", "tree_kda", "check_kda_inputs"]


def check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> torch.Tensor:
    """Validate shapes; return ``cu_seqlens`` as int64 (built from the batch when None)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"expected a torch.Tensor, got {type(t).__name__}", path=f"$.{name}", rule="type")
    if q.dim() != 4 or k.shape != q.shape:
        raise RequestError(
            f"q and k must be [B, T, H, K] and equal, got {tuple(q.shape)} and {tuple(k.shape)}",
            path="$.k",
            rule="shape",
        )
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H:
        raise RequestError(
            f"v must be [B, T, HV, V] with HV a multiple of H={H}, got {tuple(v.shape)}", path="$.v", rule="shape"
        )
    HV = v.shape[2]
    if g.shape != (B, T, HV, K) or beta.shape != (B, T, HV):
        raise RequestError(
            f"g must be [B, T, HV, K] = {(B, T, HV, K)} and beta [B, T, HV], got {tuple(g.shape)}, {tuple(beta.shape)}",
            path="$.g",
            rule="shape",
        )
    if cu_seqlens is None:
        cu = torch.arange(B + 1, device=q.device, dtype=torch.int64) * T
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        if B != 1 or cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
            raise RequestError(
                f"cu_seqlens must rise from 0 to T={T} with batch 1, got {cu.tolist()[:8]}",
                path="$.cu_seqlens",
                rule="monotone",
            )
    n = cu.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (n, HV, K, v.shape[3]):
        raise RequestError(
            f"initial_state must be [N, HV, K, V] = {(n, HV, K, v.shape[3])}, got {tuple(initial_state.shape)}",
            path="$.initial_state",
            rule="shape",
        )
    return cu


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    dt = torch.promote_types(q.dtype, torch.float32)
    H, HV = q.shape[2], v.shape[2]
    q, k, v, g, beta = (x.reshape(-1, *x.shape[2:]).to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=1), k.repeat_interleave(HV // H, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta, dt


def naive_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    chunk_size=64,
):
    """KDA token by token (reference for :func:`torch_chunk_kda`; ``chunk_size`` unused)."""
    cu = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    out_shape, out_dtype = v.shape, q.dtype
    q, k, v, g, beta, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    n, H, K, V = cu.numel() - 1, v.shape[1], k.shape[-1], v.shape[-1]
    outs, finals = [], []
    for i in range(n):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[i].to(dt)
        for t in range(int(cu[i]), int(cu[i + 1])):
            S = S * g[t].exp()[:, :, None]
            err = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
            S = S + k[t][:, :, None] * (beta[t][:, None] * err)[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
        finals.append(S)
    o = torch.stack(outs) if outs else v.new_zeros(0, H, V)
    final = (torch.stack(finals) if finals else q.new_zeros(0, H, K, V)) if output_final_state else None
    return o.reshape(out_shape).to(out_dtype), final


def torch_chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    chunk_size=64,
):
    """Chunked KDA, vectorized over all chunks (same contract as :func:`naive_recurrent_kda`).

    Inside a chunk with per-channel cumulative log decay ``c`` [L, K] and ``A[i, j] = beta_i
    sum_k k_i k_j exp(c_i - c_j)`` (j < i): ``u = (I + A)^-1 beta v``, ``w = (I + A)^-1 beta
    k exp(c)``, ``v_new = u - w S0``, ``o = (q exp(c)) S0 + QK v_new`` and ``S1 =
    exp(c_last) S0 + (k exp(c_last - c))^T v_new``.
    """
    cu = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    out_shape, out_dtype = v.shape, q.dtype
    q, k, v, g, beta, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    n, H, K, V, L, dev = cu.numel() - 1, v.shape[1], k.shape[-1], v.shape[-1], int(chunk_size), q.device
    lens = cu[1:] - cu[:-1]
    nchunk = (lens + L - 1) // L
    total = int(nchunk.sum())
    S = q.new_zeros(n, H, K, V) if initial_state is None else initial_state.to(dt)
    if total == 0:
        return v.new_zeros(out_shape).to(out_dtype), (S if output_final_state else None)
    chunk_seq = torch.repeat_interleave(torch.arange(n, device=dev), nchunk)
    first_chunk = torch.cumsum(nchunk, 0) - nchunk
    chunk_no = torch.arange(total, device=dev) - first_chunk[chunk_seq]
    tok = cu[chunk_seq][:, None] + chunk_no[:, None] * L + torch.arange(L, device=dev)[None, :]
    real = tok < cu[chunk_seq + 1][:, None]
    tok = torch.where(real, tok, 0)

    def chunked(x):  # [T, H, ...] -> [C, H, L, ...], zero padded (zero g decays nothing)
        y = x[tok] * real.reshape(*real.shape, *([1] * (x.dim() - 1))).to(x.dtype)
        return y.transpose(1, 2)

    qc, kc, vc, gc, bc = (chunked(x) for x in (q, k, v, g, beta))
    c = gc.cumsum(2)  # [C, H, L, K]
    lower = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    decay = (
        (c[:, :, :, None] - c[:, :, None, :]).masked_fill(~lower[:, :, None], float("-inf")).exp()
    )  # [C, H, i, j, K]
    kb = kc * bc[..., None]
    A = torch.einsum("chik,chjk,chijk->chij", kb, kc, decay).tril(-1)
    eye = torch.eye(L, dtype=dt, device=dev)
    u = torch.linalg.solve_triangular(eye + A, vc * bc[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + A, kb * c.exp(), upper=False, unitriangular=True)
    qk = torch.einsum("chik,chjk,chijk->chij", qc, kc, decay)
    q_dec = qc * c.exp()
    k_dec = kc * (c[:, :, -1:] - c).exp()
    last_decay = c[:, :, -1].exp()[..., None]  # [C, H, K, 1]

    order = torch.argsort(nchunk, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=dev)
    S = S[order]
    counts = nchunk[order].tolist()
    o_parts, o_chunks = [], []
    for s in range(counts[0]):
        live = sum(1 for x in counts if x > s)
        ids = first_chunk[order[:live]] + s
        Sl = S[:live]
        v_new = u[ids] - w[ids] @ Sl
        o_parts.append(q_dec[ids] @ Sl + qk[ids] @ v_new)
        o_chunks.append(ids)
        S_next = last_decay[ids] * Sl + k_dec[ids].transpose(-1, -2) @ v_new
        S = torch.cat([S_next, S[live:]]) if live < n else S_next
    inv = torch.empty(total, dtype=torch.int64, device=dev)
    inv[torch.cat(o_chunks)] = torch.arange(total, device=dev)
    o = torch.cat(o_parts)[inv].transpose(1, 2)[real]
    return o.reshape(out_shape).to(out_dtype), (S[rank] if output_final_state else None)


def tree_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: TreeSchedule,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    kernel=None,
) -> torch.Tensor:
    """KDA over tree rows: one varlen ``kernel`` call per depth level.

    Args:
        q, k: [N, H, K] flat row tokens. v: [N, HV, V]. g: [N, HV, K] log decay. beta: [N, HV].
        schedule: from :func:`~treepack.trainer.kernels.tree_scan.tree_schedule`.
        scale, use_qk_l2norm_in_kernel: as fla's ``chunk_kda``.
        kernel: a function with ``chunk_kda``'s signature; default :func:`select_kda`.

    Returns:
        [N, HV, V] in q's dtype; zeros at padding.
    """
    kernel = select_kda(q) if kernel is None else kernel

    def step(sel, h0, lv):
        o, final = kernel(
            *(x[None] for x in sel),
            scale=scale,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=lv.cu_seqlens,
        )
        return o[0], final

    return tree_scan(step, (q, k, v, g, beta), schedule, tuple(v.shape[1:]))


def select_kda(x: torch.Tensor):
    """The KDA kernel for tensors like ``x``, with ``chunk_kda``'s signature.

    CUDA bf16/fp16 with fla importable: :func:`~treepack.trainer.kernels.gpu.kda_level`
    (fla's kernels reject fp32, so fp32 stays on the reference, as for GDN); else
    :func:`torch_chunk_kda`.
    """
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and gpu_kernel_available("fla.chunk_kda"):
        return kda_level
    return torch_chunk_kda
