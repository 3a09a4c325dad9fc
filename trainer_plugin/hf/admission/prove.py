"""The probe of a setup, run on the model as the caller holds it: :func:`prove` and :func:`verify_model`.

:func:`prove` plans the probe's sequences (:mod:`~treepack.trainer.hf.admission.probe_inputs`),
cut to the caller's row length, with the setup's conv width, runs them packed through the
model walk and the packed run with the caller's backend and layer patches, and hands them to
the probe (:func:`~treepack.trainer.hf.admission.probe.verify_packing`, once per probe
signature). Every run goes through the callable the caller trains with (its wrappers: PEFT,
accelerate, ``torch.compile``; DDP without gradient synchronisation), under the caller's
autocast. Outside any packed context of the caller, so the probe's unpacked runs are plain
ones; with dropout accepted, every rate at 0 (:func:`~treepack.trainer.hf.admission.guards.dropout_off`).
A PEFT aLoRA adapter under gradient checkpointing is proven with its checkpointed layers run
plainly (:func:`_plain_layers_for_alora`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.profiler import record_function

from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.hf.admission.guards import dropout_off
from treepack.trainer.hf.admission.probe import ProbeReport, verify_packing
from treepack.trainer.hf.admission.probe_inputs import probe_shape
from treepack.trainer.hf.admission.setup import PackedSetup
from treepack.trainer.hf.admission.walk import walk
from treepack.trainer.hf.alora import alora_invocation
from treepack.trainer.hf.context import use_packed
from treepack.trainer.hf.layers import reference_rules
from treepack.trainer.hf.run import run_packed
from treepack.trainer.hf.task_head import pad_rule
from treepack.trainer.hf.wrapped import no_sync, unwrap_model, wrapper_chain

__all__ = ["prove", "verify_model"]


@contextmanager
def _plain_layers_for_alora(call: Any, hf: Any) -> Iterator[None]:
    """Checkpointed layers run plainly while an aLoRA adapter is probed.

    PEFT's aLoRA takes one forward per backward under gradient checkpointing (its replay hooks
    carry one call's ``alora_offsets`` and it refuses a second forward before the backward),
    and the probe runs several; the replay recomputes each layer on the same inputs and the
    same offsets, so the probe proves the adapter's per-sequence activation with the layers'
    checkpointing off (restored after). Nothing changes for any other model.
    """
    if alora_invocation(call) is None:
        yield
        return
    layers = [m for m in hf.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def _plan_and_batch(hf: Any, setup: PackedSetup) -> Callable[[list], tuple[Any, PackedBatch]]:
    """Sequences -> (plan, batch) of the probe: every token after the first scored, prefixes shared,
    in one row when they fit the caller's row length, else in rows of that length."""

    def plan_and_batch(seqs: list) -> tuple[Any, PackedBatch]:
        from treepack.client import Packer

        step = 128 if setup.backend == "flex" else 16
        seq_len = -(-sum(len(s) for s in seqs) // step) * step
        if setup.row_len is not None:
            seq_len = min(seq_len, setup.row_len)
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


def _packed_runner(call: Any, hf: Any, setup: PackedSetup) -> Callable[[PackedBatch], torch.Tensor]:
    """Batch -> logits of a packed call through ``call`` with ``setup``'s backend, kernels and
    patches (walked, not probed)."""
    options = {"backend": setup.backend, "varlen_fn": setup.varlen_fn, "compile": setup.compile}
    accepted = {"allow_dropout": setup.allow_dropout, "allow_stochastic": setup.allow_stochastic}

    def run(b: PackedBatch) -> torch.Tensor:
        probe = PackedSetup.of_call(b, {}, patch_layers=setup.patch_layers, verify=False, **accepted, **options)
        with record_function("treepack::walk"):
            found, _ = walk(hf, probe)
        return run_packed(call, hf, b, probe, scans=bool(found.scans), kwargs={})

    return run


def prove(hf: Any, setup: PackedSetup, model: Any = None) -> ProbeReport:
    """Prove packing exact for ``hf`` as it is now under ``setup`` (the probe, once per probe signature).

    Args:
        hf: the unwrapped HF causal LM, in the mode it will train in.
        setup: the forward's options; the probe plans with its ``conv_width``, cuts its
            sequences to its ``row_len`` and, with ``allow_dropout``, runs with every
            dropout rate at 0 (no shared mask can equal the alone runs); with
            ``allow_stochastic``, the modules that draw random numbers in eval mode.
        model: the model as the caller runs it (``hf`` inside its wrappers); None: ``hf``.

    Returns:
        The :class:`~treepack.trainer.hf.admission.probe.ProbeReport` of the setup.

    Raises:
        UnsupportedModelError: a module draws random numbers, or packed and alone differ
            beyond the noise floor.
    """
    call = hf if model is None else model
    accepted = tuple(k for k in ("allow_dropout", "allow_stochastic") if getattr(setup, k))
    extra = (*accepted, probe_shape(hf, setup.row_len)[1], wrapper_chain(call))
    # Outside any packed context of the caller: the probe's unpacked runs must be plain ones.
    # Settling what a stock layer leaves open (DSA top-k ties) as tree rows do.
    dropout = dropout_off(hf) if setup.allow_dropout else nullcontext()
    with use_packed(None), reference_rules(), dropout, no_sync(call), pad_rule(hf), _plain_layers_for_alora(call, hf):
        return verify_packing(
            hf,
            backend=setup.backend,
            patch_layers=setup.patch_layers,
            run_packed=_packed_runner(call, hf, setup),
            plan_and_batch=_plan_and_batch(hf, setup),
            call=call,
            row_len=setup.row_len,
            allow_stochastic=setup.allow_stochastic,
            extra=extra,
        )


def verify_model(
    model: Any,
    *,
    backend: str = "sdpa",
    patch_layers: bool = True,
    conv_width: int = 4,
    varlen_fn: Callable | None = None,
    compile: bool | None = None,
    allow_dropout: bool = False,
    allow_stochastic: bool = False,
    row_len: int | None = None,
) -> ProbeReport:
    """Prove packing exact for ``model`` as it is now: the keyword form of :func:`prove`.

    Args:
        model: the HF causal LM, bare or in its wrappers (PEFT, DDP, accelerate,
            ``torch.compile``: the probe runs through them), in the mode it will train in,
            under the autocast it will train under.
        backend, patch_layers, varlen_fn, compile: as for :func:`~treepack.trainer.hf.packed_forward`.
        conv_width: the plan's GDN conv width (the probe plans with it).
        allow_dropout: the caller accepted dropout (:func:`~treepack.trainer.hf.packed_forward`):
            the probe runs with every dropout rate at 0, since no shared mask can equal the alone runs.
        allow_stochastic: the caller accepted other random draws: the modules that draw run
            in eval mode for the probe.
        row_len: the row length the caller packs into: the probe's sequences fit it (a window
            or chunk as long never binds); None: the probe's own.

    Returns:
        The :class:`~treepack.trainer.hf.admission.probe.ProbeReport` of the setup.

    Raises:
        UnsupportedModelError: a module draws random numbers, or packed and alone differ
            beyond the noise floor.
        RequestError: ``backend`` is not a known value.
    """
    setup = PackedSetup(
        backend=backend,
        varlen_fn=varlen_fn,
        compile=compile,
        patch_layers=patch_layers,
        conv_width=conv_width,
        allow_dropout=allow_dropout,
        allow_stochastic=allow_stochastic,
        row_len=row_len,
    )
    return prove(unwrap_model(model), setup, model)
