"""The warnings a trainer needs: no sharing, min_shared_len hiding sharing, a large dense mask."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import treepack.trainer.data.advice as advice
from treepack.service.planner import plan_batch
from treepack.trainer import materialize
from treepack.trainer.data.advice import TreepackWarning, hidden_sharing


def _grpo(prompt_len, completion_len, prompts=4, per_prompt=8, seed=0):
    rng = np.random.default_rng(seed)
    seqs, trainable, groups = [], [], []
    for q in range(prompts):
        p = rng.integers(0, 1000, prompt_len)
        for _ in range(per_prompt):
            seqs.append(np.concatenate([p, rng.integers(0, 1000, completion_len)]))
            trainable.append(prompt_len)
            groups.append(q)
    return seqs, trainable, groups


def _plan(seqs, trainable, msl, seq_len=512):
    return plan_batch(seqs, seq_len=seq_len, min_shared_len=msl, trainable=trainable)


def test_no_sharing_warns():
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 1000, 20) for _ in range(5)]
    plan = _plan(seqs, [5] * 5, 4, seq_len=64)
    with pytest.warns(TreepackWarning, match="shares no token among its 5 sequences"):
        materialize(plan, seqs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TreepackWarning)
        materialize(plan, seqs, advise=False)


def test_min_shared_len_hiding_sharing_warns_with_the_estimate():
    """GRPO prompts of 40 tokens: at min_shared_len=64 nothing is shared, at 32 the prompts are."""
    seqs, trainable, _ = _grpo(40, 10)
    hidden = _plan(seqs, trainable, 64)
    small = _plan(seqs, trainable, 32)
    assert hidden.stats.saved_fraction < small.stats.saved_fraction
    with (
        pytest.warns(TreepackWarning, match=r"min_shared_len=64 hides sharing.*at min_shared_len=32"),
        pytest.warns(TreepackWarning, match="shares no token among its 32 sequences"),
    ):
        materialize(hidden, seqs)
    # The estimate is an upper bound of what the replan saves, and here it is the replan's saving.
    saved = hidden.stats.packed_tokens - small.stats.packed_tokens
    est = hidden_sharing(
        hidden, np.concatenate(seqs), np.concatenate([[0], np.cumsum([len(s) for s in seqs])]), np.arange(len(seqs))
    )
    assert est[32] >= saved > 0, (est, saved)
    assert est[32] == 4 * 7 * 39  # 7 sharers after the first of each prompt, 39 shareable tokens (before the join)
    with warnings.catch_warnings():  # no warning once nothing is hidden
        warnings.simplefilter("error", TreepackWarning)
        materialize(small, seqs)


def test_hidden_sharing_below_the_warning_fraction_is_quiet(monkeypatch):
    seqs, trainable, _ = _grpo(40, 10)
    plan = _plan(seqs, trainable, 64)
    monkeypatch.setattr(advice, "HIDDEN_SHARING_WARN_FRACTION", 0.99)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", TreepackWarning)
        materialize(plan, seqs)
    assert [str(w.message) for w in seen if "hides sharing" in str(w.message)] == []
    assert any("shares no token" in str(w.message) for w in seen)


def test_dense_mask_size_warns(monkeypatch):
    seqs, trainable, _ = _grpo(40, 10, prompts=1)
    batch = materialize(_plan(seqs, trainable, 8), seqs)
    monkeypatch.setattr(advice, "DENSE_MASK_WARN_BYTES", batch.num_rows * batch.seq_len**2 - 1)
    with pytest.warns(TreepackWarning, match="dense tree mask of 1 rows of 512"):
        batch.dense_mask()
    monkeypatch.setattr(advice, "DENSE_MASK_WARN_BYTES", batch.num_rows * batch.seq_len**2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TreepackWarning)
        batch.dense_mask(sliding_window=4)
