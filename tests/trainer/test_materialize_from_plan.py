"""materialize takes the trainable flags and groups from the plan; disagreeing ones raise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.service.planner import plan_batch
from treepack.trainer import materialize

from helpers.trainer_cases import mixed_batch, plan_of

FIELDS = (
    "input_ids",
    "position_ids",
    "subtree_end",
    "targets",
    "loss_mask",
    "owner",
    "score_seq",
    "score_pos",
    "score_counts",
    "groups",
)


@pytest.fixture(scope="module")
def case():
    c = mixed_batch()
    return c, plan_of(c)


def test_defaults_are_the_plans_flags_and_groups(case):
    c, plan = case
    given = materialize(plan, c["sequences"], trainable=c["trainable"], groups=c["groups"])
    default = materialize(plan, c["sequences"])
    assert default.loss_mask.any()
    for f in FIELDS:
        assert torch.equal(getattr(given, f), getattr(default, f)), f


def test_prompt_length_plans_too():
    rng = np.random.default_rng(0)
    p = rng.integers(0, 50, 10)
    seqs = [np.concatenate([p, rng.integers(0, 50, n)]) for n in (3, 5, 4)]
    plan = plan_batch(seqs, seq_len=48, min_shared_len=2, trainable=[10, 10, 10], groups=["q", "q", "r"])
    b = materialize(plan, seqs)
    assert b.score_counts.tolist() == [3, 5, 4]
    assert b.groups.tolist() == [0, 0, 1]
    assert torch.equal(b.loss_mask, materialize(plan, seqs, trainable=[10, 10, 10], groups=["q", "q", "r"]).loss_mask)


def test_disagreeing_flags_raise_naming_the_sequence(case):
    c, plan = case
    wrong = list(c["trainable"])
    wrong[6] = np.array(wrong[6], copy=True)
    wrong[6][21] = ~wrong[6][21]
    with pytest.raises(RequestError, match="sequence 6, token 21") as e:
        materialize(plan, c["sequences"], trainable=wrong)
    assert e.value.rule == "plan_mismatch" and e.value.path == "$.trainable[6]"
    off_by_one = [t + 1 if isinstance(t, int) else t for t in c["trainable"]]
    with pytest.raises(RequestError, match="disagrees with the plan"):
        materialize(plan, c["sequences"], trainable=off_by_one)


def test_disagreeing_groups_raise(case):
    c, plan = case
    with pytest.raises(RequestError, match="groups disagree with the plan at sequence 1 ") as e:
        materialize(plan, c["sequences"], groups=None if False else list(range(len(c["sequences"]))))
    assert e.value.rule == "plan_mismatch"
    relabelled = [None if g is None else f"x{g}" for g in c["groups"]]  # same partition, other labels
    assert torch.equal(
        materialize(plan, c["sequences"], groups=relabelled).groups, materialize(plan, c["sequences"]).groups
    )


def test_empty_loss_mask_raises():
    seqs = [np.arange(8), np.arange(5) + 3]
    plan = plan_batch(seqs, seq_len=16, min_shared_len=2)
    with pytest.raises(RequestError, match="loss mask would be empty") as e:
        materialize(plan, seqs)
    assert e.value.rule == "empty_loss_mask"
    b = materialize(plan, seqs, allow_empty_loss=True, advise=False)
    assert not b.loss_mask.any() and b.num_scored == 0
    only_first = plan_batch(seqs, seq_len=16, min_shared_len=2, trainable=[np.eye(8, dtype=bool)[0], np.zeros(5, bool)])
    with pytest.raises(RequestError, match="loss mask would be empty"):
        materialize(only_first, seqs)  # a first token is predicted by nothing
