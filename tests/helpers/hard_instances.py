"""Placement instances where neighbourhoods of a few light rows are not enough.

Shared by the exact-reference tests (``tests/planner/test_planner_exact.py``, tiny sizes)
and the quality sweep (``benchmarks/placement_quality.py hard``, larger sizes). Every
generator is deterministic in ``(family, seed, size)`` and returns ``plan_batch`` keyword
arguments. Classes (:data:`HARD_FAMILIES`):

- ``cross``: cross-tree sharing. Two or three system prompts, each the root of a tree of
  task prompts and completions; leaves are a sixth to most of a row, so good rows mix
  leaves of different trees and of different tasks, and the rows that share a prefix are
  not the rows that have room.
- ``deep``: agent trees with deep chains. One system prompt; each rollout forks at several
  turns (retries, tool alternatives), so leaves hang 3-6 levels deep below long chains of
  shared turns; a row pays the whole chain of every branch it takes.
- ``grpo``: GRPO with many completions per prompt: 1-3 prompts with 80-130 completions
  (log-normal lengths) in total, rows of 6-20 completions: a bin packing of many items
  behind each prompt where a greedy strands one light row.
- ``random``: random trees (2-4 roots, branching 1-3, runs of 1 to 90 tokens) with a row
  that holds a handful of leaves.

``size`` scales the number of leaves (the tests use ``size=0``: at most
:data:`TINY_LEAVES` leaves except ``grpo``, whose point is its 80+ leaves).
"""

from __future__ import annotations

import numpy as np

__all__ = ["HARD_FAMILIES", "TINY_LEAVES", "hard_instance"]

HARD_FAMILIES = ("cross", "deep", "grpo", "random")
TINY_LEAVES = 12  # the subset DP of optimum.naive_min_rows is instant up to here


class _Builder:
    """Sequences as root-to-leaf paths of a tree grown node by node."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.seqs: list[np.ndarray] = []
        self.trainable: list[int] = []
        self.groups: list[int] = []
        self._next = 1

    def run(self, n: int) -> np.ndarray:
        """n fresh tokens whose first one no other run starts with (siblings always differ)."""
        out = self.rng.integers(1 << 20, 1 << 30, max(int(n), 0))
        if n > 0:
            out[0] = self._next
            self._next += 1
        return out

    def leaf(self, path: np.ndarray, tail: int, group: int) -> None:
        """A sequence: ``path`` (not trainable) then ``tail`` trainable tokens."""
        self.seqs.append(np.concatenate([path, self.run(tail)]))
        self.trainable.append(int(path.shape[0]))
        self.groups.append(group)

    def kwargs(self, seq_len: int, min_shared_len: int) -> dict:
        return dict(
            sequences=self.seqs,
            trainable=self.trainable,
            groups=self.groups,
            seq_len=seq_len,
            min_shared_len=min_shared_len,
        )


def _cross(rng: np.random.Generator, size: int) -> dict:
    C = int(rng.integers(400, 1200))
    b = _Builder(rng)
    n_leaves = int(rng.integers(7, TINY_LEAVES + 1)) + 12 * size
    systems = [b.run(int(rng.integers(C // 20, C // 6))) for _ in range(int(rng.integers(2, 4)))]
    g = 0
    while len(b.seqs) < n_leaves:
        sys_ = systems[int(rng.integers(0, len(systems)))]
        task = np.concatenate([sys_, b.run(int(rng.integers(C // 40, C // 10)))])
        for _ in range(int(rng.integers(1, 4))):
            if len(b.seqs) == n_leaves:
                break
            room = C - task.shape[0]
            b.leaf(task, int(rng.integers(max(1, room // 6), max(2, int(room * 0.7)))), g)
        g += 1
    return b.kwargs(C, int(rng.integers(1, 9)))


def _deep(rng: np.random.Generator, size: int) -> dict:
    C = int(rng.integers(500, 1500))
    b = _Builder(rng)
    n_leaves = int(rng.integers(7, TINY_LEAVES + 1)) + 12 * size
    system = b.run(int(rng.integers(C // 20, C // 8)))
    g = 0

    def grow(path: np.ndarray, depth: int, max_depth: int, group: int) -> None:
        if len(b.seqs) >= n_leaves:
            return
        room = C - path.shape[0]
        if depth == max_depth or room < C // 5:
            b.leaf(path, int(rng.integers(max(1, room // 8), max(2, room // 2))), group)
            return
        turn = np.concatenate([path, b.run(int(rng.integers(C // 30, C // 8)))])
        kids = int(rng.choice([1, 2, 2, 3]))
        for _ in range(kids):
            grow(turn, depth + 1, max_depth, group)

    while len(b.seqs) < n_leaves:
        task = np.concatenate([system, b.run(int(rng.integers(C // 40, C // 12)))])
        grow(task, 0, int(rng.integers(3, 7)), g)
        g += 1
    return b.kwargs(C, int(rng.integers(1, 9)))


def _grpo(rng: np.random.Generator, size: int) -> dict:
    b = _Builder(rng)
    n_leaves = int(rng.integers(80, 131)) + 40 * size
    per_row = int(rng.integers(6, 21))
    median = int(rng.integers(60, 400))
    C = int(median * per_row * rng.uniform(0.9, 1.3))
    n_prompts = int(rng.integers(1, 4))
    prompts = [b.run(int(rng.integers(16, max(17, C // 8)))) for _ in range(n_prompts)]
    for i in range(n_leaves):
        p = i * n_prompts // n_leaves
        room = C - prompts[p].shape[0]
        tail = int(np.clip(rng.lognormal(np.log(median), 0.6), 4, room))
        b.leaf(prompts[p], tail, p)
    return b.kwargs(C, int(rng.integers(1, 17)))


def _random(rng: np.random.Generator, size: int) -> dict:
    C = int(rng.integers(150, 500))
    b = _Builder(rng)
    n_leaves = int(rng.integers(7, TINY_LEAVES + 1)) + 12 * size
    runs = np.array([1, 2, 3, 5, 8, 13, 21, 40, 70, 90])

    def grow(path: np.ndarray, depth: int) -> None:
        if len(b.seqs) >= n_leaves:
            return
        n = min(int(rng.choice(runs)), C - path.shape[0])
        kids = 0 if depth >= 5 or path.shape[0] + n >= C - 8 else int(rng.choice([0, 1, 2, 2, 3]))
        if kids == 0:
            b.leaf(path, max(n, 1) if path.shape[0] < C else 0, int(rng.integers(0, 4)))
            return
        node = np.concatenate([path, b.run(n)])
        for _ in range(kids):
            grow(node, depth + 1)

    while len(b.seqs) < n_leaves:
        grow(np.zeros(0, dtype=np.int64), 0)
    return b.kwargs(C, int(rng.integers(1, 5)))


_MAKERS = {"cross": _cross, "deep": _deep, "grpo": _grpo, "random": _random}


def hard_instance(family: str, seed: int, size: int = 0) -> dict:
    """One instance of ``family`` (module docstring): ``plan_batch`` keyword arguments."""
    rng = np.random.default_rng([101, HARD_FAMILIES.index(family), seed, size])
    return _MAKERS[family](rng, size)
