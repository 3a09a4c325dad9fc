"""The contract of treepack: the plan, its options, the request, shapes, errors, the wire.

The main types are importable from here (``from treepack.proto import Plan, PlanOptions,
PackInput, RequestError``); the modules hold the rest. This package depends on nothing
else of treepack.

- :mod:`~treepack.proto.plan` — :class:`Plan` and its parts (numpy only);
  :mod:`~treepack.proto.strategy` — :class:`Strategy`, how a plan packs (tree or plain), typed.
- :mod:`~treepack.proto.options` — :class:`PlanOptions` (checked by the planner).
- :mod:`~treepack.proto.batch` — the pack request :class:`PackInput` that every entry
  point takes, and the normalized :class:`SequenceBatch`; the one normalisation of
  trainable flags and group ids (``batch_fields``, one field at a time).
- :mod:`~treepack.proto.shape` — batch shapes (fingerprints) for history and what-if;
  :mod:`~treepack.proto.history` — their SQLite store, written by the sidecar and the
  embedded client alike (its file: ``history_schema``; rows written: ``history_write``;
  read back: ``history_read``).
- :mod:`~treepack.proto.whatif` — what-if queries, compositions and results.
- :mod:`~treepack.proto.index` — shared numpy index helpers.
- ``batch_columns``, ``batch_wire``, ``plan_wire``, ``shape_wire``, ``whatif_wire`` — every
  message codec.
- :mod:`~treepack.proto.cost` — :class:`CostModel`: a plan's predicted step time (numbers
  only; its coefficients measured by ``treepack.trainer.calibrate`` and fitted by
  ``cost_fit``), its JSON file.
- :mod:`~treepack.proto.errors` — the one error hierarchy and its HTTP statuses.
- :mod:`~treepack.proto.messages` — the catalogue of the pydantic v2 models of every message
  on the wire, which live by endpoint in ``pack_messages``, ``whatif_messages`` and
  ``service_messages``, over the field types of ``wire_fields``.
- :mod:`~treepack.proto.buffers` — how arrays travel: typed little-endian buffers.
- :mod:`~treepack.proto.codec` — msgpack / JSON bodies and content negotiation.
- :mod:`~treepack.proto.schema` — the JSON Schema files kept next to this module
  (``python -m treepack.proto.schema --write`` regenerates them).

Every message carries ``"version": WIRE_VERSION`` (:mod:`~treepack.proto.version`; the
service still reads version 1 and answers it in kind); a peer that receives another version
answers :class:`~treepack.proto.errors.UnsupportedVersionError`.
"""

from treepack.proto.batch import PackInput, SequenceBatch
from treepack.proto.cost import CostModel, load_cost_model
from treepack.proto.errors import (
    AuthError,
    BodyTimeoutError,
    CapacityError,
    ConflictError,
    CostModelError,
    DeadlineError,
    DecodeError,
    InputTypeError,
    OverloadedError,
    PayloadTooLargeError,
    RequestError,
    ServerError,
    TransportError,
    TreepackError,
    TreepackWarning,
    UnavailableError,
    UnsupportedMediaTypeError,
    UnsupportedModelError,
    UnsupportedVersionError,
)
from treepack.proto.options import PlanOptions
from treepack.proto.plan import Plan, PlanStats
from treepack.proto.shape import BatchShape
from treepack.proto.strategy import Strategy
from treepack.proto.version import WIRE_VERSION
from treepack.proto.whatif import Composition, WhatIfQuery, WhatIfResult

__all__ = [
    "WIRE_VERSION", "Plan", "PlanStats", "PlanOptions", "PackInput", "SequenceBatch", "BatchShape", "Composition",
    "WhatIfQuery", "WhatIfResult", "TreepackError", "RequestError", "InputTypeError", "CapacityError", "DecodeError",
    "PayloadTooLargeError", "BodyTimeoutError", "ConflictError", "UnsupportedMediaTypeError",
    "UnsupportedVersionError", "UnsupportedModelError", "AuthError", "OverloadedError", "ServerError",
    "DeadlineError", "UnavailableError", "TransportError", "CostModel", "load_cost_model", "CostModelError",
    "TreepackWarning", "Strategy",
]  # fmt: skip
