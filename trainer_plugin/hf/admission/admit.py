"""The model's admission: may it run packed under a setup, and is it proven (:func:`admit` -> :class:`Verdict`).

:func:`admit` takes the model as the caller holds it (wrapped or not: PEFT's adapters are
judged on the wrappers, :mod:`~treepack.trainer.hf.admission.peft_checks`) and the
:class:`~treepack.trainer.hf.admission.setup.PackedSetup`, and either refuses it, naming every
reason (:class:`~treepack.proto.errors.UnsupportedModelError`, or with ``raise_error=False`` a
refused :class:`Verdict`), or admits it: the model walk
(:func:`~treepack.trainer.hf.admission.walk.walk`: the static check, the CP check, the dispatch
hooks and layer patches) and, with ``setup.verify``, the probe
(:func:`~treepack.trainer.hf.admission.prove.prove`, through the caller's wrappers), each remembered per
model state and setup
(:mod:`~treepack.trainer.hf.admission.walk_cache`) so a later call of an unchanged model skips them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.profiler import record_function

from treepack.trainer.hf.admission.check import check_static
from treepack.trainer.hf.admission.peft_checks import peft_refusals
from treepack.trainer.hf.admission.probe import ProbeReport
from treepack.trainer.hf.admission.prove import prove
from treepack.trainer.hf.admission.report import Refusal, SupportReport, refused_error
from treepack.trainer.hf.admission.setup import PackedSetup
from treepack.trainer.hf.admission.walk import walk
from treepack.trainer.hf.admission.walk_cache import remember_walk, walk_info, walked
from treepack.trainer.hf.wrapped import unwrap_model

__all__ = ["Verdict", "admit"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The admission's answer for one model and setup.

    Attributes:
        setup: the setup judged.
        admitted: the model may run packed under it.
        handled: module path -> how it runs on tree rows (``tree_attention``, ``patch:<class>``,
            ``mixer:<kind>``, vision towers): what is patched or dispatched.
        refusals: every reason it may not (empty when admitted).
        probe: the :class:`~treepack.trainer.hf.admission.probe.ProbeReport` that proved the
            setup; None when it was not verified (``setup.verify`` off, or refused).
        scans: layers of the registry read the rows' tree schedule.
    """

    setup: PackedSetup
    admitted: bool
    handled: dict[str, str] = field(default_factory=dict)
    refusals: tuple[Refusal, ...] = ()
    probe: ProbeReport | None = None
    scans: bool = False

    @property
    def proven(self) -> str:
        """How the verdict was proven: ``probe`` (with its measured error) or ``not verified``."""
        if self.probe is None:
            return "not verified"
        return f"probe (logprob error {self.probe.logprob_err:.3g} of {self.probe.logprob_tol:.3g})"


def _refused(model: Any, hf: Any, setup: PackedSetup) -> Verdict | None:
    """The refused verdict of the static check and the PEFT check, or None when they refuse nothing."""
    report: SupportReport = check_static(hf, setup, hidden_applies_logit_transforms=True, raise_error=False)
    report.refusals[:0] = peft_refusals(model, hf)
    if not report.refusals:
        return None
    return Verdict(setup=setup, admitted=False, handled=dict(report.handled), refusals=tuple(report.refusals))


def admit(model: Any, setup: PackedSetup, *, raise_error: bool = True) -> Verdict:
    """Admit ``model`` for packed calls under ``setup``, or refuse it with every reason.

    Args:
        model: the HF model, bare or wrapped (DDP, FSDP2, PEFT, accelerate, ``torch.compile``).
        setup: the forward's options.
        raise_error: raise on a refusal (default); False returns the refused :class:`Verdict`
            of the static check instead (nothing installed, nothing probed). A probe that
            finds packed and alone differ always raises.

    Returns:
        The :class:`Verdict`: admitted, with what is handled and the probe report (or None).

    Raises:
        UnsupportedModelError: the static check, the PEFT check
            (:mod:`~treepack.trainer.hf.admission.peft_checks`: adapters of ``model`` and its
            wrappers), the CP check or the probe refuses the model (messages and ``refusals``
            name each module or adapter, its class and why).
    """
    hf = unwrap_model(model)
    if not raise_error and (refused := _refused(model, hf, setup)) is not None:
        return refused
    # Judged on every call, not cached with the walk: adapters are added, switched and put
    # in train or eval mode without changing anything the walk's fingerprint reads.
    if peft := peft_refusals(model, hf):
        raise refused_error(hf, SupportReport(refusals=peft))
    with record_function("treepack::walk"):
        found, state = walk(hf, setup)
        key, probed = setup.walk_key(), setup.probe_key(hf, model)
        report = None
        if setup.verify and not walked(hf, probed, state):
            report = prove(hf, setup, model)
            # The probe's own recording hooks, registered and removed, moved torch's hook
            # count: the model is the one just walked.
            remember_walk(hf, key, info=found)
            remember_walk(hf, probed, info=report)
        elif setup.verify:
            report = walk_info(hf, probed)
    return Verdict(setup=setup, admitted=True, handled=dict(found.report.handled), probe=report, scans=found.scans)
