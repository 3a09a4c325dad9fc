"""Documented synthetic batches for the demo, the benchmarks and the tests (not part of the planner).

Every generator is deterministic in its ``seed`` and returns a :class:`Workload` that
``plan_batch(**workload.plan_kwargs())`` accepts. Token ids are random in
``[0, VOCAB)``; what matters to the planner is which runs are identical.

- :func:`golden_example` — SPEC section 4's worked example (32 sequences, 4 groups).
- :func:`curriculum` — multi-task RL (GRPO): a handful of task system prompts, each shared
  by many groups; a prompt per group; 8 or 9 completions per group (8.7 on average);
  long-tailed (log-normal) prompt and completion lengths. About 25M tokens at 768 groups.
- :func:`agentic` — multi-turn agent rollouts: one system prompt + tool schema shared by
  every task, a task prompt shared by the task's rollouts, then interleaved assistant turns
  (trainable) and tool outputs (not trainable).
- :func:`distillation` — SFT distillation: several completions per source prompt, sources
  unrelated except for a 24-token instruction header (shorter than ``min_shared_len``, so
  rule 4 keeps it unshared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Workload", "golden_example", "curriculum", "agentic", "distillation", "VOCAB"]

VOCAB = 151_936  # Qwen-sized vocabulary; ids are uniform in [0, VOCAB)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A batch plus the arguments to plan it.

    Attributes:
        name: short identifier.
        sequences: token ids per sequence (uint32).
        trainable: per sequence a prompt length (int) or a bool array.
        groups: per sequence its group id.
        seq_len: row capacity C the workload is meant for.
        tags: per sequence a task tag (for what-if by task), or None.
    """

    name: str
    sequences: list[np.ndarray]
    trainable: list[Any]
    groups: list[Any]
    seq_len: int
    tags: list[str] | None = None

    @property
    def num_tokens(self) -> int:
        return int(sum(s.shape[0] for s in self.sequences))

    def plan_kwargs(self) -> dict[str, Any]:
        return dict(sequences=self.sequences, trainable=self.trainable, groups=self.groups, seq_len=self.seq_len)


def _distinct_tokens(rng: np.random.Generator, n: int, first: int, vocab: int = VOCAB) -> np.ndarray:
    """n random ids whose first id is ``first`` (forces a divergence where the spec needs one)."""
    out = rng.integers(0, vocab, n, dtype=np.uint32)
    if n:
        out[0] = first
    return out


def golden_example(seed: int = 0, *, scale: int = 1, vocab: int = VOCAB) -> Workload:
    """SPEC section 4's golden example.

    32 sequences in groups A, B, C, D (8 each, arriving in that order): a shared 4,096-token
    non-trainable system prefix, a 12,000-token non-trainable prefix per group, then a
    trainable completion of 2,000 (A), 2,000 (B), 12,000 (C) or 7,000 (D) tokens.
    C = 131,072. Tree: 236,124 tokens; bfd: 2 rows (130,105 + 122,114); in_order: 3 rows.

    Args:
        seed: token ids' seed.
        scale: divide every length and C by this (rounded, at least 1 token): the same
            shape at a size a small model trains on in a CPU benchmark.
        vocab: token ids are drawn from [0, vocab).
    """
    rng = np.random.default_rng(seed)
    div = lambda n: max(1, round(n / scale))  # noqa: E731
    system = rng.integers(0, vocab, div(4096), dtype=np.uint32)
    seqs, trainable, groups = [], [], []
    for gi, (g, clen) in enumerate(zip("ABCD", (2000, 2000, 12000, 7000))):
        prefix = _distinct_tokens(rng, div(12000), gi, vocab)
        for _ in range(8):
            comp = rng.integers(0, vocab, div(clen), dtype=np.uint32)
            seqs.append(np.concatenate([system, prefix, comp]))
            trainable.append(system.shape[0] + prefix.shape[0])
            groups.append(g)
    name = "golden" if scale == 1 else f"golden/{scale}"
    return Workload(
        name=name, sequences=seqs, trainable=trainable, groups=groups, seq_len=131072 // scale, tags=groups[:]
    )


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int, size: int) -> np.ndarray:
    x = rng.lognormal(np.log(median), sigma, size)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def curriculum(num_groups: int = 768, *, seed: int = 0, seq_len: int = 131072, num_tasks: int = 6) -> Workload:
    """Multi-task GRPO curriculum (see module docstring).

    Task system prompts are 512-4,096 tokens; a group picks a task with Zipf-like
    weights; group prompts are log-normal (median 500, clipped to [64, 8,000]); each group
    has 8 (30%) or 9 (70%) completions, log-normal (median 900, sigma 1.0, clipped so the
    sequence fits C). 768 groups: about 6,700 completions and 25M tokens.
    """
    rng = np.random.default_rng(seed)
    sys_lens = np.linspace(512, 4096, num_tasks).astype(np.int64)
    systems = [_distinct_tokens(rng, int(n), t) for t, n in enumerate(sys_lens)]
    w = 1.0 / np.arange(1, num_tasks + 1)
    task_of = rng.choice(num_tasks, size=num_groups, p=w / w.sum())
    prompt_lens = _lognormal_int(rng, 500, 0.8, 64, 8000, num_groups)
    counts = np.where(rng.random(num_groups) < 0.7, 9, 8)
    seqs, trainable, groups, tags = [], [], [], []
    for g in range(num_groups):
        t = int(task_of[g])
        prompt = np.concatenate([systems[t], rng.integers(0, VOCAB, int(prompt_lens[g]), dtype=np.uint32)])
        room = seq_len - prompt.shape[0]
        clens = _lognormal_int(rng, 900, 1.0, 16, room, int(counts[g]))
        for c in clens:
            seqs.append(np.concatenate([prompt, rng.integers(0, VOCAB, int(c), dtype=np.uint32)]))
            trainable.append(prompt.shape[0])
            groups.append(g)
            tags.append(f"task{t}")
    return Workload(
        name=f"curriculum-{num_groups}", sequences=seqs, trainable=trainable, groups=groups, seq_len=seq_len, tags=tags
    )


