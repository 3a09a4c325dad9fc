"""How a layer finds the packed batch it is running on.

:func:`treepack.trainer.hf.packed_forward` runs a stock model on tree-packed rows. Layers
that need more than their own inputs (the attention mask, GDN levels, the ancestor chains
of a sparse indexer) find the current :class:`~treepack.trainer.data.packed_batch.PackedBatch` in two
places, both set by ``packed_forward``:

1. the keyword argument ``treepack_context`` (a :class:`PackedContext`) that HF models
   forward, through ``**kwargs``, to every decoder layer and attention function. It
   survives activation checkpointing (recomputation runs in the backward pass, outside
   ``packed_forward``'s dynamic extent, with the same arguments), so a layer that sees
   it should prefer it;
2. a context variable, for layers whose ``forward`` does not take ``**kwargs``
   (:func:`current_packed`, :func:`use_packed`).

:func:`resolve_packed` reads the first, else the second, and fails with a clear error when
neither is set (a patched layer called outside ``packed_forward``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["PackedContext", "use_packed", "current_packed", "resolve_packed", "packed_context", "BATCH_KWARG"]

BATCH_KWARG = "treepack_context"


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedContext:
    """What a layer needs to run on packed rows.

    Attributes:
        batch: the packed batch (rows, masks, metadata).
        backend: attention backend, ``sdpa`` | ``flex`` | ``flash``.
        options: backend options (e.g. ``varlen_fn`` for ``flash``), passed through.
    """

    batch: PackedBatch
    backend: str = "sdpa"
    options: Mapping[str, Any] = field(default_factory=dict)


_CURRENT: ContextVar[PackedContext | None] = ContextVar("treepack_packed", default=None)


@contextmanager
def use_packed(ctx: PackedContext) -> Iterator[PackedContext]:
    """Make ``ctx`` the current packed context inside the ``with`` block (re-entrant)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_packed() -> PackedContext | None:
    """The packed context set by the innermost active :func:`use_packed`, else None."""
    return _CURRENT.get()


def resolve_packed(kwargs: Mapping[str, Any] | None = None, *, who: str = "a treepack layer") -> PackedContext:
    """The packed context for a layer call: ``kwargs[BATCH_KWARG]`` first, else the context variable.

    Args:
        kwargs: the keyword arguments the layer received (may hold ``treepack_context``,
            a :class:`PackedContext`).
        who: names the caller in the error message.

    Raises:
        RuntimeError: when no packed batch is active.
    """
    if kwargs is not None:
        ctx = kwargs.get(BATCH_KWARG)
        if ctx is not None:
            return ctx
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            f"{who} ran without a packed batch: call it through treepack.trainer.hf.packed_forward "
            "(or inside treepack.trainer.hf.context.use_packed)"
        )
    return ctx


def packed_context(kwargs: Mapping[str, Any]) -> PackedContext | None:
    """The packed context of a layer call (``kwargs[BATCH_KWARG]``, else the context variable), or None.

    A patched layer runs its stock forward when this is None (an unpacked call).
    """
    ctx = kwargs.get(BATCH_KWARG)
    return ctx if ctx is not None else _CURRENT.get()
