"""Tree attention on packed rows: SDPA (dense reference), FlexAttention, FlashAttention varlen.

All three compute, for every row position, attention over exactly the keys the tree mask
allows (:mod:`treepack.trainer.kernels.masks`), so they agree within float tolerance:

- ``sdpa``: ``scaled_dot_product_attention`` with the dense [K, 1, L, L] bool mask. Runs
  everywhere, forward and backward; memory O(L^2) per row: the reference and the CPU path.
- ``flex``: ``flex_attention`` with the BlockMask built from ``subtree_end`` (compiled on
  CUDA by default; PyTorch has no CPU backward for it).
- ``flash``: FlashAttention-2 varlen calls that read every key and value in place: one call
  over the segments themselves (causal) and one per tree depth over each shared segment's
  keys and its subtree's queries, merged by log-sum-exp
  (:mod:`~treepack.trainer.kernels.varlen_levels`, :mod:`~treepack.trainer.kernels.varlen_merge`;
  flash-attn's split forward/backward, :mod:`~treepack.trainer.kernels.gpu_flash`). Layers
  with a sliding window or a chunk size, kernels without a split pair, and
  ``gather_keys=True`` run the reference layout instead: each segment one varlen sequence
  whose keys are its gathered ancestor chain plus itself, causal aligned bottom-right
  (``flash_attn_varlen_func``). ``flash_attn`` is imported only when this backend runs;
  :func:`naive_varlen_attention` has the same signature and runs on CPU (with its loop pair
  for the copy-free path), so both layouts are tested without a GPU.

Two attention variants, exact on every backend:

- **attention sinks** (GPT-OSS ``s_aux``): one learned logit per head that joins every
  query's softmax denominator (``exp(sink)`` added to it) and has no value. Written
  through the log-sum-exp of the plain attention: ``out_sink = out * sigmoid(lse - sink)``.
  SDPA appends the sink as an extra logit column; the copy-free varlen path merges it as
  one more log-sum-exp term; flex and the gathered varlen layout use the kernel's LSE,
  made differentiable exactly by one more call with the keys as values
  (:func:`_differentiable_lse`: FlashAttention does not back-propagate through its LSE,
  and flex's LSE gradient is not relied on either). Sinks with a logit soft-cap run on
  SDPA only (refused elsewhere).
- **chunked attention** (Llama4 ``attention_chunk_size``): a key is visible iff it is an
  ancestor (the mask contract) *and* in the query's chunk of its own sequence's positions
  (``position_ids // c`` equal): an extra mask term (dense, flex ``mask_mod``), and on the
  varlen path every chain cut to the chunk (:func:`~treepack.trainer.kernels.masks.varlen_meta`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.index import scatter_filled
from treepack.trainer.kernels.masks import VarlenMeta
from treepack.trainer.kernels.varlen import CPU_SPLIT, varlen_attention
from treepack.trainer.kernels.varlen_levels import VarlenLevels
from treepack.trainer.kernels.varlen_merge import NAIVE_SPLIT, SplitVarlen, levels_attention, register_split, split_of

__all__ = ["tree_attention", "naive_varlen_attention", "BACKENDS", "TreeMasks", "AUTO", "resolve_backend"]


class TreeMasks(Protocol):
    """What :func:`tree_attention` reads from the rows it runs on (a
    :class:`~treepack.trainer.data.PackedBatch` is one): their shape and the tree mask in
    each kernel's form (:mod:`treepack.trainer.kernels.masks`)."""

    @property
    def num_rows(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    def dense_mask(self, sliding_window: int | None = None, chunk_size: int | None = None) -> torch.Tensor: ...

    def block_mask(
        self, block_size: int = 128, sliding_window: int | None = None, chunk_size: int | None = None
    ) -> Any: ...

    def varlen_meta(self, chunk_size: int | None = None) -> VarlenMeta: ...

    def varlen_levels(self) -> VarlenLevels: ...


BACKENDS = ("sdpa", "flex", "flash")
#: The trainers' default backend choice, resolved per device by :func:`resolve_backend`.
AUTO = "auto"


#: Row length from which ``auto`` takes the copy-free varlen path on a CPU: below it the
#: dense mask's L x L work is small and SDPA measured as fast or faster (rows of 512 tie,
#: the varlen path wins from 2,048: BENCHMARKS.md, "Keys read in place").
CPU_FLASH_MIN_LEN = 2048


def resolve_backend(backend: str, device: Any, seq_len: int | None = None) -> str:
    """``backend``, or for ``"auto"`` the fastest exact backend on ``device``.

    ``auto`` is ``flash`` on a CUDA device where flash-attn imports, else ``sdpa``; on a CPU
    it is ``flash`` (the copy-free varlen path with the batched CPU kernel: only the attended
    pairs, no dense ``[rows, 1, L, L]`` mask) for rows of at least :data:`CPU_FLASH_MIN_LEN`
    tokens, else ``sdpa``.

    Args:
        backend: ``sdpa`` | ``flex`` | ``flash`` | ``auto``.
        device: where the rows live.
        seq_len: the rows' length L; None: unknown (a CPU then takes ``flash``).
    """
    if backend != AUTO:
        return backend
    if torch.device(device).type == "cpu":
        return "flash" if seq_len is None or seq_len >= CPU_FLASH_MIN_LEN else "sdpa"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash"


_COMPILED_FLEX: dict[str, Callable] = {}


def _repeat_kv(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    return x if n_rep == 1 else torch.repeat_interleave(x, n_rep, dim=dim)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: TreeMasks) -> None:
    K, L = batch.num_rows, batch.seq_len
    if q.ndim != 4 or q.shape[0] != K or q.shape[2] != L:
        raise RequestError(
            f"query must have shape [{K}, heads, {L}, head_dim], got {tuple(q.shape)}", path="$.query", rule="shape"
        )
    if k.shape[0] != K or k.shape[2] != L or v.shape[:3] != k.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise RequestError(
            f"key/value shapes {tuple(k.shape)} / {tuple(v.shape)} do not match query {tuple(q.shape)}",
            path="$.key",
            rule="shape",
        )
    if q.shape[1] % k.shape[1]:
        raise RequestError(
            f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}", path="$.key", rule="gqa"
        )


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
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    gather_keys: bool = False,
) -> torch.Tensor:
    """Attention of packed rows under the tree mask.

    Args:
        q: [K, H, L, D] queries (K rows, H heads).
        k: [K, Hkv, L, D] keys, H a multiple of Hkv (grouped-query attention).
        v: [K, Hkv, L, Dv] values.
        batch: the rows' masks (a :class:`~treepack.trainer.data.PackedBatch`).
        backend: ``sdpa`` | ``flex`` | ``flash`` | ``auto`` (:func:`resolve_backend`).
        scale: softmax scale (default ``D ** -0.5``).
        sliding_window: optional window w (keys at most w-1 positions back).
        softcap: optional logit soft-capping ``c * tanh(s / c)``.
        varlen_fn: ``flash`` only: the varlen kernel (default ``flash_attn_varlen_func`` on
            CUDA, the batched CPU kernel :func:`~treepack.trainer.kernels.varlen.varlen_attention`
            on a CPU; :func:`naive_varlen_attention` is the loop reference).
        compile: ``flex`` only: run ``torch.compile(flex_attention)`` (default: on CUDA).
        sinks: optional [H] attention-sink logits (GPT-OSS ``s_aux``; module docstring).
        chunk_size: optional chunk size c of chunked attention (Llama4; module docstring).
        gather_keys: ``flash`` only: run every segment over its gathered ancestor keys (the
            reference layout) even where the copy-free levels would run.

    Returns:
        [K, H, L, Dv] attention output.
    """
    _check(q, k, v, batch)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q.shape[1],)):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise RequestError(
            f"sinks must be one logit per query head [{q.shape[1]}], got {shape}", path="$.sinks", rule="shape"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend = resolve_backend(backend, q.device, q.shape[2])
    if backend == "sdpa":
        dense = batch.dense_mask(sliding_window=sliding_window, chunk_size=chunk_size)
        return _sdpa(q, k, v, dense, scale, softcap, sinks)
    if backend == "flex":
        blocks = batch.block_mask(sliding_window=sliding_window, chunk_size=chunk_size)
        return _flex(q, k, v, blocks, scale, softcap, compile, sinks)
    if backend == "flash":
        split = None if gather_keys or sliding_window is not None or chunk_size is not None else _split(varlen_fn, q)
        if split is not None:
            if sinks is not None and softcap is not None:
                raise RequestError(_SINK_SOFTCAP.format(backend="flash"), path="$.backend", rule="unsupported")
            return _levels(q, k, v, batch.varlen_levels(), split, scale, softcap, sinks)
        return _flash(
            q, k, v, batch.varlen_meta(chunk_size=chunk_size), scale, sliding_window, softcap, varlen_fn, sinks
        )
    raise RequestError(f"backend must be one of {BACKENDS}, got {backend!r}", path="$.backend", rule="enum")


def _sdpa(q, k, v, mask, scale, softcap, sinks):
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep, 1), _repeat_kv(v, n_rep, 1)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # SDPA has no soft-capping or sinks: the same computation in plain ops.
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)
    sink = sinks.float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p.to(v.dtype), v)


