"""One tree-scan mechanism for every recurrent or convolutional mixer (SPEC section 7).

A mixer with a causal-conv state and/or a recurrent state (Gated DeltaNet, KDA, Mamba2,
Mamba, gated short convolutions) is exact on tree rows only if every segment starts from
the state its sequence has there. The plan groups segments by tree depth across all rows
(``plan.gdn``); per depth level this module makes:

- **one varlen conv call** (:func:`tree_conv`): every segment of the level becomes one
  sequence of the call, its own tokens preceded by the W-1 inputs of its conv context
  (``GdnLevel.conv_context``: the nearest W-1 tokens of its ancestor chain, across
  ancestors shorter than W-1; zeros above a root). The call runs with ``seq_idx``, so no
  window crosses into another segment; the context positions' own outputs are dropped.
  Replay cost: W-1 extra input columns per segment (nothing is recomputed twice).
  Any layer conv width up to the plan's ``conv_width`` is exact (a narrower window reads
  only the nearest context columns).
- **one varlen scan call** (:func:`tree_scan`): every segment is one sequence
  (``cu_seqlens`` / ``seq_idx``), its initial state indexed from its parent's final state
  of the previous level (roots start from zeros). ``index_select``'s backward index-adds
  every child's state gradient into its parent, so a shared prefix receives the sum of
  its branches' gradients. Chunk boundaries: each segment is chunked from its own first
  token, so a branch point inside a chunk of the unpacked sequence is exact (the
  recurrence is exactly associative at the segment boundary: the state passed is the
  state there); no token is replayed, the cost is the padding of each segment's last
  chunk (at most ``chunk_size - 1`` idle slots per segment).

Tensors are flat over rows: position ``row * seq_len + i`` (N = R * C). Outputs start as
NaN and only real tokens are written; padding positions get the value of a one-token
sequence (conv) or zeros (scan), never NaN (``0 * NaN`` would leak through later matmuls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.index import local_row_index, localize_flat, ragged_arange, segment_tokens
from treepack.proto.plan import Plan
from treepack.trainer.kernels.index import index_tensor, scatter_filled
from treepack.trainer.kernels.short_conv import check_conv_args, select_causal_conv1d

__all__ = [
    "TreeLevel",
    "TreeSchedule",
    "tree_schedule",
    "conv_width_refusal",
    "tree_conv",
    "tree_scan",
    "naive_tree_scan",
    "ConvFn",
    "LevelStep",
]

ConvFn = Callable[..., torch.Tensor]
LevelStep = Callable[[list, "torch.Tensor | None", "TreeLevel"], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeLevel:
    """One depth level as torch tensors.

    Attributes:
        depth: the level's depth (0 = row roots).
        token_idx: [T_l] int64 flat positions of the level's tokens, segment by segment.
        cu_seqlens: [n+1] int32 segment boundaries in ``token_idx``.
        seq_idx: [T_l] int32 segment number (0..n-1) of each token, as mamba_ssm's ``seq_idx``.
        parent_slot: [n] int64 index of each segment's parent in the previous level (-1 at 0).
        conv_idx: [T_l + n(W-1)] int64 flat input positions of the level's conv stream: per
            segment its W-1 context positions, then its own; N = a zero input.
        conv_seq_idx: [T_l + n(W-1)] int32 segment number of each stream column.
        conv_keep: [T_l] int64 stream columns of the segment's own tokens (``token_idx`` order).
    """

    depth: int
    token_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_idx: torch.Tensor
    parent_slot: torch.Tensor
    conv_idx: torch.Tensor
    conv_seq_idx: torch.Tensor
    conv_keep: torch.Tensor

    def to(self, device: torch.device | str) -> TreeLevel:
        return TreeLevel(depth=self.depth, **{f: getattr(self, f).to(device) for f in _LEVEL_TENSORS})


_LEVEL_TENSORS = ("token_idx", "cu_seqlens", "seq_idx", "parent_slot", "conv_idx", "conv_seq_idx", "conv_keep")


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeSchedule:
    """Everything a recurrent or conv mixer needs to run a packed batch as trees.

    Attributes:
        num_rows: R. seq_len: C (flat size N = R * C).
        conv_width: W the plan's conv context was built for (layers may use any width <= W).
        levels: per depth, :class:`TreeLevel`.
        pad_idx: [P] int64 flat positions of padding.
        conv_window: (property) [N, W] each position's conv window, from the levels.
    """

    num_rows: int
    seq_len: int
    conv_width: int
    levels: tuple[TreeLevel, ...]
    pad_idx: torch.Tensor

    @property
    def num_positions(self) -> int:
        return self.num_rows * self.seq_len

    @property
    def conv_window(self) -> torch.Tensor:
        """[N, W] int64 flat input positions of each position's conv window, oldest first.

        The position itself is last; N = a zero input (before a root); padding sees only
        itself. Read from the levels' conv streams (for whole-batch gather convs).
        """
        W, N = self.conv_width, self.num_positions
        dev = self.pad_idx.device
        win = torch.full((N, W), N, dtype=torch.int64, device=dev)
        win[:, W - 1] = torch.arange(N, device=dev)
        back = torch.arange(-(W - 1), 1, device=dev)
        for lv in self.levels:
            win[lv.token_idx] = lv.conv_idx[lv.conv_keep[:, None] + back[None, :]]
        return win

    def to(self, device: torch.device | str) -> TreeSchedule:
        """The same schedule with every tensor on ``device``."""
        return TreeSchedule(
            num_rows=self.num_rows,
            seq_len=self.seq_len,
            conv_width=self.conv_width,
            levels=tuple(lv.to(device) for lv in self.levels),
            pad_idx=self.pad_idx.to(device),
        )


def _row_map(plan: Plan, rows: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(local row of each plan row or -1, number of stacked rows R)."""
    keep = np.arange(plan.num_rows) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    real_rows = keep[keep >= 0]
    if keep.size and (keep.min() < -1 or keep.max() >= plan.num_rows or np.unique(real_rows).size != real_rows.size):
        raise RequestError(
            f"rows must be distinct and in [-1, {plan.num_rows}), got {keep.tolist()}", path="$.rows", rule="range"
        )
    return local_row_index(keep, plan.num_rows), int(keep.shape[0])


