"""verl's row length (``_row_len``): one GRPO group's whole prompt tree fits one row, join tokens
included, as the TRL drop-in's ``choose_seq_len`` (tests/trainer/test_trl_bridge.py)."""

from __future__ import annotations

import numpy as np

from treepack.service.planner import plan_batch, validate_plan
from treepack.trainer.verl import VerlPacking, _row_len


def _groups(rng, prompt_len: int, resp_len: int, n: int = 2) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """n prompts of prompt_len tokens, 8 responses of resp_len tokens each (sequences, prompt lens, groups)."""
    seqs, groups = [], []
    for g in range(n):
        p = rng.integers(3, 90, prompt_len)
        for _ in range(8):
            seqs.append(np.concatenate([p, rng.integers(3, 90, resp_len)]))
            groups.append(g)
    return seqs, np.full(len(seqs), prompt_len, np.int64), np.asarray(groups, np.int64)


def _rows(seqs, prompt_lens, groups, seq_len: int) -> int:
    plan = plan_batch(seqs, seq_len=seq_len, trainable=prompt_lens.tolist(), groups=groups.tolist(), min_shared_len=4)
    validate_plan(plan, seqs, trainable=prompt_lens.tolist())
    return plan.num_rows


def test_row_len_holds_a_whole_prompt_tree_join_tokens_included():
    """Each group (a prompt of 40 and 8 responses of 13) needs 40 - 1 + 8 x (13 + 1) tokens: every
    response holds its own copy of the prompt's last token. ``_row_len`` rounds that up (16 for
    sdpa/flash, 128 for flex), and planning at it gives one row per group; a row one join token
    per response short (prompt + responses, the rule that left them out) needs more rows
    (negative control)."""
    rng = np.random.default_rng(3)
    seqs, prompt_lens, groups = _groups(rng, 40, 13)
    seq_lens = np.asarray([s.shape[0] for s in seqs], np.int64)
    need = 40 - 1 + 8 * (13 + 1)
    L = _row_len(seq_lens, prompt_lens, groups, VerlPacking(backend="sdpa", min_shared_len=4))
    assert L == -(-need // 16) * 16
    assert _row_len(seq_lens, prompt_lens, groups, VerlPacking(backend="flex", min_shared_len=4)) == 256
    assert _rows(seqs, prompt_lens, groups, L) == 2
    assert _rows(seqs, prompt_lens, groups, 40 + 8 * 13) > 2


def test_row_len_is_capped_but_never_below_a_sequence():
    """``max_seq_len`` caps the tree's room (the planner then spreads a group over rows), but the
    row never gets shorter than the longest sequence (negative control: without the cap the
    same batch asks for the whole tree)."""
    rng = np.random.default_rng(4)
    seqs, prompt_lens, groups = _groups(rng, 100, 30, n=1)
    seq_lens = np.asarray([s.shape[0] for s in seqs], np.int64)
    assert _row_len(seq_lens, prompt_lens, groups, VerlPacking(backend="sdpa", max_seq_len=64)) == 144
    assert _row_len(seq_lens, prompt_lens, groups, VerlPacking(backend="sdpa", max_seq_len=200)) == 208
    assert _row_len(seq_lens, prompt_lens, groups, VerlPacking(backend="sdpa")) == -(-(99 + 8 * 31) // 16) * 16
