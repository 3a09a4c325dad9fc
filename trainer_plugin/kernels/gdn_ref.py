"""Pure-torch gated delta rule kernels with flash-linear-attention's signature.

The gated delta rule (Gated DeltaNet, Yang et al. 2024) keeps a state ``S`` of shape
``[K, V]`` per head and, for each token t::

    S <- exp(g_t) * S                                  # gate (g_t <= 0, log space)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T          # delta rule write
    o_t = scale * S^T q_t

Two implementations with fla's ``chunk_gated_delta_rule`` signature (``q, k, v, g, beta,
scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens``):

- :func:`naive_recurrent_gated_delta_rule`: the recurrence above, one token at a time, one
  sequence at a time. Slow and obviously right.
- :func:`torch_chunk_gated_delta_rule`: the chunked (WY / UT-transform) form used by fla and
  HF's ``torch_chunk_gated_delta_rule``, vectorized over every chunk of every sequence; the
  only loop runs over chunk index within a sequence. This is the CPU path of
  :mod:`treepack.trainer.kernels.gdn`.

Both accept fewer query/key heads than value heads (grouped value attention: each q/k head
serves ``Hv // Hk`` consecutive value heads, as in HF's Qwen3-Next), compute in at least
fp32 (fp64 inputs stay fp64, which the tests use), return the output in the input dtype and
the final state in the compute dtype, and differentiate with respect to every input
including ``initial_state``.
"""

from __future__ import annotations

import torch

from treepack.proto.errors import InputTypeError, RequestError

__all__ = ["l2norm", "naive_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule", "check_gdn_inputs"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along ``dim`` (fla's and HF's Qwen3-Next formula)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def check_gdn_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Validate shapes; return ``cu_seqlens`` as int64 (built from the batch when None).

    Raises:
        InputTypeError: a non-tensor argument.
        RequestError: inconsistent shapes, naming the argument.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"expected a torch.Tensor, got {type(t).__name__}", path=f"$.{name}", rule="type")
    if q.dim() != 4 or k.shape != q.shape:
        raise RequestError(
            f"q and k must be [B, T, Hk, K] and equal, got {tuple(q.shape)} and {tuple(k.shape)}",
            path="$.k",
            rule="shape",
        )
    B, T, Hk, _ = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % Hk:
        raise RequestError(
            f"v must be [B, T, Hv, V] with Hv a multiple of Hk={Hk}, got {tuple(v.shape)}", path="$.v", rule="shape"
        )
    Hv = v.shape[2]
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, Hv):
            raise RequestError(
                f"{name} must be [B, T, Hv] = {(B, T, Hv)}, got {tuple(t.shape)}", path=f"$.{name}", rule="shape"
            )
    if cu_seqlens is None:
        cu = torch.arange(B + 1, device=q.device, dtype=torch.int64) * T
    else:
        if B != 1:
            raise RequestError(f"with cu_seqlens the batch size must be 1, got {B}", path="$.q", rule="shape")
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
            raise RequestError(
                f"cu_seqlens must rise from 0 to T={T}, got {cu.tolist()[:8]}...", path="$.cu_seqlens", rule="monotone"
            )
    n = cu.numel() - 1
    if initial_state is not None and initial_state.shape != (n, Hv, q.shape[3], v.shape[3]):
        raise RequestError(
            f"initial_state must be [N, Hv, K, V] = {(n, Hv, q.shape[3], v.shape[3])}, "
            f"got {tuple(initial_state.shape)}",
            path="$.initial_state",
            rule="shape",
        )
    return cu


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Flatten the batch, repeat q/k heads for grouped values, normalize, cast, scale."""
    dt = torch.promote_types(q.dtype, torch.float32)
    Hk, Hv = q.shape[2], v.shape[2]
    q, k, v, g, beta = (x.reshape(-1, *x.shape[2:]).to(dt) for x in (q, k, v, g, beta))
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=1)
        k = k.repeat_interleave(Hv // Hk, dim=1)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta, dt


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token (reference for :func:`torch_chunk_gated_delta_rule`).

    Args:
        q, k: [B, T, Hk, K]; with ``cu_seqlens`` B is 1 and the sequences are concatenated.
        v: [B, T, Hv, V], Hv a multiple of Hk.
        g: [B, T, Hv] log-space decay (<= 0). beta: [B, T, Hv] write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: [N, Hv, K, V] state before each sequence's first token (None: zeros).
        output_final_state: also return the state after each sequence's last token.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head first.
        cu_seqlens: [N+1] sequence boundaries in the flattened tokens (None: B sequences of T).

    Returns:
        (o [B, T, Hv, V] in q's dtype, final state [N, Hv, K, V] or None).
    """
    cu = check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    out_shape, out_dtype = v.shape, q.dtype
    q, k, v, g, beta, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    n, H, K, V = cu.numel() - 1, v.shape[1], k.shape[-1], v.shape[-1]
    outs, finals = [], []
    for i in range(n):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[i].to(dt)
        for t in range(int(cu[i]), int(cu[i + 1])):
            S = S * g[t].exp()[:, None, None]
            err = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
            S = S + k[t][:, :, None] * (beta[t][:, None] * err)[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
        finals.append(S)
    o = torch.stack(outs) if outs else v.new_zeros(0, H, V)
    final = (
        torch.stack(finals)
        if output_final_state and finals
        else (q.new_zeros(0, H, K, V) if output_final_state else None)
    )
    return o.reshape(out_shape).to(out_dtype), final


def torch_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule, vectorized over all chunks (same contract as the naive one).

    Every sequence is cut into chunks of ``chunk_size`` from its own start (a short last
    chunk is zero-padded: zero k/v/beta write nothing and zero g decays nothing). Inside a
    chunk with cumulative log-decay ``c`` and ``A[i, j] = beta_i k_i.k_j exp(c_i - c_j)``
    (j < i), the writes are ``u = (I + A)^-1 (beta v - beta exp(c) k S0)``; outputs and the
    next state follow from ``u`` with two matmuls. The scan over chunk index runs all
    sequences that still have a chunk at once (sequences sorted by chunk count, so the live
    ones are a prefix).

    Args and Returns: as :func:`naive_recurrent_gated_delta_rule`; ``chunk_size`` is the
    chunk length (64, as fla's kernels).
    """
    cu = check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    out_shape, out_dtype = v.shape, q.dtype
    q, k, v, g, beta, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    n, H, K, V, L = cu.numel() - 1, v.shape[1], k.shape[-1], v.shape[-1], chunk_size
    lens = cu[1:] - cu[:-1]
    nchunk = (lens + L - 1) // L
    total = int(nchunk.sum())
    if n == 0 or total == 0:
        final = q.new_zeros(n, H, K, V) if initial_state is None else initial_state.to(dt)
        return v.new_zeros(out_shape).to(out_dtype), (final if output_final_state else None)
    first_chunk, tok, real = _chunk_tokens(cu, nchunk, total, L)
    qc, kc, vc, gc, bc = (_chunked(x, tok, real) for x in (q, k, v, g, beta))
    terms = _chunk_terms(qc, kc, vc, gc, bc, dt)
    S0 = q.new_zeros(n, H, K, V) if initial_state is None else initial_state.to(dt)
    o, S = _scan_chunks(terms, S0, nchunk, first_chunk, total)
    o = o[real]  # tokens in order: chunks are in token order, padding dropped
    return o.reshape(out_shape).to(out_dtype), (S if output_final_state else None)


def _chunk_tokens(
    cu: torch.Tensor, nchunk: torch.Tensor, total: int, L: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the chunks are: (first chunk of each sequence [n], token of each chunk slot [C, L], real [C, L]).

    Chunk c of sequence i holds tokens cu[i] + c*L + (0..L-1), those below cu[i+1] real;
    the others point at token 0.
    """
    dev = cu.device
    chunk_seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), nchunk)
    first_chunk = torch.cumsum(nchunk, 0) - nchunk
    chunk_no = torch.arange(total, device=dev) - first_chunk[chunk_seq]
    tok = cu[chunk_seq][:, None] + chunk_no[:, None] * L + torch.arange(L, device=dev)[None, :]
    real = tok < cu[chunk_seq + 1][:, None]  # [C, L]
    return first_chunk, torch.where(real, tok, 0), real