def _level(
    depth: int, tok: np.ndarray, lens: np.ndarray, parent_slot: np.ndarray, ctx: np.ndarray, N: int, device
) -> TreeLevel:
    """Index tensors of one level from its token positions, segment lengths and conv context."""
    n, Wm1 = lens.shape[0], ctx.shape[1]
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    seq = np.repeat(np.arange(n), lens)
    # Conv stream: segment s occupies columns [cu[s] + s(W-1), cu[s+1] + (s+1)(W-1)).
    ext_lens = lens + Wm1
    ext_start = cu[:-1] + np.arange(n) * Wm1
    conv_idx = np.empty(int(ext_lens.sum()), dtype=np.int64)
    ctx_cols = (ext_start[:, None] + np.arange(Wm1)[None, :]).reshape(-1)
    conv_idx[ctx_cols] = np.where(ctx.reshape(-1) >= 0, ctx.reshape(-1), N)
    keep = np.repeat(ext_start + Wm1, lens) + ragged_arange(lens)
    conv_idx[keep] = tok
    return TreeLevel(
        depth=depth,
        token_idx=index_tensor(tok, device),
        cu_seqlens=index_tensor(cu, device, torch.int32),
        seq_idx=index_tensor(seq, device, torch.int32),
        parent_slot=index_tensor(parent_slot, device),
        conv_idx=index_tensor(conv_idx, device),
        conv_seq_idx=index_tensor(np.repeat(np.arange(n), ext_lens), device, torch.int32),
        conv_keep=index_tensor(keep, device),
    )


def conv_width_refusal(kernel: int, conv_width: int) -> str | None:
    """Why a causal conv of width ``kernel`` cannot run on a schedule built for ``conv_width``, or None.

    The one conv-width rule: the schedule carries ``conv_width - 1`` ancestor positions of
    context per segment, so any kernel up to ``conv_width`` wide is exact (a narrower one
    reads the last ``kernel - 1`` of them); a wider one would need context the plan did
    not keep.
    """
    if kernel <= conv_width:
        return None
    return (
        f"its causal conv has kernel {kernel} but the plan was made with conv_width={conv_width}; "
        f"plan with conv_width >= {kernel}"
    )


