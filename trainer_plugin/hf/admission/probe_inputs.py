"""The probe's inputs: sequences built from the model's own config (:func:`probe_sequences`).

The long sequences cross the largest window, chunk or convolution the config declares
that applies to the caller's rows (:func:`declared_sizes`, :func:`probe_shape`), and every
sequence fits those rows; several trees share one row, a branch falls inside a chunk, scored
tokens are shared (a deep tree), one sequence is a strict prefix and one stands alone.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["PROBE_SEED", "probe_sequences", "probe_shape", "declared_sizes", "probe_configs"]


PROBE_SEED = 1729


_MIN_SPAN = 16


_SIZE_FIELD = re.compile(r"window|chunk|conv_kernel|d_conv|conv_L_cache|conv_width")


_TOKEN_FIELD = re.compile(r"token_(id|index|ids)$")


_SUBCONFIGS = ("text_config", "decoder", "language_config", "llm_config")


def probe_configs(hf: Any) -> list[Any]:
    cfg = getattr(hf, "config", None)
    out = [cfg] if cfg is not None else []
    out += [
        getattr(cfg, a)
        for a in _SUBCONFIGS
        if getattr(cfg, a, None) is not None and hasattr(getattr(cfg, a), "to_dict")
    ]
    return out


def declared_sizes(hf: Any) -> dict[str, int]:
    """Every window, chunk and convolution width the model's config declares (``{field: size}``).

    Integer fields (or lists of integers, per layer) whose names say window / chunk / conv
    kernel; a size at or above ``max_position_embeddings`` never applies and is left out.
    """
    out: dict[str, int] = {}
    for cfg in probe_configs(hf):
        limit = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        for k, v in vars(cfg).items():
            if not _SIZE_FIELD.search(k) or isinstance(v, bool):
                continue
            vals = [
                x
                for x in (v if isinstance(v, (list, tuple)) else [v])
                if isinstance(x, int) and not isinstance(x, bool)
            ]
            vals = [x for x in vals if 1 < x < limit]
            if vals:
                out[k] = max(out.get(k, 0), max(vals))
    return out


def _token_ids(hf: Any) -> np.ndarray | int:
    """The ids the probe draws from: the model's real vocabulary range (the config's and the
    input embedding's, the smaller), without the ids its configs name (``*_token_id``,
    ``*_token_index``: image and video placeholders would ask for pixel values)."""
    cfg = probe_configs(hf)[-1] if probe_configs(hf) else None
    vocab = int(getattr(cfg, "vocab_size", 0) or getattr(getattr(hf, "config", None), "vocab_size", 0) or 2)
    emb = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    vocab = min(vocab, int(rows)) if isinstance(rows, int) and rows > 1 else vocab
    named: set[int] = set()
    for c in probe_configs(hf):
        for k, v in vars(c).items():
            if _TOKEN_FIELD.search(k):
                named.update(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, int))
    named = {x for x in named if 0 <= x < vocab}
    if not named or len(named) >= vocab - 1:
        return vocab
    return np.setdiff1d(np.arange(vocab, dtype=np.int64), np.fromiter(named, dtype=np.int64))


def probe_shape(hf: Any, row_len: int | None = None) -> tuple[int, int | None]:
    """(W, cap): the span the probe's sequences cross and the longest they may be.

    W is the largest declared size (:func:`declared_sizes`) that applies to rows of
    ``row_len`` tokens (a window or chunk of ``row_len`` or more never binds inside them:
    Llama 4's chunk of 8192 on shorter rows), at least 16. The
    cap is ``row_len`` when the probe's longest sequence (3W/2 + 8) would not fit a row,
    else None; then W < cap.

    Args:
        hf: the HF model.
        row_len: the caller's row length; None: unknown (no cap).
    """
    sizes = [v for v in declared_sizes(hf).values() if row_len is None or v < row_len]
    span = max([_MIN_SPAN, *sizes])
    if row_len is None or span + span // 2 + 8 <= row_len:
        return span, None
    cap = max(int(row_len), 2)
    return min(span, cap - 1), cap


def probe_sequences(hf: Any, row_len: int | None = None) -> tuple[list[np.ndarray], int]:
    """The probe's sequences for ``hf`` and the span W they cross.

    W and the cap on their length come from :func:`probe_shape`. Trees: a prompt of
    W/2 + 3 tokens (its branch point falls inside a chunk) with a completion of W + 5
    tokens, a second completion that shares its first 3 scored tokens, a short one and a
    strict prefix of the prompt; a 7-token prompt with two completions; a sequence of
    W + 3 tokens on its own. Every sequence is cut to the cap (the longest still crosses
    W). Tokens are drawn from the model's real vocabulary range, without its named
    special ids.

    Args:
        hf: the HF model.
        row_len: the caller's row length (None: unknown).

    Returns:
        (sequences as int64 arrays, W).
    """
    span, cap = probe_shape(hf, row_len)
    ids = _token_ids(hf)
    rng = np.random.default_rng(PROBE_SEED)
    if isinstance(ids, int):
        r = lambda n: rng.integers(0, ids, n, dtype=np.int64)  # noqa: E731
    else:
        r = lambda n: ids[rng.integers(0, ids.shape[0], n)]  # noqa: E731
    p = span // 2 + 3
    prompt = r(p)
    a0 = np.concatenate([prompt, r(span + 5)])
    a1 = np.concatenate([a0[: p + 3], r(span // 3 + 2)])
    q = r(7)
    seqs = [
        a0,
        a1,
        np.concatenate([prompt, r(4)]),
        prompt[: max(2, p // 2)].copy(),
        np.concatenate([q, r(span // 2 + 1)]),
        np.concatenate([q, r(3)]),
        r(span + 3),
    ]
    return ([s[:cap].copy() for s in seqs] if cap is not None else seqs), span
