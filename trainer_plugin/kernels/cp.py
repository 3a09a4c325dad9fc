"""Context parallelism: the group, and the autograd-correct collectives the CP path moves tensors with.

A :class:`ContextParallel` wraps a ``torch.distributed`` process group of ``size`` ranks
that share every row: CP rank ``k`` holds row positions ``[k * shard_len, (k + 1) *
shard_len)`` (the plan's ``ranks.shard_len``). Following Megatron's and torchtitan's
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
  gathered tensor; on gloo, which has no reduce-scatter, all-reduce then this rank's slice).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ContextParallel", "seq_to_heads", "heads_to_seq", "gather_seq", "CP_STRATEGIES"]

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
            raise RuntimeError("ContextParallel needs an initialized torch.distributed process group (dist.init_process_group)")
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
