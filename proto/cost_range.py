"""A cost model's range: the largest count of each term within a service's limits, and predictions finite there.

A cost file holds finite coefficients (:class:`~treepack.proto.cost.CostModel` checks
that), but a finite coefficient times a large count can still overflow: ``attention_pairs``
of ``sdpa`` is ``R x C^2``, about 1.2e24 at ``seq_len`` 2**31 - 1 with 2**18 rows, so a
coefficient of 1e300 predicts an infinite step. :func:`check_cost_range` bounds every term
over the whole range a service accepts (every ``seq_len`` up to
:data:`~treepack.proto.options.MAX_SEQ_LEN`, as many rows as sequences) and refuses a
model whose prediction there, times a what-if's trial count (its means sum them), is not
a finite float, naming the coefficient that breaks it and the largest value it may take.

The bounds (R rows <= S sequences, C = ``seq_len``, P = R x C positions):

- ``step`` 1; ``rows`` R; ``positions`` and ``loss_tokens`` P;
- ``segments`` P + S (a segment holds a token, except a sequence's empty leaf);
- ``attention_pairs``: R x C^2 (``sdpa``) or P (C + 1) / 2 (a query sees at most the keys
  before it); ``sparse.pairs`` the latter; ``gathered_keys``: C per segment;
- ``K.levels`` and ``K.contexts``: one per segment at most; ``K.chunks``:
  P / ``chunk_size`` + one per segment.
"""

from __future__ import annotations

import math
import os
import sys

from treepack.proto.cost import CostModel, CostModelError, load_cost_model
from treepack.proto.options import MAX_SEQ_LEN

__all__ = ["max_counts", "check_cost_range", "load_checked_cost_model"]

_FLOAT_MAX = sys.float_info.max


def max_counts(model: CostModel, *, max_sequences: int, max_seq_len: int = MAX_SEQ_LEN) -> dict[str, float]:
    """The largest count of each of ``model``'s terms over plans of up to ``max_sequences``
    sequences at any ``seq_len`` up to ``max_seq_len`` (module docstring).

    Returns:
        term -> bound (Python floats: exact enough, and never an overflow at these sizes).
    """
    S, C = float(max_sequences), float(max_seq_len)
    R = S
    P = R * C
    G = P + S
    half = P * (C + 1) / 2
    out: dict[str, float] = {}
    for t in model.terms:
        what = t.rpartition(".")[2]
        if t == "step":
            v = 1.0
        elif t == "rows":
            v = R
        elif t in ("positions", "loss_tokens"):
            v = P
        elif t == "segments":
            v = G
        elif t == "attention_pairs":
            v = R * C * C if model.backend == "sdpa" else half
        elif t == "sparse.pairs":
            v = half
        elif t == "gathered_keys":
            v = G * C
        elif what in ("levels", "contexts"):
            v = G
        else:  # chunks
            v = P / model.chunk_size + G
        out[t] = v
    return out


def check_cost_range(model: CostModel, *, max_sequences: int, max_seq_len: int = MAX_SEQ_LEN, trials: int = 1) -> None:
    """Refuse a model whose predictions can overflow within these limits (module docstring).

    Args:
        model: the cost model.
        max_sequences: the most sequences a plan (or a what-if trial) holds.
        max_seq_len: the largest ``seq_len`` planned.
        trials: the most trials a what-if sums into one mean.

    Raises:
        CostModelError: naming the coefficient (``$.coefficients.<term>``), its value, the
            count it meets and the largest value that keeps every prediction finite.
    """
    bounds = max_counts(model, max_sequences=max_sequences, max_seq_len=max_seq_len)
    parts = {t: float(model.coefficients[t]) * b for t, b in bounds.items()}
    ceiling = _FLOAT_MAX / (2.0 * max(1, trials))
    total = math.fsum(p for p in parts.values() if math.isfinite(p))
    if all(math.isfinite(p) for p in parts.values()) and total <= ceiling:
        return
    worst = max(parts, key=lambda t: parts[t])
    room = max(0.0, ceiling - (total - parts[worst] if math.isfinite(parts[worst]) else total))
    raise CostModelError(
        f"coefficient {worst} = {float(model.coefficients[worst]):.6g} ms makes the predicted step overflow: it "
        f"meets up to {bounds[worst]:.3g} {worst} (seq_len up to {max_seq_len}, {max_sequences} rows), so a "
        f"prediction (or a what-if's sum over {trials} trials) is no finite number; at most "
        f"{room / bounds[worst]:.3g} is usable",
        path=f"$.coefficients.{worst}",
        rule="range",
    )


def load_checked_cost_model(
    path: str | os.PathLike, *, max_sequences: int, max_seq_len: int = MAX_SEQ_LEN, trials: int = 1
) -> CostModel:
    """:func:`~treepack.proto.cost.load_cost_model`, then :func:`check_cost_range` (the service's startup check).

    Raises:
        CostModelError: the file cannot be read, is no valid cost model, or its predictions
            can overflow; the message names the file and the field, on one line.
    """
    model = load_cost_model(path)
    try:
        check_cost_range(model, max_sequences=max_sequences, max_seq_len=max_seq_len, trials=trials)
    except CostModelError as e:
        raise CostModelError(f"cost file {os.fspath(path)!r}: {e.message}", path=e.path, rule=e.rule) from None
    return model
