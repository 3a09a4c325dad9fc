"""verl's ``verl.plugins`` entry point: puts :class:`~treepack.trainer.verl.TreepackFSDPEngine` in place.

verl imports every ``verl.plugins`` entry point at ``import verl`` (in the driver and in
every Ray worker). Loading this module does nothing unless ``TREEPACK_VERL=1`` is in the
environment (the one switch; on a Ray cluster, through ``ray_kwargs.ray_init.runtime_env``);
then it registers the treepack engines for verl's ``language_model`` (actor, reference) and
``value_model`` (critic) model types on the ``fsdp`` / ``fsdp2`` backends, for every device
the stock engines are registered for.
verl swallows a plugin's import errors, so :func:`register` can also be called by hand,
and :func:`registered` says whether it took.

This module imports nothing of verl or torch at load time unless switched on.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "register", "registered"]

ENV = "TREEPACK_VERL"


def _pairs() -> tuple[tuple[str, type, type], ...]:
    """(model type, stock engine, treepack engine) of each role treepack runs."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    from treepack.trainer.verl import TreepackFSDPEngine, TreepackFSDPValueEngine

    return (
        ("language_model", FSDPEngineWithLMHead, TreepackFSDPEngine),
        ("value_model", FSDPEngineWithValueHead, TreepackFSDPValueEngine),
    )


def register() -> type:
    """Register ``TreepackFSDPEngine`` in place of verl's ``FSDPEngineWithLMHead`` and
    ``TreepackFSDPValueEngine`` in place of its ``FSDPEngineWithValueHead``.

    Returns:
        The language-model engine class now registered.

    Raises:
        ImportError: verl (or its FSDP engine) is not installed, saying which release to install.
    """
    try:
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "treepack's verl engine needs verl, which is missing: pip install verl==0.9.1 "
            "(the release it was checked against)"
        ) from exc

    for model_type, stock, ours in _pairs():
        table = EngineRegistry._engines.get(model_type, {})
        for backend in ("fsdp", "fsdp2"):
            for key, cls in list(table.get(backend, {}).items()):
                if cls is stock:
                    table[backend][key] = ours
    return _pairs()[0][2]


def registered() -> bool:
    """True when every stock ``fsdp`` / ``fsdp2`` entry of both model types (language and value
    model) is the treepack engine (False without verl: nothing is registered then)."""
    try:
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead  # noqa: F401
    except ImportError:
        return False

    for model_type, stock, _ in _pairs():
        table = EngineRegistry._engines.get(model_type, {})
        entries = [cls for b in ("fsdp", "fsdp2") for cls in table.get(b, {}).values()]
        if not entries or any(cls is stock for cls in entries):
            return False
    return True


if os.environ.get(ENV, "0") == "1":
    register()
