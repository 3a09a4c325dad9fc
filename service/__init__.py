"""treepack's service layer: the pure planner, the HTTP sidecar and the ``treepack`` command.

- :mod:`treepack.service.planner`: the pure core (numpy only).
- the sidecar: :func:`create_app` (:mod:`.app`, wiring), :mod:`.routes`,
  :mod:`.dependencies`, :mod:`.planning` (the work behind the routes), :mod:`.history`,
  :mod:`.metrics`, :mod:`.pool`, :class:`Settings`, :mod:`.serve` (uvicorn).
- :mod:`treepack.service.cli`: the ``treepack`` command (demo, plan, bench, serve) and the
  synthetic workloads.

Importing this package loads neither FastAPI nor uvicorn (a planner-only install has
neither): :func:`create_app` and :class:`Settings` are imported on first use.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

__version__ = version("treepack")  # pyproject.toml's, the one source (the app's OpenAPI version too)

__all__ = ["create_app", "Settings", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from treepack.service.app import create_app

        return create_app
    if name == "Settings":
        from treepack.service.settings import Settings

        return Settings
    raise AttributeError(f"module 'treepack.service' has no attribute {name!r}")
