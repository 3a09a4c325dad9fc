"""Per-sharer payloads (share_trainable=True) and routing replay (issue 9).

1. Shared trainable positions whose sharers carry different old logprobs, reference
   logprobs, advantages and weights: every loss (SFT, PPO-clip with KL, CISPO) and every
   normalization equals the unpacked loss, values and gradients, because each sharer's
   own entries enter it. Negative control: the old behaviour (one value per position, one
   sharer's) is measurably wrong. Then the same through a tiny HF model (parameter grads).
2. Token-aligned payloads (MoE routing replay) that sharers disagree on are refused with
   both sequences named; :func:`routing_keys` makes the planner keep them apart, after
   which materialization succeeds and every sequence reads its own routing back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.service.planner import plan_batch, validate_plan
from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.data.payloads import PayloadMismatchError
from treepack.trainer.hf import packed_forward
from treepack.trainer.losses import (
    cispo_loss,
    naive_cispo_loss,
    naive_ppo_clip_loss,
    naive_sft_loss,
    ppo_clip_loss,
    sft_loss,
)
from treepack.trainer.planning import routing_keys
from treepack.trainer.planning.routing import naive_routing_keys

from helpers.tolerance import assert_close
from helpers.trainer_cases import (
    VOCAB,
    plan_of,
    reference_logprobs,
    shared_trainable_batch,
    tiny_model,
    trainable_flags,
)

NORMS = ["token", "sequence", "group", "sum", 5.0]


def _case(seed: int = 0):
    c = shared_trainable_batch()
    plan = plan_of(c, share_trainable=True)
    rng = np.random.default_rng(seed)
    seqs = c["sequences"]
    # Independent per sequence: the sharers of a position disagree on every payload.
    p = {
        "old": [torch.from_numpy(rng.normal(-4.6, 0.5, len(s))) for s in seqs],
        "ref": [torch.from_numpy(rng.normal(-4.6, 0.5, len(s))) for s in seqs],
        "adv": [torch.from_numpy(rng.normal(0, 1, len(s))) for s in seqs],
        "w": [torch.from_numpy(rng.uniform(0.5, 2, len(s))) for s in seqs],
    }
    batch = materialize(plan, seqs, payloads=p, trainable=c["trainable"], groups=c["groups"])
    shared = batch.num_scored - int(batch.loss_mask.sum())
    assert shared >= 10, "the case shares too few scored positions to test anything"
    return c, batch, p, trainable_flags(c)


def _unpacked(batch, logits, seqs):
    out = []
    for s, seq in enumerate(seqs):
        row, idx = batch.locate(s)
        x = torch.as_tensor(seq, dtype=torch.int64)
        lp = torch.log_softmax(logits[row, idx][:-1].double(), -1).gather(1, x[1:, None]).squeeze(1)
        out.append(torch.cat([lp.new_zeros(1), lp]))
    return out


def _loss_and_grad(fn, logits):
    loss = fn(logits)
    (g,) = torch.autograd.grad(loss, logits)
    return loss.detach(), g


LOSSES = {
    "sft": (
        lambda b, norm, old: lambda lp: sft_loss(lp, b, weights="w", normalization=norm),
        lambda c, p, f, norm: (
            lambda lps: naive_sft_loss(lps, f, groups=c["groups"], weights=p["w"], normalization=norm)
        ),
    ),
    "ppo": (
        lambda b, norm, old: (
            lambda lp: ppo_clip_loss(
                lp,
                b,
                advantages="adv",
                old_logprobs=old,
                ref_logprobs="ref",
                kl_coef=0.05,
                clip_high=0.28,
                normalization=norm,
            )
        ),
        lambda c, p, f, norm: (
            lambda lps: naive_ppo_clip_loss(
                lps,
                f,
                advantages=p["adv"],
                old_logprobs=p["old"],
                ref_logprobs=p["ref"],
                kl_coef=0.05,
                clip_high=0.28,
                groups=c["groups"],
                normalization=norm,
            )
        ),
    ),
    "cispo": (
        lambda b, norm, old: (
            lambda lp: cispo_loss(lp, b, advantages="adv", old_logprobs=old, clip_high=0.1, normalization=norm)
        ),
        lambda c, p, f, norm: (
            lambda lps: naive_cispo_loss(
                lps,
                f,
                advantages=p["adv"],
                old_logprobs=p["old"],
                clip_high=0.1,
                groups=c["groups"],
                normalization=norm,
            )
        ),
    ),
}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_per_sharer_payloads_match_unpacked(kind, norm):
    c, batch, p, flags = _case()
    packed_fn, naive_fn = LOSSES[kind]
    logits = (
        torch.randn(
            batch.num_rows, batch.seq_len, VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        )
        * 2
    ).requires_grad_()
    got, g_got = _loss_and_grad(lambda x: packed_fn(batch, norm, "old")(batch.target_logprobs(x)), logits)
    want, g_want = _loss_and_grad(lambda x: naive_fn(c, p, flags, norm)(_unpacked(batch, x, c["sequences"])), logits)
    assert abs(float(want)) > 1e-4
    assert_close(f"{kind}/{norm} loss", want, got, atol=1e-12, ratio=1e-10)
    assert_close(f"{kind}/{norm} grad", g_want, g_got, atol=1e-14, ratio=1e-10, nonzero_ref=True)


def _one_sharer_per_position(batch, name):
    """The old behaviour: a [K, L] payload holding one sharer's value at each position."""
    flat = torch.full((batch.num_rows * batch.seq_len,), float("nan"), dtype=torch.float64)
    first = {}
    for e, f in enumerate(batch.score_flat.tolist()):
        first.setdefault(f, e)
    idx = torch.tensor(sorted(first))
    flat[idx] = batch.entry_payloads[name][torch.tensor([first[f] for f in sorted(first)])].double()
    return flat.view(batch.num_rows, batch.seq_len)


