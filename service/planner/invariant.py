"""The plan-invariant error, and the one primitive every check of the validator raises it by.

The validator (:func:`~.validate.validate_plan`) is made of the modules that import
:func:`_check`: :mod:`~.validate_rows`, :mod:`~.validate_metadata`, :mod:`~.validate_ranks`
and :mod:`~.validate_tokens` (the forged-plan tests find them so, and read their messages).
"""

from __future__ import annotations

__all__ = ["PlanInvariantError"]


class PlanInvariantError(AssertionError):
    """A plan breaks one of its invariants (a planner bug, never a caller mistake)."""


def _check(ok: bool, what: str) -> None:
    """Raise :class:`PlanInvariantError` with ``what`` unless ``ok``.

    Args:
        ok: whether the invariant holds.
        what: the message: which invariant, and where (row, segment, sequence).
    """
    if not ok:
        raise PlanInvariantError(what)