def _sink_factor(lse: torch.Tensor, sinks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``sigmoid(lse - sink)``: the share of the softmax mass left to the real keys.

    Args:
        lse: log-sum-exp of the real keys' logits, heads on axis ``head_dim``.
        sinks: [H] sink logits.
    """
    shape = [1] * lse.ndim
    shape[head_dim] = -1
    return torch.sigmoid(lse.float() - sinks.float().view(shape))


def _lse_request() -> dict:
    """flex_attention's keyword asking for the LSE (``return_aux`` from PyTorch 2.9 on)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # pragma: no cover - older PyTorch
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def _flex(q, k, v, block_mask, scale, softcap, compile, sinks):
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

    gqa = q.shape[1] != k.shape[1]

    def call(q_, k_, v_, **extra):
        with warnings.catch_warnings():
            # Uncompiled flex (the CPU path) warns that it materializes the scores: intended.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return fn(q_, k_, v_, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa, **extra)

    if sinks is None:
        return call(q, k, v)
    if softcap is not None:
        raise RequestError(_SINK_SOFTCAP.format(backend="flex"), path="$.backend", rule="unsupported")
    out, aux = call(q, k, v, **_lse_request())
    lse = getattr(aux, "lse", aux)  # [K, H, L], natural log
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        # As on the varlen path: the LSE's exact gradient without relying on the kernel's.
        a = call(q.detach(), k.detach(), k)  # [K, H, L, D]: sum_j p_ij k_j
        t = scale * (q.float() * a.float()).sum(-1)
        lse = lse.detach().float() + (t - t.detach())
    return (out.float() * _sink_factor(lse, sinks, 1)[..., None]).to(out.dtype)


_SINK_SOFTCAP = (
    "attention sinks with logit soft-capping are not exact on backend='{backend}' "
    "(the LSE gradient assumes plain logits); "
    "use backend='sdpa'"
)


def _flash_varlen() -> Callable:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "backend='flash' on a CUDA device needs the flash-attn package (pip install 'treepack[gpu]'); "
            "use backend='sdpa', 'flex' or 'auto'"
        ) from e
    return flash_attn_varlen_func


