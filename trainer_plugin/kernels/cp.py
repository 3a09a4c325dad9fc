"""Context parallelism: the group, and the autograd-correct collectives the CP path moves tensors with.

A :class:`ContextParallel` wraps a ``torch.distributed`` process group of ``size`` ranks
that share every row: CP rank ``k`` holds ``shard_len`` positions of each row, ``[k *
shard_len, (k + 1) * shard_len)`` for contiguous shards, the plan's tiles under the
all-gather split (``Ranks.shard_positions``). Following Megatron's and torchtitan's
convention, the CP group is the inner dimension of a data-parallel x context-parallel mesh:
the rows of one data-parallel rank (``plan.ranks.rank_rows[dp_rank]``) are materialized by
every rank of its CP group, each taking its shard.

The collectives are ``torch.autograd.Function`` s whose backward is the adjoint collective,
so gradients cross ranks exactly (any backend with ``all_to_all_single``, ``all_gather``
and ``all_reduce``; gloo on CPU included):

- :func:`seq_to_heads` ``[K, H, Ls, D] -> [K, H/P, P*Ls, D]`` (Ulysses' first all-to-all;
  backward :func:`heads_to_seq`), and :func:`heads_to_seq`, its inverse;
- :func:`gather_seq` ``[K, Ls, ...] -> [K, P*Ls, ...]`` (all-gather along the row, shards
  in rank order; backward: reduce-scatter of the gradient, every rank may use the whole
  gathered tensor; on gloo, which has no reduce-scatter, all-reduce then this rank's slice);
- for the recurrent and conv mixers, :func:`rows_of_heads` ``[K, Ls, H, D] -> [K*C, H/P, D]``
  (the flat whole-row layout of the tree scans, CP padding dropped) and its inverse
  :func:`shards_of_heads`, built on the two all-to-alls, and :func:`tree_conv_heads`, a
  depthwise tree conv over concatenated per-head channels run on this rank's heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ContextParallel",
    "seq_to_heads",
    "heads_to_seq",
    "gather_seq",
    "rows_of_heads",
    "shards_of_heads",
    "tree_conv_heads",
    "head_slice",
    "divide_refusal",
    "CP_STRATEGIES",
]

CP_STRATEGIES = ("ulysses", "allgather")


class ContextParallel:
    """A context-parallel group: the ranks that split every row between them.

    Args:
        group: a ``torch.distributed`` process group (None: the default group).
        strategy: how attention runs under CP: ``"ulysses"`` (each rank runs whole-row
            tree attention for ``H / size`` heads after an all-to-all; layers whose heads
            do not divide are refused by name), ``"allgather"`` (each rank keeps its
            queries and attends over keys and values gathered from the group), or
            ``"auto"``: the plan's ``cp_attention``, and where that is ``"auto"`` too, per
            layer Ulysses where the heads divide by ``size``, else all-gather. A plan
            made for one strategy is refused with a group asking for the other.

    Attributes:
        group: the process group. size: its ranks. rank: this rank's index in it.
        strategy: the attention strategy chosen.
    """

    def __init__(self, group: Any = None, *, strategy: str = "auto") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ContextParallel needs an initialized torch.distributed process group (dist.init_process_group)"
            )
        if strategy not in ("auto", *CP_STRATEGIES):
            raise ValueError(f"strategy must be 'auto' or one of {CP_STRATEGIES}, got {strategy!r}")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.strategy = strategy

    def __repr__(self) -> str:
        return f"ContextParallel(size={self.size}, rank={self.rank}, strategy={self.strategy!r})"


def _a2a(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    K, H, Ls, D = x.shape
    P = cp.size
    send = x.reshape(K, P, H // P, Ls, D).permute(1, 0, 2, 3, 4)  # chunk j -> rank j (its heads)
    recv = _a2a(send, cp.group)  # chunk i: rank i's sequence shard of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(K, H // P, P * Ls, D)


def _heads_to_seq(y: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    K, Hp, L, D = y.shape
    P = cp.size
    Ls = L // P
    send = y.reshape(K, Hp, P, Ls, D).permute(2, 0, 1, 3, 4)  # chunk j: sequence shard j of my heads
    recv = _a2a(send, cp.group)  # chunk i: my sequence shard of rank i's heads
    return recv.permute(1, 0, 2, 3, 4).reshape(K, P * Hp, Ls, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        return _seq_to_heads(x, cp)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(g, ctx.cp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        return _heads_to_seq(y, cp)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(g, ctx.cp), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        x = x.contiguous()
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(cp.size)]
        dist.all_gather(parts, x, group=cp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        cp = ctx.cp
        K, Ls = g.shape[0], g.shape[1] // cp.size
        if dist.get_backend(cp.group) != "gloo":
            # Shard j of every row to rank j, summed over the group: one reduce-scatter.
            send = g.reshape(K, cp.size, Ls, *g.shape[2:]).transpose(0, 1).contiguous()
            out = send.new_empty(send.shape[1:])
            dist.reduce_scatter_tensor(out, send, group=cp.group)
            return out, None
        g = g.contiguous()
        dist.all_reduce(g, group=cp.group)
        return g[:, cp.rank * Ls : (cp.rank + 1) * Ls].contiguous(), None


def seq_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """``[K, H, Ls, D]`` sequence shards of all heads -> ``[K, H/P, P*Ls, D]`` whole rows of
    this rank's heads (``H`` divisible by ``P``; heads ``rank*H/P ..`` are this rank's)."""
    return _SeqToHeads.apply(x, cp)


def heads_to_seq(y: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[K, H/P, P*Ls, D] -> [K, H, Ls, D]``."""
    return _HeadsToSeq.apply(y, cp)


