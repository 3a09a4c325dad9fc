"""DDP and FSDP2 over the data-parallel dimension of a 2 x 2 (dp, cp) mesh of gloo ranks equal one process.

Four ranks build ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))``;
``plan_and_broadcast(mesh=...)`` plans on rank 0 with ``num_ranks`` 2 (DP) and ``cp_size``
2, deals rows to the DP ranks and splits each over its CP group; every rank materializes
its shard of its DP rank's rows and steps a model wrapped three ways (``WRAPS``): DDP over
the ``dp`` group, FSDP2 over ``mesh["dp"]`` and FSDP2 over the dp and cp dimensions
flattened. The wrappers average over the ranks they span, so each rank's loss (normalized
over the whole batch) is scaled by their number; where the wrapper spans dp only, the CP
group's gradients are summed. The summed loss and the gradients must equal one process
running every row (1e-5). ``plan_microbatches(mesh=)`` gives the same plan and rows. A
model with 3 query heads runs all-gather attention. Negative control: the gradients
without the CP reduction differ.
"""

from __future__ import annotations

import numpy as np
import torch

from helpers import cp_oracle as oracle
from helpers.ranks import run_ranks
from helpers.trainer_cases import mixed_batch, plan_of, tiny_model

TIMEOUT_S = 420  # a safety net on a loaded machine; the runs take far less


# How each rank's model is wrapped, and over which ranks its gradients are averaged:
# "ddp": DDP over the dp group, the CP group's gradients then summed by hand;
# "fsdp2": FSDP2 (``fully_shard`` per decoder layer and the root) over ``mesh["dp"]``, its
# gradient shards then summed over the CP group; "fsdp2_dp_cp": FSDP2 over the dp and cp
# dimensions flattened (torchtitan's ``dp_shard_cp``), which averages over all four ranks
# and needs no separate CP reduction.
WRAPS = ("ddp", "fsdp2", "fsdp2_dp_cp")


def _wrap(kind, model, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind == "ddp":
        return DDP(model, process_group=mesh.get_group("dp")), mesh.size(0)
    shard_mesh = mesh["dp"] if kind == "fsdp2" else mesh["dp", "cp"]._flatten("dp_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model, shard_mesh.size()


def _grads(model, cp_group):
    """Each parameter's whole gradient (FSDP2's shards gathered): as the wrapper left it, and
    summed over ``cp_group`` (None: left as is)."""
    import torch.distributed as dist

    raw, summed = {}, {}
    for n, p in model.named_parameters():
        g = p.grad
        local = g.to_local() if hasattr(g, "to_local") else g
        raw[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        if cp_group is not None:
            dist.all_reduce(local, group=cp_group)
        summed[n.replace("module.", "")] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return {n.replace("module.", ""): g for n, g in raw.items()}, summed


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from treepack.proto.plan_wire import plan_differences
    from treepack.trainer import materialize
    from treepack.trainer.distributed import plan_and_broadcast
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.planning import plan_microbatches

    with oracle.gloo_group(rank, port, 4, timeout_s=90):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        c = mixed_batch()
        seqs = c["sequences"]
        rng = np.random.default_rng(7)
        old = [rng.normal(-4.6, 0.4, len(s)) for s in seqs]
        adv = torch.from_numpy(rng.normal(0, 1, len(seqs)))
        kw = dict(seq_len=64, min_shared_len=6)
        req = dict(trainable=c["trainable"], groups=c["groups"]) if rank == 0 else {}
        rp = plan_and_broadcast(seqs if rank == 0 else None, mesh=mesh, **kw, **req)
        mb = plan_microbatches(seqs, num_microbatches=1, mesh=mesh, trainable=c["trainable"], groups=c["groups"], **kw)
        same_plan = (
            plan_differences(rp.plan, mb.plan) == []
            and np.array_equal(mb.rows[mb.dp_rank, 0], rp.rows)
            and mb.dp_rank == rp.rank
        )
        batch = rp.materialize(seqs, payloads={"old": old})

        def loss_of(b, logits):
            return oracle.ppo_loss(b, logits, adv)

        # The same step in one process over all rows.
        ref_model = tiny_model("qwen3", heads=(3, 1))
        plan1 = plan_of(c)  # the same rows, not split
        assert np.array_equal(plan1.segments.row, rp.plan.segments.row)
        full = materialize(plan1, seqs, payloads={"old": old})
        ref = loss_of(full, packed_forward(ref_model, full, verify=False))
        ref.backward()
        rel = lambda gs: max(
            float((gs[n] - p.grad).abs().max() / p.grad.abs().max()) for n, p in ref_model.named_parameters()
        )  # noqa: E731

        result = {
            "dp_rank": rp.rank,
            "cp_rank": rp.cp.rank,
            "rows": rp.rows.tolist(),
            "shape": list(batch.input_ids.shape),
            "strategy": batch.cp_strategy,
            "same_plan": bool(same_plan),
            "cp_size": rp.plan.ranks.cp_size,
            "num_ranks": rp.plan.ranks.num_ranks,
            "shard_len": rp.plan.ranks.shard_len,
            "seq_len": rp.plan.seq_len,
            "ref_loss": float(ref.detach()),
            "wraps": {},
        }
        for kind in WRAPS:
            model, averaged_over = _wrap(kind, tiny_model("qwen3", heads=(3, 1)), mesh)  # 3 heads: all-gather attention
            loss = loss_of(batch, packed_forward(model, batch, verify=False))
            (loss * averaged_over).backward()  # the wrapper averages; the batch's loss is their sum
            total = loss.detach().clone()
            dist.all_reduce(total)
            raw, summed = _grads(model, mesh.get_group("cp") if kind != "fsdp2_dp_cp" else None)
            sharded = sorted({type(p).__name__ for p in model.parameters()})
            result["wraps"][kind] = {
                "loss": float(total),
                "grad_rel": rel(summed),
                "raw_grad_rel": rel(raw),
                "param_types": sharded,
            }
        oracle.write_result(out_dir, rank, result)


def test_ddp_and_fsdp2_over_a_2x2_mesh_match_one_process(tmp_path):
    results = run_ranks(_worker, tmp_path, TIMEOUT_S, nprocs=4)
    assert sorted((r["dp_rank"], r["cp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["num_ranks"] == 2 and r["cp_size"] == 2 and r["same_plan"], r
        assert r["shape"][1] == r["shard_len"] < r["seq_len"] and r["strategy"] == "auto"
        assert sorted(r["wraps"]) == sorted(WRAPS)
        for kind, w in r["wraps"].items():
            assert abs(w["loss"] - r["ref_loss"]) <= 1e-5 * max(1.0, abs(r["ref_loss"])), (kind, w)
            assert w["grad_rel"] <= 1e-5, (kind, w)
            # FSDP2 really shards (its parameters are DTensors), DDP does not.
            assert w["param_types"] == (["Parameter"] if kind == "ddp" else ["DTensor"]), (kind, w)
            if kind != "fsdp2_dp_cp":  # the CP group's gradients must be summed
                assert w["raw_grad_rel"] > 1e-3, (kind, w)
    # Rows dealt to DP ranks: the CP ranks of one DP rank share its rows; the DP ranks hold every row once.
    by_dp = {r["dp_rank"]: r["rows"] for r in results}
    assert all(r["rows"] == by_dp[r["dp_rank"]] for r in results)
    held = sorted(x for rows in by_dp.values() for x in rows if x >= 0)
    assert held == list(range(len(held))) and len(held) >= 2
