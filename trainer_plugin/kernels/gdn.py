"""Gated DeltaNet on tree rows (SPEC section 7).

A recurrent layer has no mask: tree packing is exact only if every segment starts from
the state its sequence would have there. The plan's GDN metadata (``plan.gdn``) groups
segments by tree depth across all rows; this module runs, per depth level:

- the short causal conv: each token's window of W inputs runs back along its ancestor
  chain, so a segment's first W-1 windows reach into its parent (and further up when the
  parent is shorter than W-1; ``conv_context``), never into a sibling or another tree.
  Roots are zero-padded as at a sequence start. The conv is one gather-and-sum over all
  tokens (:func:`tree_causal_conv1d`), exact on any device.
- the chunked gated delta rule: one varlen call per level (``cu_seqlens``), each segment's
  initial state gathered from its parent's final state of the previous level (roots start
  from zeros). The gather's backward index-adds every child's state gradient into its
  parent, so a shared prefix receives the sum of its branches' gradients.
  flash-linear-attention's ``chunk_gated_delta_rule`` on CUDA (bf16/fp16), the pure-torch
  :func:`~treepack.trainer.kernels.gdn_ref.chunk_gated_delta_rule_ref` elsewhere.

Tensors are flat over rows: position ``row * seq_len + i`` (N = R * C). Outputs start as
NaN and only real tokens are written; padding gets zeros (a pad token is a sequence of its
own, and NaN there would leak through ``0 * NaN`` in later attention matmuls).

:func:`naive_tree_causal_conv1d` and :func:`naive_tree_gated_delta_rule` are the loop-based
references (segment by segment, walking parent pointers); tests compare both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.index import local_row_index, localize_flat, ragged_arange, segment_tokens
from treepack.proto.plan import Plan
from treepack.trainer.kernels.index import index_tensor, scatter_filled
from treepack.trainer.kernels.gdn_ref import chunk_gated_delta_rule_ref, naive_recurrent_gated_delta_rule

__all__ = [
    "GdnLevelIndex",
    "GdnSchedule",
    "gdn_schedule",
    "tree_causal_conv1d",
    "naive_tree_causal_conv1d",
    "tree_gated_delta_rule",
    "naive_tree_gated_delta_rule",
    "select_kernel",
]

Kernel = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]


@dataclass(frozen=True, slots=True, kw_only=True)
class GdnLevelIndex:
    """One depth level as torch tensors.

    Attributes:
        depth: the level's depth (0 = row roots).
        token_idx: [T_l] int64 flat positions of the level's tokens, segment by segment.
        cu_seqlens: [n+1] int32 segment boundaries in ``token_idx``.
        parent_slot: [n] int64 index of each segment's parent in the previous level (-1 at 0).
    """

    depth: int
    token_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    parent_slot: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class GdnSchedule:
    """Everything a GDN layer needs to run a packed batch as trees.

    Attributes:
        num_rows: R. seq_len: C (flat size N = R * C).
        conv_width: W the plan's conv context was built for.
        levels: per depth, :class:`GdnLevelIndex`.
        conv_window: [N, W] int64 flat input positions of each position's conv window,
            oldest first (the position itself last); N = a zero input (before a root).
        pad_idx: [P] int64 flat positions of padding.
    """

    num_rows: int
    seq_len: int
    conv_width: int
    levels: tuple[GdnLevelIndex, ...]
    conv_window: torch.Tensor
    pad_idx: torch.Tensor

    @property
    def num_positions(self) -> int:
        return self.num_rows * self.seq_len


def gdn_schedule(plan: Plan, device: torch.device | str | None = None, rows: np.ndarray | None = None) -> GdnSchedule:
    """Turn ``plan.gdn`` into torch index tensors (vectorized numpy, then one copy each).

    Args:
        plan: the plan.
        device: where the tensors go (default CPU).
        rows: optional [R'] row numbers to keep (a rank's rows), in the order they are
            stacked in the batch, -1 for an empty row (all padding); default every row.

    Returns:
        The :class:`GdnSchedule` for the stacked rows.
    """
    if not isinstance(plan, Plan):
        raise InputTypeError(f"expected a treepack Plan, got {type(plan).__name__}", path="$.plan", rule="type")
    seg, C, W = plan.segments, plan.seq_len, plan.gdn.conv_width
    keep = np.arange(plan.num_rows) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    real_rows = keep[keep >= 0]
    if keep.size and (keep.min() < -1 or keep.max() >= plan.num_rows or np.unique(real_rows).size != real_rows.size):
        raise RequestError(f"rows must be distinct and in [-1, {plan.num_rows}), got {keep.tolist()}", path="$.rows", rule="range")
    new_row = local_row_index(keep, plan.num_rows)
    R = int(keep.shape[0])

    def remap(flat: np.ndarray) -> np.ndarray:  # plan-wide flat positions -> stacked flat positions
        return localize_flat(flat, new_row, C)

    levels = []
    ctx_all = np.full((seg.num_segments, max(W - 1, 0)), -1, dtype=np.int64)
    slot_new = np.full(seg.num_segments, -1, dtype=np.int64)
    for lv in plan.gdn.levels:
        ctx_all[lv.segs] = lv.conv_context
        segs = lv.segs[new_row[seg.row[lv.segs]] >= 0]
        if segs.size == 0:
            break  # no deeper segment in the kept rows either
        slot_new[segs] = np.arange(segs.shape[0])
        lens = seg.length[segs]
        cu = np.zeros(segs.shape[0] + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        par = seg.parent[segs]
        levels.append(
            GdnLevelIndex(
                depth=lv.depth,
                token_idx=index_tensor(remap(segment_tokens(seg, C, segs)), device),
                cu_seqlens=index_tensor(cu, device, torch.int32),
                parent_slot=index_tensor(np.where(par >= 0, slot_new[np.maximum(par, 0)], -1), device),
            )
        )

    # Conv windows: element j of the window of the token at offset o of segment s is entry
    # o + j of (s's W-1 context positions ++ s's own positions).
    N = R * C
    win = np.full((N, W), -1, dtype=np.int64)
    win[:, W - 1] = np.arange(N)  # padding: a sequence of one token
    segs = np.flatnonzero(new_row[seg.row] >= 0)
    if segs.size:
        lens = seg.length[segs]
        sid = np.repeat(segs, lens)
        off = ragged_arange(lens)
        pos = remap(segment_tokens(seg, C, segs))
        e = off[:, None] + np.arange(W)[None, :]
        own = pos[:, None] + (e - (W - 1)) - off[:, None]  # positions inside the segment
        if W > 1:
            ctx = remap(ctx_all[sid[:, None], np.minimum(e, W - 2)])
            win[pos] = np.where(e < W - 1, ctx, own)
        else:
            win[pos] = own
    real = np.zeros(N, dtype=bool)
    if segs.size:
        real[pos] = True
    win = np.where(win < 0, N, win)
    return GdnSchedule(
        num_rows=R,
        seq_len=C,
        conv_width=W,
        levels=tuple(levels),
        conv_window=index_tensor(win, device),
        pad_idx=index_tensor(np.flatnonzero(~real), device),
    )


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise RequestError(f"conv activation must be None, 'silu' or 'swish', got {activation!r}", path="$.activation", rule="enum")


def _check_conv(x: torch.Tensor, weight: torch.Tensor, n: int, width: int) -> None:
    if x.dim() != 2 or x.shape[0] != n:
        raise RequestError(f"x must be [N, D] with N = rows * seq_len = {n}, got {tuple(x.shape)}", path="$.x", rule="shape")
    if weight.shape != (x.shape[1], width):
        raise RequestError(
            f"weight must be [D, W] = {(x.shape[1], width)} (W = the plan's conv_width), got {tuple(weight.shape)}; "
            "plan with conv_width equal to the layer's conv kernel size",
            path="$.weight",
            rule="shape",
        )


def tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    schedule: GdnSchedule,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal conv of width W along every token's ancestor chain.

    Args:
        x: [N, D] flat row inputs.
        weight: [D, W] per-channel taps, oldest input first (``nn.Conv1d.weight[:, 0]``).
        bias: [D] or None.
        schedule: from :func:`gdn_schedule`.
        activation: None, ``silu`` or ``swish`` (applied after the bias).

    Returns:
        [N, D] in the compute dtype of ``x`` and ``weight`` (padding positions see only
        themselves, like a one-token sequence).
    """
    N = schedule.num_positions
    _check_conv(x, weight, N, schedule.conv_width)
    xe = torch.cat([x.to(weight.dtype), x.new_zeros(1, x.shape[1], dtype=weight.dtype)])
    win = schedule.conv_window
    y = xe[win[:, 0]] * weight[:, 0]
    for j in range(1, schedule.conv_width):
        y = y + xe[win[:, j]] * weight[:, j]
    if bias is not None:
        y = y + bias
    return _activate(y, activation)


