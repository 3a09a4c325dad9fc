"""Context-parallel shards: one CP rank's share of every row of a whole-row batch.

:func:`cp_shard` cuts a :class:`~treepack.trainer.data.packed_batch.PackedBatch` of whole
rows into CP rank ``cp.rank``'s shard (the layout is the plan's ``ranks``, see the
:mod:`~treepack.trainer.data.packed_batch` docstring); :func:`cp_strategy` settles the
attention strategy between the plan and the group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["cp_shard", "cp_strategy"]


def _fill_of(x: torch.Tensor) -> Any:
    return float("nan") if x.dtype.is_floating_point else (False if x.dtype == torch.bool else -1)


def cp_shard(full: PackedBatch, cp: Any, pad_id: int = 0) -> PackedBatch:
    """CP rank ``cp.rank``'s shard of a whole-row batch (see :class:`PackedBatch`).

    The rows are padded to ``cp_size * shard_len`` (pad id, position 0, each padding
    position seeing only itself, nothing scored) and cut at ``[rank * shard_len, (rank + 1) *
    shard_len)``; the scored entries are those whose position lies in the shard.
    """
    if full.images is not None:
        raise RequestError(
            "images are not supported under context parallelism (the vision tower runs on whole sequences)",
            path="$.cp",
            rule="unsupported",
        )
    plan = full.plan
    K, C = full.num_rows, plan.seq_len
    Ls = plan.ranks.shard_len
    Lp = cp.size * Ls
    positions = torch.from_numpy(plan.ranks.shard_positions(full.rows)).to(full.device)  # [P, K, Ls]
    mine = positions[cp.rank]

    def cut(x: torch.Tensor, fill: Any) -> torch.Tensor:
        pad = torch.full((K, Lp - C, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        idx = mine.view(K, Ls, *([1] * (x.ndim - 2))).expand(K, Ls, *x.shape[2:])
        return torch.cat([x, pad], dim=1).gather(1, idx).contiguous()

    se_pad = torch.arange(C + 1, Lp + 1, dtype=torch.int64, device=full.device).repeat(K, 1)
    subtree_end = torch.cat([full.subtree_end, se_pad], dim=1).gather(1, mine)
    # Column of each row position in this shard (-1: held by another rank).
    column = torch.full((K, Lp), -1, dtype=torch.int64, device=full.device)
    column.scatter_(1, mine, torch.arange(Ls, device=full.device).expand(K, Ls).contiguous())
    row, col = full.score_flat // C, column[full.score_flat // C, full.score_flat % C]
    keep = col >= 0
    local_flat = row * Ls + col
    return PackedBatch(
        plan=plan,
        rows=full.rows,
        input_ids=cut(full.input_ids, int(pad_id)),
        position_ids=cut(full.position_ids, 0),
        subtree_end=subtree_end,
        targets=cut(full.targets, -1),
        loss_mask=cut(full.loss_mask, False),
        owner=cut(full.owner, -1),
        payloads={k: cut(v, _fill_of(v)) for k, v in full.payloads.items()},
        entry_payloads={k: v[keep] for k, v in full.entry_payloads.items()},
        local_seqs=full.local_seqs,
        seq_ptr=full.seq_ptr,
        seq_flat=full.seq_flat,
        score_seq=full.score_seq[keep],
        score_pos=full.score_pos[keep],
        score_flat=local_flat[keep],
        score_target=full.score_target[keep],
        score_counts=full.score_counts,
        groups=full.groups,
        device=full.device,
        cp=cp,
        cp_full=dataclasses.replace(full, payloads={}, entry_payloads={}),
        cp_positions=positions,
        cp_strategy=cp_strategy(plan, cp),
    )


def cp_strategy(plan: Any, cp: Any) -> str:
    """The attention strategy of ``plan`` (``ranks.cp_attention``) run by group ``cp``:
    the plan's, or the group's where the plan says ``"auto"``.

    Raises:
        RequestError: the plan and the group name different strategies.
    """
    planned, asked = plan.ranks.cp_attention, getattr(cp, "strategy", "auto")
    if planned != "auto" and asked not in ("auto", planned):
        raise RequestError(
            f"the plan was made for cp_attention={planned!r}, the ContextParallel group asks for {asked!r}: "
            "plan with the group's strategy, or leave one of them 'auto'",
            path="$.cp.strategy",
            rule="cp_strategy",
        )
    if asked == "ulysses" and not plan.ranks.contiguous:
        raise RequestError(
            "Ulysses attention needs contiguous CP shards; this plan's split is balanced for all-gather",
            path="$.cp.strategy",
            rule="cp_strategy",
        )
    return asked if planned == "auto" else planned
