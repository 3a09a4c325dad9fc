"""The oracle for recurrent / conv mixer hybrids: packed rows against every sequence alone.

Shared by the per-family tests (tests/trainer/test_mixers_*.py). A family supplies a tiny
random fp32 model; :func:`mixer_case` plans trees with every shape the oracle must cover
(:func:`helpers.trees.tree_plan`: depth >= 3, several trees per row, padding, inner
segments shorter than the conv window, segments crossing a 64-token chunk, hence also the
model's own smaller power-of-two chunk) and the checks return their figures so the tests
can assert on them and report them.
"""

from __future__ import annotations

import numpy as np
import torch

from treepack.trainer import materialize
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.admission.guards import trust_hook
from treepack.trainer.hf.layers import unpatch_layers

from helpers.trainer_cases import unchecked_packed_logits
from helpers.trees import scored_loss_pair, tree_features, tree_plan

VOCAB = 97


def mixer_case(conv_width: int, seed: int = 0, chunk: int | None = None):
    """(seqs, trainable, plan, batch) for a model whose widest conv is ``conv_width``.

    Args:
        chunk: the model's scan chunk size; the plan must have a branch point that is not on
            a multiple of it and a segment crossing a multiple of it.
    """
    seqs, trainable, plan = tree_plan(
        seed, min_shared_len=2, conv_width=conv_width, tail=3, trees=2, depth=3, max_len=160, seq_len=192
    )
    assert tree_features(plan, conv_width)["ok"]
    seg = plan.segments
    assert (seg.row_start + seg.length < plan.seq_len).any(), "no row has padding"
    if chunk is not None:
        inner = seg.parent >= 0
        assert (inner & (seg.seq_start % chunk != 0)).any(), f"no branch point off a {chunk}-token chunk boundary"
        assert (seg.seq_start // chunk != (seg.seq_start + seg.length - 1) // chunk).any()
    return seqs, trainable, plan, materialize(plan, seqs, trainable=trainable)


def unpacked_logprobs(model, seqs):
    """Per sequence: [n, V] log-softmax of the stock model on that sequence alone.

    The sequences run as one right-padded batch: every layer is causal, so a sequence's
    positions cannot see the padding after it (one call instead of one per sequence keeps
    the backward of the stock slow paths fast).
    """
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
    lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
    return [lp[i, : len(s)] for i, s in enumerate(seqs)]


def packed_logprobs(model, batch, patch_layers=True):
    return torch.log_softmax(packed_forward(model, batch, backend="sdpa", patch_layers=patch_layers).float(), -1)


def max_logprob_diff(batch, lp_packed, ref) -> float:
    worst = 0.0
    for s, r in enumerate(ref):
        row, idx = batch.locate(s)
        worst = max(worst, float((lp_packed[row, idx] - r).detach().abs().max()))
    return worst


def linear_scan_diff(model, batch, ref) -> float:
    """Negative control: the packed rows with the mixers left stock (each row one scan)."""
    unpatch_layers(model)
    with torch.no_grad():
        scan = torch.log_softmax(unchecked_packed_logits(model, batch).float(), -1)
    return max_logprob_diff(batch, scan, ref)


def max_grad_rel_err(model, seqs, trainable, ref, batch, lp, *, min_checked: int) -> float:
    """Largest |packed grad - unpacked grad| / max|unpacked grad| over the parameters."""
    loss, loss_ref = scored_loss_pair(seqs, trainable, ref, batch, lp)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    params = [p for p in model.parameters() if p.requires_grad]
    g_ref = torch.autograd.grad(loss_ref, params, allow_unused=True)
    g = torch.autograd.grad(loss, params, allow_unused=True)
    worst, checked = 0.0, 0
    for (name, _), a, b in zip(model.named_parameters(), g, g_ref):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0, name
            continue
        scale = float(b.abs().max())
        if scale == 0:
            continue
        worst = max(worst, float((a - b).abs().max()) / scale)
        checked += 1
    assert checked > min_checked, f"only {checked} parameters had gradients"
    return worst


def leaf_gradient_leaks(model, plan, batch, embed: torch.nn.Module) -> tuple[int, int]:
    """(positions off a leaf's chain with nonzero gradient, chain positions without) for a leaf loss."""
    seg = plan.segments
    has_child = set(seg.parent[seg.parent >= 0].tolist())
    leaf = next(
        s
        for s in range(seg.num_segments)
        if s not in has_child and seg.parent[s] >= 0 and (seg.parent == seg.parent[s]).sum() >= 2
    )
    chain, p = set(), leaf
    while p >= 0:
        chain.add(p)
        p = int(seg.parent[p])
    seg_ids = torch.from_numpy(plan.segment_ids())
    embeds = []
    hook = embed.register_forward_hook(trust_hook(lambda m, i, o: embeds.append(o)))
    try:
        lp = packed_logprobs(model, batch)
    finally:
        hook.remove()
    on_leaf = seg_ids == leaf
    (grad,) = torch.autograd.grad(
        lp[on_leaf][..., 5].sum() + lp[on_leaf][..., 11].sum(), embeds[-1]
    )  # the packed call: the probe (if any) ran before it
    on_chain = torch.from_numpy(np.isin(plan.segment_ids(), sorted(chain)))
    per_pos = grad.abs().sum(-1)
    return int(torch.count_nonzero(per_pos[~on_chain])), int(on_chain.sum()) - int(
        torch.count_nonzero(per_pos[on_chain])
    )


def run_oracle(model, case, embed: torch.nn.Module, *, min_checked: int = 10) -> dict:
    """Every oracle figure of one family on one case (see the module docstring)."""
    seqs, trainable, plan, batch = case
    ref = unpacked_logprobs(model, seqs)
    control = linear_scan_diff(model, batch, ref)
    lp = packed_logprobs(model, batch)
    figures = {
        "nan": bool(lp.isnan().any()),
        "logprob_diff": max_logprob_diff(batch, lp, ref),
        "grad_rel_err": max_grad_rel_err(model, seqs, trainable, ref, batch, lp, min_checked=min_checked),
        "control_diff": control,
    }
    figures["leak_off_chain"], figures["dead_on_chain"] = leaf_gradient_leaks(model, plan, batch, embed)
    with torch.no_grad():  # the patched model still runs unpacked exactly as before
        again = unpacked_logprobs(model, seqs)
    figures["unpacked_after"] = max(float((a - r.detach()).abs().max()) for a, r in zip(again, ref))
    return figures


def assert_oracle(figures: dict) -> None:
    assert not figures["nan"], "a packed position was never written"
    assert figures["logprob_diff"] <= 1e-5, f"packed != unpacked: max |d logprob| = {figures['logprob_diff']:.3g}"
    assert figures["grad_rel_err"] <= 1e-4, f"gradients: max rel err {figures['grad_rel_err']:.3g}"
    assert figures["control_diff"] > 1e-3, (
        f"negative control: a linear scan of the row matched unpacked ({figures['control_diff']:.3g})"
    )
    assert figures["leak_off_chain"] == 0, "a leaf loss reached a sibling, another tree or padding"
    assert figures["dead_on_chain"] == 0, "every chain token should get gradient from a leaf loss"
    assert figures["unpacked_after"] == 0, "an unpacked call after packed_forward differs from before"
