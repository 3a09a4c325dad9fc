"""The probe's noise model: bounds from the dtype, measured rather than guessed.

The unpacked path's own noise is the difference between each sequence alone and all of them
right-padded in one batch. Packed log-probabilities must lie within 4x that noise plus a floor
of a few ulps of the dtype, each parameter's projected gradient within 8x its noise plus a
floor (the larger of 1024 ulps capped at 1e-3, and two ulps) of its norm. When the two unpacked
shapes themselves differ by more than :data:`NOISE_CAP`, something random runs (dropout) or
the model reads the batch shape: nothing can be proven.
"""

from __future__ import annotations

import torch

__all__ = [
    "NOISE_FACTOR",
    "LOGPROB_FLOOR_EPS",
    "GRAD_FLOOR_EPS",
    "FLOOR_CAP",
    "NOISE_CAP",
    "logprob_err",
    "logprob_scale",
    "logprob_bound",
    "grad_bound",
]

# Floors, in units of the dtype's eps: the unpacked noise can be exactly 0 in fp32 (same
# kernels on both shapes) while packing reorders sums. Capped so a coarse dtype still
# relies on its measured noise, not on a floor wider than a real discrepancy.
LOGPROB_FLOOR_EPS, GRAD_FLOOR_EPS = 64, 1024


NOISE_FACTOR = 4.0


FLOOR_CAP = 1e-3


# Beyond this relative difference between the two unpacked batch shapes, the unpacked path
# is not deterministic (dropout, batch-dependent code) and no tolerance can be derived.
NOISE_CAP = 0.05


def logprob_err(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    worst = 0.0
    for r, g in zip(ref, got):
        if not torch.equal(torch.isnan(r), torch.isnan(g)):
            return float("inf")
        keep = ~torch.isnan(r)
        if bool(keep.any()):
            worst = max(worst, float((r[keep].double() - g[keep].double()).abs().max()))
    return worst


def logprob_scale(ref: list[torch.Tensor]) -> float:
    return max(1.0, max(float(torch.nan_to_num(r.double()).abs().max()) for r in ref))


def logprob_bound(noise: float, scale: float, eps: float) -> float:
    """The bound on |packed - alone| log-probabilities: 4x the unpacked noise plus a floor of ulps.

    Args:
        noise: max |alone - padded| log-probability.
        scale: the log-probabilities' magnitude (:func:`logprob_scale`).
        eps: the dtype's machine epsilon.
    """
    floor = min(LOGPROB_FLOOR_EPS * eps, FLOOR_CAP)
    return NOISE_FACTOR * noise + floor * scale


def grad_bound(gnoise: torch.Tensor, gscale: torch.Tensor, eps: float) -> torch.Tensor:
    """[P] bounds on each parameter's projected gradient error: 8x its noise plus a floor of its norm.

    Args:
        gnoise: [P] max |alone - padded| projection per parameter.
        gscale: [P] gradient norms (clamped away from 0).
        eps: the dtype's machine epsilon.
    """
    # Gradients sum over every position and layer: a coarse dtype keeps two of its ulps.
    gfloor = max(min(GRAD_FLOOR_EPS * eps, FLOOR_CAP), 2 * eps)
    return 2 * NOISE_FACTOR * gnoise + gfloor * gscale
