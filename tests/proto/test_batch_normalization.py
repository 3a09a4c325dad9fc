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


def _batches_equal(a, b) -> None:
    for f in ("lens", "orig_lens", "kept", "first_trainable", "group_codes"):
        assert np.array_equal(getattr(a, f), getattr(b, f)) and getattr(a, f).dtype == getattr(b, f).dtype, f
    for f in ("trainable", "prompt_lens"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert (
                all(np.array_equal(p, q) for p, q in zip(x, y, strict=True))
                if f == "trainable"
                else (np.array_equal(x, y))
            ), f
    assert a.group_labels == b.group_labels and [type(x) for x in a.group_labels] == [type(x) for x in b.group_labels]
    assert a.overflow == b.overflow and (a.keys is None) == (b.keys is None)
    assert all(
        x.dtype == np.uint32 and x.flags.c_contiguous and np.array_equal(x, y) for x, y in zip(a.tokens, b.tokens)
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_common_sequence_path_equals_the_general_checks(seed, monkeypatch):
    """uint32 arrays with prompt lengths and int group ids take the short path (attribute
    reads, numpy group codes); the same batch as lists and numpy ints takes every general
    check. Both give the same batch, overflow, flags and group labels included."""
    from treepack.proto import batch as B
    from treepack.proto import batch_fields as F

    rng = np.random.default_rng(seed)
    n, C = 60, 40
    arrays = [rng.integers(0, 2**32, int(rng.integers(1, 60)), dtype=np.uint32) for _ in range(n)]
    trainable = [int(rng.integers(0, len(a) + 1)) for a in arrays]
    trainable[3] = np.arange(len(arrays[3])) % 2 == 0  # one sequence with flags: every other prompt becomes flags
    groups = [int(g) for g in rng.integers(-(2**62), 2**62, 9)[rng.integers(0, 9, n)]]
    general = []
    one = B._normalize_one
    monkeypatch.setattr(B, "_normalize_one", lambda *a: general.append(a[3]) or one(*a))
    for on_overflow in ("truncate", "drop"):
        general.clear()
        fast = B.normalize_batch(arrays, seq_len=C, trainable=trainable, groups=groups, on_overflow=on_overflow)
        # Not vacuous: the general checks ran only for the long sequences and the flags.
        assert sorted(general) == sorted({3} | {s for s, a in enumerate(arrays) if len(a) > C}) != []
        general.clear()
        slow = B.normalize_batch(
            [a.tolist() for a in arrays],
            seq_len=C,
            trainable=[t if isinstance(t, np.ndarray) else np.int64(t) for t in trainable],
            groups=[np.int64(g) for g in groups],
            on_overflow=on_overflow,
        )
        assert general == list(range(n))
        _batches_equal(fast, slow)
        assert fast.overflow
    # Negative control: the short path is taken only where it is the general path's answer.
    strided = np.arange(20, dtype=np.uint32)[::2]
    out = B.normalize_batch([strided], seq_len=C)
    assert out.tokens[0] is not strided and out.tokens[0].flags.c_contiguous
    with pytest.raises(RequestError) as e:
        B.normalize_batch([np.arange(5, dtype=np.uint32)], seq_len=C, trainable=[6])
    assert e.value.rule == "prompt_len_range"
    with pytest.raises(InputTypeError):
        B.normalize_batch([np.arange(5, dtype=np.uint32)], seq_len=C, trainable=[True])
    assert F._int_group_codes([1, True]) is None and F._int_group_codes([2**63]) is None
    with pytest.raises(RequestError) as e:
        group_codes([1, 2**63], 2)
    assert (e.value.path, e.value.rule) == ("$.groups[1]", "int64")
