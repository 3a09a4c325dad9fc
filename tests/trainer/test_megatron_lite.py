"""The torch-only parts of treepack.trainer.megatron, in the main env (no Megatron installed).

The backend itself runs in ``make test-megatron`` (tests/megatron). Here: the package imports
without Megatron and ``from_hf`` names what to install; the vocab-parallel log-probabilities
and entropies on one rank (the whole vocabulary plus Megatron's padding entries) equal the
packed batch's own log-softmax and the loop reference, with a negative control (padding
entries left in the softmax); the tree mask in Megatron's convention (True = masked out).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from treepack.service.planner import plan_batch
from treepack.trainer import materialize
from treepack.trainer.megatron import (
    INSTALL_HINT,
    from_hf,
    naive_vocab_parallel_target_logprobs,
    tree_attention_mask,
    vocab_parallel_target_logprobs,
)

from helpers.tolerance import assert_close, assert_not_close

V, PADDED = 50, 56


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, V, size=9)
    seqs = [np.concatenate([prompt, rng.integers(0, V, size=5)]).astype(np.uint32) for _ in range(3)]
    plan = plan_batch(seqs, seq_len=32, min_shared_len=2, trainable=[9, 9, 9])
    return materialize(plan, seqs)


def _has_megatron() -> bool:
    # Not find_spec("megatron"): with tests/ on sys.path, tests/megatron is a namespace package of that name.
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


@pytest.mark.skipif(_has_megatron(), reason="megatron is installed here")
def test_from_hf_names_what_to_install():
    with pytest.raises(ImportError, match="megatron-core .* and megatron-bridge") as e:
        from_hf(torch.nn.Linear(2, 2))
    assert INSTALL_HINT in str(e.value)


def test_vocab_parallel_logprobs_and_entropy_on_one_rank(batch):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch.num_rows, batch.seq_len, PADDED, generator=gen, dtype=torch.float64)
    logits[..., V:] += 3.0  # Megatron's padding rows are not trained: large logits there must not count
    logits.requires_grad_(True)
    lp, ent = vocab_parallel_target_logprobs(logits, batch, vocab_size=V, with_entropy=True)
    want_lp, want_ent = batch.target_logprobs(logits[..., :V], with_entropy=True)
    assert_close("logprobs", want_lp, lp, atol=1e-12)
    assert_close("entropy", want_ent, ent, atol=1e-12)
    nlp, nent = naive_vocab_parallel_target_logprobs(logits, batch, vocab_size=V, with_entropy=True)
    assert_close("naive logprobs", nlp, lp, atol=1e-12)
    assert_close("naive entropy", nent, ent, atol=1e-12)
    g = torch.autograd.grad((lp.sum() + ent.sum()), logits)[0]
    g_want = torch.autograd.grad((want_lp.sum() + want_ent.sum()), logits)[0]
    assert_close("gradient", g_want, g, atol=1e-12)
    assert torch.count_nonzero(g[..., V:]) == 0  # the padding entries get no gradient
    # Negative control: the padding entries left in the softmax.
    padded = vocab_parallel_target_logprobs(logits, batch, vocab_size=PADDED)
    assert_not_close("padding in the softmax", want_lp, padded, atol=1e-2)


def test_vocab_parallel_refuses_bad_inputs(batch):
    from treepack.proto.errors import RequestError

    logits = torch.zeros(batch.num_rows, batch.seq_len, PADDED)
    with pytest.raises(RequestError, match="vocab_size must be a positive int"):
        vocab_parallel_target_logprobs(logits, batch, vocab_size=0)
    with pytest.raises(RequestError, match="fewer than vocab_size"):
        vocab_parallel_target_logprobs(logits, batch, vocab_size=PADDED + 1)
    with pytest.raises(RequestError, match="logits must have shape"):
        vocab_parallel_target_logprobs(logits[0], batch, vocab_size=V)


def test_tree_attention_mask_is_megatron_convention(batch):
    m = tree_attention_mask(batch)
    assert m.shape == (batch.num_rows, 1, batch.seq_len, batch.seq_len) and m.dtype == torch.bool
    assert torch.equal(m, ~batch.dense_mask())
    assert not m.diagonal(dim1=-2, dim2=-1).any()  # a query always sees itself: never masked out
    future = torch.ones(batch.seq_len, batch.seq_len, dtype=torch.bool).triu(1)
    assert m[:, 0][:, future].all()  # the future is always masked out
