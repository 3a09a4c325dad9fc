"""Mamba2's state-space duality (SSD) scan in pure torch, with mamba_ssm's signature.

Per head h (P channels, state size N, group g(h) of B/C) and token t::

    dt_t <- softplus(dt_t + dt_bias)        (each step optional, then clamped to dt_limit)
    S    <- exp(dt_t * A_h) * S + dt_t * x_t B_t^T          S: [P, N]
    y_t  =  S C_t + D_h x_t,   then  y_t * silu(z_t)  when z is given

Two implementations with ``mamba_chunk_scan_combined``'s signature (``x, dt, A, B, C,
chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
return_final_states, return_varlen_states``):

- :func:`naive_ssd_scan`: the recurrence above, token by token, sequence by sequence.
- :func:`torch_ssd_chunk_scan`: the chunked SSD form (intra-chunk quadratic, inter-chunk
  state scan) of HF's ``torch_forward`` and mamba_ssm's kernels, vectorized over every
  chunk of every sequence; the only loop runs over chunk index within a sequence. Every
  sequence is chunked from its own first token (the CPU path of
  :func:`~treepack.trainer.kernels.tree_scan.tree_scan` for Mamba2 layers).

Varlen: ``cu_seqlens`` ([n+1], batch 1) or ``seq_idx`` ([1, L]) cut the row into n
sequences. ``initial_states`` then holds one state per sequence, ``[n, H, P, N]``: the tree
fork needs that. mamba_ssm 2.2's own kernel takes one initial state per batch row, not one
per sequence, so a GPU wrapper either uses a kernel with
per-sequence initial states (vLLM's varlen SSD) or runs the level from zero states and adds
the parent's term ``y_t += exp(cumsum_s<=t(dt_s A)) C_t . S0`` and ``S_end += exp(sum(dt
A)) S0`` outside the kernel (exact by linearity; cumulate per segment, not over the whole
level, to keep fp32 precision). ``return_varlen_states`` returns every sequence's final
state ``[n, H, P, N]``. Computation is in at least fp32; y is returned in x's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from treepack.proto.errors import InputTypeError, RequestError
from treepack.trainer.kernels.gpu_varlen import mamba_chunk_scan_varlen
from treepack.trainer.kernels.short_conv import gpu_kernel_available
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_scan

__all__ = ["select_ssd", "torch_ssd_chunk_scan", "naive_ssd_scan", "check_ssd_inputs", "tree_ssd_scan"]


def check_ssd_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens) -> torch.Tensor:
    """Validate shapes; return int64 sequence boundaries over the flattened batch.

    Raises:
        InputTypeError: a non-tensor argument.
        RequestError: inconsistent shapes, naming the argument.
    """
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"expected a torch.Tensor, got {type(t).__name__}", path=f"$.{name}", rule="type")
    if x.dim() != 4:
        raise RequestError(f"x must be [B, L, H, P], got {tuple(x.shape)}", path="$.x", rule="shape")
    b, L, H, P = x.shape
    if dt.shape != (b, L, H) or A.shape != (H,):
        raise RequestError(
            f"dt must be [B, L, H] and A [H] with H = {H}, got {tuple(dt.shape)}, {tuple(A.shape)}",
            path="$.dt",
            rule="shape",
        )
    if B.dim() != 4 or B.shape[:2] != (b, L) or H % B.shape[2] or C.shape != B.shape:
        raise RequestError(
            f"B and C must be [B, L, G, N] with H % G == 0, got {tuple(B.shape)}, {tuple(C.shape)}",
            path="$.B",
            rule="shape",
        )
    for name, t, shapes in (("D", D, ((H,), (H, P))), ("z", z, ((b, L, H, P),)), ("dt_bias", dt_bias, ((H,),))):
        if t is not None and tuple(t.shape) not in shapes:
            raise RequestError(f"{name} must be one of {shapes}, got {tuple(t.shape)}", path=f"$.{name}", rule="shape")
    if cu_seqlens is None and seq_idx is not None:
        if b != 1 or tuple(seq_idx.shape) != (1, L):
            raise RequestError(
                f"seq_idx must be [1, L] = (1, {L}) with batch 1, got {tuple(seq_idx.shape)}",
                path="$.seq_idx",
                rule="shape",
            )
        change = torch.nonzero(seq_idx[0, 1:] != seq_idx[0, :-1]).flatten() + 1
        cu_seqlens = torch.cat([change.new_zeros(1), change, change.new_full((1,), L)])
    if cu_seqlens is None:
        cu = torch.arange(b + 1, device=x.device, dtype=torch.int64) * L
    else:
        cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
        if b != 1 or cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != L or bool((cu[1:] < cu[:-1]).any()):
            raise RequestError(
                f"cu_seqlens must rise from 0 to L={L} with batch 1, got {cu.tolist()[:8]}",
                path="$.cu_seqlens",
                rule="monotone",
            )
    n, N = cu.numel() - 1, B.shape[3]
    if initial_states is not None and tuple(initial_states.shape) != (n, H, P, N):
        raise RequestError(
            f"initial_states must be [n, H, P, N] = {(n, H, P, N)}, got {tuple(initial_states.shape)}",
            path="$.initial_states",
            rule="shape",
        )
    return cu


def _prepare(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit):
    """Flatten the batch, discretize dt, repeat B/C per head; everything in the compute dtype."""
    ct = torch.promote_types(x.dtype, torch.float32)
    H = x.shape[2]
    x, dt, B, C = (t.reshape(-1, *t.shape[2:]).to(ct) for t in (x, dt, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.to(ct)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    rep = H // B.shape[1]
    return x, dt, A.to(ct), B.repeat_interleave(rep, dim=1), C.repeat_interleave(rep, dim=1), ct


def _finish(y, x_flat, D, z, shape, out_dtype):
    if D is not None:
        y = y + x_flat * (D.to(y.dtype)[:, None] if D.dim() == 1 else D.to(y.dtype))
    if z is not None:
        y = y * F.silu(z.reshape(y.shape).to(y.dtype))
    return y.reshape(shape).to(out_dtype)


def _returns(y, finals, cu, b, return_final_states, return_varlen_states):
    if not (return_final_states or return_varlen_states):
        return y
    out = [y]
    if return_final_states:  # the state after each batch row's last token (varlen: batch 1)
        out.append(finals if finals.shape[0] == b else finals[-1:])
    if return_varlen_states:
        out.append(finals)
    return tuple(out)


def naive_ssd_scan(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
):
    """The SSD recurrence token by token (reference for :func:`torch_ssd_chunk_scan`).

    Args:
        x: [B, L, H, P]. dt: [B, L, H]. A: [H] (negative). B, C: [B, L, G, N], H % G == 0.
        chunk_size: unused here (the signature's).
        D: [H] or [H, P] skip. z: [B, L, H, P] output gate. dt_bias: [H].
        initial_states: [n, H, P, N], one per sequence (module docstring), or None (zeros).
        seq_idx: [1, L] sequence number of every token; cu_seqlens: [n+1] (batch 1).
        dt_softplus, dt_limit: dt post-processing (clamped only when not (0, inf)).
        return_final_states: also the state after each batch row's last token, [B, H, P, N].
        return_varlen_states: also every sequence's final state, [n, H, P, N].

    Returns:
        y [B, L, H, P] in x's dtype, followed by the requested states.
    """
    cu = check_ssd_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens)
    shape, b = x.shape, x.shape[0]
    xf, dtf, Af, Bf, Cf, ct = _prepare(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    H, P, N = xf.shape[1], xf.shape[2], Bf.shape[2]
    ys, finals = [], []
    for i in range(cu.numel() - 1):
        S = xf.new_zeros(H, P, N) if initial_states is None else initial_states[i].to(ct)
        for t in range(int(cu[i]), int(cu[i + 1])):
            S = (dtf[t] * Af).exp()[:, None, None] * S + dtf[t][:, None, None] * xf[t][:, :, None] * Bf[t][:, None, :]
            ys.append(torch.einsum("hpn,hn->hp", S, Cf[t]))
        finals.append(S)
    y = torch.stack(ys) if ys else xf.new_zeros(0, H, P)
    fin = torch.stack(finals) if finals else xf.new_zeros(0, H, P, N)
    return _returns(_finish(y, xf, D, z, shape, x.dtype), fin, cu, b, return_final_states, return_varlen_states)


def torch_ssd_chunk_scan(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
):
    """The chunked SSD scan, vectorized over all chunks (same contract as :func:`naive_ssd_scan`).

    Chunk c of a sequence holds its tokens ``c * chunk_size ..`` (a short last chunk is
    zero-padded: dt = 0 there decays nothing and writes nothing). With ``a = cumsum(dt A)``
    inside a chunk: ``y_l = sum_{s<=l} (C_l.B_s) exp(a_l - a_s) dt_s x_s + exp(a_l) C_l S0``
    and ``S1 = exp(a_last) S0 + sum_s exp(a_last - a_s) dt_s x_s B_s^T``; the state scan over
    chunk index runs every sequence that still has a chunk at once.
    """
    cu = check_ssd_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens)
    shape, b = x.shape, x.shape[0]
    xf, dtf, Af, Bf, Cf, ct = _prepare(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    H, P, N, Lc = xf.shape[1], xf.shape[2], Bf.shape[2], int(chunk_size)
    n = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    nchunk = (lens + Lc - 1) // Lc
    total = int(nchunk.sum())
    S = xf.new_zeros(n, H, P, N) if initial_states is None else initial_states.to(ct)
    if total == 0:
        return _returns(
            _finish(xf.new_zeros(0, H, P), xf, D, z, shape, x.dtype),
            S,
            cu,
            b,
            return_final_states,
            return_varlen_states,
        )
    first_chunk, tok, real = _chunk_tokens(cu, nchunk, total, Lc, xf.device)
    y_diag, chunk_states, chunk_decay, c_dec = _chunk_terms(xf, dtf, Af, Bf, Cf, tok, real.to(ct))
    off, S = _scan_chunks(c_dec, chunk_decay, chunk_states, S, nchunk, first_chunk, total)
    y = (y_diag + off)[real]  # tokens in order, padding dropped
    return _returns(_finish(y, xf, D, z, shape, x.dtype), S, cu, b, return_final_states, return_varlen_states)


def _chunk_tokens(
    cu: torch.Tensor, nchunk: torch.Tensor, total: int, Lc: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the chunks are: (first chunk of each sequence [n], token of each slot [Cn, Lc], real [Cn, Lc]).

    Chunk c of a sequence holds its tokens ``c * Lc ..``; slots past its end point at token 0.
    """
    chunk_seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), nchunk)
    first_chunk = torch.cumsum(nchunk, 0) - nchunk
    chunk_no = torch.arange(total, device=dev) - first_chunk[chunk_seq]
    tok = cu[chunk_seq][:, None] + chunk_no[:, None] * Lc + torch.arange(Lc, device=dev)[None, :]
    real = tok < cu[chunk_seq + 1][:, None]  # [Cn, Lc]
    return first_chunk, torch.where(real, tok, 0), real


