"""How the tree modules of a Megatron model find the packed rows they run on.

:func:`~treepack.trainer.megatron.packed_forward` calls the stock ``GPTModel.forward``,
whose signature carries no plan. The two modules it swapped in read the rows from a context
variable set for the call's extent: the rotary embedding (:mod:`~treepack.trainer.megatron.rope`)
reads the plan's per-token ``position_ids``, the core attention
(:mod:`~treepack.trainer.megatron.attention`) the batch's masks for the ``flex`` and
``flash`` backends. Outside ``packed_forward`` neither finds one and both run as plain
Megatron modules (positions ``0..s-1``, the mask Megatron hands them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["MegatronRows", "use_rows", "current_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronRows:
    """The rows of one packed forward.

    Attributes:
        batch: the packed batch.
        position_ids: [K, L] int64 each token's position in its own sequence.
        backend: attention backend, ``sdpa`` | ``flex`` | ``flash``.
        varlen_fn: ``flash`` only: the varlen kernel (default ``flash_attn_varlen_func``).
    """

    batch: PackedBatch
    position_ids: torch.Tensor
    backend: str = "sdpa"
    varlen_fn: Callable | None = None


_CURRENT: ContextVar[MegatronRows | None] = ContextVar("treepack_megatron_rows", default=None)


@contextmanager
def use_rows(rows: MegatronRows) -> Iterator[MegatronRows]:
    """Make ``rows`` current inside the ``with`` block (re-entrant)."""
    token = _CURRENT.set(rows)
    try:
        yield rows
    finally:
        _CURRENT.reset(token)


def current_rows() -> MegatronRows | None:
    """The rows of the packed forward in progress, or None."""
    return _CURRENT.get()
