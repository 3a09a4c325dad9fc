"""DDP and FSDP2 (``fully_shard``) wrapped models on 2 gloo CPU ranks, against one process."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import numpy as np
import torch

from helpers.ranks import run_ranks
from helpers.trainer_cases import mixed_batch, plan_of

TIMEOUT_S = 300
WRAPS = ("ddp", "fsdp2")
OUTPUTS = ("logits", "hidden")


def _wrap(kind, model):
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _step(model, batch, adv, output):
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.hf.head import output_head
    from treepack.trainer.losses import ppo_clip_loss

    out = packed_forward(model, batch, output=output)
    lp = (
        batch.target_logprobs(out)
        if output == "logits"
        else batch.target_logprobs_from_hidden(out, output_head(model), chunk_size=16)
    )
    loss = ppo_clip_loss(lp, batch, advantages=adv, old_logprobs="old", normalization="sequence")
    loss.backward()
    return loss.detach()


def _full_grads(model):
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[n.replace("module.", "")] = g.detach().clone()
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from treepack.trainer import materialize

    from helpers.trainer_cases import tiny_model

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=90)
    )
    try:
        c = mixed_batch()
        plan = plan_of(c, num_ranks=2)
        rng = np.random.default_rng(7)
        old = [rng.normal(-4.6, 0.4, len(s)) for s in c["sequences"]]
        adv = torch.from_numpy(rng.normal(0, 1, len(c["sequences"])))
        mine = materialize(plan, c["sequences"], payloads={"old": old}, rows=plan.ranks.rank_rows[rank])
        full = materialize(plan, c["sequences"], payloads={"old": old})
        result = {}
        for kind in WRAPS:
            for output in OUTPUTS:
                ref_model = tiny_model("qwen3")
                ref_loss = _step(ref_model, full, adv, output)
                ref = _full_grads(ref_model)
                model = _wrap(kind, tiny_model("qwen3"))
                loss = _step(model, mine, adv, output)
                dist.all_reduce(loss)
                got = _full_grads(model)  # averaged over the 2 ranks by DDP / FSDP2
                rel = max(float((2 * got[n] - g).abs().max() / g.abs().max()) for n, g in ref.items())
                x = torch.tensor([[3, 5, 7]])
                with torch.no_grad():  # unpacked generation through the wrapped model still works
                    gen = (model.module if kind == "ddp" else model).generate(
                        input_ids=x, max_new_tokens=3, do_sample=False, pad_token_id=0
                    )
                result[f"{kind}/{output}"] = {
                    "loss": float(loss),
                    "ref_loss": float(ref_loss),
                    "max_grad_rel": rel,
                    "gen": gen.tolist(),
                }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        # Both ranks finish their collectives before either tears gloo down: a rank that exits
        # while its peer's pair threads still run makes the peer abort (SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_and_fsdp2_wrapped_models_match_one_process(tmp_path):
    r0, r1 = run_ranks(_worker, tmp_path, TIMEOUT_S)
    assert sorted(r0) == sorted(f"{k}/{o}" for k in WRAPS for o in OUTPUTS)
    for key, a in r0.items():
        b = r1[key]
        assert a["loss"] == b["loss"] and abs(a["loss"] - a["ref_loss"]) <= 1e-6 * abs(a["ref_loss"]), key
        assert a["max_grad_rel"] <= 1e-4 and b["max_grad_rel"] <= 1e-4, key
        assert a["gen"] == b["gen"] and len(a["gen"][0]) == 6, key
