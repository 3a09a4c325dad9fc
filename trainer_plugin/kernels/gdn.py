"""Gated DeltaNet on tree rows (SPEC section 7).

A recurrent layer has no mask: tree packing is exact only if every segment starts from
the state its sequence would have there. GDN runs on the one tree-scan mechanism of
:mod:`treepack.trainer.kernels.tree_scan` (its schedule is a
:class:`~treepack.trainer.kernels.tree_scan.TreeSchedule`); per depth level:

- the short causal conv (:func:`tree_causal_conv1d`): one varlen conv call over the
  level's segments, each preceded by its W-1 conv context from its ancestor chain (across
  ancestors shorter than W-1), never a sibling or another tree; roots are zero-padded as
  at a sequence start.
- the chunked gated delta rule (:func:`tree_gated_delta_rule`): one varlen call per level
  (``cu_seqlens``), each segment's initial state indexed from its parent's final state of
  the previous level (roots start from zeros); the backward index-adds every child's state
  gradient into its parent. flash-linear-attention's ``chunk_gated_delta_rule`` on CUDA
  (bf16/fp16), the pure-torch
  :func:`~treepack.trainer.kernels.gdn_ref.torch_chunk_gated_delta_rule` elsewhere.

Tensors are flat over rows: position ``row * seq_len + i`` (N = R * C). Outputs start as
NaN and only real tokens are written; padding gets zeros (a pad token is a sequence of its
own, and NaN there would leak through ``0 * NaN`` in later attention matmuls).

:func:`naive_tree_causal_conv1d` and :func:`naive_tree_gated_delta_rule` are the loop-based
references (segment by segment, walking parent pointers); tests compare both paths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.plan import Plan
from treepack.trainer.kernels.gdn_ref import naive_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv, tree_scan

__all__ = [
    "tree_causal_conv1d",
    "naive_tree_causal_conv1d",
    "tree_gated_delta_rule",
    "naive_tree_gated_delta_rule",
    "select_kernel",
]

Kernel = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise RequestError(
        f"conv activation must be None, 'silu' or 'swish', got {activation!r}", path="$.activation", rule="enum"
    )


def _check_conv(x: torch.Tensor, weight: torch.Tensor, n: int, width: int) -> None:
    if x.dim() != 2 or x.shape[0] != n:
        raise RequestError(
            f"x must be [N, D] with N = rows * seq_len = {n}, got {tuple(x.shape)}", path="$.x", rule="shape"
        )
    if weight.shape != (x.shape[1], width):
        raise RequestError(
            f"weight must be [D, W] = {(x.shape[1], width)}, got {tuple(weight.shape)}",
            path="$.weight",
            rule="shape",
        )


def tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    schedule: TreeSchedule,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal conv of width W along every token's ancestor chain.

    Runs through :func:`~treepack.trainer.kernels.tree_scan.tree_conv`.

    Args:
        x: [N, D] flat row inputs.
        weight: [D, W] per-channel taps, oldest input first (``nn.Conv1d.weight[:, 0]``),
            W at most the plan's ``conv_width``.
        bias: [D] or None.
        schedule: from :func:`~treepack.trainer.kernels.tree_scan.tree_schedule`.
        activation: None, ``silu`` or ``swish`` (applied after the bias).

    Returns:
        [N, D] in the compute dtype of ``x`` and ``weight`` (padding positions see only
        themselves, like a one-token sequence).
    """
    return tree_conv(x, weight, bias, schedule, activation)


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
        chain: list[int] = []
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
            return torch_chunk_gated_delta_rule

        def fla_kernel(
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
        ):
            # Grouped values: repeat q/k heads ourselves (as HF's fallback does), so the
            # head mapping does not depend on the installed fla version.
            if v.shape[2] != q.shape[2]:
                q = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
                k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
            return chunk_gated_delta_rule(
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

        return fla_kernel
    return torch_chunk_gated_delta_rule


def _check_flat(q, k, v, g, beta, n: int) -> None:
    for name, t, d in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"expected a torch.Tensor, got {type(t).__name__}", path=f"$.{name}", rule="type")
        if t.dim() != d or t.shape[0] != n:
            raise RequestError(
                f"{name} must be {d}-D with N = rows * seq_len = {n} first, got {tuple(t.shape)}",
                path=f"$.{name}",
                rule="shape",
            )


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: TreeSchedule,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """The gated delta rule over tree rows: one varlen kernel call per depth level.

    Args:
        q, k: [N, Hk, K] flat row tokens. v: [N, Hv, V]. g, beta: [N, Hv].
        schedule: from :func:`~treepack.trainer.kernels.tree_scan.tree_schedule`.
        scale, use_qk_l2norm_in_kernel: as fla's ``chunk_gated_delta_rule``.
        kernel: a function with fla's signature; default :func:`select_kernel`.

    Returns:
        o: [N, Hv, V] in q's dtype; zeros at padding.
    """
    N = schedule.num_positions
    _check_flat(q, k, v, g, beta, N)
    kernel = select_kernel(q) if kernel is None else kernel

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
            q[t][None],
            k[t][None],
            v[t][None],
            g[t][None],
            beta[t][None],
            scale=scale,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        assert fin is not None, "output_final_state=True returns the final state"
        out[t] = o[0]
        states[s] = fin[0]
    return out
