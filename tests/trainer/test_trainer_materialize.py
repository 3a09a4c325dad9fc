"""materialize / PackedBatch: tokens, positions, targets, payloads, locate and the mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.index import local_row_index, localize_flat
from treepack.trainer import materialize
from treepack.trainer.kernels.masks import naive_dense_mask

from helpers.trainer_cases import VOCAB, mixed_batch, plan_of, random_batch, trainable_flags


def _check_batch(case, plan, batch) -> int:
    """Every invariant of a materialized batch against the sequences; returns scored count."""
    seqs = case["sequences"]
    flags = trainable_flags(case)
    mask = batch.dense_mask()
    assert torch.equal(mask, naive_dense_mask(batch.plan, batch.rows))
    seen = torch.zeros(batch.num_rows, batch.seq_len, dtype=torch.int64)
    scored = 0
    for s, seq in enumerate(seqs):
        row, idx = batch.locate(s)
        n = len(seq)
        assert idx.shape == (n,) and bool((idx[1:] > idx[:-1]).all())
        assert torch.equal(batch.input_ids[row, idx], torch.as_tensor(seq, dtype=torch.int64))
        assert torch.equal(batch.position_ids[row, idx], torch.arange(n))
        # The last token sees exactly the sequence's own tokens.
        visible = torch.nonzero(mask[row, 0, idx[-1]]).flatten()
        assert torch.equal(visible, idx)
        # Targets: the sequence's next token at each scored position, unique owner.
        f = flags[s]
        for p in range(n - 1):
            if f[p + 1]:
                i = int(idx[p])
                assert int(batch.targets[row, i]) == int(seq[p + 1])
                assert bool(batch.loss_mask[row, i]) and int(batch.owner[row, i]) == s
                seen[row, i] += 1
                scored += 1
    # Default mode: every scored position belongs to exactly one sequence, nothing else is scored.
    assert torch.equal(seen > 0, batch.loss_mask) and int(seen.max()) <= 1
    assert bool((batch.targets[~batch.loss_mask] == -1).all())
    # Padding: position 0, sees itself only.
    used = torch.zeros_like(batch.loss_mask)
    for k, r in enumerate(batch.rows.tolist()):
        n = int(plan.segments.row_len[r]) if r >= 0 else 0
        used[k, :n] = True
        assert torch.equal(batch.subtree_end[k, n:], torch.arange(n + 1, batch.seq_len + 1))
    assert bool((batch.position_ids[~used] == 0).all())
    return scored


def test_mixed_batch_layout_and_locate():
    case = mixed_batch()
    plan = plan_of(case)
    batch = materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"])
    assert batch.num_rows == plan.num_rows and batch.seq_len == 64
    assert _check_batch(case, plan, batch) == batch.num_scored == int(batch.loss_mask.sum())
    # The case really has what it promises: depth >= 2, several trees in a row, padding.
    seg = plan.segments
    assert int(seg.depth.max()) >= 2 and int((seg.sharers >= 2).sum()) >= 3
    assert any(int((seg.parent[seg.row_ptr[r] : seg.row_ptr[r + 1]] == -1).sum()) >= 2 for r in range(plan.num_rows))
    assert int(plan.stats.padding_tokens) > 0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_random_batches(seed):
    case = random_batch(seed)
    plan = plan_of(case)
    batch = materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"], advise=False)
    _check_batch(case, plan, batch)
    assert batch.score_counts.tolist() == [int(f[1:].sum()) for f in trainable_flags(case)]


def test_payloads_target_and_input_aligned():
    case = mixed_batch()
    plan = plan_of(case)
    seqs = case["sequences"]
    old = [torch.randn(len(s), dtype=torch.float64) for s in seqs]
    # Routing replay [tokens, layers, top_k] made from the tokens, so shared tokens agree.
    routing = [np.stack([np.stack([s * 3 + k, s * 5 + k]) for k in range(2)], -1).transpose(1, 0, 2) % 64 for s in seqs]
    loaded = []

    class Lazy:
        def __len__(self):
            return len(seqs)

        def __getitem__(self, s):
            loaded.append(s)
            return old[s].numpy()

    adv_flat = torch.as_tensor(np.concatenate([np.full(len(s), float(i)) for i, s in enumerate(seqs)]))
    batch = materialize(
        plan,
        seqs,
        payloads={"old": Lazy(), "adv": adv_flat, "w": lambda s: np.ones(len(seqs[s]), np.float32)},
        input_payloads={"routing": routing},
        trainable=case["trainable"],
        rows=[1],
    )
    held = set(np.flatnonzero(plan.row_of == 1).tolist())
    assert set(loaded) == held, "a lazy payload was read for a sequence of another row"
    assert batch.payloads["routing"].shape == (1, 64, 2, 2) and batch.payloads["routing"].dtype == torch.int64
    flags = trainable_flags(case)
    for s in held:
        row, idx = batch.locate(s)
        assert torch.equal(batch.payloads["routing"][row, idx], torch.as_tensor(routing[s]))
        for p in range(len(seqs[s]) - 1):
            i = int(idx[p])
            if flags[s][p + 1]:
                assert float(batch.payloads["old"][row, i]) == float(old[s][p + 1])
                assert float(batch.payloads["adv"][row, i]) == float(s)
            else:
                assert torch.isnan(batch.payloads["old"][row, i])
    assert batch.entry_payloads["w"].shape == (batch.num_scored,) and batch.entry_payloads["w"].dtype == torch.float32
    assert torch.equal(batch.entry_payloads["old"], batch.payloads["old"].reshape(-1)[batch.score_flat])
    # Unwritten slots show: NaN for floats, -1 for integers.
    assert torch.isnan(batch.payloads["old"][~batch.loss_mask]).all()
    pad = batch.input_ids.new_zeros(batch.input_ids.shape, dtype=torch.bool)
    pad[0, int(plan.segments.row_len[1]) :] = True
    assert bool((batch.payloads["routing"][pad] == -1).all())


def test_rank_rows_with_empty_padding_rows():
    case = mixed_batch()
    plan = plan_of(case, num_ranks=2)
    rows = plan.ranks.rank_rows
    assert rows.shape == (2, 2) and int((rows == -1).sum()) == 1
    seen = set()
    full = materialize(plan, case["sequences"], trainable=case["trainable"])
    every = np.arange(plan.num_rows * plan.seq_len)
    for p in range(2):
        batch = materialize(plan, case["sequences"], trainable=case["trainable"], rows=rows[p])
        assert batch.num_rows == 2
        # Plan-wide flat positions (GDN conv context) map onto this rank's rows.
        local_of_row = local_row_index(batch.rows, plan.num_rows)
        loc = localize_flat(every, local_of_row, plan.seq_len)
        here = loc >= 0
        assert set(np.unique(every[here] // plan.seq_len)) == set(rows[p][rows[p] >= 0].tolist())
        assert torch.equal(batch.input_ids.reshape(-1)[loc[here]], full.input_ids.reshape(-1)[every[here]])
        assert localize_flat(np.array([-1]), local_of_row, plan.seq_len)[0] == -1
        for k in np.flatnonzero(batch.empty_rows):
            assert bool((batch.input_ids[k] == 0).all()) and not bool(batch.loss_mask[k].any())
            assert torch.equal(batch.subtree_end[k], torch.arange(1, 65))
        seen |= set(batch.local_seqs.tolist())
        for s in range(plan.num_sequences):
            if s not in set(batch.local_seqs.tolist()):
                with pytest.raises(RequestError, match="not materialized"):
                    batch.locate(s)
    assert seen == set(range(plan.num_sequences))
    # Global counts for the normalizations, whatever the rank holds.
    assert int(batch.score_counts.sum()) == sum(int(f[1:].sum()) for f in trainable_flags(case))


def test_truncated_and_dropped_sequences():
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, VOCAB, n) for n in (10, 40, 12, 50)]
    for mode in ("truncate", "drop"):
        plan = plan_batch_kw(seqs, mode)
        batch = materialize(plan, seqs, trainable=[3] * 4, advise=False)
        for s in range(4):
            n = int(plan.seq_lens[s])
            if n == 0:
                with pytest.raises(RequestError, match="dropped"):
                    batch.locate(s)
                assert batch.unpack_logprobs(torch.zeros(batch.num_rows, 32, VOCAB))[s] is None
                continue
            row, idx = batch.locate(s)
            assert torch.equal(batch.input_ids[row, idx], torch.as_tensor(seqs[s][:n]))


def plan_batch_kw(seqs, mode):
    from treepack.service.planner import plan_batch, validate_plan

    plan = plan_batch(seqs, seq_len=32, trainable=[3] * len(seqs), on_overflow=mode, min_shared_len=4)
    validate_plan(plan)
    return plan


def test_errors_name_what_and_where():
    case = mixed_batch()
    plan = plan_of(case)
    seqs, tr = case["sequences"], case["trainable"]
    with pytest.raises(RequestError, match=r"sequences has 3 entries.*`\$.sequences`"):
        materialize(plan, seqs[:3], trainable=tr)
    bad = list(seqs)
    bad[2] = seqs[2][:-1]
    with pytest.raises(RequestError, match=r"sequences\[2\]"):
        materialize(plan, bad, trainable=tr)
    bad = list(seqs)
    bad[0] = seqs[0].copy()
    bad[0][3] = (bad[0][3] + 1) % VOCAB
    with pytest.raises(RequestError, match="differs from the planned one") as e:
        materialize(plan, bad, trainable=tr)
    assert e.value.path in ("$.sequences[0]", "$.sequences[1]", "$.sequences[2]", "$.sequences[3]", "$.sequences[4]")
    with pytest.raises(RequestError, match=r"payloads.old\[1\] has shape \(3,\)"):
        materialize(
            plan,
            seqs,
            trainable=tr,
            payloads={"old": [np.zeros(len(s)) if i != 1 else np.zeros(3) for i, s in enumerate(seqs)]},
        )
    with pytest.raises(RequestError, match=r"trainable\[0\]"):
        materialize(plan, seqs, trainable=[np.ones(2, bool)] + list(tr[1:]))
    with pytest.raises(InputTypeError):
        materialize(plan, [s.astype(np.float32) for s in seqs], trainable=tr)
    batch = materialize(plan, seqs, trainable=tr)
    with pytest.raises(RequestError, match=r"logits must have shape \[3, 64"):
        batch.unpack_logprobs(torch.zeros(3, 63, 10))
    with pytest.raises(RequestError, match="out of range"):
        batch.locate(99)


def test_generalized_sharing_consistency_check():
    """share_trainable plans score shared positions; flags other than the plan's are refused
    (a plan made without flags shares the positions the flags would score)."""
    from treepack.service.planner import plan_batch

    rng = np.random.default_rng(5)
    a = rng.integers(0, VOCAB, 12)
    b = np.concatenate([a, rng.integers(0, VOCAB, 5)])
    c = np.concatenate([a[:9], (a[9:10] + 1) % VOCAB, rng.integers(0, VOCAB, 4)])
    plan = plan_batch([a, b], seq_len=32, min_shared_len=4, trainable=[4, 4], share_trainable=True)
    batch = materialize(plan, [a, b])
    assert int(batch.loss_mask.sum()) < batch.num_scored  # shared scored positions
    assert torch.equal(batch.loss_mask, materialize(plan, [a, b], trainable=[4, 4]).loss_mask)
    plan = plan_batch([a, c], seq_len=32, min_shared_len=4)
    with pytest.raises(RequestError, match="disagrees with the plan at sequence 0, token 4"):
        materialize(plan, [a, c], trainable=[4, 4])
