"""The run-time probe of an FSDP2 model on 2 gloo ranks whose row lengths differ.

A sharded model's forward is a collective: when one rank meets a new probe signature (its
row length caps the probe's sequences, and that length comes from its own micro-batch) and
the other does not, a probe on that rank alone would leave the ranks' all-gathers out of
step. Rank 0 packs two batches into rows of 64; rank 1 into rows of 64, then 24 (a cap the
probe's longest sequence does not fit). Checked: each rank on its own would probe a
different number of times (the negative control: the case is not vacuous), both ranks
probe as often as the ranks together need, and every packed forward equals the same model
unsharded on the same batch.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import numpy as np
import torch

from helpers.ranks import run_ranks

TIMEOUT_S = 240
ROW_LENS = {0: (64, 64), 1: (64, 24)}


def _batch(seq_len: int, seed: int):
    from treepack.client import Packer
    from treepack.trainer import materialize

    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 90, 6)
    seqs = [np.concatenate([prompt, rng.integers(1, 90, n)]) for n in (5, 7, 3)]
    with Packer() as packer:
        plan = packer.pack(seqs, seq_len=seq_len, trainable=[6, 6, 6], min_shared_len=4, record=False)
    return materialize(plan, seqs, trainable=[6, 6, 6])


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import treepack.trainer.hf.admission.probe as probe
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.hf.admission.lockstep import lockstep_ranks
    from treepack.trainer.hf.admission.probe_inputs import probe_shape

    from helpers.trainer_cases import tiny_model

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=90)
    )
    runs, own = [0], set()
    original = probe.run_probe

    def counted(hf, *, signature, **kw):
        runs[0] += 1
        return original(hf, signature=signature, **kw)

    probe.run_probe = counted
    try:
        ref = tiny_model("qwen3").eval()
        model = tiny_model("qwen3").eval()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        errs = []
        for i, seq_len in enumerate(ROW_LENS[rank]):
            batch = _batch(seq_len, seed=10 * rank + i)
            own.add(probe_shape(model, seq_len)[1])  # the cap: the signature part that varies here
            with torch.no_grad():
                got = packed_forward(model, batch)
                want = packed_forward(ref, batch, verify=False)
            errs.append(float((got - want).abs().max()))
        result = {"runs": runs[0], "own": len(own), "errs": errs, "lockstep": lockstep_ranks(model)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        probe.run_probe = original
        dist.destroy_process_group()


def test_every_rank_of_a_sharded_model_probes_together(tmp_path):
    r0, r1 = run_ranks(_worker, tmp_path, TIMEOUT_S)
    assert r0["lockstep"] and r1["lockstep"]
    assert (r0["own"], r1["own"]) == (1, 2), "alone, the ranks would probe a different number of times"
    assert r0["runs"] == r1["runs"] == 2, (r0, r1)
    assert max(r0["errs"] + r1["errs"]) <= 1e-5, (r0, r1)