def agentic(num_tasks: int = 256, *, seed: int = 0, seq_len: int = 131072, rollouts: int = 8) -> Workload:
    """Multi-turn agent rollouts with interleaved trainable turns.

    One 6,000-token system prompt + tool schema shared by every task; a task prompt
    (log-normal, median 400); per task ``rollouts`` rollouts of 2-10 turns, each an
    assistant turn (trainable, median 150 tokens) followed by a tool output (not
    trainable, median 600 tokens), capped to fit C.
    """
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, 6000, dtype=np.uint32)
    seqs, trainable, groups, tags = [], [], [], []
    for t in range(num_tasks):
        task = _distinct_tokens(rng, int(_lognormal_int(rng, 400, 0.7, 32, 4000, 1)[0]), t % VOCAB)
        prefix = np.concatenate([system, task])
        for _ in range(rollouts):
            parts, flags = [prefix], [np.zeros(prefix.shape[0], dtype=bool)]
            total = prefix.shape[0]
            for _turn in range(int(rng.integers(2, 11))):
                a = int(_lognormal_int(rng, 150, 0.8, 4, 4000, 1)[0])
                o = int(_lognormal_int(rng, 600, 1.0, 4, 16000, 1)[0])
                if total + a + o > seq_len:
                    break
                parts += [rng.integers(0, VOCAB, a, dtype=np.uint32), rng.integers(0, VOCAB, o, dtype=np.uint32)]
                flags += [np.ones(a, dtype=bool), np.zeros(o, dtype=bool)]
                total += a + o
            seqs.append(np.concatenate(parts))
            trainable.append(np.concatenate(flags))
            groups.append(t)
            tags.append("agent")
    return Workload(
        name=f"agentic-{num_tasks}", sequences=seqs, trainable=trainable, groups=groups, seq_len=seq_len, tags=tags
    )


def distillation(num_sources: int = 512, *, seed: int = 0, seq_len: int = 131072) -> Workload:
    """SFT distillation: 4-16 completions per source prompt (see module docstring).

    Source prompts are log-normal (median 1,500, clipped to [100, 20,000]); completions
    log-normal (median 2,500, sigma 0.9), trainable; every sequence starts with the same
    24-token instruction header.
    """
    rng = np.random.default_rng(seed)
    header = rng.integers(0, VOCAB, 24, dtype=np.uint32)
    seqs, trainable, groups, tags = [], [], [], []
    for src in range(num_sources):
        body = _distinct_tokens(rng, int(_lognormal_int(rng, 1500, 0.9, 100, 20000, 1)[0]), src % VOCAB)
        prompt = np.concatenate([header, body])
        k = int(rng.integers(4, 17))
        for c in _lognormal_int(rng, 2500, 0.9, 16, seq_len - prompt.shape[0], k):
            seqs.append(np.concatenate([prompt, rng.integers(0, VOCAB, int(c), dtype=np.uint32)]))
            trainable.append(prompt.shape[0])
            groups.append(src)
            tags.append("distill")
    return Workload(
        name=f"distill-{num_sources}", sequences=seqs, trainable=trainable, groups=groups, seq_len=seq_len, tags=tags
    )
