"""The wire contract of treepack: version, errors, message schemas, array buffers, body codec.

Modules (this package depends on nothing else of treepack):

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
