"""The client's request columns: prefix references (fast == naive), the msgpack body written
straight from the arrays (== ``packb`` of the message), and input taken without copies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.proto.batch import PackInput, normalize_batch
from treepack.proto.batch_columns import BodyChunks, Column, batch_columns, msgpack_body, naive_prefix_refs, prefix_refs
from treepack.proto.batch_wire import decode_pack_request, encode_pack_body, encode_pack_request
from treepack.proto.codec import decode_body, encode_body, parse_message
from treepack.proto.pack_messages import PackRequest
from treepack.service.cli.workloads import agentic, curriculum, distillation, golden_example


def _same_refs(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 30), min_size=1, max_size=12),
    groups=st.one_of(st.none(), st.lists(st.sampled_from([0, 1, "a", None]), min_size=12, max_size=12)),
    min_prefix=st.sampled_from([0, 1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_prefix_refs_equal_the_naive_ones(lens, groups, min_prefix, seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 3, 30).astype(np.uint32)
    # Mostly a shared prompt cut at random places, then a tiny vocabulary: many ties and near-misses.
    tokens = [
        np.concatenate([prompt[: int(rng.integers(0, 31))], rng.integers(0, 2, n).astype(np.uint32)])[:n] for n in lens
    ]
    g = None if groups is None else groups[: len(lens)]
    _same_refs(prefix_refs(tokens, g, min_prefix), naive_prefix_refs(tokens, g, min_prefix))


def test_prefix_refs_confirm_a_guess_exactly():
    # A group whose members share a 100-token prompt; one member is identical to the first,
    # one agrees 3 tokens past the prompt, one is shorter than the prompt, one differs early.
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1000, 100).astype(np.uint32)
    first = np.concatenate([prompt, [7, 8, 9, 10, 11]]).astype(np.uint32)
    members = [
        first,
        np.concatenate([prompt, [1, 2]]),
        first.copy(),
        np.concatenate([prompt, [7, 8, 9, 3]]),
        prompt[:80].copy(),
        np.concatenate([prompt[:50], [5000], prompt[51:], [1]]),
        np.concatenate([prompt, [2]]),
    ]
    tokens = [np.asarray(m, dtype=np.uint32) for m in members]
    got = prefix_refs(tokens, [0] * len(tokens), 64)
    _same_refs(got, naive_prefix_refs(tokens, [0] * len(tokens), 64))
    assert got[1].tolist() == [0, 100, 105, 103, 80, 0, 100]


def test_prefix_refs_on_long_sequences():
    # Common prefixes ending in each comparison window (4096, then 8192, 16384 tokens).
    rng = np.random.default_rng(2)
    base = rng.integers(0, 50_000, 30_000).astype(np.uint32)
    tokens = [base[:20_000].copy()]
    for cut in (4095, 4096, 4097, 12_287, 12_288, 19_999):
        t = base[:20_000].copy()
        t[cut] += 1
        tokens.append(t)
    tokens += [base[:20_000].copy(), base.copy(), base[:5000].copy()]
    for groups in ([0] * len(tokens), None):
        got = prefix_refs(tokens, groups, 64)
        _same_refs(got, naive_prefix_refs(tokens, groups, 64))
    assert prefix_refs(tokens, [0] * len(tokens), 64)[1].tolist() == [
        0,
        4095,
        4096,
        4097,
        12_287,
        12_288,
        19_999,
        20_000,
        20_000,
        5000,
    ]


def _cases():
    rng = np.random.default_rng(4)
    w = curriculum(6)
    yield "curriculum", w.plan_kwargs()
    yield "agentic-flags", agentic(2).plan_kwargs()
    yield "distill", distillation(2).plan_kwargs()
    yield "golden", golden_example().plan_kwargs()
    seqs = [rng.integers(0, 4, n) for n in (70, 90, 2, 75)]  # int64, lists, uint16: the planner converts them
    yield (
        "int64-lists-keys",
        dict(
            sequences=[seqs[0].tolist(), seqs[1], seqs[2], seqs[3].astype(np.uint16)],
            keys=[None, np.ones(90, np.uint64), None, np.arange(75)],
            trainable=[3, np.arange(90) > 80, 0, 75],
            groups=[np.int64(1), np.int64(1), "x", None],
            seq_len=128,
        ),
    )
    yield (
        "np-int-groups",
        dict(sequences=w.sequences, trainable=w.trainable, groups=[np.int32(g) for g in w.groups], seq_len=w.seq_len),
    )
    yield (
        "empty-sequence",
        dict(sequences=[w.sequences[0], np.zeros(0, np.uint32)], seq_len=w.seq_len),
    )  # the server's error


@pytest.mark.parametrize("name,kwargs", list(_cases()))
def test_msgpack_body_is_packb_of_the_message(name, kwargs):
    for dedup in (True, False):
        body = encode_pack_body(PackInput.of(**kwargs, tags=None), dedup=dedup)
        assert body == encode_body(encode_pack_request(PackInput.of(**kwargs), dedup=dedup), "msgpack"), name
    msg = parse_message(PackRequest, decode_body(body, "msgpack"))
    if name != "empty-sequence":
        req = decode_pack_request(msg)
        got = req.normalize(req.options.seq_len, req.options.on_overflow)
        ref = normalize_batch(**kwargs)
        assert all(np.array_equal(a, b) for a, b in zip(got.tokens, ref.tokens))
        assert np.array_equal(got.first_trainable, ref.first_trainable) and got.group_labels == ref.group_labels


def test_msgpack_body_writes_columns_and_arrays_as_bins():
    parts = [np.arange(3, dtype="<u4"), np.zeros(0, "<u4"), np.arange(70, dtype="<u4")]
    for n in (0, 1, 255, 256, 70_000):
        a = np.arange(n, dtype="<i8")
        fields = {"a": a, "b": Column("<u4", parts), "c": [1, "x", None], "d": True}
        want = {"a": a.tobytes(), "b": np.concatenate(parts).tobytes(), "c": [1, "x", None], "d": True}
        assert msgpack_body(fields) == encode_body(want, "msgpack")


def test_wire_form_input_is_taken_without_copies():
    w = curriculum(4)
    cols = batch_columns(w.sequences, trainable=w.trainable, groups=w.groups, dedup=False)
    assert all(p is s for p, s in zip(cols.tokens.parts, w.sequences))
    assert cols.prompt_lens.tolist() == list(w.trainable)
    flags = [np.arange(len(s)) >= 5 for s in w.sequences]
    cols = batch_columns(w.sequences, trainable=flags, groups=w.groups)
    assert all(np.shares_memory(p, f) for p, f in zip(cols.trainable.parts, flags))
    # Prefix references cut views, not copies.
    assert cols.prefix_src is not None and all(
        np.shares_memory(p, s) for p, s in zip(cols.tokens.parts, w.sequences) if p.size
    )
    # Other input is converted (here by the planner's own normalization).
    cols = batch_columns([s.astype(np.int64) for s in w.sequences], dedup=False)
    assert all(
        p.dtype == np.dtype("<u4") and not np.shares_memory(p, s) for p, s in zip(cols.tokens.parts, w.sequences)
    )


def test_body_chunks_join_to_the_body_every_time():
    parts = [b"ab", np.arange(5, dtype="<u4"), b"", np.arange(3000, dtype="<i8"), b"z"]
    want = b"".join(parts)
    for size in (1, 3, 7, 64, 1 << 20):
        body = BodyChunks(parts, size)
        chunks = list(body)
        assert b"".join(chunks) == want and body.nbytes == len(want)
        assert all(len(c) == size for c in chunks[:-1]) and 0 < len(chunks[-1]) <= size
        assert b"".join(body) == want  # again: a retry sends the same bytes
