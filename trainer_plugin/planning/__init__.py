"""Before the plan: the trainer's batches as planner inputs, and the planning call.

- :mod:`~treepack.trainer.planning.bridge`: HF/TRL padded ``[B, T]`` batches <-> sequences,
  trainable flags and groups (:func:`from_padded`, :func:`from_labeled`);
- :mod:`~treepack.trainer.planning.padded_images`: TRL's batched image inputs cut into each
  row's own (:func:`~treepack.trainer.planning.padded_images.sequence_images`);
- :mod:`~treepack.trainer.planning.routing`: :func:`routing_keys`, planner keys from MoE
  routing-replay arrays (so the planner never shares a token whose routing differs);
- :mod:`~treepack.trainer.planning.images`: :func:`image_keys`, planner keys from image
  content (so identical placeholder tokens of different images are never shared);
- :mod:`~treepack.trainer.planning.planner`: :func:`obtain_plan`, the one resolution of a
  ``planner`` argument (:class:`Planner`, a function, a sidecar URL or None);
- :mod:`~treepack.trainer.planning.microbatch`: plan a whole generation batch once, deal its
  rows to ranks and micro-batches (:func:`plan_microbatches`);
- :mod:`~treepack.trainer.planning.mesh`: a data-parallel x context-parallel ``DeviceMesh``
  as the planning entry points read it (:func:`mesh_ranks`).

What runs after the plan (:func:`~treepack.trainer.data.materialize` ->
:class:`~treepack.trainer.data.PackedBatch`) is :mod:`treepack.trainer.data`, the floor
above this one: planning imports only the contract, the client and the kernels
(``tests/proto/test_rings.py`` holds it).
"""

from treepack.trainer.planning.bridge import PaddedSequences, from_labeled, from_padded
from treepack.trainer.planning.images import image_keys
from treepack.trainer.planning.mesh import MeshRanks, mesh_ranks
from treepack.trainer.planning.microbatch import MicroBatches, plan_microbatches
from treepack.trainer.planning.planner import PlanFunction, Planner, obtain_plan
from treepack.trainer.planning.routing import routing_keys

__all__ = [
    "PaddedSequences",
    "from_padded",
    "from_labeled",
    "routing_keys",
    "image_keys",
    "MicroBatches",
    "plan_microbatches",
    "MeshRanks",
    "mesh_ranks",
    "Planner",
    "PlanFunction",
    "obtain_plan",
]
