"""Batches shaped the way trainers send them, at the sizes they send them.

:func:`grpo_groups` is the ordinary RL batch: many groups of a few sequences, a prompt and
short completions trainable after it (issue 37's crash: 256 groups of 4 with a 64-token
prompt and 16-token completions in rows of 8,192). :func:`shapes` draws batch shapes for
the shape fuzz (``tests/planner/test_shape_fuzz.py``): a shape is a small dict of integers
and :func:`shape_batch` builds its ``plan_batch`` arguments with seeded tokens, so a failing
example prints as a few numbers and replays from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

__all__ = ["grpo_groups", "shape_batch", "shapes", "KINDS"]


def grpo_groups(
    groups: int, *, per_group: int = 4, prompt: int = 64, completion: int = 16, seq_len: int = 8192, seed: int = 0
) -> dict[str, Any]:
    """``groups`` GRPO groups: a random prompt each, ``per_group`` completions after it.

    Args:
        groups: number of groups.
        per_group: sequences per group.
        prompt: prompt tokens (not trainable).
        completion: completion tokens (trainable).
        seq_len: the row capacity passed on.
        seed: token seed.

    Returns:
        ``plan_batch`` keyword arguments (``sequences``, ``trainable``, ``groups``, ``seq_len``).
    """
    rng = np.random.default_rng(seed)
    heads = rng.integers(0, 1 << 30, (groups, prompt), dtype=np.uint32)
    tails = rng.integers(0, 1 << 30, (groups, per_group, completion), dtype=np.uint32)
    seqs = [np.concatenate([heads[g], tails[g, j]]) for g in range(groups) for j in range(per_group)]
    return dict(
        sequences=seqs,
        trainable=[prompt] * len(seqs),
        groups=[g for g in range(groups) for _ in range(per_group)],
        seq_len=seq_len,
    )


KINDS = ("groups", "one_prompt", "chains", "exact_fit", "random_tree")
"""The batch kinds of :func:`shape_batch`: GRPO/curriculum groups behind optional system
prompts, completions all of one length or log-uniform up to it, some duplicated; one
prompt with thousands of completions; deep multi-turn chains (each turn extends the last
rollout); sequences of exactly ``seq_len`` among short ones; random trees of short runs."""


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 1 << 30, max(int(n), 0), dtype=np.uint32)


class _Batch:
    """Sequences appended until a token budget is spent (then :attr:`full`)."""

    def __init__(self, max_tokens: int) -> None:
        self.seqs: list[np.ndarray] = []
        self.trainable: list[int] = []
        self.groups: list[int] = []
        self.left = max_tokens

    @property
    def full(self) -> bool:
        return self.left <= 0

    def add(self, seq: np.ndarray, prompt: int, group: int) -> None:
        """A sequence, trainable from ``prompt`` on (clipped so at least one token is trainable)."""
        self.seqs.append(seq)
        self.trainable.append(max(0, min(prompt, seq.shape[0] - 1)))
        self.groups.append(group)
        self.left -= seq.shape[0]


def _lens(rng: np.random.Generator, n: int, hi: int) -> list[int]:
    """n lengths in [1, hi], log-uniform (short ones common, long ones present)."""
    return np.clip(np.exp(rng.uniform(0, np.log(hi + 1), n)).astype(np.int64), 1, hi).tolist()


def _groups(s: dict[str, int], rng: np.random.Generator, b: _Batch, groups: int, per_group: int) -> None:
    C = s["seq_len"]
    system = _tokens(rng, min(s["system"], C - 1))
    for g in range(groups):
        head = system if g % 2 == 0 else system[:0]
        prompt = np.concatenate([head, _tokens(rng, min(s["prompt"], C - 1 - head.shape[0]))])
        room = C - prompt.shape[0]
        hi = min(s["completion"], room)
        for i, n in enumerate(_lens(rng, per_group, hi) if s["spread"] else [hi] * per_group):
            if b.full:
                return
            if s["duplicates"] and i % 3 == 2:
                b.add(b.seqs[-1].copy(), b.trainable[-1], g)
            else:
                b.add(np.concatenate([prompt, _tokens(rng, n)]), prompt.shape[0], g)


def _chains(s: dict[str, int], rng: np.random.Generator, b: _Batch) -> None:
    C, turn = s["seq_len"], max(1, s["completion"] % 97)
    for g in range(s["groups"]):
        turns = min(s["per_group"] * 8, C // turn)  # up to 512 turns deep
        toks = _tokens(rng, turns * turn)
        for k in range(1, turns + 1):
            if b.full:
                return
            b.add(toks[: k * turn], (k - 1) * turn, g)


def shape_batch(shape: dict[str, int]) -> dict[str, Any]:
    """The ``plan_batch`` arguments of a drawn shape (:func:`shapes`; kinds: :data:`KINDS`).

    Sequences never exceed ``seq_len``; tokens stop at the shape's ``max_tokens``.
    """
    s = shape
    rng = np.random.default_rng(s["seed"])
    kind, C = KINDS[s["kind"]], s["seq_len"]
    b = _Batch(s["max_tokens"])
    if kind == "groups":
        _groups(s, rng, b, s["groups"], s["per_group"])
    elif kind == "one_prompt":
        _groups(s, rng, b, 1, s["groups"] * s["per_group"])
    elif kind == "chains":
        _chains(s, rng, b)
    elif kind == "exact_fit":
        _groups(s, rng, b, s["groups"], s["per_group"])
        extra = 0
        for i in range(0, len(b.seqs), 5):
            if extra > s["max_tokens"]:
                break
            extra += C - b.seqs[i].shape[0]
            b.seqs[i] = np.concatenate([b.seqs[i], _tokens(rng, C)])[:C]
    else:
        from helpers.trees import tree_sequences

        for i in range(min(s["groups"], 16)):  # tiny vocabulary: the trees of different seeds merge
            for seq in tree_sequences(s["seed"] + i, trees=4, depth=6, max_len=min(C, 1000)):
                if not b.full:
                    b.add(seq, seq.shape[0] - 1 - s["completion"] % 7, i)
    if not b.seqs:  # a chain turn longer than the row, say: the batch still has a sequence
        b.add(_tokens(rng, 1), 0, 0)
    return dict(
        sequences=b.seqs,
        trainable=b.trainable,
        groups=b.groups,
        seq_len=C,
        min_shared_len=s["min_shared_len"],
        share_trainable=bool(s["share_trainable"]),
        min_shared_saving=s["min_shared_saving"],
    )


def _log_int(d: st.DrawFn, hi: int) -> int:
    """An integer in [1, hi], about uniform in its number of bits."""
    bits = d(st.integers(0, max(hi.bit_length() - 1, 0)))
    return min(hi, d(st.integers(1 << bits, (2 << bits) - 1)))


def shapes(*, max_sequences: int, max_tokens: int, max_seq_len: int = 1 << 20) -> st.SearchStrategy[dict[str, int]]:
    """Batch shapes of every kind (:data:`KINDS`), within a budget.

    Args:
        max_sequences: bound on groups x sequences per group.
        max_tokens: tokens a batch stops at (the test's time).
        max_seq_len: the largest row capacity drawn (16 up to it).

    Returns:
        A strategy of shape dicts for :func:`shape_batch`.
    """

    @st.composite
    def draw(d: st.DrawFn) -> dict[str, int]:
        seq_len = d(st.sampled_from([c for c in (16, 64, 512, 2048, 8192, 32768, 131072, 1 << 20) if c <= max_seq_len]))
        groups = _log_int(d, min(4096, max_sequences))
        return dict(
            kind=d(st.integers(0, len(KINDS) - 1)),
            seed=d(st.integers(0, 2**16)),
            seq_len=seq_len,
            groups=groups,
            per_group=_log_int(d, max(1, min(64, max_sequences // groups))),
            prompt=0 if d(st.integers(0, 4)) == 0 else _log_int(d, 32768),
            completion=_log_int(d, 32768),
            spread=d(st.integers(0, 1)),  # 0: every completion that long (max_new_tokens reached)
            system=d(st.sampled_from([0, 0, 8, 100, 1000])),
            duplicates=d(st.integers(0, 1)),
            min_shared_len=d(st.sampled_from([1, 4, 64, 256])),
            share_trainable=d(st.integers(0, 1)),
            min_shared_saving=d(st.sampled_from([0, 0, 32])),
            max_tokens=max_tokens,
        )

    return draw()
