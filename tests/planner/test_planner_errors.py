"""Bad input raises the project's errors, naming the value, the rule and where."""

from __future__ import annotations

import numpy as np
import pytest

from treepack.proto.errors import CapacityError, InputTypeError, RequestError
from treepack.service.planner import plan_batch

OK = [np.arange(10), np.arange(12)]

CASES = [
    # (kwargs, exception, text in message, path, rule)
    (
        dict(sequences=[np.arange(20)], seq_len=16),
        CapacityError,
        "sequence 0 has 20 tokens, longer than seq_len 16",
        "$.sequences[0]",
        "max_len",
    ),
    (
        dict(sequences=[np.arange(5), np.arange(40)], seq_len=32),
        CapacityError,
        "sequence 1 has 40 tokens",
        "$.sequences[1]",
        "max_len",
    ),
    (
        dict(sequences=OK, seq_len=64, trainable=[np.ones(10, bool), np.ones(11, bool)]),
        RequestError,
        "11 flags for 12 tokens",
        "$.sequences[1].trainable",
        "length_mismatch",
    ),
    (
        dict(sequences=OK, seq_len=64, trainable=[3]),
        RequestError,
        "1 entries for 2 sequences",
        "$.trainable",
        "length_mismatch",
    ),
    (
        dict(sequences=OK, seq_len=64, trainable=[3, 13]),
        RequestError,
        "prompt length must be in [0, 12], got 13",
        "$.sequences[1].trainable",
        "prompt_len_range",
    ),
    (
        dict(sequences=[np.array([1, -5, 2])], seq_len=64),
        RequestError,
        "token id must be >= 0, got -5",
        "$.sequences[0][1]",
        "token_range",
    ),
    (
        dict(sequences=[np.array([1, 2**32])], seq_len=64),
        RequestError,
        "token id must fit uint32",
        "$.sequences[0][1]",
        "token_range",
    ),
    (
        dict(sequences=[np.array([1.5, 2.0])], seq_len=64),
        InputTypeError,
        "expected integer token ids, got dtype float64",
        "$.sequences[0]",
        "dtype",
    ),
    (dict(sequences=[np.zeros((2, 2), int)], seq_len=64), InputTypeError, "1-D", "$.sequences[0]", "ndim"),
    (dict(sequences=[], seq_len=64), RequestError, "the batch is empty", "$.sequences", "non_empty"),
    (dict(sequences=[np.arange(0)], seq_len=64), RequestError, "no tokens", "$.sequences[0]", "non_empty"),
    (dict(sequences=OK, seq_len=64, placement="best"), RequestError, "unknown placement 'best'", "$.placement", "enum"),
    (
        dict(sequences=OK, seq_len=64, min_shared_len=0),
        RequestError,
        "min_shared_len must be >= 1, got 0",
        "$.min_shared_len",
        "minimum",
    ),
    (
        dict(sequences=OK, seq_len=64, min_shared_len=2.5),
        InputTypeError,
        "min_shared_len must be an int",
        "$.min_shared_len",
        "type",
    ),
    (dict(sequences=OK, seq_len=0), RequestError, "seq_len must be > 0", "$.seq_len", "positive"),
    (dict(sequences=OK, seq_len="64"), InputTypeError, "seq_len must be an int", "$.seq_len", "type"),
    (
        dict(sequences=OK, seq_len=64, on_overflow="clip"),
        RequestError,
        "on_overflow must be one of",
        "$.on_overflow",
        "enum",
    ),
    (dict(sequences=OK, seq_len=64, num_ranks=0), RequestError, "num_ranks must be >= 1", "$.num_ranks", "minimum"),
    (
        dict(sequences=OK, seq_len=64, groups=[1]),
        RequestError,
        "groups has 1 entries for 2 sequences",
        "$.groups",
        "length_mismatch",
    ),
    (
        dict(sequences=OK, seq_len=64, groups=[1, 2.5]),
        InputTypeError,
        "group must be an int or a string",
        "$.groups[1]",
        "type",
    ),
    (
        dict(sequences=OK, seq_len=64, keys=[None, np.zeros(3, np.uint64)]),
        RequestError,
        "keys must be one uint64 per token (12)",
        "$.sequences[1].keys",
        "length_mismatch",
    ),
    (
        dict(sequences=OK, seq_len=64, trainable=[np.full(10, 2), 12]),
        InputTypeError,
        "expected bools or 0/1",
        "$.sequences[0].trainable",
        "dtype",
    ),
    (
        dict(sequences=OK, seq_len=64, conv_width=0),
        RequestError,
        "conv_width must be in [1, 64]",
        "$.conv_width",
        "range",
    ),
    (dict(sequences="abc", seq_len=64), InputTypeError, "sequences must be a list", "$.sequences", "type"),
]


@pytest.mark.parametrize("kwargs,exc,text,path,rule", CASES, ids=[c[3] + ":" + c[4] for c in CASES])
def test_bad_input(kwargs, exc, text, path, rule):
    with pytest.raises(exc) as info:
        plan_batch(**kwargs)
    err = info.value
    assert text in err.message, err.message
    assert err.path == path
    assert err.rule == rule
    assert isinstance(err, ValueError)
    assert path in str(err)


def test_capacity_error_names_index_length_and_capacity():
    with pytest.raises(CapacityError) as info:
        plan_batch([np.arange(10), np.arange(300)], seq_len=256)
    msg = str(info.value)
    assert "sequence 1" in msg and "300" in msg and "256" in msg


def test_truncate_and_drop_are_reported_not_silent():
    seqs = [np.arange(10), np.arange(300)]
    t = plan_batch(seqs, seq_len=256, on_overflow="truncate")
    assert [(e.index, e.length, e.action) for e in t.overflow] == [(1, 300, "truncate")]
    assert t.seq_lens.tolist() == [10, 256] and t.orig_lens.tolist() == [10, 300]
    d = plan_batch(seqs, seq_len=256, on_overflow="drop")
    assert [(e.index, e.action) for e in d.overflow] == [(1, "drop")]
    assert d.row_of[1] == -1 and d.stats.kept_sequences == 1
    with pytest.raises(ValueError, match="dropped"):
        d.locate(1)


def test_uint_inputs_are_accepted_without_checks():
    plan = plan_batch([np.arange(10, dtype=np.uint16), np.arange(10, dtype=np.uint32), [1, 2, 3]], seq_len=64)
    assert plan.num_rows == 1