def _differentiable_lse(
    fn: Callable, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, args: tuple, kw: dict, scale: float
) -> torch.Tensor:
    """[H, Tq] the kernel's LSE with its exact gradient (FlashAttention returns it detached).

    ``d lse_i / d q_i = scale * sum_j p_ij k_j`` and ``d lse_i / d k_j = scale * p_ij q_i``.
    One more varlen call with the keys as values gives ``a_i = sum_j p_ij k_j``; the term
    ``t_i = scale * q_i . a_i``, with q and k detached inside the call, has exactly these
    gradients (through q directly, through the values for k), and ``t - t.detach()`` adds
    them to the LSE without changing its value. (Exact for plain logits: a soft-cap would
    scale each p_ij by the cap's derivative, so sinks with a soft-cap are refused.)
    """
    a = fn(q.detach(), k.detach(), k, *args, **kw)
    t = scale * (q.float() * a.float()).sum(-1)  # [Tq, H]
    return lse.detach().float() + (t - t.detach()).transpose(0, 1)


def _split(varlen_fn: Callable | None, q: torch.Tensor) -> SplitVarlen | None:
    """The split pair the copy-free path runs for ``varlen_fn`` (None: the gathered path).

    ``varlen_fn`` None means flash-attn on CUDA (its pair when it imports with a known
    signature and the inputs suit it: fp16/bf16, head dim a multiple of 8) and the batched
    CPU kernel on a CPU; else the pair registered for ``varlen_fn``
    (:func:`~treepack.trainer.kernels.varlen_merge.split_of`).
    """
    if varlen_fn is not None:
        return split_of(varlen_fn)
    if not q.is_cuda:
        return CPU_SPLIT
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8:
        return None
    from treepack.trainer.kernels.gpu_flash import flash_split

    return flash_split()


@torch.compiler.disable  # eager inside a compiled model, as _flash below: its calls have the tree's sizes
def _levels(q, k, v, levels, split, scale, softcap, sinks):
    """Copy-free varlen attention (:mod:`~treepack.trainer.kernels.varlen_merge`) of
    ``q`` [K, H, L, D], ``k``, ``v`` [K, Hkv, L, D]: the rows are read in place."""
    K, H, L, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    with record_function("treepack::layout"):
        qf = q.transpose(1, 2).reshape(K * L, H, D)
        kf = k.transpose(1, 2).reshape(K * L, Hkv, D)
        vf = v.transpose(1, 2).reshape(K * L, Hkv, Dv)
    out = levels_attention(qf, kf, vf, levels, split, scale=scale, softcap=softcap, sinks=sinks)
    return out.view(K, L, H, Dv).transpose(1, 2)


