"""treepack's service layer: the planner (:mod:`treepack.service.planner`) and its HTTP sidecar.

Importing this package loads neither FastAPI nor uvicorn (a planner-only install has
neither): :func:`create_app` and :class:`Settings` are imported on first use.
"""

from __future__ import annotations

from typing import Any

from treepack.service.version import __version__

__all__ = ["create_app", "Settings", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from treepack.service.app import create_app

        return create_app
    if name == "Settings":
        from treepack.service.settings import Settings

        return Settings
    raise AttributeError(f"module 'treepack.service' has no attribute {name!r}")
