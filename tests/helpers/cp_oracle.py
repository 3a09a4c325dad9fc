"""The context-parallel oracle shared by the CP tests (tests/e2e): one rank's step against one process.

Every rank of a gloo group (spawned by :func:`helpers.ranks.run_ranks`) materializes the
hand-made batch (:func:`helpers.trainer_cases.mixed_batch`) twice: whole rows as one process
would, and its own CP shard of every row. For each model it runs the reference step (whole
rows, PPO-clip loss, backward) and the CP step (its shard, the same loss normalized over
the whole batch, backward); the CP step's loss summed over the group and its gradients
summed over the group must equal the reference's. The workers write plain numbers
(:func:`step_record`, :func:`shard_record`); the test process checks them
(:func:`assert_step_matches`, :func:`assert_shard_size`, :func:`assert_same_summed_loss`).

Worker flow::

    with gloo_group(rank, port, world, timeout_s=90):
        s = shard_mixed_batch(world, cp_attention="auto")
        ref = reference_step(build, s)
        model = build()
        record = step_record(model, s, ref)          # CP forward, loss, backward, summed grads
        write_result(out_dir, rank, {**shard_record(s), "runs": [record]})
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from helpers.trainer_cases import mixed_batch, plan_of

# Logprobs absolute, the summed loss relative to max(1, |loss|), every parameter's summed
# gradient relative to its reference's largest entry.
TOL = 1e-5
# A negative control must miss the reference by more than this (far above TOL).
CONTROL_GAP = 1e-3


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world: int, timeout_s: float) -> Iterator[None]:
    """The default process group of ``world`` gloo ranks on 127.0.0.1, one thread each
    (ranks share a small machine), destroyed on the way out.

    Args:
        rank, port: as :func:`helpers.ranks.run_ranks` passes them.
        world: number of ranks.
        timeout_s: gloo's collective timeout: a rank stuck waiting fails instead of hanging.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def write_result(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    """Write this rank's ``rank{rank}.json`` (what :func:`helpers.ranks.run_ranks` reads),
    then wait for every rank, so none tears the group down under another's collective."""
    import torch.distributed as dist

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Shards:
    """The mixed batch on one rank: whole rows and this rank's CP shard of them.

    Attributes:
        cp: this rank's ``ContextParallel`` over the default group.
        plan: the CP plan (``cp_size`` = world); same rows as the one-process plan.
        full: the one-process batch of whole rows, ``[K, seq_len]``.
        mine: this rank's shard of every row, ``[K, shard_len]``.
        adv: ``[num_sequences]`` float64 advantages; ``full`` and ``mine`` carry the same
            ``"old"`` logprobs payload.
    """

    cp: Any
    plan: Any
    full: Any
    mine: Any
    adv: torch.Tensor


def shard_mixed_batch(world: int, **plan_kw: Any) -> Shards:
    """Plan :func:`~helpers.trainer_cases.mixed_batch` for one process and for ``world`` CP
    ranks (``plan_kw``: e.g. ``cp_attention``), both validated, and materialize both.

    Raises:
        AssertionError: the CP plan put segments in other rows than the one-process plan
            (the reference would then be another batch).
    """
    from treepack.trainer import ContextParallel, materialize

    cp = ContextParallel()
    c = mixed_batch()
    plan1 = plan_of(c)
    plan = plan_of(c, cp_size=world, **plan_kw)
    assert np.array_equal(plan.segments.row, plan1.segments.row)
    rng = np.random.default_rng(7)
    old = [rng.normal(-4.6, 0.4, len(s)) for s in c["sequences"]]
    adv = torch.from_numpy(rng.normal(0, 1, len(c["sequences"])))
    full = materialize(plan1, c["sequences"], payloads={"old": old})
    mine = materialize(plan, c["sequences"], payloads={"old": old}, cp=cp)
    return Shards(cp=cp, plan=plan, full=full, mine=mine, adv=adv)


def shard_record(s: Shards) -> dict[str, Any]:
    """What :func:`assert_shard_size` checks: the row length, the shard length and alignment,
    the shard batch's shape, and how many entries the shard scores."""
    from treepack.proto.options import CP_ALIGN

    return {
        "seq_len": s.plan.seq_len,
        "shard_len": s.plan.ranks.shard_len,
        "align": CP_ALIGN,
        "shape": list(s.mine.input_ids.shape),
        "entries": s.mine.num_scored,
    }


