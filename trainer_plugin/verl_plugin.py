"""verl's ``verl.plugins`` entry point: puts :class:`~treepack.trainer.verl.TreepackFSDPEngine` in place.

verl imports every ``verl.plugins`` entry point at ``import verl`` (in the driver and in
every Ray worker). Loading this module does nothing unless ``TREEPACK_VERL=1`` is in the
environment (the one switch; on a Ray cluster, through ``ray_kwargs.ray_init.runtime_env``);
then it registers the treepack engine for verl's ``language_model`` model type on the
``fsdp`` / ``fsdp2`` backends, for every device the stock engine is registered for.
verl swallows a plugin's import errors, so :func:`register` can also be called by hand,
and :func:`registered` says whether it took.

This module imports nothing of verl or torch at load time unless switched on.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "register", "registered"]

ENV = "TREEPACK_VERL"


def register() -> type:
    """Register ``TreepackFSDPEngine`` in place of verl's ``FSDPEngineWithLMHead``.

    Returns:
        The engine class now registered.

    Raises:
        ImportError: verl (or its FSDP engine) is not installed, saying which release to install.
    """
    try:
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError as exc:
        raise ImportError(
            "treepack's verl engine needs verl, which is missing: pip install verl==0.9.1 "
            "(the release it was checked against)"
        ) from exc

    from treepack.trainer.verl import TreepackFSDPEngine

    table = EngineRegistry._engines["language_model"]
    for backend in ("fsdp", "fsdp2"):
        for key, cls in list(table.get(backend, {}).items()):
            if cls is FSDPEngineWithLMHead:
                table[backend][key] = TreepackFSDPEngine
    return TreepackFSDPEngine


def registered() -> bool:
    """True when every stock ``fsdp`` / ``fsdp2`` language-model entry is the treepack engine
    (False without verl: nothing is registered then)."""
    try:
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError:
        return False

    table = EngineRegistry._engines.get("language_model", {})
    entries = [cls for b in ("fsdp", "fsdp2") for cls in table.get(b, {}).values()]
    return bool(entries) and not any(cls is FSDPEngineWithLMHead for cls in entries)


if os.environ.get(ENV, "0") == "1":
    register()