def tree_schedule(plan: Plan, device: torch.device | str | None = None, rows: np.ndarray | None = None) -> TreeSchedule:
    """Turn ``plan.gdn`` into torch index tensors (vectorized numpy, then one copy each).

    Args:
        plan: the plan.
        device: where the tensors go (default CPU).
        rows: optional [R'] row numbers to keep (a rank's rows), in the order they are
            stacked in the batch, -1 for an empty row (all padding); default every row.

    Returns:
        The :class:`TreeSchedule` for the stacked rows.
    """
    if not isinstance(plan, Plan):
        raise InputTypeError(f"expected a treepack Plan, got {type(plan).__name__}", path="$.plan", rule="type")
    seg, C, W = plan.segments, plan.seq_len, plan.gdn.conv_width
    new_row, R = _row_map(plan, rows)
    N = R * C

    def remap(flat: np.ndarray) -> np.ndarray:  # plan-wide flat positions -> stacked flat positions
        return localize_flat(flat, new_row, C)

    levels, real = [], np.zeros(N, dtype=bool)
    slot_new = np.full(seg.num_segments, -1, dtype=np.int64)
    for lv in plan.gdn.levels:
        kept = new_row[seg.row[lv.segs]] >= 0
        segs = lv.segs[kept]
        if segs.size == 0:
            break  # no deeper segment in the kept rows either
        slot_new[segs] = np.arange(segs.shape[0])
        par = seg.parent[segs]
        tok = remap(segment_tokens(seg, C, segs))
        real[tok] = True
        ctx = remap(lv.conv_context[kept].reshape(segs.shape[0], max(W - 1, 0)))
        parent_slot = np.where(par >= 0, slot_new[np.maximum(par, 0)], -1)
        levels.append(_level(lv.depth, tok, seg.length[segs], parent_slot, ctx, N, device))
    return TreeSchedule(
        num_rows=R,
        seq_len=C,
        conv_width=W,
        levels=tuple(levels),
        pad_idx=index_tensor(np.flatnonzero(~real), device),
    )


def _check_flat(name: str, x: torch.Tensor, n: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"expected a torch.Tensor, got {type(x).__name__}", path=f"$.{name}", rule="type")
    if x.dim() < 2 or x.shape[0] != n:
        raise RequestError(
            f"{name} must be [N, ...] with N = rows * seq_len = {n}, got {tuple(x.shape)}",
            path=f"$.{name}",
            rule="shape",
        )


def tree_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    schedule: TreeSchedule,
    activation: str | None = None,
    *,
    conv_fn: ConvFn | None = None,
) -> torch.Tensor:
    """Depthwise causal conv along every token's ancestor chain: one varlen call per level.

    Args:
        x: [N, D] flat row inputs.
        weight: [D, W] per-channel taps, oldest first (``nn.Conv1d.weight[:, 0]``), W <=
            the plan's ``conv_width``.
        bias: [D] or None.
        schedule: from :func:`tree_schedule`.
        activation: None, ``silu`` or ``swish`` (after the bias).
        conv_fn: a function with causal-conv1d's ``causal_conv1d_fn`` signature; default
            :func:`~treepack.trainer.kernels.short_conv.select_causal_conv1d`.

    Returns:
        [N, D] in the compute dtype of ``x`` and ``weight``; a padding position is convolved
        as a one-token sequence.
    """
    N = schedule.num_positions
    _check_flat("x", x, N)
    check_conv_args(x.dim() == 2, weight, x.shape[1], bias, activation)
    if weight.shape[1] > schedule.conv_width:
        raise RequestError(
            f"weight has a conv width of {weight.shape[1]}, more than the plan's conv_width={schedule.conv_width}; "
            f"plan with conv_width >= {weight.shape[1]}",
            path="$.plan.gdn.conv_width",
            rule="conv_width",
        )
    conv_fn = select_causal_conv1d(x) if conv_fn is None else conv_fn
    dt = torch.promote_types(x.dtype, weight.dtype)
    xe = torch.cat([x.to(dt), x.new_zeros(1, x.shape[1], dtype=dt)])
    outs, idx = [], []
    for lv in schedule.levels:
        stream = xe.index_select(0, lv.conv_idx).T[None]  # [1, D, T_ext], channel-last strides
        y = conv_fn(stream, weight, bias, seq_idx=lv.conv_seq_idx[None], activation=activation)
        outs.append(y[0].T.index_select(0, lv.conv_keep))
        idx.append(lv.token_idx)
    if schedule.pad_idx.numel():
        pad = xe.index_select(0, schedule.pad_idx)[:, :, None]  # [P, D, 1]: one-token sequences
        outs.append(conv_fn(pad, weight, bias, activation=activation)[:, :, 0])
        idx.append(schedule.pad_idx)
    if not outs:
        return x.new_full((N, x.shape[1]), float("nan"), dtype=dt)
    return scatter_filled(torch.cat(outs), torch.cat(idx), N)


