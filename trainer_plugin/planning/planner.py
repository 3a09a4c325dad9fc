"""Which planner the trainer asks: the one resolution of a ``planner`` argument.

Every trainer entry point that plans (:func:`~treepack.trainer.planning.microbatch.plan_microbatches`,
:func:`~treepack.trainer.distributed.plan_and_broadcast`, the TRL trainers) takes
``planner``: a :class:`Planner` (anything with ``Packer.pack``'s ``.pack``, such as
:class:`treepack.client.Packer`), a :class:`PlanFunction` (a callable with that
signature), a sidecar URL (``str``), or None for an embedded ``Packer()``.
:func:`obtain_plan` resolves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Union, runtime_checkable

from treepack.proto.errors import InputTypeError
from treepack.proto.plan import Plan

__all__ = ["Planner", "PlanFunction", "PlannerArg", "obtain_plan"]


@runtime_checkable
class Planner(Protocol):
    """A planner object: :class:`treepack.client.Packer`, or anything with its ``pack``."""

    def pack(self, sequences: Sequence[Any], **options: Any) -> Plan: ...


class PlanFunction(Protocol):
    """A plain function with ``Packer.pack``'s signature."""

    def __call__(self, sequences: Sequence[Any], **options: Any) -> Plan: ...


# What a trainer entry point's ``planner`` argument may be (None: an embedded Packer; str: a sidecar URL).
PlannerArg = Union[Planner, PlanFunction, str, None]


def obtain_plan(sequences: Sequence[Any], *, planner: PlannerArg = None, **plan_kwargs: Any) -> Plan:
    """Ask ``planner`` for a plan.

    Args:
        sequences: the batch.
        planner: a :class:`Planner`, a sidecar URL (``str``), a :class:`PlanFunction`, or
            None for an embedded ``Packer()``.
        **plan_kwargs: ``Packer.pack``'s options (``seq_len``, ``trainable``, ...).

    Raises:
        InputTypeError: a planner of another kind.
    """
    if planner is None or isinstance(planner, str):
        # The client (and with it the embedded planner) loads only when asked for.
        from treepack.client import Packer

        with Packer(planner) as packer:
            return packer.pack(sequences, **plan_kwargs)
    if isinstance(planner, Planner):
        return planner.pack(sequences, **plan_kwargs)
    if callable(planner):
        return planner(sequences, **plan_kwargs)
    raise InputTypeError(
        f"planner must have .pack(...) or be callable, got {type(planner).__name__}", path="$.planner", rule="type"
    )