def ppo_loss(batch: Any, logits: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """The PPO-clip loss of ``batch``'s scored entries (``"old"`` payload, sequence
    normalization counted over the whole batch), so CP shards' losses sum to the whole one."""
    from treepack.trainer.losses import ppo_clip_loss

    return ppo_clip_loss(
        batch.target_logprobs(logits), batch, advantages=adv, old_logprobs="old", normalization="sequence"
    )


def detached(lps: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Per-sequence logprobs (``unpack_logprobs``) cut from the graph."""
    return [None if x is None else x.detach() for x in lps]


def lp_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """Largest ``|a - b|`` over the scored positions of per-sequence logprobs.

    Returns:
        The difference; inf where NaN (unscored) sits at other places in ``a`` than in
        ``b`` (a broken shard, or a control that lost positions).

    Raises:
        AssertionError: a sequence is None (not materialized) on one side only.
    """
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
            continue
        if not torch.equal(torch.isnan(x), torch.isnan(y)):
            return float("inf")
        m = ~torch.isnan(x)
        if m.any():
            worst = max(worst, float((x[m] - y[m]).abs().max()))
    return worst


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Reference:
    """The one-process step: ``model`` after backward (its ``.grad`` set), per-sequence
    logprobs ``lp`` and the loss."""

    model: torch.nn.Module
    lp: list[torch.Tensor | None]
    loss: float


def reference_step(build: Callable[[], torch.nn.Module], s: Shards) -> Reference:
    """Build a model and run the one-process step on whole rows: forward, loss, backward."""
    from treepack.trainer.hf import packed_forward

    model = build()
    logits = packed_forward(model, s.full, verify=False)  # the test is its own oracle
    lp = detached(s.full.unpack_logprobs(logits))
    loss = ppo_loss(s.full, logits, s.adv)
    loss.backward()
    return Reference(model=model, lp=lp, loss=float(loss.detach()))


def summed_grad_rel(model: torch.nn.Module, ref_model: torch.nn.Module) -> tuple[float, int]:
    """Sum ``model``'s gradients over the group and compare with ``ref_model``'s.

    A parameter without a gradient on this rank counts as zeros (its layer touched nothing
    of this shard); one whose reference gradient is all zero is not compared. The gradients
    travel as one flat tensor: one collective, not one per parameter (each collective waits
    for every rank to be scheduled, which dominates on a loaded machine).

    Returns:
        (the largest ``max |summed - ref| / max |ref|`` over parameters, how many were compared)
    """
    import torch.distributed as dist

    pairs = list(zip(model.named_parameters(), ref_model.named_parameters(), strict=True))
    assert all(n == m for (n, _), (m, _) in pairs), [(n, m) for (n, _), (m, _) in pairs if n != m]
    grads = [torch.zeros_like(q) if p.grad is None else p.grad.detach() for (_, p), (_, q) in pairs]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    rel, checked = 0.0, 0
    for g, (_, (_, q)) in zip(flat.split([g.numel() for g in grads]), pairs):
        scale = 0.0 if q.grad is None else float(q.grad.abs().max())
        if scale > 0:
            checked += 1
            rel = max(rel, float((g.view_as(q) - q.grad).abs().max()) / scale)
    return rel, checked


def step_record(
    model: torch.nn.Module,
    s: Shards,
    ref: Reference,
    *,
    grads: bool = True,
    around_backward: contextlib.AbstractContextManager | None = None,
    **forward_kw: Any,
) -> dict[str, Any]:
    """Run the CP step of ``model`` (built as the reference's) on this rank's shard and
    compare it with ``ref``.

    Args:
        model: a fresh model with the reference's weights.
        s: the shards; ``ref``: :func:`reference_step` on them.
        grads: False for forward only (the logprobs and the loss are still compared).
        around_backward: a context the backward runs in (e.g. one counting calls).
        forward_kw: to ``packed_forward`` (``backend=``, ``varlen_fn=``, ...).

    Returns:
        Plain numbers for :func:`assert_step_matches`: ``logits_shape``, ``lp_diff``,
        ``loss`` (summed over the group), ``ref_loss``, ``grads``, ``grad_rel``,
        ``grads_checked``.
    """
    import torch.distributed as dist

    from treepack.trainer.hf import packed_forward

    with torch.set_grad_enabled(grads):
        logits = packed_forward(model, s.mine, verify=False, **forward_kw)
        lps = detached(s.mine.unpack_logprobs(logits.detach()))
        loss = ppo_loss(s.mine, logits, s.adv)
    total = loss.detach().clone()
    dist.all_reduce(total)
    rel, checked = 0.0, 0
    if grads:
        with around_backward or contextlib.nullcontext():
            loss.backward()
        rel, checked = summed_grad_rel(model, ref.model)
    return {
        "logits_shape": list(logits.shape),
        "lp_diff": lp_diff(lps, ref.lp),
        "loss": float(total),
        "ref_loss": ref.loss,
        "grads": grads,
        "grad_rel": rel,
        "grads_checked": checked,
    }


def assert_shard_size(r: dict[str, Any], world: int) -> None:
    """Each rank holds 1/cp of every row, plus less than one aligned tile of padding, and
    scores something (``r``: :func:`shard_record`)."""
    C, Ls, align = r["seq_len"], r["shard_len"], r["align"]
    assert r["shape"][1] == Ls and Ls % align == 0, r
    assert C <= world * Ls < C + world * align, r
    assert r["entries"] > 0, r


def assert_step_matches(f: dict[str, Any], shard_len: int, what: Any) -> None:
    """The CP step equals the one-process step (``f``: :func:`step_record`): local logits of
    the shard's length, logprobs, the summed loss and (when run) the summed gradients
    within :data:`TOL`, over more than 10 parameters."""
    assert f["logits_shape"][1] == shard_len, (what, f)
    assert f["lp_diff"] <= TOL, (what, f)
    assert abs(f["loss"] - f["ref_loss"]) <= TOL * max(1.0, abs(f["ref_loss"])), (what, f)
    assert not f["grads"] or (f["grad_rel"] <= TOL and f["grads_checked"] > 10), (what, f)


def assert_same_summed_loss(records: list[dict[str, Any]]) -> None:
    """The group's summed loss is the same number on every rank (one step's records, rank order)."""
    assert len({f["loss"] for f in records}) == 1, records
