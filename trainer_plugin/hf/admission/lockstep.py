"""Whether a model's ranks must probe together, and their agreement
(:func:`~treepack.trainer.hf.admission.probe.verify_packing`).

A model sharded over the ranks (FSDP, FSDP2, DTensor parameters) runs each forward as a
collective: a probe that ran on one rank alone would leave the ranks' all-gathers out of step.
"""

from __future__ import annotations

import sys

import torch

from treepack.trainer.distributed import comm_device

__all__ = ["lockstep_ranks", "on_any_rank"]


def lockstep_ranks(hf: torch.nn.Module) -> bool:
    """Whether ``hf``'s forwards are collectives over the default process group: more than one
    rank, and its parameters sharded (FSDP or FSDP2 modules, or DTensor parameters). Read on
    every call: sharding wraps a model in place, after any earlier call."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = tuple(k for k in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)) if k)
    if kinds and any(isinstance(m, kinds) for m in hf.modules()):
        return True
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and any(isinstance(p, dtensor) for p in hf.parameters())


def on_any_rank(flag: bool) -> bool:
    """``flag`` OR-ed over the ranks of the default process group (one all-reduce)."""
    t = torch.tensor([int(flag)], dtype=torch.int64, device=comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())
