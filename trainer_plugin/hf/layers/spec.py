"""What a layer kind is: :class:`TreeLayer`, and the patch that runs it on tree rows.

A :class:`TreeLayer` says, for one kind of token mixer, how it is recognised (by
mechanism: its parameters and attributes, or for a few layers their exact class), how it
runs on tree rows, what it needs from the plan, why it refuses, and how it shards across
ranks. The registry (:mod:`treepack.trainer.hf.layers`) holds one per kind; the support
check, the patching and the schedules read it.

A patched module keeps its bound stock forward in ``module.__dict__[STOCK_ATTR]`` (outside
``nn.Module``'s registries) and runs it whenever no packed batch is active, so an unpacked
call is unchanged.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.hf.context import packed_context
from treepack.trainer.kernels.tree_scan import TreeSchedule

__all__ = ["TreeLayer", "TreeForward", "LayerSpec", "STOCK_ATTR", "NOT_SHARDED", "check_rows", "conv1d_width", "install_forward", "layer_name"]

# Where a patched module keeps its bound stock forward.
STOCK_ATTR = "_treepack_stock_forward"
# The ``shard`` of a kind with no context-parallel plan yet: context parallelism refuses it by name.
NOT_SHARDED = None


class TreeForward(Protocol):
    """A layer's forward on tree rows: ``(layer, hidden_states [K, L, hidden], schedule) -> [K, L, hidden]``."""

    def __call__(self, layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor: ...


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
        shard: how the kind shards its rows across ranks (context parallelism).
            :data:`NOT_SHARDED` (None) for every kind today: the context-parallel path
            refuses such a kind by name.
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
    shard: Any = NOT_SHARDED

    def __post_init__(self) -> None:
        if (self.tree_forward is None) == (self.patch is None):
            raise TypeError(f"layer kind {self.kind!r} needs exactly one of tree_forward and patch")
        if self.structure is None and not self.classes:
            raise TypeError(f"layer kind {self.kind!r} is recognised by nothing: give structure or classes")
        if self.structure is not None and not self.stock:
            raise TypeError(f"layer kind {self.kind!r} is found by structure but names no stock layer to compare code with")

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
        conv = self.conv_width
        return lambda layer, hidden_states, *args, **kwargs: schedule_forward(layer, hidden_states, *args, tree_forward=self.tree_forward, conv_width=conv, **kwargs)


def layer_name(module: torch.nn.Module) -> str:
    """``Class (layer i)``, for errors."""
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def conv1d_width(module: torch.nn.Module) -> int:
    """The kernel width of a mixer's depthwise causal conv (``conv1d``, else ``conv``)."""
    conv = getattr(module, "conv1d", None) or getattr(module, "conv")
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


def schedule_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, tree_forward: TreeForward, conv_width: Callable | None, **kwargs: Any
) -> torch.Tensor:
    """The patched forward of a schedule-driven kind: tree rows when a packed batch is active, else stock."""
    ctx = packed_context(kwargs)
    if ctx is None:
        return getattr(self, STOCK_ATTR)(hidden_states, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("cache_params", args[0] if args else None)))
    if cache is not None:
        raise RequestError("packed rows run without a cache: call the model with use_cache=False", path="$.use_cache", rule="unsupported")
    width = None if conv_width is None else conv_width(self)
    return tree_forward(self, hidden_states, ctx.batch.tree_schedule(width, who=layer_name(self)))


def install_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> None:
    """Make ``forward`` the module's forward, keeping the stock one (idempotent)."""
    if STOCK_ATTR not in module.__dict__:
        module.__dict__[STOCK_ATTR] = module.forward  # bound stock forward, outside nn.Module's registries
        module.forward = types.MethodType(forward, module)
