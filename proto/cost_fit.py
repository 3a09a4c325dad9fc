"""Fitting a cost model to measured step times: non-negative, relative least squares.

``treepack.trainer.calibrate`` times forward+backward of calibration plans on the local
device and hands their counts (:func:`~treepack.proto.cost.plan_features`) and times to
:func:`fit_cost_model`, which returns the :class:`~treepack.proto.cost.CostModel`; the
solver is a Lawson-Hanson active set (:func:`_nnls`), numpy only.

A fit knows how good it is. Fewer batches than terms is refused: such a fit interpolates
the batches exactly (zero error on them) with coefficients that say nothing and change
from run to run. The model's ``fit`` reports the errors on the batches it was fitted to
and, what predicts how it does on batches it has not seen, leave-one-out (cross-validated)
errors: each batch predicted by the fit to all the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treepack.proto.cost import CostModel, cost_terms
from treepack.proto.errors import CostModelError

__all__ = ["fit_cost_model", "held_out_errors"]


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


def _fit(X: np.ndarray, t: np.ndarray) -> np.ndarray:
    """[T] non-negative coefficients minimising the relative error of ``X @ c`` against ``t``."""
    A = X / t[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    return _nnls(A / scale, np.ones(X.shape[0])) / scale


def held_out_errors(X: np.ndarray, t: np.ndarray) -> np.ndarray:
    """[B] relative error of each batch's time predicted by the fit to the other B - 1 (leave-one-out).

    Args:
        X: [B, T] features. t: [B] measured times, ms.
    """
    B = X.shape[0]
    out = np.zeros(B)
    for i in range(B):
        keep = np.arange(B) != i
        out[i] = abs(float(X[i] @ _fit(X[keep], t[keep])) - t[i]) / t[i]
    return out


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
        The :class:`CostModel`; ``fit`` holds ``batches``, ``terms``, ``rank`` (of the
        features: below ``terms``, some coefficients trade off against each other and only
        their sum is measured), ``median_rel_err`` and ``max_rel_err`` on the calibration
        batches, and ``cv_median_rel_err`` and ``cv_max_rel_err``: leave-one-out
        (:func:`held_out_errors`), the error to expect on batches the fit has not seen.

    Raises:
        CostModelError: shapes that do not match, times that are not positive, or fewer
            batches than terms (rule ``underdetermined``).
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
    if X.shape[0] < len(terms):
        raise CostModelError(
            f"{X.shape[0]} timed batches cannot determine {len(terms)} coefficients ({', '.join(terms)}): "
            "the fit would pass through every batch and say nothing about others; time at least as many "
            "batches as terms (calibrate times each batch twice, as the tree and as plain packing)",
            path="$.features",
            rule="underdetermined",
        )
    coef = _fit(X, t)
    rel = np.abs(X @ coef - t) / t
    held = held_out_errors(X, t)
    fit = {
        "batches": float(X.shape[0]),
        "terms": float(len(terms)),
        "rank": float(np.linalg.matrix_rank(X / t[:, None])),
        "median_rel_err": float(np.median(rel)),
        "max_rel_err": float(rel.max()),
        "cv_median_rel_err": float(np.median(held)),
        "cv_max_rel_err": float(held.max()),
    }
    return CostModel(
        backend=backend,
        mixers=tuple(mixers),
        coefficients={n: float(c) for n, c in zip(terms, coef)},
        chunk_size=chunk_size,
        device=device,
        description=description,
        fit=fit,
    )
