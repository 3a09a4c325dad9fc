"""Run-time proof that packing is exact for one model setup: :func:`verify_packing`.

:func:`~treepack.trainer.hf.admission.check.check_static` reads a model's structure; it cannot see
what runs (a layer that does not pass its context on, a mask a model builds for itself, a
hook, a random draw). So before the first packed step of a setup,
:func:`~treepack.trainer.hf.packed_forward` runs a small probe on the model itself and refuses
the setup unless packing is exact:

- a tree batch built from the model's own config
  (:func:`~treepack.trainer.hf.admission.probe_inputs.probe_sequences`): long sequences
  crossing the largest window, chunk or convolution that applies to the caller's rows,
  every sequence fitting those rows, several trees in one row, a branch inside a chunk,
  shared scored tokens (a deep tree), a strict prefix and a sequence of its own;
- one forward of one sequence alone watched operator by operator
  (:mod:`~treepack.trainer.hf.admission.draws`): a module that draws random numbers in the
  mode it runs in is refused by name (every sharer of a packed prefix would get one draw),
  and the coarsest float dtype it computes in is the precision of the noise model;
- the packed forward (with the caller's backend) against every sequence alone, both run
  through the callable the caller trains with (PEFT, DDP, accelerate, ``torch.compile``
  wrappers) under the caller's autocast, with the model as the caller holds it: train or
  eval mode, gradient checkpointing (reentrant or not), dtype, device;
- forward log-probabilities (a classification head's per-token values or per-sequence
  scores: :mod:`~treepack.trainer.hf.admission.readout`) and gradients
  (:mod:`~treepack.trainer.hf.admission.measure`): a fixed random weighting of every scored
  output is backpropagated, and every
  parameter's gradient is reduced to its norm and three random projections (so nothing of
  the model's size is kept twice);
- the noise model (:mod:`~treepack.trainer.hf.admission.tolerance`): packed drift within
  :data:`~treepack.trainer.hf.admission.tolerance.MULTIPLE` times the noise floor, the
  drift between each sequence alone and the same sequences in another legal batch shape
  (right-padded into one batch; when that is not enough, also reordered into two batches),
  at least a few units of rounding of the compute dtype. The same sequence alone run twice
  must agree to rounding, and two unpacked shapes must not differ beyond what rounding
  explains (the model would read the batch shape): otherwise nothing can be proven.

On a mismatch it raises :class:`~treepack.proto.errors.UnsupportedModelError` naming the
first module whose output diverges (:mod:`~treepack.trainer.hf.admission.divergence`: a
forward pass with every module's output hooked, compared module by module in the order they
finish), or, when every output agrees but the gradients do not (a checkpoint replay that ran
something else), the last module, in forward order, whose parameters' gradients differ,
with the measured drift and its noise floor.

A passing probe is remembered per model and :func:`probe_signature` (backend, layer
patches, train/eval, checkpointing and its reentrancy, dtype, device, autocast, and what
the caller adds: the wrappers, the rows' cap, what was accepted), so each setup is proven
once per process. The random streams of torch (CPU and the model's device) are forked:
the caller's random draws are unchanged by the probe.

A model whose parameters are sharded over the ranks (FSDP, FSDP2, tensor parallel) runs
each forward as a collective, so its probe runs on every rank or on none: whether any rank
needs one is agreed by one all-reduce per call (a rank's row length, and so the probe's
cap, depends on its own micro-batch), and such a probe measures both unpacked shapes, so
that every rank runs the same forwards whatever its own measurements say.
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
    alone_outputs,
    at_module,
    class_at,
    first_divergence,
    gradient_divergence,
    packed_outputs,
    padded_outputs,
)
from treepack.trainer.hf.admission.draws import ForwardWatch, draw_refusals, draws_off, watch_forward
from treepack.trainer.hf.admission.lockstep import lockstep_ranks, on_any_rank
from treepack.trainer.hf.admission.measure import (
    SHAPES,
    own_random_stream,
    projected_grads,
    seed,
    weighted,
)
from treepack.trainer.hf.admission.probe_inputs import PROBE_SEED, probe_sequences
from treepack.trainer.hf.admission.readout import Readout, readout
from treepack.trainer.hf.admission.tolerance import (
    MULTIPLE,
    NoiseFloor,
    grad_floor,
    logprob_err,
    logprob_floor,
    logprob_scale,
    shape_noise_limit,
)
from treepack.trainer.hf.admission.walk_cache import forget_walks

__all__ = ["ProbeReport", "verify_packing", "run_probe", "probe_signature", "forget_probes", "checkpointing"]

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
        logprob_tol: the bound it had to stay under (:data:`MULTIPLE` x the noise floor).
        grad_err: max over parameters of |packed - alone| projected gradient / its bound.
        seconds: wall time of the probe.
        noise: the :class:`~treepack.trainer.hf.admission.tolerance.NoiseFloor` measured
            (compute dtype, floors, shapes); None in reports made without one.
    """

    signature: tuple
    tokens: int
    logprob_err: float
    logprob_tol: float
    grad_err: float
    seconds: float
    noise: NoiseFloor | None = None