def gather_seq(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """``[K, Ls, ...]`` -> ``[K, P*Ls, ...]``: every rank's shard, in rank order."""
    return _GatherSeq.apply(x, cp)


def rows_of_heads(x: torch.Tensor, cp: ContextParallel, seq_len: int) -> torch.Tensor:
    """A mixer's per-head tensor from sequence shards to whole rows of this rank's heads.

    ``[K, Ls, H, D]`` (this rank's shard of every row, all heads) -> ``[K * seq_len, H/P, D]``
    (flat whole rows, the layout the tree scans take; heads ``rank*H/P ..`` only); the CP
    padding past ``seq_len`` is dropped. Autograd-correct (:func:`seq_to_heads`).
    """
    K, _, H, D = x.shape
    y = seq_to_heads(x.transpose(1, 2), cp)[:, :, :seq_len]
    return y.transpose(1, 2).reshape(K * seq_len, H // cp.size, D)


def shards_of_heads(y: torch.Tensor, cp: ContextParallel, num_rows: int, shard_len: int) -> torch.Tensor:
    """The inverse of :func:`rows_of_heads`: ``[K * seq_len, H/P, D] -> [K, shard_len, H, D]``.

    The CP padding positions (past ``seq_len``) come back as zeros: nothing reads them.
    """
    N, Hp, D = y.shape
    C = N // num_rows
    y = y.reshape(num_rows, C, Hp, D).transpose(1, 2)
    pad = cp.size * shard_len - C
    if pad:
        y = torch.cat([y, y.new_zeros(num_rows, Hp, pad, D)], dim=2)
    return heads_to_seq(y, cp).transpose(1, 2)


def tree_conv_heads(
    parts: list[torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    schedule: Any,
    cp: ContextParallel,
    seq_len: int,
    activation: str | None = None,
) -> list[torch.Tensor]:
    """A depthwise tree conv over concatenated per-head channels, on whole rows of this rank's heads.

    The stock layers convolve ``cat(parts)`` channel by channel (q, k and v of a delta
    rule; x, B and C of Mamba2); a depthwise conv is independent per channel, so each part
    goes to whole rows of its ``H_i / P`` heads (:func:`rows_of_heads`) and one tree conv
    runs on those channels with the matching rows of ``weight`` and ``bias``.

    Args:
        parts: ``[K, Ls, H_i, d_i]`` this rank's shard of every row, in the order their
            channels have in ``weight``; every ``H_i`` divisible by ``cp.size``.
        weight: ``[sum H_i * d_i, W]`` the conv taps (``conv1d.weight[:, 0]``). bias: ``[sum H_i * d_i]`` or None.
        schedule: the whole rows' tree schedule. seq_len: the plan's row length.
        activation: as :func:`~treepack.trainer.kernels.tree_scan.tree_conv`.

    Returns:
        ``[K * seq_len, H_i / P, d_i]`` per part, in the dtype of the parts.
    """
    from treepack.trainer.kernels.tree_scan import tree_conv

    sizes = [x.shape[2] * x.shape[3] for x in parts]
    rows = [rows_of_heads(x, cp, seq_len) for x in parts]
    mine = [head_slice(x.shape[2], cp) for x in parts]
    W = weight.shape[-1]
    w = torch.cat(
        [p.reshape(x.shape[2], -1, W)[h].reshape(-1, W) for p, x, h in zip(torch.split(weight, sizes), parts, mine)]
    )
    b = (
        None
        if bias is None
        else torch.cat(
            [p.reshape(x.shape[2], -1)[h].reshape(-1) for p, x, h in zip(torch.split(bias, sizes), parts, mine)]
        )
    )
    N = rows[0].shape[0]
    x = torch.cat([r.reshape(N, -1) for r in rows], dim=-1)
    out = tree_conv(x, w, b, schedule, activation).to(x.dtype)
    return [o.reshape(N, -1, r.shape[2]) for o, r in zip(torch.split(out, [r[0].numel() for r in rows], dim=-1), rows)]


def head_slice(num_heads: int, cp: ContextParallel) -> slice:
    """The heads (or channels) of ``num_heads`` this rank runs after :func:`rows_of_heads`."""
    n = num_heads // cp.size
    return slice(cp.rank * n, (cp.rank + 1) * n)


def divide_refusal(what: str, count: int, cp_size: int) -> str | None:
    """Why ``count`` ``what`` (heads, channels) cannot be dealt to ``cp_size`` ranks, or None."""
    if count % cp_size:
        return (
            f"{count} {what} do not divide over {cp_size} context-parallel ranks "
            f"(each rank runs whole rows of {what} / cp)"
        )
    return None
