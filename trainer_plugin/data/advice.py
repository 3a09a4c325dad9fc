"""Warnings a trainer needs before it wastes a step: :class:`TreepackWarning`.

- :func:`warn_no_sharing`: the plan shares no token, so tree packing saves nothing over
  plain packing (completions of one prompt split across batches, or all prompts distinct);
- :func:`warn_hidden_sharing`: ``min_shared_len`` hides sharing: prefixes that several
  sequences have in common but that are shorter than ``min_shared_len`` are laid out once
  per sequence. The warning says how many tokens a smaller value could share, estimated
  from the sequences themselves (sorted, adjacent longest common prefixes: the prefix-trie
  bound, so an upper bound on what a replan with that value saves);
- :func:`warn_dense_mask`: a dense-mask backend (``sdpa``) is about to allocate a
  [K, 1, L, L] mask larger than :data:`DENSE_MASK_WARN_BYTES`.

Each limit is a module attribute, so a trainer can change it
(``treepack.trainer.data.advice.DENSE_MASK_WARN_BYTES = 4 << 30``) or silence the class
with ``warnings.filterwarnings("ignore", category=TreepackWarning)``.
"""

from __future__ import annotations

import warnings

import numpy as np

from treepack.proto.errors import TreepackWarning
from treepack.proto.plan import Plan

__all__ = [
    "TreepackWarning",
    "DENSE_MASK_WARN_BYTES",
    "HIDDEN_SHARING_WARN_FRACTION",
    "hidden_sharing",
    "warn_no_sharing",
    "warn_hidden_sharing",
    "warn_dense_mask",
]

DENSE_MASK_WARN_BYTES = 1 << 30
"""Warn when a dense [K, 1, L, L] bool tree mask would take more bytes than this."""

HIDDEN_SHARING_WARN_FRACTION = 0.05
"""Warn when sharing hidden by ``min_shared_len`` holds at least this fraction of the tokens."""


def warn_no_sharing(plan: Plan) -> bool:
    """Warn (and return True) when a plan of 2+ sequences shares no token."""
    st = plan.stats
    if st.kept_sequences < 2 or st.unpacked_tokens == 0 or st.tree_tokens < st.unpacked_tokens:
        return False
    warnings.warn(
        f"the plan shares no token among its {st.kept_sequences} sequences (saved_fraction 0): tree packing "
        "gives nothing over plain packing here; keep each prompt's completions in one batch, and see "
        "min_shared_len (it is " + str(plan.min_shared_len) + ")",
        TreepackWarning,
        stacklevel=3,
    )
    return True


def hidden_sharing(plan: Plan, tokens: np.ndarray, ptr: np.ndarray, seqs: np.ndarray) -> dict[int, int]:
    """Tokens that prefixes shorter than ``min_shared_len`` could share, per smaller threshold.

    Args:
        plan: the plan (its ``min_shared_len``, ``first_trainable``, ``share_trainable``).
        tokens: [sum n] int token ids of ``seqs``, concatenated.
        ptr: [len(seqs) + 1] CSR offsets of each sequence in ``tokens``.
        seqs: [S'] the sequences (plan indices) held in ``tokens``.

    Returns:
        {v: tokens} for v = 1, 2, 4, ... < ``min_shared_len``: the prefix-trie bound on the
        tokens shared by common prefixes of length in [v, min_shared_len), which the plan
        lays out once per sequence. Empty when ``min_shared_len`` <= 1 or S' < 2.
    """
    m = int(plan.min_shared_len)
    n = int(seqs.shape[0])
    if m <= 1 or n < 2:
        return {}
    lens = np.diff(ptr)
    ft = plan.first_trainable[seqs]
    # The planner's default-mode shareable run (proto.batch.SequenceBatch.shareable_lens).
    cap = lens if plan.share_trainable else np.where(ft >= lens, lens, np.maximum(ft - 1, 0))
    cap = np.minimum(cap, m)
    col = np.arange(m)
    idx = np.minimum(ptr[:-1, None] + col[None, :], max(int(ptr[-1]) - 1, 0))
    M = np.where(col[None, :] < cap[:, None], np.asarray(tokens, dtype=np.int64)[idx] if ptr[-1] else -1, -1)
    # Lexicographic order of the rows, via fixed-width big-endian bytes (token + 1, padding 0).
    keys = np.ascontiguousarray((M + 1).astype(">u8")).view(np.dtype((np.bytes_, 8 * m))).ravel()
    M = M[np.argsort(keys, kind="stable")]
    same = (M[1:] == M[:-1]) & (M[1:] >= 0)
    lcp = np.cumprod(same, axis=1).sum(axis=1)
    hidden = lcp[lcp < m]
    out = {}
    v = 1
    while v < m:
        out[v] = int(hidden[hidden >= v].sum())
        v *= 2
    return out


def warn_hidden_sharing(plan: Plan, tokens: np.ndarray, ptr: np.ndarray, seqs: np.ndarray) -> dict[int, int]:
    """Warn when ``min_shared_len`` hides at least :data:`HIDDEN_SHARING_WARN_FRACTION` of the tokens.

    The message names the largest power-of-two threshold that recovers at least 90% of the
    hidden sharing, and the estimate. Returns :func:`hidden_sharing`'s figures.
    """
    est = hidden_sharing(plan, tokens, ptr, seqs)
    total = int(ptr[-1])
    if not est or total == 0 or est[1] < HIDDEN_SHARING_WARN_FRACTION * total:
        return est
    v = max(k for k, t in est.items() if t >= 0.9 * est[1])
    warnings.warn(
        f"min_shared_len={plan.min_shared_len} hides sharing: common prefixes shorter than it hold up to "
        f"{est[v]} tokens ({est[v] / total:.1%} of these sequences' {total}) at min_shared_len={v}, laid out once per "
        f"sequence now (the plan saves {plan.stats.saved_fraction:.1%}); replan with min_shared_len={v} "
        "(a prefix-trie bound: the replan's saving is at most this)",
        TreepackWarning,
        stacklevel=3,
    )
    return est


def warn_dense_mask(rows: int, seq_len: int) -> bool:
    """Warn (and return True) before a [rows, 1, L, L] bool mask above :data:`DENSE_MASK_WARN_BYTES`."""
    size = int(rows) * int(seq_len) * int(seq_len)
    if size <= DENSE_MASK_WARN_BYTES:
        return False
    warnings.warn(
        f"the dense tree mask of {rows} rows of {seq_len} takes {size / 2**20:.0f} MiB (limit "
        f"DENSE_MASK_WARN_BYTES={DENSE_MASK_WARN_BYTES / 2**20:.0f} MiB), and SDPA's math path needs heads x 4 "
        "times that for the scores; use backend='flash' (varlen, no mask) or 'flex' (block mask), or shorter rows",
        TreepackWarning,
        stacklevel=3,
    )
    return True