@pytest.mark.parametrize("kind", ["ppo", "cispo"])
def test_one_value_per_position_is_wrong(kind):
    """Negative control: collapsing each shared position's old logprobs to one sharer's."""
    c, batch, p, flags = _case()
    packed_fn, naive_fn = LOSSES[kind]
    logits = (
        torch.randn(
            batch.num_rows, batch.seq_len, VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        )
        * 2
    ).requires_grad_()
    collapsed = _one_sharer_per_position(batch, "old")
    got, g_got = _loss_and_grad(lambda x: packed_fn(batch, "token", collapsed)(batch.target_logprobs(x)), logits)
    want, g_want = _loss_and_grad(lambda x: naive_fn(c, p, flags, "token")(_unpacked(batch, x, c["sequences"])), logits)
    loss_err = abs(float(got - want)) / abs(float(want))
    grad_err = float((g_got - g_want).abs().max() / g_want.abs().max())
    assert loss_err > 1e-3 and grad_err > 1e-2, (loss_err, grad_err)


def test_packed_view_of_disagreeing_sharers_is_the_fill_value():
    """``batch.payloads`` never holds an arbitrary sharer's value where the sharers differ."""
    _, batch, p, _ = _case()
    flat = batch.payloads["old"].reshape(-1)
    counts = torch.bincount(batch.score_flat, minlength=flat.shape[0])
    shared = torch.nonzero(counts > 1).flatten()
    own = torch.nonzero(counts == 1).flatten()
    assert shared.numel() and bool(torch.isnan(flat[shared]).all())
    assert not bool(torch.isnan(flat[own]).any())


