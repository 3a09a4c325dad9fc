"""Batches shaped the way trainers send them, at the sizes they send them.

:func:`grpo_groups` is the ordinary RL batch: many groups of a few sequences, a prompt and
short completions trainable after it (issue 37's crash: 256 groups of 4 with a 64-token
prompt and 16-token completions in rows of 8,192). The ``shape_*`` strategies draw batch
shapes for the shape fuzz (``tests/planner/test_shape_fuzz.py``); a shape is a small dict
of integers, and :func:`shape_batch` turns it into ``plan_batch`` keyword arguments with
seeded tokens, so a failing example prints as a few numbers and replays from them.
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
"""The batch kinds :func:`shape_batch` builds (see its docstring)."""


def _lens(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """n lengths in [lo, hi], log-uniform (short ones common, long ones present)."""
    if hi <= lo:
        return np.full(n, lo, dtype=np.int64)
    return np.clip(np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(np.int64), lo, hi)


def _groups(shape: dict[str, int], rng: np.random.Generator) -> tuple[list[np.ndarray], list[int], list[int]]:
    """Groups behind optional shared system prompts, some completions duplicated."""
    C, systems = shape["seq_len"], [rng.integers(0, 1 << 30, shape["system"], dtype=np.uint32)]
    seqs, trainable, groups = [], [], []
    for g in range(shape["groups"]):
        head = systems[0] if shape["system"] and g % 2 == 0 else np.zeros(0, np.uint32)
        p = int(min(shape["prompt"], C - 1 - head.shape[0])) if C - 1 > head.shape[0] else 0
        prompt = np.concatenate([head, rng.integers(0, 1 << 30, max(p, 0), dtype=np.uint32)])
        room = max(C - prompt.shape[0], 1)
        for i, n in enumerate(_lens(rng, shape["per_group"], 1, min(shape["completion"], room)).tolist()):
            if i and shape["duplicates"] and i % 3 == 0:
                seqs.append(seqs[-1].copy())
            else:
                seqs.append(np.concatenate([prompt, rng.integers(0, 1 << 30, n, dtype=np.uint32)])[:C])
            trainable.append(min(prompt.shape[0], seqs[-1].shape[0] - 1))
            groups.append(g)
    return seqs, trainable, groups


def _chains(shape: dict[str, int], rng: np.random.Generator) -> tuple[list[np.ndarray], list[int], list[int]]:
    """Multi-turn rollouts: each sequence one turn longer than the last, the last turn trainable."""
    C, turn = shape["seq_len"], max(1, shape["completion"] % 97)
    seqs, trainable, groups = [], [], []
    for g in range(shape["groups"]):
        toks = rng.integers(0, 1 << 30, C, dtype=np.uint32)
        for k in range(1, shape["per_group"] + 1):
            end = min(k * turn, C)
            seqs.append(toks[:end])
            trainable.append(max(0, end - turn))
            groups.append(g)
            if end == C:
                break
    return seqs, trainable, groups


def shape_batch(shape: dict[str, int]) -> dict[str, Any]:
    """The ``plan_batch`` arguments of a drawn shape (:func:`shapes`).

    Kinds: ``groups`` (GRPO/curriculum groups, system prompts, duplicates), ``one_prompt``
    (one prompt, thousands of completions), ``chains`` (deep multi-turn prefix chains),
    ``exact_fit`` (sequences of exactly ``seq_len`` tokens beside short ones),
    ``random_tree`` (random trees of short runs, from :func:`~helpers.trees.tree_sequences`).
    Sequences never exceed ``seq_len``.
    """
    rng = np.random.default_rng(shape["seed"])
    kind, C = KINDS[shape["kind"]], shape["seq_len"]
    if kind == "groups":
        seqs, trainable, groups = _groups(shape, rng)
    elif kind == "one_prompt":
        seqs, trainable, groups = _groups(shape | {"groups": 1, "per_group": shape["groups"] * shape["per_group"]}, rng)
    elif kind == "chains":
        seqs, trainable, groups = _chains(shape, rng)
    elif kind == "exact_fit":
        seqs, trainable, groups = _groups(shape, rng)
        for i in range(0, len(seqs), 5):
            seqs[i] = np.concatenate([seqs[i], rng.integers(0, 1 << 30, C, dtype=np.uint32)])[:C]
    else:
        from helpers.trees import tree_sequences

        seqs = [s[:C] for s in tree_sequences(shape["seed"], trees=3, depth=5, max_len=max(C, 2))]
        trainable = [max(0, len(s) - 1 - shape["completion"] % 7) for s in seqs]
        groups = list(range(len(seqs)))
    return dict(
        sequences=seqs,
        trainable=trainable,
        groups=groups,
        seq_len=C,
        min_shared_len=shape["min_shared_len"],
        share_trainable=bool(shape["share_trainable"]),
        min_shared_saving=shape["min_shared_saving"],
    )


def shapes(*, max_sequences: int, max_seq_len: int, max_groups: int = 4096) -> st.SearchStrategy[dict[str, int]]:
    """Batch shapes of every kind, within ``max_sequences`` sequences and ``max_seq_len``.

    Args:
        max_sequences: bound on groups x sequences per group (the test's time).
        max_seq_len: the largest row capacity drawn (16 up to it, log-uniform-ish).
        max_groups: the most groups drawn.

    Returns:
        A strategy of shape dicts for :func:`shape_batch`.
    """

    @st.composite
    def draw(d: st.DrawFn) -> dict[str, int]:
        seq_len = d(
            st.sampled_from([16, 64, 512, 2048, 8192, 32768, 131072, 1 << 20]).filter(lambda c: c <= max_seq_len)
        )
        groups = d(st.integers(1, max_groups))
        per_group = d(st.integers(1, max(1, min(64, max_sequences // groups))))
        return dict(
            kind=d(st.integers(0, len(KINDS) - 1)),
            seed=d(st.integers(0, 2**16)),
            seq_len=seq_len,
            groups=min(groups, max_sequences),
            per_group=per_group,
            prompt=d(st.integers(0, min(32768, seq_len))),
            completion=d(st.integers(1, min(32768, seq_len))),
            system=d(st.sampled_from([0, 0, 8, 100, 1000])),
            duplicates=d(st.integers(0, 1)),
            min_shared_len=d(st.sampled_from([1, 4, 64, 256])),
            share_trainable=d(st.integers(0, 1)),
            min_shared_saving=d(st.sampled_from([0, 0, 32])),
        )

    return draw()
