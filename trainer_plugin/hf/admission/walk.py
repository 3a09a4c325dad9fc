"""The model walk of a packed call: the static check, the CP check, the dispatch hooks and layer patches.

:func:`walk` runs them once per model state and setup (the walk cache,
:mod:`~treepack.trainer.hf.admission.walk_cache`): a model changed since (hooks, patches,
modules, modes, config) is walked, and judged, again. :func:`enable_tree_attention` is what
it installs: nothing of it changes an unpacked call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treepack.trainer.hf.admission.check import SupportReport, check_static
from treepack.trainer.hf.admission.cp import check_cp_layers
from treepack.trainer.hf.admission.setup import PackedSetup
from treepack.trainer.hf.admission.walk_cache import fingerprint, remember_walk, walk_info, walked
from treepack.trainer.hf.dispatch import install_dispatch
from treepack.trainer.hf.layers import handled_layer
from treepack.trainer.hf.layers import patch_layers as patch_layers_of
from treepack.trainer.hf.wrapped import unwrap_model

__all__ = ["Walk", "walk", "enable_tree_attention"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Walk:
    """What a passed walk found, kept with it in the walk cache.

    Attributes:
        report: the static check's :class:`SupportReport` (every handled module and how).
        scans: layers of the registry read the rows' tree schedule (built before the forward).
    """

    report: SupportReport
    scans: bool


def enable_tree_attention(model: Any, *, patch_layers: bool = True) -> str:
    """Prepare ``model`` for packed calls (idempotent); returns its attention implementation.

    Installs the per-call dispatch hooks (:func:`~treepack.trainer.hf.dispatch.install_dispatch`)
    and, with ``patch_layers``, the tree forwards of every layer kind of the registry (GDN,
    Mamba2, Mamba, KDA, short conv, DeepSeek-V3.2 sparse attention:
    :func:`treepack.trainer.hf.layers.patch_layers`). Neither changes an unpacked call; the
    model's ``attn_implementation`` stays what it was, so nothing needs switching back.

    Args:
        model: the HF model, possibly wrapped.
        patch_layers: also patch the registry's layers (without the patches those layers
            would scan each row as one sequence).

    Returns:
        The model's (unchanged) ``config._attn_implementation``.
    """
    hf = unwrap_model(model)
    install_dispatch(hf)
    if patch_layers:
        patch_layers_of(hf)
    return hf.config._attn_implementation


def walk(hf: Any, setup: PackedSetup) -> tuple[Walk, tuple | None]:
    """Walk ``hf`` for ``setup`` unless it passed that walk and has not changed since.

    Args:
        hf: the unwrapped HF model.
        setup: the forward's options; its :meth:`~PackedSetup.walk_key` is the cache key.

    Returns:
        (the :class:`Walk`, the model's fingerprint it was found unchanged by; None when the
        walk ran now, so nothing cached against the older state holds).

    Raises:
        UnsupportedModelError: the static check or the CP check refuses the model.
    """
    key = setup.walk_key()
    state = fingerprint(hf)
    if walked(hf, key, state):
        return walk_info(hf, key), state
    report = check_static(hf, setup, hidden_applies_logit_transforms=True)
    if setup.cp_size:
        check_cp_layers(hf, setup.cp_size, setup.cp_contiguous)
    enable_tree_attention(hf, patch_layers=setup.patch_layers)
    scans = setup.patch_layers and any(handled_layer(m) is not None for m in hf.modules())
    found = Walk(report=report, scans=scans)
    remember_walk(hf, key, info=found)
    return found, None
