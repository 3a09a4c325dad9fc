"""The layer registry: one module per layer kind, each one :class:`~treepack.trainer.hf.layers.spec.TreeLayer`.

Attention runs through HF's ``AttentionInterface`` (:mod:`treepack.trainer.hf.attention`);
every other token mixer that runs on tree rows is a kind here:

- :mod:`~treepack.trainer.hf.layers.gdn`: Qwen3-Next / Qwen3.5 Gated DeltaNet (``gdn``);
- :mod:`~treepack.trainer.hf.layers.gdn_olmo`: OLMo-hybrid's GDN variant (``gdn_olmo``);
- :mod:`~treepack.trainer.hf.layers.kda`: Kimi-Linear's KDA (``kda``);
- :mod:`~treepack.trainer.hf.layers.mamba2`: Mamba2 mixers (``mamba2``);
- :mod:`~treepack.trainer.hf.layers.mamba`: Jamba's Mamba (``mamba``);
- :mod:`~treepack.trainer.hf.layers.short_conv`: LFM2's short conv (``short_conv``);
- :mod:`~treepack.trainer.hf.layers.dsa`: DeepSeek-V3.2 / GLM-MoE-DSA sparse attention and
  their indexers (``dsa``, ``glm_dsa``, ``dsa_indexer``).

Every module of this package that defines ``LAYERS`` (a tuple of ``TreeLayer``) is a kind
module and is registered when the package is imported, so adding a kind is adding one
module (and its test); :func:`register` adds one at run time.
:func:`~treepack.trainer.hf.admission.check_model`, :func:`patch_layers` and the tree
schedule (:meth:`~treepack.trainer.data.packed_batch.PackedBatch.tree_schedule`) read it.

Recognition: a kind with ``classes`` takes modules of exactly those class names; a kind
with ``structure`` takes modules whose parameters and attributes describe it, and handles
them only when their ``forward`` is the code of one of its ``stock`` layers
(:func:`~treepack.trainer.hf.layers.stock.stock_class`) and their conv activation is one
the tree conv runs; :func:`unhandled_reason` says why not otherwise.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from treepack.trainer.hf.layers.spec import STOCK_ATTR, LayerSpec, TreeLayer, install_forward
from treepack.trainer.hf.layers.stock import CONV_ACTIVATIONS, stock_class

__all__ = [
    "TreeLayer",
    "LayerSpec",
    "registered",
    "register",
    "unregister",
    "kind_named",
    "layer_by_class",
    "layer_of",
    "mixer_kind",
    "stock_layer",
    "unhandled_reason",
    "is_handled",
    "handled_layer",
    "patch_layers",
    "unpatch_layers",
    "reference_rules",
]

_INFRASTRUCTURE = frozenset({"spec", "stock"})
_REGISTRY: dict[str, TreeLayer] = {}


def register(layer: TreeLayer) -> TreeLayer:
    """Add a layer kind to the registry (its ``kind`` must be new); returns it."""
    if not isinstance(layer, TreeLayer):
        raise TypeError(f"expected a TreeLayer, got {type(layer).__name__}")
    if layer.kind in _REGISTRY:
        raise ValueError(f"layer kind {layer.kind!r} is registered already")
    taken = {c: k.kind for k in _REGISTRY.values() for c in k.classes}
    clash = [c for c in layer.classes if c in taken]
    if clash:
        raise ValueError(f"layer kind {layer.kind!r}: classes {clash} belong to kind {taken[clash[0]]!r}")
    _REGISTRY[layer.kind] = layer
    return layer


def unregister(kind: str) -> TreeLayer:
    """Remove a layer kind (e.g. one a test registered); returns it."""
    return _REGISTRY.pop(kind)


def registered() -> tuple[TreeLayer, ...]:
    """Every registered kind, in registration order (kind modules by name first)."""
    return tuple(_REGISTRY.values())


def kind_named(kind: str) -> TreeLayer:
    """The registered kind ``kind`` (KeyError names the known ones)."""
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise KeyError(f"no layer kind {kind!r}; registered: {sorted(_REGISTRY)}") from None


def layer_by_class(name: str) -> TreeLayer | None:
    """The kind that patches class ``name`` by exact name, or None."""
    return next((k for k in _REGISTRY.values() if name in k.classes), None)


def _structure_layer(module: torch.nn.Module) -> TreeLayer | None:
    return next((k for k in _REGISTRY.values() if k.matches(module)), None)


def layer_of(module: torch.nn.Module) -> TreeLayer | None:
    """The kind of ``module``: by exact class name, else by structure; None for no kind."""
    return layer_by_class(type(module).__name__) or _structure_layer(module)


def mixer_kind(module: torch.nn.Module) -> str | None:
    """The kind ``module``'s structure describes (mechanism, no class names), or None.

    A module with a kind is a token mixer that is wrong on tree rows unless
    :func:`is_handled` says its tree forward reproduces it.
    """
    layer = _structure_layer(module)
    return None if layer is None else layer.kind


def stock_layer(module: torch.nn.Module) -> str | None:
    """The stock HF class whose forward ``module`` runs (same code), or None."""
    layer = _structure_layer(module)
    return None if layer is None else stock_class(module, layer.stock)


def unhandled_reason(module: torch.nn.Module) -> str | None:
    """Why a structurally recognised mixer cannot run exactly on tree rows, or None when it can (or is no mixer)."""
    layer = _structure_layer(module)
    if layer is None:
        return None
    if stock_class(module, layer.stock) is None:
        return f"its forward is not the code of a stock {layer.kind} layer ({', '.join(c for _, c in layer.stock)})"
    act = getattr(module, "activation", None)
    if act not in CONV_ACTIVATIONS:
        return f"conv activation {act!r} (tree conv supports {CONV_ACTIVATIONS})"
    return layer.refuse(module)


def is_handled(module: torch.nn.Module) -> bool:
    """True when ``module`` is a structurally recognised mixer whose tree forward reproduces it exactly."""
    return _structure_layer(module) is not None and unhandled_reason(module) is None


def handled_layer(module: torch.nn.Module) -> TreeLayer | None:
    """The kind that runs ``module`` on tree rows (by exact class name, else a handled structure match), or None."""
    by_name = layer_by_class(type(module).__name__)
    if by_name is not None:
        return by_name
    return _structure_layer(module) if is_handled(module) else None


def patch_layers(model: torch.nn.Module) -> list[str]:
    """Install the tree forward on every module of ``model`` that a registered kind runs (idempotent).

    Returns:
        The qualified names of the patched modules (already patched ones included).
    """
    names = []
    for name, mod in model.named_modules():
        layer = handled_layer(mod)
        if layer is None:
            continue
        install_forward(mod, layer.forward_for(mod))
        names.append(name)
    return names


def unpatch_layers(model: torch.nn.Module) -> int:
    """Restore the stock forwards; returns how many modules were restored."""
    n = 0
    for mod in model.modules():
        if STOCK_ATTR in mod.__dict__:
            del mod.__dict__[STOCK_ATTR]
            del mod.__dict__["forward"]
            n += 1
    return n


@contextmanager
def reference_rules() -> Iterator[None]:
    """Inside the block, unpacked calls of patched layers settle what their stock layer leaves
    open the way tree rows do (every registered kind's ``reference``: DSA indexers order equal
    top-k scores by position). Outside it they run stock, so packed calls leave the model as
    found.

    For reference runs that must equal the packed run exactly: the probe's alone runs, and
    a caller's own check of a model with such layers (run the reference's backward inside the
    block too when checkpointing replays it).
    """
    with ExitStack() as stack:
        for layer in _REGISTRY.values():
            if layer.reference is not None:
                stack.enter_context(layer.reference())
        yield


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in _INFRASTRUCTURE:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for layer in getattr(module, "LAYERS", ()):
            register(layer)


_discover()