def naive_tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: Plan,
    activation: str | None = None,
) -> torch.Tensor:
    """Reference for :func:`tree_causal_conv1d`: per segment, ``F.conv1d`` over its whole chain.

    Walks parent pointers to concatenate the segment's ancestors' inputs (no plan metadata
    beyond the segment table), convolves the chain with W-1 zeros in front, keeps the
    segment's part. Padding positions are convolved alone.
    """
    C, W = plan.seq_len, weight.shape[1]
    seg = plan.segments
    N = plan.num_rows * C
    _check_conv(x, weight, N, W)
    out = torch.full((N, x.shape[1]), float("nan"), dtype=weight.dtype, device=x.device)
    covered = torch.zeros(N, dtype=torch.bool)
    for s in range(seg.num_segments):
        chain = []
        p = s
        while p >= 0:
            b = int(seg.row[p]) * C + int(seg.row_start[p])
            chain = list(range(b, b + int(seg.length[p]))) + chain
            p = int(seg.parent[p])
        xs = x[chain].to(weight.dtype).T[None]  # [1, D, L]
        y = F.conv1d(F.pad(xs, (W - 1, 0)), weight[:, None, :], bias, groups=x.shape[1])[0].T
        n = int(seg.length[s])
        mine = chain[-n:]
        out[mine] = _activate(y[-n:], activation)
        covered[mine] = True
    for i in torch.nonzero(~covered).flatten().tolist():
        y = x[i].to(weight.dtype) * weight[:, -1] + (0 if bias is None else bias)
        out[i] = _activate(y, activation)
    return out


