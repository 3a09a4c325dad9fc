"""Packed losses == the same losses on unpacked sequences, for every normalization.

The logits are a random leaf tensor on the packed rows; the unpacked reference reads each
sequence's logits back through ``locate`` (what the model would give it alone, by the
oracle tested in test_trainer_hf.py) and applies loop-based ``naive_*`` losses. Values and
gradients with respect to the logits must agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.trainer import materialize
from treepack.trainer.losses import (
    cispo_loss,
    entry_weights,
    naive_cispo_loss,
    naive_ppo_clip_loss,
    naive_sft_loss,
    position_sum,
    ppo_clip_loss,
    sft_loss,
)

from helpers.trainer_cases import VOCAB, mixed_batch, plan_of, trainable_flags

NORMS = ["token", "sequence", "group", "sum", 7.0]


def _setup(seed=0):
    c = mixed_batch()
    plan = plan_of(c)
    rng = np.random.default_rng(seed)
    seqs = c["sequences"]
    old = [torch.from_numpy(rng.normal(-4.6, 0.5, len(s))) for s in seqs]
    ref = [torch.from_numpy(rng.normal(-4.6, 0.5, len(s))) for s in seqs]
    adv_tok = [torch.from_numpy(rng.normal(0, 1, len(s))) for s in seqs]
    w = [torch.from_numpy(rng.uniform(0.5, 2, len(s))) for s in seqs]
    batch = materialize(
        plan,
        seqs,
        payloads={"old": old, "ref": ref, "adv": adv_tok, "w": w},
        trainable=c["trainable"],
        groups=c["groups"],
    )
    return c, batch, dict(old=old, ref=ref, adv=adv_tok, w=w), trainable_flags(c)


def _unpacked_logprobs(batch, logits, seqs):
    out = []
    for s, seq in enumerate(seqs):
        row, idx = batch.locate(s)
        x = torch.as_tensor(seq, dtype=torch.int64)
        lp = torch.log_softmax(logits[row, idx][:-1].double(), -1).gather(1, x[1:, None]).squeeze(1)
        out.append(torch.cat([lp.new_zeros(1), lp]))
    return out


def _compare(packed_fn, naive_fn, batch, seqs):
    torch.manual_seed(1)
    logits = (torch.randn(batch.num_rows, batch.seq_len, VOCAB, dtype=torch.float64) * 2).requires_grad_()
    lp = batch.target_logprobs(logits)
    got = packed_fn(lp)
    (g1,) = torch.autograd.grad(got, logits)
    want = naive_fn(_unpacked_logprobs(batch, logits, seqs))
    (g2,) = torch.autograd.grad(want, logits)
    assert abs(float(want.detach())) > 1e-4
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (float(got), float(want))
    assert float((g1 - g2).abs().max()) <= 1e-10 * max(float(g2.abs().max()), 1e-30) + 1e-14
    return got.detach()


@pytest.mark.parametrize("norm", NORMS)
def test_sft_matches_unpacked(norm):
    c, batch, p, flags = _setup()
    _compare(
        lambda lp: sft_loss(lp, batch, weights="w", normalization=norm),
        lambda lps: naive_sft_loss(lps, flags, groups=c["groups"], weights=p["w"], normalization=norm),
        batch,
        c["sequences"],
    )


@pytest.mark.parametrize("norm", NORMS)
def test_ppo_clip_matches_unpacked(norm):
    c, batch, p, flags = _setup()
    kw = dict(clip_low=0.2, clip_high=0.28, normalization=norm)
    _compare(
        lambda lp: ppo_clip_loss(
            lp, batch, advantages="adv", old_logprobs="old", ref_logprobs="ref", kl_coef=0.05, **kw
        ),
        lambda lps: naive_ppo_clip_loss(
            lps,
            flags,
            advantages=p["adv"],
            old_logprobs=p["old"],
            ref_logprobs=p["ref"],
            kl_coef=0.05,
            groups=c["groups"],
            **kw,
        ),
        batch,
        c["sequences"],
    )


@pytest.mark.parametrize("norm", NORMS)
def test_cispo_matches_unpacked(norm):
    c, batch, p, flags = _setup()
    _compare(
        lambda lp: cispo_loss(lp, batch, advantages="adv", old_logprobs="old", clip_high=0.1, normalization=norm),
        lambda lps: naive_cispo_loss(
            lps,
            flags,
            advantages=p["adv"],
            old_logprobs=p["old"],
            clip_high=0.1,
            groups=c["groups"],
            normalization=norm,
        ),
        batch,
        c["sequences"],
    )


def test_input_forms_agree():
    """Advantages as a payload name, a packed [K, L] tensor or (when constant per sequence) [S]."""
    c, batch, p, flags = _setup()
    S = batch.plan.num_sequences
    per_seq = torch.linspace(-1, 1, S, dtype=torch.float64)
    packed = torch.zeros(batch.num_rows, batch.seq_len, dtype=torch.float64)
    packed.view(-1)[batch.score_flat] = per_seq[batch.score_seq]
    lp = batch.target_logprobs(torch.randn(batch.num_rows, batch.seq_len, VOCAB, dtype=torch.float64))
    a = ppo_clip_loss(lp, batch, advantages=per_seq, old_logprobs="old")
    b = ppo_clip_loss(lp, batch, advantages=packed, old_logprobs=batch.payloads["old"])
    assert torch.allclose(a, b, rtol=1e-12)
    # Grouped normalization: the weights of a group's tokens sum to 1 / groups-with-entries.
    w = entry_weights(batch, "group")
    groups = batch.groups[batch.score_seq]
    sums = torch.zeros(int(groups.max()) + 1, dtype=torch.float64).index_add(0, groups, w)
    nz = sums[sums > 0]
    assert torch.allclose(nz, torch.full_like(nz, 1.0 / nz.numel()))


def test_shared_scored_positions_keep_advantage_signs_apart():
    """Generalized sharing: two sequences score the same positions with opposite advantages.

    a is a prefix of b, planned with share_trainable=True (so fully shared) and scored from
    token 4 on: positions 3..10 are scored for both. The packed loss (each sharer's entry
    with its own advantage, one logprob per position) equals the per-sequence loss;
    merging the two signs into one weighted advantage (the negative control) does not.
    """
    from treepack.service.planner import plan_batch

    rng = np.random.default_rng(5)
    a = rng.integers(0, VOCAB, 12)
    b = np.concatenate([a, rng.integers(0, VOCAB, 5)])
    seqs = [a, b]
    plan = plan_batch(seqs, seq_len=32, min_shared_len=4, trainable=[4, 4], share_trainable=True)
    old = [torch.from_numpy(rng.normal(-4.6, 0.6, len(s))) for s in seqs]
    old[1][:12] = old[0]  # behaviour logprobs depend on context and token only: sharers agree
    batch = materialize(plan, seqs, payloads={"old": old})
    assert int(batch.loss_mask.sum()) == 13 and batch.num_scored == 8 + 13
    flags = [torch.arange(len(s)) >= 4 for s in seqs]
    adv = torch.tensor([1.5, -0.7], dtype=torch.float64)
    for norm in ("token", "sequence"):
        got = _compare(
            lambda lp: ppo_clip_loss(lp, batch, advantages=adv, old_logprobs="old", normalization=norm),
            lambda lps: naive_ppo_clip_loss(lps, flags, advantages=adv, old_logprobs=old, normalization=norm),
            batch,
            seqs,
        )
        logits = torch.randn(1, 32, VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
        lp = batch.target_logprobs(logits)
        r = torch.exp(lp - torch.nan_to_num(batch.payloads["old"]))
        wa = position_sum(batch, entry_weights(batch, norm) * adv[batch.score_seq])
        merged = -(torch.where(wa > 0, wa * r.clamp(max=1.2), wa * r.clamp(min=0.8))).sum()
        assert abs(float(merged) - float(got)) > 1e-3
        # SFT and CISPO are linear in the weights: summed weights are exact.
        _compare(
            lambda lp: cispo_loss(lp, batch, advantages=adv, old_logprobs="old", normalization=norm),
            lambda lps: naive_cispo_loss(lps, flags, advantages=adv, old_logprobs=old, normalization=norm),
            batch,
            seqs,
        )
    unpacked = batch.unpack_logprobs(batch.target_logprobs(logits))
    assert torch.equal(unpacked[0][4:], unpacked[1][4:12])


def test_loss_argument_errors():
    c, batch, p, flags = _setup()
    lp = torch.zeros(batch.num_rows, batch.seq_len)
    with pytest.raises(ValueError, match="normalization must be one of"):
        sft_loss(lp, batch, normalization="batch")
    with pytest.raises(ValueError, match="no target-aligned payload named 'adv2'"):
        ppo_clip_loss(lp, batch, advantages="adv2")
    with pytest.raises(ValueError, match=r"advantages must have shape \[12\]"):
        ppo_clip_loss(lp, batch, advantages=torch.zeros(5))
    with pytest.raises(ValueError, match="old_logprobs must have shape"):
        cispo_loss(lp, batch, advantages=1.0, old_logprobs=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="kl_coef needs ref_logprobs"):
        ppo_clip_loss(lp, batch, advantages=1.0, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"logprobs must have shape"):
        sft_loss(torch.zeros(3), batch)


def _with_unscored_group(c):
    """``c`` plus a group "Z" whose sequences have no scored entry (one never trainable, one
    trainable only at token 0, which nothing predicts), and an ungrouped unscored sequence."""
    rng = np.random.default_rng(99)
    extra = [rng.integers(0, VOCAB, 11), rng.integers(0, VOCAB, 7), rng.integers(0, VOCAB, 5)]
    flags = [np.zeros(11, bool), np.eye(1, 7, 0, dtype=bool)[0], np.zeros(5, bool)]
    return dict(
        c, sequences=c["sequences"] + extra, trainable=c["trainable"] + flags, groups=c["groups"] + ["Z", "Z", None]
    )


@pytest.mark.parametrize("norm", NORMS)
def test_a_group_with_no_scored_token_changes_no_loss(norm):
    """Sequences and groups with no scored entry contribute nothing and are not counted.

    The logits are a function of (input token, position) only, so every scored entry has
    the same log-probability in both packings; the losses with and without the unscored
    group must be equal (not halved or diluted), and the packed loss equals the naive one.
    """
    from helpers.trainer_cases import mixed_batch

    base = mixed_batch()
    big = _with_unscored_group(base)
    g = torch.Generator().manual_seed(5)
    E = torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    F = torch.randn(64, VOCAB, generator=g, dtype=torch.float64)
    got = {}
    for name, c in (("base", base), ("big", big)):
        plan = plan_of(c)
        S = len(c["sequences"])
        assert name == "base" or len(set(c["groups"][-3:-1])) == 1 and c["groups"][-3] not in base["groups"]
        batch = materialize(plan, c["sequences"], trainable=c["trainable"], groups=c["groups"])
        adv = torch.full((S,), 100.0, dtype=torch.float64)  # the unscored sequences' must weigh nothing
        adv[: len(base["sequences"])] = torch.linspace(-1, 1, len(base["sequences"]), dtype=torch.float64)
        old = torch.full((S,), -4.0, dtype=torch.float64)
        logits = E[batch.input_ids] + F[batch.position_ids]
        lp = batch.target_logprobs(logits)
        losses = (
            sft_loss(lp, batch, normalization=norm),
            ppo_clip_loss(lp, batch, advantages=adv, old_logprobs=old, normalization=norm),
            cispo_loss(lp, batch, advantages=adv, old_logprobs=old, normalization=norm),
        )
        flags = trainable_flags(c)
        lps = _unpacked_logprobs(batch, logits, c["sequences"])
        naive = (
            naive_sft_loss(lps, flags, groups=c["groups"], normalization=norm),
            naive_ppo_clip_loss(
                lps,
                flags,
                advantages=adv,
                old_logprobs=[old[s].expand(len(x)) for s, x in enumerate(c["sequences"])],
                groups=c["groups"],
                normalization=norm,
            ),
            naive_cispo_loss(
                lps,
                flags,
                advantages=adv,
                old_logprobs=[old[s].expand(len(x)) for s, x in enumerate(c["sequences"])],
                groups=c["groups"],
                normalization=norm,
            ),
        )
        for a, b in zip(losses, naive):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (name, norm, float(a), float(b))
        got[name] = torch.stack(losses)
    assert float(got["base"].abs().min()) > 1e-3
    assert torch.allclose(got["big"], got["base"], rtol=1e-10, atol=1e-12), (norm, got)
