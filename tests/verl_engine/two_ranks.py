"""One rank of the 2-rank parity check (``test_two_ranks.py`` starts two of these).

    python two_ranks.py RANK INIT_FILE MODEL_DIR OUT_DIR

Two gloo ranks, FSDP2 over both (parameters sharded, gradients reduced by FSDP2). Each rank
builds the stock engine and ``TreepackFSDPEngine`` from ``MODEL_DIR`` and takes its half of
one GRPO batch (verl's dispatch split, ``chunk_tensordict``). ``infer_batch``: log-probs and
entropies at the response positions, stock vs treepack, on each rank. ``train_batch``
(SGD lr 1, no clipping, ``global_batch_size`` the whole batch): the update (the gradient
after FSDP2's reduction) of both engines, gathered to full tensors. Rank 0 writes
``OUT_DIR/result.pt``: the errors and both updates, and how many plans ``validate_plan``
checked on this rank (every plan the engine made, as in the test process).
"""

from __future__ import annotations

import os
import sys

RANK, INIT_FILE, MODEL_DIR, OUT_DIR = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
WORLD = 2
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
os.environ.update(RANK=str(RANK), LOCAL_RANK=str(RANK), WORLD_SIZE=str(WORLD))

import cpu_shim  # noqa: E402

cpu_shim.install(rank=RANK, world_size=WORLD, init_file=INIT_FILE)

import torch  # noqa: E402
from engines import build, flags, grpo_batch, response_values, update  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

import treepack.service.planner.api as api  # noqa: E402
from treepack.service.planner.validate import validate_plan  # noqa: E402
from treepack.trainer.verl import TreepackFSDPEngine  # noqa: E402

VALIDATED = [0]
_original = api.plan_with_tree


def _checked(batch, options, **kwargs):
    result = _original(batch, options, **kwargs)
    validate_plan(result.plan, batch, dense_check_max=512)
    VALIDATED[0] += 1
    return result


for _name, _mod in list(sys.modules.items()):
    if _name.startswith("treepack.") and getattr(_mod, "plan_with_tree", None) is _original:
        _mod.plan_with_tree = _checked


def half(td):
    """This rank's half of the batch, as verl's data-parallel dispatch splits it."""
    return tu.chunk_tensordict(td, WORLD)[RANK]


def infer(eng):
    td = flags(
        half(grpo_batch(groups=4, n=4, seed=1)),
        dynamic=False,
        rmpad=True,
        temperature=0.7,
        calculate_entropy=True,
        compute_loss=False,
    )
    return response_values(eng, td)


def update_of(eng):
    return update(
        eng,
        flags(
            half(grpo_batch(groups=4, n=4, seed=2)),
            dynamic=False,
            rmpad=True,
            calculate_entropy=False,
            global_batch_size=16,
        ),
        undo=False,
    )


def main() -> None:
    stock, tree = build(FSDPEngineWithLMHead, path=MODEL_DIR), build(TreepackFSDPEngine, path=MODEL_DIR)
    lp_ref, ent_ref, _ = infer(stock)
    lp, ent, metrics = infer(tree)
    errs = torch.stack([(lp - lp_ref).abs().max(), (ent - ent_ref).abs().max()])
    saved = torch.tensor(min(metrics["treepack/saved_fraction"].values))
    ref, got = update_of(stock), update_of(tree)
    # The worst log-prob / entropy error over both ranks, the smallest saving.
    torch.distributed.all_reduce(errs, op=torch.distributed.ReduceOp.MAX)
    torch.distributed.all_reduce(saved, op=torch.distributed.ReduceOp.MIN)
    if RANK == 0:
        torch.save(
            {
                "logp_err": float(errs[0]),
                "entropy_err": float(errs[1]),
                "saved_min": float(saved),
                "stock": ref,
                "tree": got,
                "validated": VALIDATED[0],
                "ref_logp_max": float(lp_ref.abs().max()),
            },
            os.path.join(OUT_DIR, "result.pt"),
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