# Eager inside a compiled model: the gathers' sizes are the tree's (data-dependent), so
# dynamo would recompile them with symbolic sizes on the next tree of the same row shape,
# which inductor cannot lower (``Exponent must be non-negative``). The projections around
# it still compile; the varlen kernel itself is a compiled kernel already.
@torch.compiler.disable
def _flash(q, k, v, meta, scale, sliding_window, softcap, varlen_fn, sinks, k_self=None, v_self=None):
    """Varlen attention over ``meta``: ``q`` [K, H, L, D]; ``k``, ``v`` [K, Hkv, Lk, D]
    (``meta.k_index`` flat in [K * Lk]); ``k_self``, ``v_self`` [K, Hkv, L, D] the keys and
    values at the query positions, which padding attends (default ``k``, ``v``: Lk == L)."""
    if sinks is not None and softcap is not None:
        raise RequestError(_SINK_SOFTCAP.format(backend="flash"), path="$.backend", rule="unsupported")
    fn = varlen_fn if varlen_fn is not None else varlen_attention if not q.is_cuda else _flash_varlen()
    K, H, L, D = q.shape
    Hkv, Dv, Lk = k.shape[1], v.shape[-1], k.shape[2]
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)
    args = (meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k)
    kw = dict(
        dropout_p=0.0,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        softcap=0.0 if softcap is None else float(softcap),
    )
    with record_function("treepack::layout"):
        qf = q.transpose(1, 2).reshape(K * L, H, D)
        kf = k.transpose(1, 2).reshape(K * Lk, Hkv, D)
        vf = v.transpose(1, 2).reshape(K * Lk, Hkv, Dv)
        ksf = kf if k_self is None else k_self.transpose(1, 2).reshape(K * L, Hkv, D)
        vsf = vf if v_self is None else v_self.transpose(1, 2).reshape(K * L, Hkv, Dv)
        qg, kg, vg = qf[meta.q_index], kf[meta.k_index], vf[meta.k_index]
    if sinks is None:
        out = fn(qg, kg, vg, *args, **kw)
    else:
        out, lse, _ = fn(qg, kg, vg, *args, return_attn_probs=True, **kw)
        if tuple(lse.shape) != (H, qg.shape[0]):
            # Older flash-attn returned a padded [B, H, max_seqlen_q] LSE for varlen calls.
            raise RequestError(
                f"the varlen kernel returned an LSE of shape {tuple(lse.shape)}, "
                f"expected [heads, total_q] = {[H, qg.shape[0]]}; "
                "attention sinks need flash-attn >= 2.6 (or backend='sdpa' / 'flex')",
                path="$.backend",
                rule="unsupported",
            )
        lse = _differentiable_lse(fn, qg, kg, lse, args, kw, scale)
        out = (out.float() * _sink_factor(lse, sinks, 0).transpose(0, 1)[..., None]).to(out.dtype)
    with record_function("treepack::layout"):
        # NaN first so that a position the kernel did not write shows up.
        res = scatter_filled(out, meta.q_index, K * L)
        # A padding token attends only itself: its output is its own value (times its sink factor).
        pad_v = _repeat_kv(vsf[meta.pad_index], H // Hkv, 1).to(out.dtype)
        if sinks is not None:
            s_self = scale * (qf[meta.pad_index].float() * _repeat_kv(ksf[meta.pad_index], H // Hkv, 1).float()).sum(
                -1
            )  # [P, H]
            pad_v = (pad_v.float() * _sink_factor(s_self, sinks, 1)[..., None]).to(out.dtype)
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
    return_attn_probs: bool = False,
    **unused: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
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
        return_attn_probs: also return the log-sum-exp of each query's logits, as
            FlashAttention does (its third output, the probabilities, is None here).

    Returns:
        [Tq, H, Dv], or (that, lse [H, Tq] float32, None).
    """
    if dropout_p:
        raise RequestError("naive_varlen_attention has no dropout", path="$.dropout_p", rule="unsupported")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    n_rep = q.shape[1] // k.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    left, right = window_size
    outs, lses = [], []
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
        lses.append(torch.logsumexp(s.float(), dim=-1))
    out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])
    if not return_attn_probs:
        return out
    return out, torch.cat(lses, dim=1) if lses else q.new_zeros(q.shape[1], 0, dtype=torch.float32), None


register_split(naive_varlen_attention, NAIVE_SPLIT)
