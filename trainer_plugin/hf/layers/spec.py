"""What a layer kind is: :class:`TreeLayer`, and the patch that runs it on tree rows.

A :class:`TreeLayer` says, for one kind of token mixer, how it is recognised (by
mechanism: its parameters and attributes, or for a few layers their exact class), how it
runs on tree rows, what it needs from the plan, why it refuses, and how it shards across
ranks. The registry (:mod:`treepack.trainer.hf.layers`) holds one per kind; the support
check, the patching and the schedules read it.

A patched module keeps its bound stock forward in ``module.__dict__[STOCK_ATTR]`` (outside
``nn.Module``'s registries) and runs it whenever no packed batch is active (and no
``reference`` rule of its kind is entered), so an unpacked call is unchanged, bitwise.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.trainer.hf.context import packed_context
from treepack.trainer.kernels.tree_scan import TreeSchedule

__all__ = [
    "TreeLayer",
    "TreeForward",
    "ShardForward",
    "ContextShard",
    "LayerSpec",
    "STOCK_ATTR",
    "NOT_SHARDED",
    "check_rows",
    "check_shard_rows",
    "conv1d_width",
    "install_forward",
    "layer_name",
]

# Where a patched module keeps its bound stock forward.
STOCK_ATTR = "_treepack_stock_forward"
# The ``shard`` of a kind with no context-parallel plan yet: context parallelism refuses it by name.
NOT_SHARDED = None


class TreeForward(Protocol):
    """A layer's forward on tree rows: ``(layer, hidden_states [K, L, hidden], schedule) -> [K, L, hidden]``."""

    def __call__(self, layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor: ...


class ShardForward(Protocol):
    """A layer's forward on one context-parallel shard.

    ``(layer, hidden_states [K, Ls, hidden], schedule, batch) -> [K, Ls, hidden]``: the
    hidden states are this rank's shard of every row, ``schedule`` is the whole rows' tree
    schedule (``batch.cp_full``'s), ``batch`` the shard (``batch.cp`` its group).
    """

    def __call__(
        self, layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, batch: Any
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextShard:
    """How a layer kind runs under context parallelism (a :class:`TreeLayer`'s ``shard``).

    Attributes:
        forward: the layer on one rank's shard (:class:`ShardForward`), for kinds run by
            ``tree_forward``; None for a kind whose ``patch`` runs the shard itself (DSA)
            or that runs only inside another kind's forward (DSA's indexer).
        refusal: ``(module, cp_size) -> reason or None``: why this module cannot run over
            ``cp_size`` ranks (e.g. heads that do not divide), checked before compute.
    """

    forward: ShardForward | None = None
    refusal: Callable[[torch.nn.Module, int], str | None] | None = None

    def refuse(self, module: torch.nn.Module, cp_size: int) -> str | None:
        """Why ``module`` cannot run over ``cp_size`` context-parallel ranks, or None."""
        return None if self.refusal is None else self.refusal(module, cp_size)


class LayerSpec(Protocol):
    """What the support check and the patching read of a layer kind (:class:`TreeLayer` is one)."""

    kind: str
    classes: tuple[str, ...]
    stock: tuple[tuple[str, str], ...]
    shard: Any

    def matches(self, module: torch.nn.Module) -> bool: ...

    def refuse(self, module: torch.nn.Module) -> str | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeLayer:
    """One layer kind of the registry.

    Attributes:
        kind: the registry key (``gdn``, ``mamba2``, ``dsa``, ...), shown in reports.
        structure: recognises the kind by mechanism (parameters and attributes, no class
            names); None for kinds recognised by ``classes`` only. A module it matches is a
            token mixer that is wrong on tree rows unless it runs one of the ``stock``
            layers' code.
        stock: (module, class) of the stock HF layers whose forward the tree forward
            reproduces; a structural match is handled only when its ``forward`` is the code
            of one of them (:func:`~treepack.trainer.hf.layers.stock.stock_layer`).
        classes: class names patched by exact name (a subclass is refused: its forward may
            differ).
        tree_forward: runs a layer on tree rows from the batch's
            :meth:`~treepack.trainer.data.packed_batch.PackedBatch.tree_schedule`; installed
            through :func:`schedule_forward`.
        patch: a whole replacement ``forward(self, ...)`` for kinds that need more than a
            schedule (DSA: the batch's ancestor masks); used instead of ``tree_forward``.
        conv_width: the causal conv width the layer needs the plan's ``conv_width`` to
            cover (None: no conv).
        chunk_size: the scan chunk the layer's tree scan runs (None: no chunked scan);
            read from the layer, not from the plan.
        refusal: why a recognised, stock-code layer still cannot run (e.g. an unsupported
            conv activation), or None.
        shard: how the kind runs on one context-parallel rank's shard of every row (a
            :class:`ContextShard`), or :data:`NOT_SHARDED` (None): context parallelism
            refuses the kind by name.
        reference: a context manager under which the kind's patched layers, on unpacked
            calls, settle what the stock layer leaves open the way tree rows settle it
            (DSA indexers: top-k ties to the lower position); None when the stock layer
            leaves nothing open. Outside it a patched layer runs its stock forward on
            unpacked calls. The probe's alone runs enter every kind's
            (:func:`~treepack.trainer.hf.layers.reference_rules`).
    """

    kind: str
    structure: Callable[[torch.nn.Module], bool] | None = None
    stock: tuple[tuple[str, str], ...] = ()
    classes: tuple[str, ...] = ()
    tree_forward: TreeForward | None = None
    patch: Callable[..., Any] | None = None
    conv_width: Callable[[torch.nn.Module], int] | None = None
    chunk_size: Callable[[torch.nn.Module], int] | None = None
    refusal: Callable[[torch.nn.Module], str | None] | None = None
    shard: ContextShard | None = NOT_SHARDED
    reference: Callable[[], AbstractContextManager[Any]] | None = None

    def __post_init__(self) -> None:
        if (self.tree_forward is None) == (self.patch is None):
            raise TypeError(f"layer kind {self.kind!r} needs exactly one of tree_forward and patch")
        if self.structure is None and not self.classes:
            raise TypeError(f"layer kind {self.kind!r} is recognised by nothing: give structure or classes")
        if self.structure is not None and not self.stock:
            raise TypeError(
                f"layer kind {self.kind!r} is found by structure but names no stock layer to compare code with"
            )

    def matches(self, module: torch.nn.Module) -> bool:
        """True when ``module`` is of this kind (by structure)."""
        return self.structure is not None and bool(self.structure(module))

    def refuse(self, module: torch.nn.Module) -> str | None:
        """The kind's own reason to refuse a stock-code ``module``, or None."""
        return None if self.refusal is None else self.refusal(module)

    def forward_for(self, module: torch.nn.Module) -> Callable[..., Any]:
        """The function to install as ``module.forward`` (bound to the module)."""
        if self.patch is not None:
            return self.patch
        conv, shard = self.conv_width, self.shard
        return lambda layer, hidden_states, *args, **kwargs: schedule_forward(
            layer, hidden_states, *args, tree_forward=self.tree_forward, conv_width=conv, shard=shard, **kwargs
        )


def layer_name(module: torch.nn.Module) -> str:
    """``Class (layer i)``, for errors."""
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def conv1d_width(module: torch.nn.Module) -> int:
    """The kernel width of a mixer's depthwise causal conv (``conv1d``, else ``conv``)."""
    conv = getattr(module, "conv1d", None) or module.conv
    return int(conv.weight.shape[-1])


def check_rows(hidden_states: torch.Tensor, schedule: TreeSchedule) -> tuple[int, int]:
    """(K, L) of ``hidden_states`` [K, L, hidden], checked against the schedule's rows."""
    K, L = hidden_states.shape[:2]
    if K * L != schedule.num_positions:
        raise RequestError(
            f"hidden_states has {K} rows of {L}, the schedule {schedule.num_rows} rows of {schedule.seq_len}",
            path="$.hidden_states",
            rule="shape",
        )
    return K, L


def check_shard_rows(hidden_states: torch.Tensor, batch: Any) -> tuple[int, int]:
    """(K, Ls) of a CP shard's ``hidden_states`` [K, Ls, hidden], checked against the shard ``batch``."""
    K, Ls = hidden_states.shape[:2]
    if (K, Ls) != (batch.num_rows, batch.seq_len):
        raise RequestError(
            f"hidden_states has {K} rows of {Ls}, the context-parallel shard {batch.num_rows} rows of {batch.seq_len}",
            path="$.hidden_states",
            rule="shape",
        )
    return K, Ls


def schedule_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    *args: Any,
    tree_forward: TreeForward,
    conv_width: Callable | None,
    shard: ContextShard | None = NOT_SHARDED,
    **kwargs: Any,
) -> torch.Tensor:
    """The patched forward of a schedule-driven kind: tree rows when a packed batch is active, else stock.

    On a context-parallel shard (``batch.cp``) the kind's ``shard.forward`` runs with the
    whole rows' schedule; a kind without one is refused (``packed_forward`` refuses it
    before compute already).
    """
    ctx = packed_context(kwargs)
    if ctx is None:
        return getattr(self, STOCK_ATTR)(hidden_states, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("cache_params", args[0] if args else None)))
    if cache is not None:
        raise RequestError(
            "packed rows run without a cache: call the model with use_cache=False",
            path="$.use_cache",
            rule="unsupported",
        )
    width = None if conv_width is None else conv_width(self)
    batch = ctx.batch
    if batch.cp is None:
        return tree_forward(self, hidden_states, batch.tree_schedule(width, who=layer_name(self)))
    if shard is NOT_SHARDED or shard.forward is None:
        raise UnsupportedModelError(
            f"{layer_name(self)} has no context-parallel path", path="$.model", rule="cp_unsupported_layer"
        )
    reason = shard.refuse(self, batch.cp.size)
    if reason is not None:
        raise UnsupportedModelError(
            f"context parallelism: {layer_name(self)}: {reason}", path="$.model", rule="cp_unsupported_layer"
        )
    return shard.forward(self, hidden_states, batch.cp_full.tree_schedule(width, who=layer_name(self)), batch)


def install_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> None:
    """Make ``forward`` the module's forward, keeping the stock one (idempotent)."""
    if STOCK_ATTR not in module.__dict__:
        module.__dict__[STOCK_ATTR] = module.forward  # bound stock forward, outside nn.Module's registries
        module.forward = types.MethodType(forward, module)
