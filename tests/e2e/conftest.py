"""Tests here start processes (uvicorn servers, gloo ranks, SIGKILL rounds): all marked ``slow``."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.slow)
