"""The family sweep's tiny models and their oracle, shared by the trainer tests.

:func:`model_support` loads ``benchmarks/model_support.py`` (tiny random fp32 configs of
every HF family); :func:`oracle` runs a model packed and every sequence alone on one
small tree batch and returns both sides' scored log-probabilities and gradients.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "model_support.py"


def model_support() -> Any:
    """``benchmarks/model_support.py`` as a module (loaded once per process)."""
    name = "_bench_model_support"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def window_case(vocab: int = 97) -> dict[str, Any]:
    """A 10-token prompt with 3 completions (longest 24 tokens: past a window of 6 and
    across it from the prompt) and a 17-token sequence of its own, in 64-token rows."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, vocab, 10)
    seqs = [np.concatenate([prompt, rng.integers(0, vocab, n)]) for n in (9, 14, 4)] + [rng.integers(0, vocab, 17)]
    return dict(sequences=seqs, trainable=[10, 10, 10, 2], groups=[0, 0, 0, 1], seq_len=64, min_shared_len=4)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def oracle(
    model: torch.nn.Module, batch: Any, case: dict[str, Any], grads: bool = True, **packed_kw: Any
) -> tuple[list, list, dict, dict]:
    """(alone logprobs, packed logprobs, alone grads, packed grads) of ``model`` on ``batch``.

    Logprobs are [n] per sequence, NaN off the scored positions (the
    :meth:`PackedBatch.unpack_logprobs` format); the loss both sides backpropagate weights
    every scored logprob by a fixed random number (so no gradient cancels by symmetry).
    """
    from treepack.trainer.hf import packed_forward

    ms = model_support()
    seqs = case["sequences"]
    gen = torch.Generator().manual_seed(11)
    weights = [torch.randn(len(s), generator=gen) for s in seqs]
    flags = []
    for s, t in zip(seqs, case["trainable"]):
        f = torch.zeros(len(s), dtype=torch.bool)
        f[max(int(t), 1) :] = True
        flags.append(f)
    with torch.set_grad_enabled(grads):
        alone = [torch.cat([lp.new_full((1,), float("nan")), lp]) for lp in ms.unpacked_logprobs(model, seqs)]
        alone = [torch.where(f, x, torch.full_like(x, float("nan"))) for x, f in zip(alone, flags)]
        if grads:
            sum((torch.nan_to_num(x) * w).sum() for x, w in zip(alone, weights)).backward()
        g_alone = _grads(model) if grads else {}
        logits = packed_forward(model, batch, **packed_kw)
        packed = batch.unpack_logprobs(batch.target_logprobs(logits))
        if grads:
            sum((torch.nan_to_num(x) * w).sum() for x, w in zip(packed, weights)).backward()
        g_packed = _grads(model) if grads else {}
    return [x.detach() for x in alone], [x.detach() for x in packed], g_alone, g_packed


def mixing_hook(calls: list) -> Any:
    """A forward hook from unknown code that mixes positions (a cumsum over the row); records its calls."""

    def mixing_hook(module, args, out):
        calls.append(module)
        return out + 0.5 * out.cumsum(1)

    return mixing_hook
