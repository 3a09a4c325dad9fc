"""One gloo rank of a multi-rank Megatron oracle run (started by ``test_ranks.py``, never collected).

``python ranks_worker.py RANK WORLD TP INIT_FILE OUT_DIR FAMILY...``: parallel_state with
tensor parallel size TP and data parallel size WORLD / TP; the case is planned over the DP
ranks (``num_ranks``); this rank runs its DP rank's rows through ``from_hf(hf, tp=TP)`` and
``packed_forward``, the GRPO loss on vocab-parallel logits, then sums the gradients over the
DP group as Megatron's ``finalize_model_grads`` does (:func:`oracle.reduce_grads`) and converts
them to HF names (Bridge's export gathers the TP shards). It writes ``rank{RANK}.pt``: per
family the per-sequence log-probabilities it holds, its loss, the HF-named gradients, and
(DP > 1) this rank's gradients before the DP sum (the negative control: one rank's rows alone).
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cpu_standins  # noqa: E402

cpu_standins.install()

import torch  # noqa: E402


def main(rank: int, world: int, tp: int, init_file: str, out_dir: str, families: list[str]) -> None:
    t0 = time.monotonic()
    torch.set_num_threads(1)
    cpu_standins.init_ranks(rank, world, tp, init_file)
    import oracle
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from treepack.trainer.megatron import from_hf

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    seqs, _, plan, adv = oracle.tree_case(0, num_ranks=dp)
    rows = plan.ranks.rank_rows[dp_rank] if dp > 1 else None
    out: dict = {"dp": dp, "tp": ps.get_tensor_model_parallel_world_size(), "families": {}}
    for fam in families:
        hf = oracle.hf_model(fam)
        model = from_hf(hf, tp=tp)
        r = oracle.step(model, plan, seqs, adv, rows=rows, tp_group=ps.get_tensor_model_parallel_group())
        bridge = oracle.hf_bridge(hf)
        local = oracle.hf_grads(model, bridge) if dp > 1 else None
        oracle.reduce_grads(model)
        out["families"][fam] = {
            "lps": r["lps"],
            "loss": r["loss"],
            "grads": oracle.hf_grads(model, bridge),
            "local_grads": local,
            "vocab_shard": int(model.output_layer.weight.shape[0]),
        }
    out["seconds"] = time.monotonic() - t0
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), a[3], a[4], a[5:])
