"""Plan once per generation batch, then run it as row micro-batches.

An RL step generates a batch (all prompts x completions), then runs it as several
micro-batches (gradient accumulation) on several ranks (DDP). Planning each micro-batch
on its own would cut the batch before the tree is built and lose the sharing between
micro-batches' sequences; :func:`plan_microbatches` plans the whole batch once (each
prompt's completions in the rows of its tree) and deals the plan's rows out instead::

    mb = plan_microbatches(seqs, num_microbatches=4, seq_len=2048, trainable=prompt_lens,
                           groups=groups, num_ranks=world)
    for rows in mb.rows[rank]:                      # the same count on every rank and step
        batch = materialize(mb.plan, seqs, rows=rows, trainable=prompt_lens, groups=groups)

Every rank gets the same number of micro-batches and every micro-batch the same number of
rows (``-1`` for an empty padding row, which materializes as padding without loss), so
collectives and gradient synchronisation line up.

With a data-parallel x context-parallel ``DeviceMesh`` (``mesh=``, dims ``"dp"`` and
``"cp"``; :mod:`~treepack.trainer.planning.mesh`) the rows are dealt to the DP ranks and
every row is split over the CP group::

    mb = plan_microbatches(seqs, num_microbatches=4, seq_len=C, mesh=mesh, ...)
    for rows in mb.rows[mb.dp_rank]:
        batch = materialize(mb.plan, seqs, rows=rows, cp=mb.cp, ...)   # this rank's shard
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treepack.proto.errors import RequestError
from treepack.proto.plan import Plan
from treepack.trainer.planning.mesh import mesh_plan_options, mesh_ranks
from treepack.trainer.planning.planner import PlannerArg, obtain_plan

__all__ = ["MicroBatches", "split_rows", "plan_microbatches"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatches:
    """One plan of a whole generation batch, dealt out as row micro-batches.

    Attributes:
        plan: the plan of every sequence of the batch.
        rows: [P, M, k] int64 global rows of rank p's micro-batch m, -1 for empty padding rows.
        plan_ms: wall time of planning, milliseconds.
        dp_rank: with a mesh, this process's data-parallel rank (its rows are ``rows[dp_rank]``), else 0.
        cp: with a mesh whose CP dimension is > 1, this process's
            :class:`~treepack.trainer.kernels.cp.ContextParallel` group, else None.
    """

    plan: Plan
    rows: np.ndarray
    plan_ms: float
    dp_rank: int = 0
    cp: Any = None

    @property
    def num_microbatches(self) -> int:
        """M, micro-batches per rank."""
        return int(self.rows.shape[1])


def split_rows(plan: Plan, num_microbatches: int) -> np.ndarray:
    """Deal each rank's rows to ``num_microbatches`` micro-batches of one common size.

    Rank p's real rows (``plan.ranks.rank_rows[p]``, padding dropped) go round-robin, so
    micro-batch sizes differ by at most one row before padding; every micro-batch of every
    rank is then padded with ``-1`` to k = ceil(max real rows per rank / M).

    Args:
        plan: the plan (``plan.ranks`` holds the rank assignment).
        num_microbatches: M >= 1.

    Returns:
        [P, M, k] int64 rows (k >= 1).

    Raises:
        RequestError: M < 1.
    """
    M = int(num_microbatches)
    if M < 1:
        raise RequestError(
            f"num_microbatches must be >= 1, got {num_microbatches}", path="$.num_microbatches", rule="range"
        )
    rank_rows = plan.ranks.rank_rows
    P = rank_rows.shape[0]
    real = [r[r >= 0] for r in rank_rows]
    k = max(1, max((-(-x.shape[0] // M) for x in real), default=1))
    out = np.full((P, M, k), -1, dtype=np.int64)
    for p, rows in enumerate(real):
        for m in range(M):
            part = rows[m::M]
            out[p, m, : part.shape[0]] = part
    return out


def plan_microbatches(
    sequences: Sequence[Any],
    *,
    num_microbatches: int,
    planner: PlannerArg = None,
    mesh: Any = None,
    **plan_kwargs: Any,
) -> MicroBatches:
    """Plan a whole generation batch once and deal its rows to ranks and micro-batches.

    Args:
        sequences: every sequence of the generation batch (token id arrays).
        num_microbatches: M, micro-batches per rank (gradient accumulation steps).
        planner: as :func:`~treepack.trainer.planning.planner.obtain_plan` (None: an
            embedded ``Packer()``).
        **plan_kwargs: ``Packer.pack``'s arguments: ``seq_len`` (required),
            ``trainable``, ``groups``, ``num_ranks``, ``min_shared_len``, ...
        mesh: a DP x CP ``DeviceMesh`` (module docstring): ``num_ranks`` is then its DP
            size and ``cp_size`` its CP size (given ones must agree).

    Returns:
        The :class:`MicroBatches`.
    """
    m = None
    if mesh is not None:
        m = mesh_ranks(mesh)
        plan_kwargs = mesh_plan_options(m, plan_kwargs)
    t0 = time.perf_counter()
    plan = obtain_plan(sequences, planner=planner, **plan_kwargs)
    ms = (time.perf_counter() - t0) * 1e3
    rows = split_rows(plan, num_microbatches)
    if m is None:
        return MicroBatches(plan=plan, rows=rows, plan_ms=ms)
    return MicroBatches(plan=plan, rows=rows, plan_ms=ms, dp_rank=m.dp_rank, cp=m.cp)