def _chunk_terms(xf, dtf, Af, Bf, Cf, tok: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What each chunk contributes independently of its initial state (see :func:`torch_ssd_chunk_scan`).

    Args:
        xf, dtf, Af, Bf, Cf: from ``_prepare``. tok: [Cn, Lc] token of each slot. m: [Cn, Lc]
            1 on real slots, 0 on padding (compute dtype).

    Returns:
        (y_diag [Cn, Lc, H, P] the in-chunk outputs, chunk_states [Cn, H, P, N] the writes,
        chunk_decay [Cn, H, 1, 1], c_dec [Cn, Lc, H, N] the decayed C that reads S0).
    """
    Lc, dev = tok.shape[1], tok.device
    xc, Bc, Cc = xf[tok], Bf[tok], Cf[tok]  # [Cn, Lc, H, P|N]
    dtc = dtf[tok] * m[..., None]  # [Cn, Lc, H]
    a = torch.cumsum(dtc * Af, dim=1).transpose(1, 2)  # [Cn, H, Lc]
    lower = torch.ones(Lc, Lc, dtype=torch.bool, device=dev).tril()
    decay = (a[..., :, None] - a[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [Cn, H, l, s]
    xdt = xc * dtc[..., None]  # [Cn, Lc, H, P]
    G = torch.einsum("clhn,cshn->chls", Cc, Bc)
    y_diag = torch.einsum("chls,cshp->clhp", G * decay, xdt)
    w_state = (a[..., -1:] - a).exp()  # [Cn, H, Lc]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", Bc, w_state, xdt)
    chunk_decay = a[..., -1].exp()[..., None, None]  # [Cn, H, 1, 1]
    c_dec = Cc * a.transpose(1, 2).exp()[..., None]  # [Cn, Lc, H, N]
    return y_diag, chunk_states, chunk_decay, c_dec


def _scan_chunks(c_dec, chunk_decay, chunk_states, S, nchunk, first_chunk, total: int):
    """The state scan over chunk index, every sequence that still has a chunk at once.

    Returns:
        (the outputs read from each chunk's initial state [Cn, Lc, H, P] in chunk order,
        final states [n, H, P, N]).
    """
    n, dev = S.shape[0], nchunk.device
    order = torch.argsort(nchunk, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=dev)
    S = S[order]
    counts = nchunk[order].tolist()
    off_parts, off_ids = [], []
    for s in range(counts[0]):
        live = sum(1 for k in counts if k > s)
        ids = first_chunk[order[:live]] + s
        Sl = S[:live]
        off_parts.append(torch.einsum("clhn,chpn->clhp", c_dec[ids], Sl))
        off_ids.append(ids)
        S_next = chunk_decay[ids] * Sl + chunk_states[ids]
        S = torch.cat([S_next, S[live:]]) if live < n else S_next
    inv = torch.empty(total, dtype=torch.int64, device=dev)
    inv[torch.cat(off_ids)] = torch.arange(total, device=dev)
    return torch.cat(off_parts)[inv], S[rank]


def tree_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    schedule: TreeSchedule,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    scan_fn=None,
) -> torch.Tensor:
    """The SSD scan over tree rows: one varlen ``scan_fn`` call per depth level.

    Args:
        x: [N, H, P] flat row tokens. dt: [N, H]. B, C: [N, G, N_state]. A, D, dt_bias: [H].
        schedule: from :func:`~treepack.trainer.kernels.tree_scan.tree_schedule`.
        chunk_size, dt_softplus, dt_limit: as ``mamba_chunk_scan_combined``.
        scan_fn: a function with ``mamba_chunk_scan_combined``'s signature and per-sequence
            ``initial_states`` (module docstring); default :func:`select_ssd`.

    Returns:
        [N, H, P] in x's dtype; zeros at padding.
    """
    scan_fn = select_ssd(x) if scan_fn is None else scan_fn

    def step(sel, h0, lv):
        xs, dts, Bs, Cs = (t[None] for t in sel)
        y, states = scan_fn(
            xs,
            dts,
            A,
            Bs,
            Cs,
            chunk_size,
            D=D,
            dt_bias=dt_bias,
            initial_states=h0,
            seq_idx=lv.seq_idx[None],
            cu_seqlens=lv.cu_seqlens,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            return_varlen_states=True,
        )
        return y[0], states

    return tree_scan(step, (x, dt, B, C), schedule, tuple(x.shape[1:]))


def select_ssd(x: torch.Tensor):
    """The SSD kernel for tensors like ``x``, with ``mamba_chunk_scan_combined``'s signature.

    CUDA with mamba_ssm importable:
    :func:`~treepack.trainer.kernels.gpu_varlen.mamba_chunk_scan_varlen` (per-sequence
    initial states, differentiable varlen states); else :func:`torch_ssd_chunk_scan`.
    """
    if x.is_cuda and gpu_kernel_available("mamba_ssm.mamba_chunk_scan_combined"):
        return mamba_chunk_scan_varlen
    return torch_ssd_chunk_scan
