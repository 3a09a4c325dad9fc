"""Optional test dependencies: skipped on a partial install, required under CI.

``make test`` installs every extra (trl, peft, accelerate, torch); a test that needs one
imports it through :func:`require`. Outside CI a missing package skips the test, as
``pytest.importorskip`` does; with the ``CI`` environment variable set (``.ci/run`` sets
it) a missing package is an error, so an extra that fell out of the install fails the run
instead of silently skipping the tests that need it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    """True when the ``CI`` environment variable is set to anything but "", "0" or "false"."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(module: str) -> ModuleType:
    """``module`` imported; a skip when it is missing, or under CI an ImportError naming it."""
    if not in_ci():
        return pytest.importorskip(module)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"CI is set and the test dependency {module!r} does not import ({e}): `make test` installs every extra"
        ) from e