def test_model_oracle_with_per_sharer_payloads():
    """Through a tiny Qwen3: packed PPO-clip with per-sharer old logprobs and per-token
    advantages == unpacked (loss and parameter gradients), on SDPA and the varlen path."""
    c, _, _, flags = _case()
    plan = plan_of(c, share_trainable=True)
    model = tiny_model("qwen3")
    ref_lp = reference_logprobs(model, c["sequences"], flags)
    rng = np.random.default_rng(4)
    # Behaviour logprobs near the policy's, independently perturbed per sequence, so that
    # sharers differ and ratios clip on both sides.
    old = [torch.nan_to_num(x.detach()) + torch.from_numpy(rng.normal(0, 0.3, len(x))).float() for x in ref_lp]
    adv = [torch.from_numpy(rng.normal(0, 1, len(s))).float() for s in c["sequences"]]
    batch = materialize(
        plan, c["sequences"], payloads={"old": old, "adv": adv}, trainable=c["trainable"], groups=c["groups"]
    )
    kw = dict(clip_low=0.2, clip_high=0.28, normalization="group")
    ref = naive_ppo_clip_loss(
        [torch.nan_to_num(x) for x in reference_logprobs(model, c["sequences"], flags)],
        flags,
        advantages=adv,
        old_logprobs=old,
        groups=c["groups"],
        **kw,
    )
    params = [q for q in model.parameters()]
    want = torch.autograd.grad(ref, params)
    for backend in ("sdpa", "flash"):
        lp = batch.target_logprobs(packed_forward(model, batch, backend=backend, varlen_fn=naive_varlen_attention))
        loss = ppo_clip_loss(lp, batch, advantages="adv", old_logprobs="old", **kw)
        got = torch.autograd.grad(loss, params)
        assert_close(f"{backend} loss", ref.detach().double(), loss.detach().double(), atol=1e-7, ratio=1e-6)
        assert_close(f"{backend} grads", list(want), list(got), ratio=1e-4)


def _routing_case():
    """Three sequences on one 20-token prompt; routing [tokens, layers=2, top_k=2]."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, VOCAB, 20)
    seqs = [np.concatenate([prompt, rng.integers(0, VOCAB, n)]) for n in (6, 8, 5)]
    routing = [rng.integers(0, 8, (len(s), 2, 2)) for s in seqs]
    for r in routing[1:]:
        r[:20] = routing[0][:20]
    routing[2][13, 1, 0] = (routing[0][13, 1, 0] + 1) % 8  # sequence 2 routed token 13 differently
    return seqs, routing


def test_disagreeing_routing_is_refused_naming_the_sequences():
    seqs, routing = _routing_case()
    plan = plan_batch(seqs, seq_len=64, min_shared_len=4, trainable=[20] * 3)
    validate_plan(plan, seqs, trainable=[20] * 3)
    with pytest.raises(PayloadMismatchError, match=r"sequences 2 and 0 share token 13") as e:
        materialize(plan, seqs, trainable=[20] * 3, input_payloads={"routing": routing})
    assert isinstance(e.value, RequestError) and e.value.rule == "sharers_disagree"
    assert e.value.path == "$.input_payloads.routing[2]" and e.value.sequences == (2, 0)


def test_routing_keys_keep_disagreeing_tokens_apart():
    seqs, routing = _routing_case()
    keys = routing_keys(routing)
    assert all(k.dtype == np.uint64 and k.shape == (len(s),) for k, s in zip(keys, seqs))
    for a, b in zip(keys, naive_routing_keys(routing)):
        assert np.array_equal(a, b)
    assert np.array_equal(keys[0][:13], keys[2][:13]) and keys[0][13] != keys[2][13]
    plan = plan_batch(seqs, seq_len=64, min_shared_len=4, trainable=[20] * 3, keys=keys)
    validate_plan(plan, seqs, trainable=[20] * 3)
    batch = materialize(plan, seqs, trainable=[20] * 3, input_payloads={"routing": routing})
    packed = batch.payloads["routing"].reshape(-1, 2, 2)
    for s, r in enumerate(routing):
        row, idx = batch.locate(s)
        assert torch.equal(packed[row * plan.seq_len + torch.as_tensor(idx)], torch.as_tensor(r))
    # Sequence 2 still shares its first 13 tokens, where its routing agrees.
    (_, i0), (_, i2) = batch.locate(0), batch.locate(2)
    assert np.array_equal(i0[:13], i2[:13]) and i0[13] != i2[13]


def test_routing_keys_errors():
    with pytest.raises(TypeError, match="expert indices"):
        routing_keys([np.zeros((3, 2, 2), dtype=np.float32)])
    with pytest.raises(ValueError, match=r"routing array must be \[tokens"):
        routing_keys([np.int64(3)])
