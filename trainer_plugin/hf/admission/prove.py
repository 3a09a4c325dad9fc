"""The probe of a setup, run on the model as the caller holds it: :func:`prove` and :func:`verify_model`.

:func:`prove` plans the probe's sequences (:mod:`~treepack.trainer.hf.admission.probe_inputs`)
with the setup's conv width, runs them packed through the model walk and the packed run with
the caller's backend and layer patches, and hands them to the probe
(:func:`~treepack.trainer.hf.admission.probe.verify_packing`, once per probe signature). Outside
any packed context of the caller, so the probe's unpacked runs are plain ones; with dropout
accepted, every rate at 0 (:func:`~treepack.trainer.hf.admission.guards.dropout_off`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.profiler import record_function

from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.hf.admission.guards import dropout_off
from treepack.trainer.hf.admission.probe import ProbeReport, verify_packing
from treepack.trainer.hf.admission.setup import PackedSetup
from treepack.trainer.hf.admission.walk import walk
from treepack.trainer.hf.context import use_packed
from treepack.trainer.hf.layers import reference_rules
from treepack.trainer.hf.run import run_packed

__all__ = ["prove", "verify_model"]


def _plan_and_batch(hf: Any, setup: PackedSetup) -> Callable[[list], tuple[Any, PackedBatch]]:
    """Sequences -> (plan, batch) of the probe: every token after the first scored, prefixes shared."""

    def plan_and_batch(seqs: list) -> tuple[Any, PackedBatch]:
        from treepack.client import Packer

        step = 128 if setup.backend == "flex" else 16
        seq_len = -(-sum(len(s) for s in seqs) // step) * step
        with Packer() as packer:
            plan = packer.pack(
                seqs,
                seq_len=seq_len,
                trainable=[1] * len(seqs),
                min_shared_len=2,
                share_trainable=True,
                conv_width=setup.conv_width,
                record=False,
            )
        device = next(hf.parameters()).device
        return plan, materialize(plan, seqs, device=device, trainable=[1] * len(seqs), advise=False)

    return plan_and_batch


def _packed_runner(hf: Any, setup: PackedSetup) -> Callable[[PackedBatch], torch.Tensor]:
    """Batch -> logits of a packed call with ``setup``'s backend, kernels and patches (walked, not probed)."""
    options = {"backend": setup.backend, "varlen_fn": setup.varlen_fn, "compile": setup.compile}

    def run(b: PackedBatch) -> torch.Tensor:
        call = PackedSetup.of_call(b, {}, patch_layers=setup.patch_layers, verify=False, **options)
        with record_function("treepack::walk"):
            found, _ = walk(hf, call)
        return run_packed(hf, hf, b, call, scans=bool(found.scans), kwargs={})

    return run


def prove(hf: Any, setup: PackedSetup) -> ProbeReport:
    """Prove packing exact for ``hf`` as it is now under ``setup`` (the probe, once per probe signature).

    Args:
        hf: the unwrapped HF causal LM, in the mode it will train in.
        setup: the forward's options; the probe plans with its ``conv_width`` and, with
            ``allow_dropout``, runs with every dropout rate at 0 (no shared mask can equal
            the alone runs).

    Returns:
        The :class:`~treepack.trainer.hf.admission.probe.ProbeReport` of the setup.

    Raises:
        UnsupportedModelError: packed and alone differ beyond the measured bound.
    """
    # Outside any packed context of the caller: the probe's unpacked runs must be plain ones,
    # settling what a stock layer leaves open (DSA top-k ties) as tree rows do.
    with use_packed(None), reference_rules(), dropout_off(hf) if setup.allow_dropout else nullcontext():
        return verify_packing(
            hf,
            backend=setup.backend,
            patch_layers=setup.patch_layers,
            run_packed=_packed_runner(hf, setup),
            plan_and_batch=_plan_and_batch(hf, setup),
            extra=("allow_dropout",) if setup.allow_dropout else (),
        )


def verify_model(
    hf: Any,
    *,
    backend: str = "sdpa",
    patch_layers: bool = True,
    conv_width: int = 4,
    varlen_fn: Callable | None = None,
    compile: bool | None = None,
    allow_dropout: bool = False,
) -> ProbeReport:
    """Prove packing exact for ``hf`` as it is now: the keyword form of :func:`prove`.

    Args:
        hf: the unwrapped HF causal LM, in the mode it will train in.
        backend, patch_layers, varlen_fn, compile: as for :func:`~treepack.trainer.hf.packed_forward`.
        conv_width: the plan's GDN conv width (the probe plans with it).
        allow_dropout: the caller accepted dropout (:func:`~treepack.trainer.hf.packed_forward`):
            the probe runs with every dropout rate at 0, since no shared mask can equal the alone runs.

    Returns:
        The :class:`~treepack.trainer.hf.admission.probe.ProbeReport` of the setup.

    Raises:
        UnsupportedModelError: packed and alone differ beyond the measured bound.
        RequestError: ``backend`` is not a known value.
    """
    setup = PackedSetup(
        backend=backend,
        varlen_fn=varlen_fn,
        compile=compile,
        patch_layers=patch_layers,
        conv_width=conv_width,
        allow_dropout=allow_dropout,
    )
    return prove(hf, setup)