def checkpointing(hf: torch.nn.Module) -> tuple[bool, Any]:
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
    on, reentrant = checkpointing(hf)
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


@dataclass(slots=True)
class _Runs:
    """The probe's runs: how to run each, and what was measured (per sequence the head's outputs:
    [n] log-probabilities, [n, labels] values or [labels] scores (``ro``); ([P] norms, [P, 3]
    projections) of the gradients)."""

    call: Any
    hf: Any
    ro: Readout
    seqs: list[torch.Tensor]
    weights: list[torch.Tensor]
    reentrant: bool
    grads: bool
    alone: list[torch.Tensor]
    g_alone: tuple[torch.Tensor, torch.Tensor]

    def gradients(self, lps: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return projected_grads(self.hf, weighted(lps, self.weights), self.reentrant, self.grads)

    def shape(self, name: str) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        lps = self.ro.padded(self.call, self.seqs, name)
        return [x.detach() for x in lps], self.gradients(lps)


def _alone(call: Any, hf: Any, seqs: list[torch.Tensor]) -> _Runs:
    """Every sequence alone through ``call``, forward and projected gradients."""
    device = seqs[0].device
    on, reentrant = checkpointing(hf)
    gen = torch.Generator().manual_seed(PROBE_SEED)
    ro = readout(hf)
    # Gradients are proven where the caller computes them (a no-grad scoring call proves the forward).
    grads = torch.is_grad_enabled()
    runs = _Runs(call, hf, ro, seqs, [], bool(reentrant) if on else False, grads, [], (torch.zeros(0),) * 2)
    alone = ro.alone(call, seqs, 0)
    runs.weights = [torch.randn(a.shape, generator=gen).to(device) for a in alone]
    runs.g_alone = runs.gradients(alone)
    runs.alone = [x.detach() for x in alone]
    return runs


@dataclass(frozen=True, slots=True)
class _Judged:
    """Packed drift against the noise floor: ``lp_err`` against its bound ``lp_tol``; ``ratio`` ([P]) and
    ``grad_ratio`` (their max) are gradient drift / bound (<= 1 passes); ``shape_noise``, the largest
    relative drift of the unpacked shapes, against ``limit`` (what rounding explains)."""

    noise: NoiseFloor
    lp_err: float
    lp_tol: float
    ratio: torch.Tensor
    grad_ratio: float
    shape_noise: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.lp_err <= self.lp_tol and self.grad_ratio <= 1.0


def _judge(runs: _Runs, packed: tuple, shapes: dict[str, tuple], dtype: torch.dtype) -> _Judged:
    """Packed against every sequence alone, within :data:`MULTIPLE` x the noise floor of ``shapes``."""
    eps = torch.finfo(dtype).eps
    scale = logprob_scale(runs.alone)
    lp_noise = max(logprob_err(runs.alone, lps) for lps, _ in shapes.values())
    norms = runs.g_alone[0]
    # Away from 0: a model whose probe gradients are all 0 (an adapter the probe never activates) compares
    # them exactly, not 0/0.
    gscale = torch.clamp(norms, min=max(1e-3 * float(norms.max()), 1e-30) if norms.numel() else 0.0)
    gnoise = torch.stack([(g[1] - runs.g_alone[1]).abs().amax(1) for _, g in shapes.values()]).amax(0)
    floors, grel, grel_noise = grad_floor(gnoise, gscale, eps)
    noise = NoiseFloor(
        compute_dtype=str(dtype).removeprefix("torch."),
        logprob=logprob_floor(lp_noise, scale, eps),
        logprob_noise=lp_noise,
        grad_rel=grel,
        grad_rel_noise=grel_noise,
        shapes=tuple(shapes),
    )
    ratio = (packed[1][1] - runs.g_alone[1]).abs().amax(1) / (MULTIPLE * floors) if norms.numel() else norms
    return _Judged(
        noise=noise,
        lp_err=logprob_err(runs.alone, packed[0]),
        lp_tol=MULTIPLE * noise.logprob,
        ratio=ratio,
        grad_ratio=float(ratio.max()) if ratio.numel() else 0.0,
        shape_noise=max(lp_noise / scale, grel_noise),
        limit=shape_noise_limit(eps),
    )


def _refuse_draws(hf: Any, watch: ForwardWatch, what: str, silenced: bool = False) -> None:
    found = draw_refusals(hf, watch)
    shown = "; ".join(f"{p or '<model>'} ({c}): {r}" for p, c, r in found[:4])
    more = f" (+{len(found) - 4} more)" if len(found) > 4 else ""
    lead = "even with the drawing modules in eval mode (allow_stochastic), " if silenced else ""
    raise UnsupportedModelError(
        f"{what}: {lead}the model draws random numbers in the mode it runs in, so packed rows cannot equal "
        f"each sequence alone: {shown}{more}",
        path="$.model" + (f".{found[0][0]}" if found[0][0] else ""),
        rule="stochastic",
        refusals=tuple(found),
    )


def _refuse_twin(runs: _Runs, what: str, err: float, tol: float) -> None:
    s = runs.seqs[-1:]
    path = first_divergence(runs.call, runs.hf, s, lambda: alone_outputs(runs.call, runs.hf, s, offset=1), 0.0)
    msg = (
        f"{what}: the model is not a function of its inputs: the same sequence alone, run twice, differs by "
        f"{err:.3g} (rounding allows {tol:.3g}); something random runs{at_module(path, class_at(runs.hf, path))}"
    )
    raise UnsupportedModelError(msg, path="$.model" + (f".{path}" if path else ""), rule="stochastic")


def _refuse_nondeterministic(runs: _Runs, what: str, j: _Judged) -> None:
    hf, seqs = runs.hf, runs.seqs
    path = first_divergence(runs.call, hf, seqs, lambda: padded_outputs(runs.call, hf, seqs), j.limit)
    raise UnsupportedModelError(
        f"{what}: the unpacked model is not deterministic across batch shapes (each sequence alone vs "
        f"{' / '.join(j.noise.shapes)}: logprobs differ by {j.noise.logprob_noise:.3g}, gradients by "
        f"{j.noise.grad_rel_noise:.3g} of their norm, beyond the {j.limit:.3g} that {j.noise.compute_dtype} "
        f"rounding explains); something batch-dependent runs{at_module(path, class_at(hf, path))}, so packing "
        "cannot be verified",
        path="$.model" + (f".{path}" if path else ""),
        rule="probe_nondeterministic",
    )


def _refuse_mismatch(runs: _Runs, what: str, j: _Judged, packed_run: Callable) -> None:
    hf = runs.hf
    path = first_divergence(runs.call, hf, runs.seqs, packed_run, j.lp_tol / logprob_scale(runs.alone))
    kind = "forward output"
    if path is None and j.grad_ratio > 1.0:
        path, kind = gradient_divergence(hf, j.ratio), "parameter gradients"
    msg = (
        f"{what}: packed rows differ from each sequence alone beyond {MULTIPLE:g}x the {j.noise.compute_dtype} "
        f"noise floor: {runs.ro.name} by {j.lp_err:.3g} (noise floor {j.noise.logprob:.3g}, bound {j.lp_tol:.3g}; "
        f"noise measured against {' / '.join(j.noise.shapes)}), gradients up to {j.grad_ratio:.3g}x their bound; "
        f"first diverging {kind}{at_module(path, class_at(hf, path))}"
    )
    raise UnsupportedModelError(
        msg,
        path="$.model" + (f".{path}" if path else ""),
        rule="probe_mismatch",
        refusals=((path or "", class_at(hf, path), msg),),
    )


def _prove(
    runs: _Runs, batch: Any, run_packed: Callable, dtype: torch.dtype, what: str, lockstep: bool = False
) -> _Judged:
    """The same sequence alone twice within rounding, then packed against alone within the noise floor.

    The second shape is measured only when the first is not enough (always with ``lockstep``:
    every rank runs the same forwards): the verdict is the same as with both measured, since a
    wider floor never refuses what a narrower one accepts.
    """
    with torch.no_grad():
        twin = runs.ro.alone(runs.call, runs.seqs[-1:], 1)
    tol = MULTIPLE * logprob_floor(0.0, logprob_scale(runs.alone), torch.finfo(dtype).eps)
    if (err := logprob_err(runs.alone[-1:], twin)) > tol:
        _refuse_twin(runs, what, err, tol)
    seed()
    lp = runs.ro.packed(batch, run_packed(batch))
    packed = ([x.detach() for x in lp], runs.gradients(lp))
    names = list(SHAPES)
    shapes = {names[0]: runs.shape(names[0])}
    j = _judge(runs, packed, shapes, dtype)
    if lockstep or (not j.ok and j.shape_noise <= j.limit):
        shapes[names[1]] = runs.shape(names[1])
        j = _judge(runs, packed, shapes, dtype)
    if j.shape_noise > j.limit:
        _refuse_nondeterministic(runs, what, j)
    if not j.ok:
        _refuse_mismatch(runs, what, j, lambda: packed_outputs(runs.hf, batch, run_packed))
    return j


def run_probe(
    model: Any,
    *,
    run_packed: Callable[[Any], torch.Tensor],
    plan_and_batch: Callable[[list[np.ndarray]], tuple[Any, Any]],
    call: Any = None,
    row_len: int | None = None,
    allow_stochastic: bool = False,
    signature: tuple = (),
    lockstep: bool = False,
) -> ProbeReport:
    """Run the probe once (no cache): packed vs every sequence alone, forward and gradients.

    Args:
        model: the unwrapped HF causal LM, in the caller's mode.
        run_packed: batch -> [K, L, V] logits of the packed call (the caller's backend and wrappers).
        plan_and_batch: sequences -> (plan, PackedBatch) with every token after the first scored.
        call: the model as the caller runs it (its wrappers); None: ``model``.
        row_len: the caller's row length (the probe's sequences fit it); None: unknown.
        allow_stochastic: the caller accepted random draws: the modules that draw run in eval
            mode for the probe (it proves the rest).
        signature: recorded in the report.
        lockstep: every rank runs this probe (a sharded model): the forwards it runs do not
            depend on what it measures.

    Returns:
        The :class:`ProbeReport`.

    Raises:
        UnsupportedModelError: a module draws random numbers; packed and alone differ beyond
            the noise floor (naming the first diverging module); or the unpacked path is not
            deterministic.
    """
    t0 = time.perf_counter()
    hf = model
    call = hf if call is None else call
    first = next(hf.parameters())
    arrays, _ = probe_sequences(hf, row_len)
    _, batch = plan_and_batch(arrays)
    seqs = [torch.as_tensor(a, device=first.device) for a in arrays]
    named = ", ".join(f"{k}={v}" for k, v in zip(_SIGNATURE_NAMES, signature))
    what = f"{type(hf).__name__} ({named})"
    with own_random_stream(first.device):
        watch = watch_forward(hf, seqs[-1])
        if watch.draws and not allow_stochastic:
            _refuse_draws(hf, watch, what)
        with draws_off(hf, list(watch.draws)):
            if watch.draws and (again := watch_forward(hf, seqs[-1])).draws:
                _refuse_draws(hf, again, what, silenced=True)
            runs = _alone(call, hf, seqs)
            j = _prove(runs, batch, run_packed, watch.compute_dtype, what, lockstep)
    return ProbeReport(
        signature=signature,
        tokens=int(sum(a.shape[0] for a in arrays)),
        logprob_err=j.lp_err,
        logprob_tol=j.lp_tol,
        grad_err=j.grad_ratio,
        seconds=time.perf_counter() - t0,
        noise=j.noise,
    )


def verify_packing(hf: Any, *, backend: str, patch_layers: bool, extra: tuple = (), **probe: Any) -> ProbeReport:
    """:func:`run_probe` once per (model, :func:`probe_signature` + ``extra``); later calls return the first report.

    For a sharded model (:func:`~treepack.trainer.hf.admission.lockstep.lockstep_ranks`) every
    rank probes when any rank meets a new signature (one all-reduce per call), since its
    forwards are collectives: every rank must call this as often as the others, as it must
    call the model.

    Args:
        hf: the unwrapped model; backend, patch_layers: as for ``packed_forward``.
        extra: more of the setup, part of the signature (the wrappers, the rows' cap, what was accepted).
        **probe: ``run_packed``, ``plan_and_batch``, ``call``, ``row_len`` and ``allow_stochastic``
            of :func:`run_probe`.

    Raises:
        UnsupportedModelError: as :func:`run_probe` (a refused setup is probed again next call).
    """
    sig = probe_signature(hf, backend=backend, patch_layers=patch_layers) + tuple(extra)
    done = _VERIFIED.setdefault(hf, {})
    lockstep = lockstep_ranks(hf)
    need = sig not in done
    if lockstep:
        need = on_any_rank(need)
    if need:
        done[sig] = run_probe(hf, signature=sig, lockstep=lockstep, **probe)
    return done[sig]