def tree_scan(
    step: LevelStep, inputs: Sequence[torch.Tensor], schedule: TreeSchedule, out_tail: tuple[int, ...]
) -> torch.Tensor:
    """Run a varlen recurrent kernel over tree rows: one ``step`` call per depth level.

    Args:
        step: ``step(level_inputs, initial_state, level) -> (o [T_l, *out_tail], final
            [n, ...])``: runs the kernel over the level's segments (``level.cu_seqlens`` /
            ``level.seq_idx``), each starting from ``initial_state[i]`` (None: zeros), and
            returns every segment's final state.
        inputs: per-token tensors [N, ...] (gathered to [T_l, ...] for the level).
        schedule: from :func:`tree_schedule`.
        out_tail: the output's per-token shape.

    Returns:
        [N, *out_tail] in the dtype of ``inputs[0]``; zeros at padding.
    """
    N = schedule.num_positions
    for i, x in enumerate(inputs):
        _check_flat(f"inputs[{i}]", x, N)
    ref = inputs[0]
    outs, idx = [], []
    final: torch.Tensor | None = None
    for lv in schedule.levels:
        sel = [x.index_select(0, lv.token_idx) for x in inputs]
        # Fork: each child starts from its parent's final state (backward sums the children).
        h0 = None if final is None else final.index_select(0, lv.parent_slot)
        o, final = step(sel, h0, lv)
        outs.append(o.to(ref.dtype))
        idx.append(lv.token_idx)
    outs.append(ref.new_zeros(schedule.pad_idx.shape[0], *out_tail))
    idx.append(schedule.pad_idx)
    return scatter_filled(torch.cat(outs), torch.cat(idx), N)


def naive_tree_scan(
    run: Callable, inputs: Sequence[torch.Tensor], plan: Plan, out_tail: tuple[int, ...]
) -> torch.Tensor:
    """Reference for :func:`tree_scan`: segment by segment, walking parent pointers.

    Segments run in pre-order (parents first); each starts from its parent's final state,
    read from a dict (no level metadata used).

    Args:
        run: ``run(segment_inputs, initial_state) -> (o [n, *out_tail], final [1, ...])``
            on one segment's tokens (``initial_state`` [1, ...] or None for zeros).
        inputs: per-token tensors [N, ...], N = rows * seq_len of ``plan``.
        plan: the plan.
        out_tail: the output's per-token shape.

    Returns:
        [N, *out_tail]; zeros at padding.
    """
    C, seg = plan.seq_len, plan.segments
    N = plan.num_rows * C
    for i, x in enumerate(inputs):
        _check_flat(f"inputs[{i}]", x, N)
    ref = inputs[0]
    out = torch.full((N, *out_tail), float("nan"), dtype=ref.dtype, device=ref.device)
    out[torch.from_numpy(plan.segment_ids().reshape(-1) < 0)] = 0
    states: dict[int, torch.Tensor] = {}
    for s in range(seg.num_segments):
        b = int(seg.row[s]) * C + int(seg.row_start[s])
        t = torch.arange(b, b + int(seg.length[s]), device=ref.device)
        p = int(seg.parent[s])
        o, states[s] = run([x[t] for x in inputs], None if p < 0 else states[p])
        out[t] = o.to(ref.dtype)
    return out
