"""Run-time proof that packing is exact for one model setup: :func:`verify_packing`.

:func:`~treepack.trainer.hf.admission.check.check_static` reads a model's structure; it cannot see
what runs (a layer that does not pass its context on, a mask a model builds for itself, a
hook). So before the first packed step of a setup, :func:`~treepack.trainer.hf.packed_forward`
runs a small probe on the model itself and refuses the setup unless packing is exact:

- a tree batch built from the model's own config
  (:func:`~treepack.trainer.hf.admission.probe_inputs.probe_sequences`): every
  sequence longer than the largest window, chunk or convolution the config declares,
  several trees in one row, a branch inside a chunk, shared scored tokens (a deep tree),
  a strict prefix and a sequence of its own;
- the packed forward (through :func:`~treepack.trainer.hf.packed_forward`, with the caller's backend) against
  every sequence alone, with the model as the caller holds it: train or eval mode,
  gradient checkpointing (reentrant or not), dtype, device;
- forward log-probabilities (a classification head's per-token values or per-sequence
  scores: :mod:`~treepack.trainer.hf.admission.readout`) and gradients
  (:mod:`~treepack.trainer.hf.admission.measure`): a fixed random weighting of every scored
  output is backpropagated, and every
  parameter's gradient is reduced to its norm and three random projections (so nothing of
  the model's size is kept twice);
- tolerances from the dtype, measured rather than guessed
  (:mod:`~treepack.trainer.hf.admission.tolerance`): the unpacked path's own noise
  is the difference between each sequence alone and all of them right-padded in one
  batch (two batch shapes, the same mathematics). Packed log-probabilities must lie within
  4x that noise plus a floor of a few ulps of the dtype, each parameter's projected
  gradient within 8x its noise plus a floor (the larger of 1024 ulps capped at 1e-3, and
  two ulps) of its norm. When the two unpacked shapes
  themselves differ by more than the dtype allows, something random runs (dropout) or
  the model reads the batch shape, and the probe refuses too: it cannot prove anything.

On a mismatch it raises :class:`~treepack.proto.errors.UnsupportedModelError` naming the
first module whose output diverges (:mod:`~treepack.trainer.hf.admission.divergence`: a
forward pass with every module's output hooked, compared module by module in the order they
finish), or, when every output agrees but the gradients do not (a checkpoint replay that ran
something else), the last module, in forward order, whose parameters' gradients differ,
with the measured error and its bound.

A passing probe is remembered per model and :func:`probe_signature` (backend, layer
patches, train/eval, checkpointing and its reentrancy, dtype, device), so each setup is
proven once per process. The random streams of torch (CPU and the model's device) are
forked: the caller's random draws are unchanged by the probe.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer.hf.admission.divergence import (
    at_module,
    class_at,
    first_divergence,
    gradient_divergence,
    packed_outputs,
    padded_outputs,
)
from treepack.trainer.hf.admission.measure import own_random_stream, projected_grads, seed, weighted
from treepack.trainer.hf.admission.probe_inputs import PROBE_SEED, probe_sequences
from treepack.trainer.hf.admission.readout import readout
from treepack.trainer.hf.admission.tolerance import NOISE_CAP, grad_bound, logprob_bound, logprob_err, logprob_scale
from treepack.trainer.hf.admission.walk_cache import forget_walks

__all__ = ["ProbeReport", "verify_packing", "run_probe", "probe_signature", "forget_probes"]

_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, ProbeReport]] = weakref.WeakKeyDictionary()
_SIGNATURE_NAMES = ("backend", "patch_layers", "training", "checkpointing", "reentrant", "dtype", "device")


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """What a passing probe measured.

    Attributes:
        signature: the :func:`probe_signature` it proved.
        tokens: tokens of the probe's sequences (each alone).
        logprob_err: max |packed - alone| over every scored log-probability (a classification
            head's per-token values or per-sequence scores: :mod:`~treepack.trainer.hf.admission.readout`).
        logprob_tol: the bound it had to stay under.
        grad_err: max over parameters of |packed - alone| projected gradient / the bound.
        seconds: wall time of the probe.
    """

    signature: tuple
    tokens: int
    logprob_err: float
    logprob_tol: float
    grad_err: float
    seconds: float


def _checkpointing(hf: torch.nn.Module) -> tuple[bool, Any]:
    """(whether checkpointing runs in this mode, use_reentrant of its function or None)."""
    on = hf.training and any(getattr(m, "gradient_checkpointing", False) is True for m in hf.modules())
    fn = next(
        (
            m.__dict__.get("_gradient_checkpointing_func")
            for m in hf.modules()
            if "_gradient_checkpointing_func" in m.__dict__
        ),
        None,
    )
    reentrant = getattr(fn, "keywords", {}).get("use_reentrant") if fn is not None else None
    return on, reentrant


def probe_signature(hf: torch.nn.Module, *, backend: str, patch_layers: bool = True) -> tuple:
    """What a passing probe proves for ``hf``: (backend, patch_layers, training, checkpointing,
    reentrant, dtype, device, gradients enabled, autocast dtype or None)."""
    p = next(hf.parameters(), None)
    on, reentrant = _checkpointing(hf)
    dev = p.device.type if p is not None else "cpu"
    autocast = str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
    return (
        backend,
        bool(patch_layers),
        bool(hf.training),
        on,
        reentrant if on else None,
        str(p.dtype) if p is not None else "",
        str(p.device) if p is not None else "",
        torch.is_grad_enabled(),
        autocast,
    )


def forget_probes(hf: torch.nn.Module | None = None) -> None:
    """Drop the remembered probes and model walks (of ``hf``, or all): the next packed call walks and probes again."""
    forget_walks(hf)
    if hf is None:
        _VERIFIED.clear()
    else:
        _VERIFIED.pop(hf, None)


def _measure(hf: Any, seqs: list[torch.Tensor], batch: Any, run_packed: Callable[[Any], torch.Tensor]) -> dict:
    """The head's outputs (:mod:`~treepack.trainer.hf.admission.readout`: log-probabilities, values or
    scores) and projected gradients of each sequence alone, right-padded and packed."""
    device = seqs[0].device
    on, reentrant = _checkpointing(hf)
    reentrant = bool(reentrant) if on else False
    gen = torch.Generator().manual_seed(PROBE_SEED)
    ro = readout(hf)
    # Gradients are proven where the caller computes them (a no-grad scoring call proves the forward).
    grads = torch.is_grad_enabled()
    with own_random_stream(device):
        alone = ro.alone(hf, seqs)
        weights = [torch.randn(a.shape, generator=gen).to(device) for a in alone]
        g_alone = projected_grads(hf, weighted(alone, weights), reentrant, grads)
        padded = ro.padded(hf, seqs)
        g_padded = projected_grads(hf, weighted(padded, weights), reentrant, grads)
        seed()
        packed = ro.packed(batch, run_packed(batch))
        g_packed = projected_grads(hf, weighted(packed, weights), reentrant, grads)
    return {
        "name": ro.name,
        "alone": [x.detach() for x in alone],
        "padded": [x.detach() for x in padded],
        "packed": [x.detach() for x in packed],
        "g_alone": g_alone,
        "g_padded": g_padded,
        "g_packed": g_packed,
    }


def _refuse_nondeterministic(hf: Any, seqs: list[torch.Tensor], what: str, noise: float) -> None:
    path = first_divergence(hf, seqs, lambda: padded_outputs(hf, seqs), NOISE_CAP)
    raise UnsupportedModelError(
        f"{what}: the unpacked model is not deterministic across batch shapes (each sequence alone vs right-padded: "
        f"logprobs differ by {noise:.3g}); something random or batch-dependent "
        f"runs{at_module(path, class_at(hf, path))}, "
        "so packing cannot be verified (dropout while training? call model.eval() or set the dropout to 0)",
        path="$.model" + (f".{path}" if path else ""),
        rule="probe_nondeterministic",
    )


def _refuse_mismatch(hf: Any, seqs: list[torch.Tensor], what: str, found: dict, packed_run: Callable) -> None:
    path = first_divergence(hf, seqs, packed_run, found["rel"])
    kind = "forward output"
    if path is None and found["grad_ratio"] > 1.0:
        path, kind = gradient_divergence(hf, found["ratio"]), "parameter gradients"
    msg = (
        f"{what}: packed rows differ from each sequence alone: {found['name']} by {found['lp_err']:.3g} "
        f"(bound {found['lp_tol']:.3g}), gradients up to {found['grad_ratio']:.3g}x their bound; "
        f"first diverging {kind}{at_module(path, class_at(hf, path))}"
    )
    raise UnsupportedModelError(
        msg,
        path="$.model" + (f".{path}" if path else ""),
        rule="probe_mismatch",
        refusals=((path or "", class_at(hf, path), msg),),
    )


def run_probe(
    model: Any,
    *,
    run_packed: Callable[[Any], torch.Tensor],
    plan_and_batch: Callable[[list[np.ndarray]], tuple[Any, Any]],
    signature: tuple = (),
) -> ProbeReport:
    """Run the probe once (no cache): packed vs every sequence alone, forward and gradients.

    Args:
        model: the unwrapped HF causal LM, in the caller's mode.
        run_packed: batch -> [K, L, V] logits of the packed call (the caller's backend).
        plan_and_batch: sequences -> (plan, PackedBatch) with every token after the first scored.
        signature: recorded in the report.

    Returns:
        The :class:`ProbeReport`.

    Raises:
        UnsupportedModelError: packed and alone differ beyond the measured bound (naming the
            first diverging module), or the unpacked path is not deterministic.
    """
    t0 = time.perf_counter()
    hf = model
    first = next(hf.parameters())
    dtype = first.dtype
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    arrays, _ = probe_sequences(hf)
    _, batch = plan_and_batch(arrays)
    seqs = [torch.as_tensor(a, device=first.device) for a in arrays]
    m = _measure(hf, seqs, batch, run_packed)
    scale = logprob_scale(m["alone"])
    noise = logprob_err(m["alone"], m["padded"])
    norms = m["g_alone"][0]
    gscale = torch.clamp(norms, min=1e-3 * float(norms.max()) if norms.numel() else 0.0)
    gnoise = (m["g_padded"][1] - m["g_alone"][1]).abs().amax(1) if norms.numel() else norms
    named = ", ".join(f"{k}={v}" for k, v in zip(_SIGNATURE_NAMES, signature))
    what = f"{type(hf).__name__} ({named})"
    if noise > NOISE_CAP * scale or bool((gnoise > NOISE_CAP * gscale).any()):
        _refuse_nondeterministic(hf, seqs, what, noise)
    lp_tol = logprob_bound(noise, scale, eps)
    lp_err = logprob_err(m["alone"], m["packed"])
    ratio = (m["g_packed"][1] - m["g_alone"][1]).abs().amax(1) / grad_bound(gnoise, gscale, eps)
    grad_ratio = float(ratio.max()) if ratio.numel() else 0.0
    if lp_err > lp_tol or grad_ratio > 1.0:
        found = {"rel": lp_tol / scale, "ratio": ratio, "grad_ratio": grad_ratio, "lp_err": lp_err, "lp_tol": lp_tol}
        found["name"] = m["name"]
        _refuse_mismatch(hf, seqs, what, found, lambda: packed_outputs(hf, batch, run_packed))
    return ProbeReport(
        signature=signature,
        tokens=int(sum(a.shape[0] for a in arrays)),
        logprob_err=lp_err,
        logprob_tol=lp_tol,
        grad_err=grad_ratio,
        seconds=time.perf_counter() - t0,
    )


def verify_packing(hf: Any, *, backend: str, patch_layers: bool, extra: tuple = (), **probe: Any) -> ProbeReport:
    """:func:`run_probe` once per (model, :func:`probe_signature` + ``extra``); later calls return the first report.

    Args:
        hf: the unwrapped model; backend, patch_layers: as for ``packed_forward``.
        extra: more of the setup, part of the signature.
        **probe: ``run_packed`` and ``plan_and_batch`` of :func:`run_probe`.

    Raises:
        UnsupportedModelError: as :func:`run_probe` (a refused setup is probed again next call).
    """
    sig = probe_signature(hf, backend=backend, patch_layers=patch_layers) + tuple(extra)
    done = _VERIFIED.setdefault(hf, {})
    if sig not in done:
        done[sig] = run_probe(hf, signature=sig, **probe)
    return done[sig]
