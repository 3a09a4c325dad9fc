"""``plan_batch`` without ``trainable=`` says that it plans every token as a non-target
(the ``treepack plan`` command refuses such input); ``trainable=None`` says so on purpose.

The suite ignores :class:`NoTrainableWarning` (pyproject.toml: the planner's tests plan token
structure without loss targets); these tests catch it with ``pytest.warns``, which sees it anyway.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from treepack.proto import PackInput
from treepack.proto.errors import NoTrainableWarning, TreepackWarning
from treepack.service.planner import plan_batch

SEQS = [np.arange(20), np.arange(20)]


def test_no_trainable_argument_warns_naming_both_ways_out():
    with pytest.warns(NoTrainableWarning, match=r"no trainable=.*trainable=None to say nothing is trained") as rec:
        plan = plan_batch(SEQS, seq_len=64, min_shared_len=4)
    assert issubclass(NoTrainableWarning, TreepackWarning)
    assert rec[0].filename == __file__  # points at the caller's line
    assert plan.stats.tree_tokens == 20  # planned as nothing trained: the two copies share everything


@pytest.mark.parametrize(
    "call",
    [
        lambda: plan_batch(SEQS, seq_len=64, min_shared_len=4, trainable=None),
        lambda: plan_batch(SEQS, seq_len=64, min_shared_len=4, trainable=[10, 10]),
        lambda: plan_batch(PackInput.of(SEQS, seq_len=64, min_shared_len=4)),
    ],
    ids=["explicit None", "prompt lengths", "a PackInput"],
)
def test_an_explicit_trainable_is_not_warned_about(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoTrainableWarning)
        call()
