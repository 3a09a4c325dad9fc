"""The golden example (SPEC 4) with every length divided by a scale factor, for the trainer benchmarks.

A thin adapter over :func:`treepack.service.cli.workloads.golden_example` (``scale``):
it adds the ``min_shared_len`` that keeps rule 4 meaningful at the smaller size.
"""

from __future__ import annotations

from typing import Any

from treepack.service.cli.workloads import VOCAB, golden_example

__all__ = ["scaled_golden"]


def scaled_golden(scale: int = 1, *, vocab: int = VOCAB, seed: int = 0) -> dict[str, Any]:
    """Sequences, prompt lengths, groups and seq_len of the golden example divided by ``scale``.

    Returns:
        ``dict(sequences, trainable, groups, seq_len, min_shared_len)`` for ``plan_batch``.
    """
    w = golden_example(seed, scale=scale, vocab=vocab)
    return dict(w.plan_kwargs(), min_shared_len=max(1, 64 // scale))
