"""The model's admission: may it run tree-packed under a setup, and is it proven.

One entry, :func:`admit` (model, :class:`PackedSetup`) -> :class:`Verdict`, composed of:

- :mod:`~treepack.trainer.hf.admission.setup`: :class:`PackedSetup`, the forward's options as
  one frozen object (validated once; its keys are the walk cache's);
- the static checks, by concept: :mod:`~treepack.trainer.hf.admission.check` (:func:`check_model`,
  the fail-closed check that every token mixer runs tree-exact, composed of
  :mod:`~treepack.trainer.hf.admission.structure`, :mod:`~treepack.trainer.hf.admission.attention_checks`,
  :mod:`~treepack.trainer.hf.admission.mixers`, :mod:`~treepack.trainer.hf.admission.positions`,
  :mod:`~treepack.trainer.hf.admission.config_checks` and the vision towers of
  :mod:`treepack.trainer.hf.vision`), its :mod:`~treepack.trainer.hf.admission.report`, and
  :mod:`~treepack.trainer.hf.admission.cp` (:func:`check_cp_layers`);
- :mod:`~treepack.trainer.hf.admission.guards`: hooks and patches, dropout while training;
- :mod:`~treepack.trainer.hf.admission.walk` and :mod:`~treepack.trainer.hf.admission.walk_cache`:
  the model walk (checks, dispatch hooks, layer patches of :mod:`treepack.trainer.hf.layers`),
  once per model state and setup;
- the run-time probe: :mod:`~treepack.trainer.hf.admission.probe_inputs` (the sequences),
  :mod:`~treepack.trainer.hf.admission.readout` (what is compared, by the model's head),
  :mod:`~treepack.trainer.hf.admission.measure` (what is measured),
  :mod:`~treepack.trainer.hf.admission.tolerance` (the noise model),
  :mod:`~treepack.trainer.hf.admission.divergence` (the first diverging module),
  :mod:`~treepack.trainer.hf.admission.probe` (the run and its report) and
  :mod:`~treepack.trainer.hf.admission.prove` (:func:`verify_model`, the probe of a setup).
"""

from treepack.trainer.hf.admission.admit import Verdict, admit
from treepack.trainer.hf.admission.check import check_model, check_static
from treepack.trainer.hf.admission.cp import check_cp_layers
from treepack.trainer.hf.admission.guards import trust_hook
from treepack.trainer.hf.admission.probe import ProbeReport, forget_probes
from treepack.trainer.hf.admission.prove import prove, verify_model
from treepack.trainer.hf.admission.report import Refusal, SupportReport
from treepack.trainer.hf.admission.setup import OUTPUTS, PackedSetup
from treepack.trainer.hf.admission.walk import enable_tree_attention
from treepack.trainer.hf.admission.walk_cache import forget_walks

__all__ = [
    "admit",
    "Verdict",
    "PackedSetup",
    "OUTPUTS",
    "check_model",
    "check_static",
    "check_cp_layers",
    "SupportReport",
    "Refusal",
    "verify_model",
    "prove",
    "ProbeReport",
    "enable_tree_attention",
    "trust_hook",
    "forget_probes",
    "forget_walks",
]
