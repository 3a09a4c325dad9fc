"""The padded-batch bridge and the plan-once micro-batches, against hand-built layouts and the unpacked model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.client import Packer
from treepack.proto.errors import RequestError
from treepack.trainer import materialize
from treepack.trainer.planning.bridge import from_padded
from treepack.trainer.planning.microbatch import plan_microbatches, split_rows

from helpers.extras import require


def _padded(seqs_p, seqs_c, *, prompt_side="left", completion_side="right"):
    B = len(seqs_p)
    P, C = max(map(len, seqs_p)), max(map(len, seqs_c))
    pid, pm = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    cid, cm = torch.zeros(B, C, dtype=torch.long), torch.zeros(B, C, dtype=torch.long)
    for b, (p, c) in enumerate(zip(seqs_p, seqs_c)):
        a = P - len(p) if prompt_side == "left" else 0
        pid[b, a : a + len(p)], pm[b, a : a + len(p)] = torch.tensor(p), 1
        a = C - len(c) if completion_side == "left" else 0
        cid[b, a : a + len(c)] = torch.tensor(c, dtype=torch.long)
        cm[b, a : a + len(c)] = 1
    return pid, pm, cid, cm


PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [5, 6, 7, 8]]
COMPLETIONS = [[11, 12, 13], [11, 14], [15, 16, 17, 18], []]


@pytest.mark.parametrize("sides", [("left", "right"), ("right", "right"), ("left", "left"), ("right", "left")])
def test_sequences_flags_groups_from_any_padding(sides):
    pad = _padded(PROMPTS, COMPLETIONS, prompt_side=sides[0], completion_side=sides[1])
    ps = from_padded(*pad)
    assert [s.tolist() for s in ps.sequences] == [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert ps.trainable == [4, 4, 2, 4]
    assert ps.groups.tolist() == [0, 0, 1, 0]
    assert ps.completion_width == 4


def test_round_trip_puts_each_value_under_its_completion_token():
    # The value scattered back at [b, c] is the value at the row position predicting completion
    # token c of row b: write each position's own next-token id there and read the ids back.
    for sides in (("left", "right"), ("right", "left")):
        pid, pm, cid, cm = _padded(PROMPTS, COMPLETIONS, prompt_side=sides[0], completion_side=sides[1])
        ps = from_padded(pid, pm, cid, cm)
        plan = Packer().pack(
            ps.sequences, seq_len=16, trainable=ps.trainable, groups=ps.groups.tolist(), min_shared_len=1
        )
        assert plan.stats.saved_fraction > 0
        batch = materialize(plan, ps.sequences, trainable=ps.trainable, groups=ps.groups.tolist())
        values = batch.targets.double().requires_grad_(True)
        back = ps.to_padded(batch, values)
        assert torch.equal(back.long(), cid * cm)
        back.sum().backward()
        assert torch.equal(values.grad, batch.loss_mask.double())  # each scored position once, nothing else


def test_matches_unpacked_model_logprobs():
    from treepack.trainer import packed_forward

    from helpers.tiny_trl import tiny_model

    model = tiny_model()
    pid, pm, cid, cm = _padded(PROMPTS, COMPLETIONS)
    ps = from_padded(pid, pm, cid, cm)
    ids, mask = torch.cat([pid, cid], 1), torch.cat([pm, cm], 1)
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        ref = ref.gather(-1, ids[:, 1:, None]).squeeze(-1)[:, -cid.shape[1] :] * cm
        plan = Packer().pack(
            ps.sequences, seq_len=16, trainable=ps.trainable, groups=ps.groups.tolist(), min_shared_len=1
        )
        batch = materialize(plan, ps.sequences, trainable=ps.trainable)
        got = ps.to_padded(batch, batch.target_logprobs(packed_forward(model, batch)))
    assert torch.allclose(got, ref, atol=1e-5)


def test_refuses_holes_orphans_and_foreign_batches():
    pid, pm, cid, cm = _padded(PROMPTS, COMPLETIONS)
    hole = cm.clone()
    hole[0, 1] = 0
    with pytest.raises(RequestError, match="padding inside"):
        from_padded(pid, pm, cid, hole)
    empty = pm.clone()
    empty[2] = 0
    with pytest.raises(RequestError, match="empty prompt"):
        from_padded(pid, empty, cid, cm)
    with pytest.raises(RequestError, match="integer ids"):
        from_padded(pid.float(), pm, cid, cm)
    ps = from_padded(pid, pm, cid, cm)
    plan = Packer().pack(ps.sequences, seq_len=16, trainable=[1] * 4, min_shared_len=1)
    wrong = materialize(plan, ps.sequences, trainable=[1] * 4, advise=False)  # scores prompt tokens too
    with pytest.raises(RequestError, match="outside the completions"):
        ps.to_padded(wrong, torch.zeros(wrong.num_rows, 16))


def test_microbatches_equal_counts_every_row_once():
    rng = np.random.default_rng(0)
    seqs, trainable, groups = [], [], []
    for g in range(6):
        prompt = rng.integers(3, 40, 24)
        for _ in range(4):
            seqs.append(np.concatenate([prompt, rng.integers(3, 40, rng.integers(2, 9))]))
            trainable.append(24)
            groups.append(g)
    mb = plan_microbatches(
        seqs, num_microbatches=3, seq_len=64, trainable=trainable, groups=groups, num_ranks=2, min_shared_len=8
    )
    assert mb.rows.shape[:2] == (2, 3) and mb.plan.stats.saved_fraction > 0.4
    real = mb.rows[mb.rows >= 0]
    assert sorted(real.tolist()) == list(range(mb.plan.num_rows))
    counts = (mb.rows >= 0).sum(-1)
    assert counts.max() - counts.min() <= 1 + int(np.ptp((mb.plan.ranks.rank_rows >= 0).sum(1)))
    assert mb.plan_ms > 0
    lp = []
    for rows in mb.rows.reshape(-1, mb.rows.shape[-1]):
        b = materialize(mb.plan, seqs, trainable=trainable, groups=groups, rows=rows)
        lp.append(b.num_scored)
    assert sum(lp) == sum(len(s) - 24 for s in seqs)  # every completion token scored exactly once
    with pytest.raises(RequestError, match="num_microbatches"):
        split_rows(mb.plan, 0)


def test_group_shuffle_order_is_the_seeded_draw():
    """Interleaved prompts: the order is the groups' first landing in TRL's draw, rows in drawn order.

    The expected order is the loop-based reference; an order by group id (or any order that
    ignores the draw) fails, and the chosen seed's draw is checked to differ from both.
    """
    require("trl")
    from treepack.trainer.trl.grpo import _shuffle_keeping_groups

    from helpers.tiny_trl import group_shuffle_reference

    prompts = [[5, 6, 7], [8, 9], [3, 4, 5, 6], [7]] * 4  # rows of a group are not adjacent
    pid, pm, cid, cm = _padded(prompts, [[1, 2]] * 16)
    batch = {
        "prompt_ids": pid,
        "prompt_mask": pm,
        "completion_ids": cid,
        "completion_mask": cm,
        "idx": torch.arange(16),
        "names": list("abcdefghijklmnop"),
    }
    for seed in (3, 11):
        torch.manual_seed(seed)
        want = group_shuffle_reference(batch)["idx"].tolist()
        torch.manual_seed(seed)
        got = _shuffle_keeping_groups(batch)
        assert got["idx"].tolist() == want, (seed, got["idx"].tolist(), want)
        assert got["names"] == [batch["names"][i] for i in want]
        by_id = sorted(want, key=lambda i: (i % 4, want.index(i)))
        assert want != by_id and [i % 4 for i in want] != sorted(i % 4 for i in want), (
            "the draw must not coincide with the id order"
        )


def test_group_shuffle_keeps_prompts_together_and_draws_like_trl():
    require("trl")
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    from treepack.trainer.trl.grpo import _shuffle_keeping_groups

    pid, pm, cid, cm = _padded([[5, 6, 7]] * 4 + [[8, 9]] * 4 + [[3, 4, 5, 6]] * 4 + [[7]] * 4, [[1, 2]] * 16)
    batch = {
        "prompt_ids": pid,
        "prompt_mask": pm,
        "completion_ids": cid,
        "completion_mask": cm,
        "idx": torch.arange(16),
        "names": list("abcdefghijklmnop"),
    }
    torch.manual_seed(3)
    stock = shuffle_sequence_dict(batch)
    after_stock = torch.rand(1)
    torch.manual_seed(3)
    ours = _shuffle_keeping_groups(batch)
    assert torch.equal(torch.rand(1), after_stock)  # one randperm(B), like TRL: the random stream is unchanged
    assert sorted(ours["idx"].tolist()) == list(range(16)) and ours["names"] == [
        batch["names"][i] for i in ours["idx"].tolist()
    ]
    assert any(
        len(set((p["idx"] // 4).tolist())) > 1 for p in split_tensor_dict(stock, 4)
    )  # TRL's own shuffle splits groups
    for part in split_tensor_dict(ours, 4):
        assert len(set((part["idx"] // 4).tolist())) == 1  # each micro-batch holds one whole prompt group


def test_the_record_tag_is_the_config_s_then_the_run_s():
    """The tag the TRL trainers record with: PackingConfig.tag, else TRL's run_name, else
    the name of its output_dir; "" records untagged (no tags sent at all)."""
    from types import SimpleNamespace

    from treepack.trainer.trl.config import PackingConfig, record_tag

    args = SimpleNamespace(run_name="grpo-7", output_dir="/ckpt/runs/grpo-7-out/")
    assert record_tag(PackingConfig(tag="mine"), args) == "mine"
    assert record_tag(PackingConfig(), args) == "grpo-7"
    assert record_tag(PackingConfig(), SimpleNamespace(run_name=None, output_dir="/ckpt/runs/grpo-7-out/")) == (
        "grpo-7-out"
    )
    assert record_tag(PackingConfig(tag=""), args) is None
    assert record_tag(PackingConfig(), None) is None
    with pytest.raises(RequestError, match="tag"):
        PackingConfig(tag=7)


def test_chosen_row_length_holds_a_whole_prompt_tree():
    """``choose_seq_len``: each GRPO group (a prompt and its 8 completions) fits one row, join tokens
    included (every completion holds its own copy of the prompt's last token), and no more rows
    than groups are planned; a row one join token short of that needs more rows (negative control)."""
    from treepack.trainer.trl.config import PackingConfig, choose_seq_len

    rng = np.random.default_rng(3)
    prompts, completions = [], []
    for _ in range(2):
        p = rng.integers(3, 90, 40).tolist()
        for _ in range(8):
            prompts.append(p)
            completions.append(rng.integers(3, 90, 13).tolist())
    ps = from_padded(*_padded(prompts, completions))
    cfg = PackingConfig(min_shared_len=4, max_seq_len=4096)
    L = choose_seq_len(ps, cfg)
    assert L == -(-(40 + 8 * (13 + 1) - 1) // 16) * 16
    plan = lambda n: Packer().pack(
        ps.sequences, seq_len=n, trainable=ps.trainable, groups=ps.groups.tolist(), min_shared_len=4
    )  # noqa: E731
    assert plan(L).num_rows == 2
    assert plan(40 + 8 * 13).num_rows > 2
