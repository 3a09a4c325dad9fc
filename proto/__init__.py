"""The contract of treepack: the plan, its options, the batch, shapes, errors, the wire.

Modules (this package depends on nothing else of treepack):

- :mod:`~treepack.proto.plan` — :class:`Plan` and its parts (numpy only).
- :mod:`~treepack.proto.options` — :class:`PlanOptions` (checked by the planner).
- :mod:`~treepack.proto.batch` — the normalized :class:`SequenceBatch`; the one
  normalisation of trainable flags and group ids.
- :mod:`~treepack.proto.shape` — batch shapes (fingerprints) for history and what-if.
- :mod:`~treepack.proto.whatif` — what-if compositions and results.
- :mod:`~treepack.proto.index` — shared numpy index helpers.
- ``batch_columns``, ``batch_wire``, ``plan_wire``, ``shape_wire``, ``whatif_wire`` — every
  message codec.
- :mod:`~treepack.proto.errors` — the one error hierarchy and its HTTP statuses.
- :mod:`~treepack.proto.messages` — pydantic v2 models of every message on the wire.
- :mod:`~treepack.proto.buffers` — how arrays travel: typed little-endian buffers.
- :mod:`~treepack.proto.codec` — msgpack / JSON bodies and content negotiation.
- :mod:`~treepack.proto.schema` — the JSON Schema files kept next to this module
  (``python -m treepack.proto.schema --write`` regenerates them).

Every message carries ``"version": WIRE_VERSION``; a peer that receives another version
answers :class:`~treepack.proto.errors.UnsupportedVersionError`.
"""

WIRE_VERSION = 1

__all__ = ["WIRE_VERSION"]
