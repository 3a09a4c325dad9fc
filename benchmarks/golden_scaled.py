"""The golden example (SPEC 4) with every length divided by a scale factor.

32 sequences in groups A, B, C, D (8 each): a shared system prefix of 4,096 / scale
tokens, a group prefix of 12,000 / scale, then a trainable completion of 2,000 / 2,000 /
12,000 / 7,000 (/ scale) tokens; rows of 131,072 / scale. At scale 1 this is the golden
example itself (236,124 tree tokens of 699,072; 2 rows with ``bfd``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["scaled_golden"]


def scaled_golden(scale: int = 1, *, vocab: int = 151_936, seed: int = 0) -> dict[str, Any]:
    """Sequences, prompt lengths, groups and seq_len of the golden example divided by ``scale``.

    Returns:
        ``dict(sequences, trainable, groups, seq_len, min_shared_len)`` for ``plan_batch``.
    """
    rng = np.random.default_rng(seed)
    div = lambda n: max(1, round(n / scale))  # noqa: E731
    system = rng.integers(0, vocab, div(4096))
    seqs, trainable, groups = [], [], []
    for gi, (g, clen) in enumerate(zip("ABCD", (2000, 2000, 12000, 7000))):
        prefix = rng.integers(0, vocab, div(12000))
        prefix[0] = gi  # groups diverge right after the system prefix
        for _ in range(8):
            seqs.append(np.concatenate([system, prefix, rng.integers(0, vocab, div(clen))]))
            trainable.append(len(system) + len(prefix))
            groups.append(g)
    return dict(sequences=seqs, trainable=trainable, groups=groups, seq_len=131072 // scale, min_shared_len=max(1, 64 // scale))
