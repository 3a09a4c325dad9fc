"""The probe's noise model: what "exact" means at the precision the step computes in.

Two legal batch shapes of the same sequences (each alone, all right-padded into one batch,
reordered into two batches) run the same mathematics, yet at a finite precision their
results differ: matmul and softmax reductions change order with the shape. The **noise
floor** of a quantity is the larger of

- its **measured shape noise**: the largest drift between each sequence alone and the same
  sequences in another legal batch shape; and
- a **rounding floor**: a few units of rounding of the compute dtype (the coarsest float
  dtype the forward computes in, :mod:`~treepack.trainer.hf.admission.draws`) times the
  quantity's scale, for the shapes that round alike (float32 and float64 often agree to
  the bit across shapes, while packing still reorders sums).

Packed rows are accepted when their drift from each sequence alone is at most
:data:`MULTIPLE` times the noise floor, per token and per parameter:

- **log-probabilities**: the largest drift over every scored token against the largest
  shape noise, with a floor of :data:`LOGPROB_FLOOR_ULPS` units of rounding (at most
  :data:`FLOOR_CAP`) of the largest log-probability;
- **gradients**: each parameter's projected gradient drift against its own norm times the
  model's relative gradient noise (the largest shape drift of any parameter over its norm:
  rounding noise scales with a gradient's magnitude, and one projection of one parameter
  is too few samples to estimate its own), with a floor of :data:`GRAD_FLOOR_ULPS` units
  of rounding (at most :data:`FLOOR_CAP`, at least half a unit).

Nothing widens the bound beyond the measured noise and these floors. Random draws are
refused before this (:mod:`~treepack.trainer.hf.admission.draws`), and shapes that differ
beyond what rounding explains (:func:`shape_noise_limit`) mean the model reads the batch
shape: refused too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "MULTIPLE",
    "LOGPROB_FLOOR_ULPS",
    "GRAD_FLOOR_ULPS",
    "FLOOR_CAP",
    "NOISE_LIMIT_ULPS",
    "NOISE_CAP",
    "NoiseFloor",
    "logprob_err",
    "logprob_scale",
    "logprob_floor",
    "grad_floor",
    "shape_noise_limit",
]

# The stated multiple: packed drift <= MULTIPLE x noise floor, per token and per parameter.
MULTIPLE = 4.0

# Rounding floors, in units of the compute dtype's eps. Capped so that a coarse dtype
# relies on its measured noise, not on a floor wider than a real discrepancy.
LOGPROB_FLOOR_ULPS, GRAD_FLOOR_ULPS = 16, 256
FLOOR_CAP = 2.5e-4

# Beyond this relative drift between two unpacked batch shapes, rounding does not explain
# it (the model reads the batch shape): 1024 units of rounding, at most 5%.
NOISE_LIMIT_ULPS, NOISE_CAP = 1024, 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class NoiseFloor:
    """The noise floors of one probe.

    Attributes:
        compute_dtype: the dtype whose rounding the floors are in.
        logprob: the log-probabilities' noise floor (nats).
        logprob_noise: their measured shape noise (nats).
        grad_rel: the gradients' relative noise floor (of each parameter's norm).
        grad_rel_noise: their measured relative shape noise.
        shapes: the batch shapes measured against each sequence alone.
    """

    compute_dtype: str
    logprob: float
    logprob_noise: float
    grad_rel: float
    grad_rel_noise: float
    shapes: tuple[str, ...]


def logprob_err(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    """max |got - ref| over every scored position (inf when the scored positions differ)."""
    worst = 0.0
    for r, g in zip(ref, got):
        if not torch.equal(torch.isnan(r), torch.isnan(g)):
            return float("inf")
        keep = ~torch.isnan(r)
        if bool(keep.any()):
            worst = max(worst, float((r[keep].double() - g[keep].double()).abs().max()))
    return worst


def logprob_scale(ref: list[torch.Tensor]) -> float:
    """The log-probabilities' magnitude: max |ref|, at least 1."""
    return max(1.0, max(float(torch.nan_to_num(r.double()).abs().max()) for r in ref))


def logprob_floor(noise: float, scale: float, eps: float) -> float:
    """The log-probabilities' noise floor: the measured noise, at least the rounding floor.

    Args:
        noise: max |alone - other shape| log-probability over the shapes measured.
        scale: the log-probabilities' magnitude (:func:`logprob_scale`).
        eps: the compute dtype's machine epsilon.
    """
    return max(noise, min(LOGPROB_FLOOR_ULPS * eps, FLOOR_CAP) * scale)


def grad_floor(gnoise: torch.Tensor, gscale: torch.Tensor, eps: float) -> tuple[torch.Tensor, float, float]:
    """[P] noise floors of each parameter's projected gradient, the relative floor and noise.

    Args:
        gnoise: [P] max |alone - other shape| projection per parameter over the shapes measured.
        gscale: [P] gradient norms (clamped away from 0).
        eps: the compute dtype's machine epsilon.

    Returns:
        ([P] floors, relative floor, measured relative noise): floor = relative floor x norm.
    """
    noise = float((gnoise / gscale).max()) if gnoise.numel() else 0.0
    rel = max(noise, min(GRAD_FLOOR_ULPS * eps, FLOOR_CAP), 0.5 * eps)
    return rel * gscale, rel, noise


def shape_noise_limit(eps: float) -> float:
    """The largest relative shape noise rounding explains at ``eps`` (:data:`NOISE_LIMIT_ULPS`, :data:`NOISE_CAP`)."""
    return min(NOISE_LIMIT_ULPS * eps, NOISE_CAP)