def _chunked(x: torch.Tensor, tok: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[T, H, ...] -> [C, H, L, ...], zero padded."""
    y = x[tok]
    y = y * real.reshape(*real.shape, *([1] * (y.dim() - 2))).to(y.dtype)
    return y.transpose(1, 2)


def _chunk_terms(qc, kc, vc, gc, bc, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """What each chunk contributes independently of its initial state (the function's docstring).

    Returns:
        (u, w, qk, q_dec, k_dec, chunk_decay): the writes' two parts ``u - w S0``, the
        intra-chunk scores, the decayed queries and keys, and the chunk's total decay
        [C, H, 1, 1].
    """
    L, dev = qc.shape[2], qc.device
    c = gc.cumsum(-1)  # [C, H, L] cumulative log decay inside each chunk
    lower = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    # exp(c_i - c_j) for j <= i; the upper triangle is masked before exp (it would overflow).
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = kc * bc[..., None]
    A = (kb @ kc.transpose(-1, -2)) * decay
    A = A.tril(-1)  # strictly lower part (the solve below reads nothing else anyway)
    eye = torch.eye(L, dtype=dt, device=dev)
    u = torch.linalg.solve_triangular(eye + A, vc * bc[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + A, kb * c.exp()[..., None], upper=False, unitriangular=True)
    qk = (qc @ kc.transpose(-1, -2)) * decay  # zero above the diagonal (decay is 0 there)
    q_dec = qc * c.exp()[..., None]
    k_dec = kc * (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()[..., None, None]  # [C, H, 1, 1]
    return u, w, qk, q_dec, k_dec, chunk_decay


def _scan_chunks(
    terms: tuple[torch.Tensor, ...], S: torch.Tensor, nchunk: torch.Tensor, first_chunk: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state scan over chunk index, all sequences that still have a chunk at once.

    Args:
        terms: from :func:`_chunk_terms`. S: [n, H, K, V] initial states.

    Returns:
        (outputs [C, L, H, V] in chunk order, final states [n, H, K, V]).
    """
    u, w, qk, q_dec, k_dec, chunk_decay = terms
    n, dev = S.shape[0], nchunk.device
    # Sequences sorted by chunk count (descending), so those alive at step s are a prefix.
    order = torch.argsort(nchunk, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=dev)
    S = S[order]
    counts = nchunk[order].tolist()
    o_parts, o_chunks = [], []
    for s in range(counts[0]):
        live = sum(1 for x in counts if x > s)
        ids = first_chunk[order[:live]] + s  # chunk s of each live sequence
        Sl = S[:live]
        v_new = u[ids] - w[ids] @ Sl
        o_parts.append(q_dec[ids] @ Sl + qk[ids] @ v_new)
        o_chunks.append(ids)
        S_next = chunk_decay[ids] * Sl + k_dec[ids].transpose(-1, -2) @ v_new
        S = torch.cat([S_next, S[live:]]) if live < n else S_next
    inv = torch.empty(total, dtype=torch.int64, device=dev)
    inv[torch.cat(o_chunks)] = torch.arange(total, device=dev)
    return torch.cat(o_parts)[inv].transpose(1, 2), S[rank]
