"""What the static check found: :class:`SupportReport` of :class:`Refusal` entries, and the error it raises.

Every refusal of the admission's static checks (:mod:`~treepack.trainer.hf.admission.check`)
is a :class:`Refusal` (the module's path, its class and why); :func:`refused_error` turns a
report with refusals into the :class:`~treepack.proto.errors.UnsupportedModelError` that
names them (the first six in its message, every one in ``refusals``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from treepack.proto.errors import UnsupportedModelError

__all__ = ["Refusal", "SupportReport", "refused_error"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """One module that has no tree-exact path: ``path`` in the model, ``cls`` its class name, ``reason``."""

    path: str
    cls: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path or '<model>'} ({self.cls}): {self.reason}"


@dataclass(slots=True)
class SupportReport:
    """What :func:`check_model` found.

    Attributes:
        handled: module path -> how it runs on tree rows (``tree_attention``, ``patch:<class>``, ...).
        refusals: the modules (or config settings) with no tree-exact path.
    """

    handled: dict[str, str] = field(default_factory=dict)
    refusals: list[Refusal] = field(default_factory=list)


def refused_error(model: Any, report: SupportReport) -> UnsupportedModelError:
    """The error naming every refusal of ``report`` (which has at least one).

    Args:
        model: the model checked (its class names it).
        report: the check's report.

    Returns:
        The :class:`~treepack.proto.errors.UnsupportedModelError` to raise (rule ``unsupported_model``).
    """
    shown = "; ".join(str(r) for r in report.refusals[:6])
    more = f" (+{len(report.refusals) - 6} more)" if len(report.refusals) > 6 else ""
    return UnsupportedModelError(
        f"{type(model).__name__} cannot run tree-packed exactly: {shown}{more}",
        path=f"$.model.{report.refusals[0].path}" if report.refusals[0].path else "$.model",
        rule="unsupported_model",
        refusals=tuple((r.path, r.cls, r.reason) for r in report.refusals),
    )
