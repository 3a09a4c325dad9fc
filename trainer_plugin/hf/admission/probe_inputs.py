"""The probe's inputs: sequences built from the model's own config (:func:`probe_sequences`).

Every sequence is longer than the largest window, chunk or convolution the config declares
(:func:`declared_sizes`); several trees share one row, a branch falls inside a chunk, scored
tokens are shared (a deep tree), one sequence is a strict prefix and one stands alone.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["PROBE_SEED", "probe_sequences", "declared_sizes", "probe_configs"]


PROBE_SEED = 1729


_MIN_SPAN = 16


_SIZE_FIELD = re.compile(r"window|chunk|conv_kernel|d_conv|conv_L_cache|conv_width")


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


def probe_sequences(hf: Any) -> tuple[list[np.ndarray], int]:
    """The probe's sequences for ``hf`` and the span W they cross.

    W is the largest declared size (:func:`declared_sizes`), at least 16. Trees: a prompt
    of W/2 + 3 tokens (its branch point falls inside a chunk) with a completion of W + 5
    tokens, a second completion that shares its first 3 scored tokens, a short one and a
    strict prefix of the prompt; a 7-token prompt with two completions; a sequence of
    W + 3 tokens on its own.

    Returns:
        (sequences as int64 arrays, W).
    """
    cfg = probe_configs(hf)[-1] if probe_configs(hf) else None
    vocab = int(getattr(cfg, "vocab_size", 0) or getattr(getattr(hf, "config", None), "vocab_size", 0) or 2)
    span = max([_MIN_SPAN, *declared_sizes(hf).values()])
    rng = np.random.default_rng(PROBE_SEED)
    r = lambda n: rng.integers(0, vocab, n, dtype=np.int64)  # noqa: E731
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
    return seqs, span
