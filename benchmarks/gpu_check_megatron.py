"""The ``megatron`` section of ``benchmarks/gpu_check.py``: the Megatron-Core backend on one GPU.

Needs megatron-core and megatron-bridge in the interpreter (docs/megatron.md); without them
the section says so (``ok`` None, ``skipped`` naming what is missing) instead of running.

On one GPU (NCCL world of 1, tensor parallel size 1): a tiny random Qwen3 (qk-norm, GQA)
converted by :func:`~treepack.trainer.megatron.from_hf` in bf16 runs a GRPO-shaped tree batch
through :func:`~treepack.trainer.megatron.packed_forward` with the ``sdpa`` and ``flex``
backends; the per-sequence log-probabilities are checked against the HF model (bf16) running
each sequence alone, within the bf16 drift of HF itself (bf16 alone vs fp32 alone, times 4),
and every self-attention's mask type is checked to be ``arbitrary`` (the fused causal softmax
of Megatron's stock local spec ignores the mask for key lengths 16..4096 in bf16). Then the
packed forward + backward is timed against HF running the sequences one by one.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import torch

VOCAB = 512


def _missing() -> str | None:
    import importlib.util

    for mod in ("megatron.core", "megatron.bridge"):
        try:
            if importlib.util.find_spec(mod) is None:
                return mod
        except ImportError:
            return mod
    return None


def _case():
    from treepack.service.planner import plan_batch

    rng = np.random.default_rng(0)
    seqs, prompts = [], []
    for _ in range(8):
        prompt = rng.integers(0, VOCAB, 512)
        for n in (200, 300, 400, 500):
            seqs.append(np.concatenate([prompt, rng.integers(0, VOCAB, n)]).astype(np.uint32))
            prompts.append(512)
    return seqs, prompts, plan_batch(seqs, seq_len=4096, trainable=prompts)


def _hf(dtype):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
    )
    return tf.Qwen3ForCausalLM(cfg).to("cuda", dtype).eval()


def _alone(hf, seqs, prompts):
    out = []
    with torch.no_grad():
        for x, p in zip(seqs, prompts):
            ids = torch.as_tensor(x.astype(np.int64), device="cuda")[None]
            lp = torch.log_softmax(hf(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(lp[p - 1 :].double().cpu())
    return out


def _packed_lps(model, batch, backend):
    from treepack.trainer.megatron import packed_forward, vocab_parallel_target_logprobs

    logits = packed_forward(model, batch, backend=backend)
    lp = vocab_parallel_target_logprobs(logits, batch, vocab_size=model.config.vocab_size)
    return lp, batch.unpack_logprobs(lp)


def _err(ref, lps, prompts):
    return max(float((r - x[p:].cpu().double()).abs().max()) for r, x, p in zip(ref, lps, prompts))


def section(cpu_smoke: bool) -> dict:
    """Run the section (module docstring); ``cpu_smoke`` only checks that it would skip cleanly."""
    missing = _missing()
    if missing is not None:
        return dict(ok=None, skipped=f"{missing} is not installed here (docs/megatron.md: Install)")
    if cpu_smoke or not torch.cuda.is_available():
        return dict(ok=None, skipped="the Megatron section needs a CUDA device")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    from treepack.trainer import materialize
    from treepack.trainer.megatron import from_hf

    if not dist.is_initialized():
        init = tempfile.mktemp(prefix="treepack-gpu-check-megatron-")
        dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    seqs, prompts, plan = _case()
    ref32 = _alone(_hf(torch.float32), seqs, prompts)
    hf = _hf(torch.bfloat16)
    ref16 = _alone(hf, seqs, prompts)
    drift = max(float((a - b).abs().max()) for a, b in zip(ref32, ref16))
    model = from_hf(hf, tp=1)
    kinds = {m.attn_mask_type for n, m in model.named_modules() if type(m).__name__ == "SelfAttention"}
    res: dict = dict(mask_types=sorted(k.name for k in kinds), hf_bf16_drift=drift, rows=plan.num_rows)
    batch = materialize(plan, seqs, device="cuda")
    for backend in ("sdpa", "flex"):
        with torch.no_grad():
            _, lps = _packed_lps(model, batch, backend)
        res[f"{backend}_logprob_err"] = _err(ref16, lps, prompts)

    def packed_step():
        lp, _ = _packed_lps(model, batch, "flex")
        lp.sum().backward()

    def alone_step():
        for x in seqs:
            ids = torch.as_tensor(x.astype(np.int64), device="cuda")[None]
            hf(input_ids=ids).logits.float().logsumexp(-1).sum().backward()

    for name, fn in (("packed_ms", packed_step), ("hf_alone_ms", alone_step)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        res[name] = round((time.perf_counter() - t0) / 3 * 1e3, 2)
    bound = 4 * max(drift, 1e-3)
    res["ok"] = kinds == {AttnMaskType.arbitrary} and all(res[f"{b}_logprob_err"] <= bound for b in ("sdpa", "flex"))
    res["bound"] = bound
    return res
