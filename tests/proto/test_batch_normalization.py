"""The one normalisation of trainable flags and group ids (planner, wire and trainer)."""

from __future__ import annotations

import numpy as np
import pytest

from treepack.proto.batch_fields import group_codes, normalize_trainable
from treepack.proto.errors import InputTypeError, RequestError
from treepack.service.planner import plan_batch


def test_trainable_forms_cut_to_the_placed_lengths():
    seqs = [np.arange(10), np.arange(80)]
    plan = plan_batch(seqs, seq_len=64, trainable=[4, 70], on_overflow="truncate")
    flags = normalize_trainable([np.arange(10) >= 4, 70], plan.seq_lens, plan.orig_lens)
    assert flags(0).tolist() == plan.trainable_of(0).tolist() == [False] * 4 + [True] * 6
    assert flags(1).shape == (64,) and not flags(1).any() and not plan.trainable_of(1).any()
    assert not normalize_trainable(None, plan.seq_lens)(0).any()
    with pytest.raises(RequestError) as e:
        normalize_trainable([np.ones(9, bool), 3], plan.seq_lens, plan.orig_lens)(0)
    assert (e.value.path, e.value.rule, e.value.message) == (
        "$.trainable[0]",
        "length_mismatch",
        "trainable has 9 flags for 10 tokens",
    )
    with pytest.raises(InputTypeError) as e:
        normalize_trainable([True, 3], plan.seq_lens)(0)
    assert e.value.rule == "type"


def test_group_codes_in_order_of_first_appearance():
    codes, labels = group_codes(["b", "a", None, "b", 7], 5)
    assert codes.tolist() == [0, 1, 2, 0, 3] and labels == ("b", "a", None, 7)
    plan = plan_batch([np.arange(5)] * 5, seq_len=64, groups=["b", "a", None, "b", 7])
    assert plan.group_codes.tolist() == codes.tolist()
    with pytest.raises(InputTypeError) as e:
        group_codes([1.5], 1)
    assert (e.value.path, e.value.rule) == ("$.groups[0]", "type")
