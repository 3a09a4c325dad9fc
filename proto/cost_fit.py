"""Fitting a cost model to measured step times: non-negative, relative least squares.

``treepack.trainer.calibrate`` times forward+backward of calibration plans on the local
device and hands their counts (:func:`~treepack.proto.cost.plan_features`) and times to
:func:`fit_cost_model`, which returns the :class:`~treepack.proto.cost.CostModel`; the
solver is a Lawson-Hanson active set (:func:`_nnls`), numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treepack.proto.cost import CostModel, cost_terms
from treepack.proto.errors import CostModelError

__all__ = ["fit_cost_model"]


def _nnls(A: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """argmin ||A x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    m, n = A.shape
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    w = A.T @ (b - A @ x)
    tol = 1e-10 * max(1.0, float(np.abs(A).max(initial=0.0)))
    for _ in range(iters):
        if free.all() or not (w[~free] > tol).any():
            break
        j = int(np.argmax(np.where(free, -np.inf, w)))
        free[j] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            neg = free & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
        w = A.T @ (b - A @ x)
    return x


def fit_cost_model(
    features: np.ndarray,
    times_ms: Sequence[float],
    *,
    backend: str,
    mixers: Sequence[str] = (),
    chunk_size: int = 64,
    device: str = "",
    description: str = "",
) -> CostModel:
    """Fit non-negative coefficients to measured step times (relative least squares).

    Each batch's equation is divided by its measured time, so a long and a short step
    weigh alike and the fit minimises relative error.

    Args:
        features: [B, T] counts, rows from :func:`plan_features` with
            ``cost_terms(backend, mixers)``.
        times_ms: [B] measured step times, ms (> 0).

    Returns:
        The :class:`CostModel`; ``fit`` holds ``batches``, ``median_rel_err`` and
        ``max_rel_err`` on the calibration batches.

    Raises:
        CostModelError: shapes that do not match, or times that are not positive.
    """
    terms = cost_terms(backend, mixers)
    X = np.asarray(features, dtype=np.float64)
    t = np.asarray(times_ms, dtype=np.float64)
    if X.ndim != 2 or X.shape[1] != len(terms) or t.shape != (X.shape[0],):
        raise CostModelError(
            f"features must be [batches, {len(terms)}] and times [batches], got {X.shape} and {t.shape}",
            path="$.features",
            rule="shape",
        )
    if X.shape[0] == 0 or not (np.isfinite(t).all() and (t > 0).all()):
        raise CostModelError("need at least one batch, every time finite and > 0", path="$.times_ms", rule="range")
    A = X / t[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    coef = _nnls(A / scale, np.ones(X.shape[0])) / scale
    rel = np.abs(X @ coef - t) / t
    fit = {"batches": float(X.shape[0]), "median_rel_err": float(np.median(rel)), "max_rel_err": float(rel.max())}
    return CostModel(
        backend=backend,
        mixers=tuple(mixers),
        coefficients={n: float(c) for n, c in zip(terms, coef)},
        chunk_size=chunk_size,
        device=device,
        description=description,
        fit=fit,
    )
