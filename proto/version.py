"""The wire version every message carries (``"version": WIRE_VERSION``), and the ones still read.

Version 2 added, over version 1: ``plan.packing`` (the typed strategy) and, per what-if
result, ``strategies``, ``trial_step_ms``, ``max_step_ms``, ``p_step_over``,
``suggested_trials``, ``std`` and ``stderr`` of every distribution, and the request's
``max_step_ms``. A version-1 request is a valid version-2 request without those fields:
the service reads it and answers ``/v1/pack`` and ``/v1/whatif`` in version 1 (the same
message without the added fields), so a client of the previous release keeps working
against this sidecar. Any other version is refused
(:class:`~treepack.proto.errors.UnsupportedVersionError`).
"""

WIRE_VERSION = 2
READ_VERSIONS = (1, 2)
"""Request versions the service reads (the latest is :data:`WIRE_VERSION`)."""

__all__ = ["WIRE_VERSION", "READ_VERSIONS"]