def select_kernel(q: torch.Tensor) -> Kernel:
    """fla's ``chunk_gated_delta_rule`` for CUDA bf16/fp16 inputs, else the torch reference.

    fla is imported here, lazily; fla's kernels reject fp32, so fp32 stays on the reference.
    """
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:
            return chunk_gated_delta_rule_ref

        def fla_kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
            # Grouped values: repeat q/k heads ourselves (as HF's fallback does), so the
            # head mapping does not depend on the installed fla version.
            if v.shape[2] != q.shape[2]:
                q = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
                k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
            return chunk_gated_delta_rule(
                q, k, v, g, beta,
                scale=scale,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
            )

        return fla_kernel
    return chunk_gated_delta_rule_ref


def _check_flat(q, k, v, g, beta, n: int) -> None:
    for name, t, d in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"expected a torch.Tensor, got {type(t).__name__}", path=f"$.{name}", rule="type")
        if t.dim() != d or t.shape[0] != n:
            raise RequestError(f"{name} must be {d}-D with N = rows * seq_len = {n} first, got {tuple(t.shape)}", path=f"$.{name}", rule="shape")


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: GdnSchedule,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """The gated delta rule over tree rows: one varlen kernel call per depth level.

    Args:
        q, k: [N, Hk, K] flat row tokens. v: [N, Hv, V]. g, beta: [N, Hv].
        schedule: from :func:`gdn_schedule`.
        scale, use_qk_l2norm_in_kernel: as fla's ``chunk_gated_delta_rule``.
        kernel: a function with fla's signature; default :func:`select_kernel`.

    Returns:
        o: [N, Hv, V] in q's dtype; zeros at padding.
    """
    N = schedule.num_positions
    _check_flat(q, k, v, g, beta, N)
    kernel = select_kernel(q) if kernel is None else kernel
    outs, idx = [], []
    final = None
    for lv in schedule.levels:
        sel = [x.index_select(0, lv.token_idx)[None] for x in (q, k, v, g, beta)]
        # Fork: each child starts from its parent's final state (backward sums children).
        h0 = None if final is None else final.index_select(0, lv.parent_slot)
        o, final = kernel(
            *sel,
            scale=scale,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=lv.cu_seqlens,
        )
        outs.append(o[0])
        idx.append(lv.token_idx)
    H, V = v.shape[1], v.shape[2]
    outs.append(q.new_zeros(schedule.pad_idx.shape[0], H, V))
    idx.append(schedule.pad_idx)
    return scatter_filled(torch.cat(outs).to(q.dtype), torch.cat(idx), N)


def naive_tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: Plan,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """Reference for :func:`tree_gated_delta_rule`: segment by segment, token by token.

    Segments run in pre-order (parents first); each starts from its parent's final state,
    read from a dict (no level metadata used). Same arguments, with the plan instead of a
    schedule.
    """
    C, seg = plan.seq_len, plan.segments
    N = plan.num_rows * C
    _check_flat(q, k, v, g, beta, N)
    H, V = v.shape[1], v.shape[2]
    out = torch.full((N, H, V), float("nan"), dtype=q.dtype, device=q.device)
    out[torch.from_numpy(plan.segment_ids().reshape(-1) < 0)] = 0
    states: dict[int, torch.Tensor] = {}
    for s in range(seg.num_segments):
        b = int(seg.row[s]) * C + int(seg.row_start[s])
        t = torch.arange(b, b + int(seg.length[s]))
        p = int(seg.parent[s])
        h0 = None if p < 0 else states[p][None]
        o, fin = naive_recurrent_gated_delta_rule(
            q[t][None], k[t][None], v[t][None], g[t][None], beta[t][None],
            scale=scale, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        out[t] = o[0]
        states[s] = fin[0]
    return out
