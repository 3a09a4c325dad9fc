"""Shared fixtures, and the plan checker every test runs under.

:func:`_validate_every_plan` (autouse) wraps the planner's one entry point,
``plan_with_tree``, wherever a treepack module imported it, so that every plan any test
makes in this process — directly, through the embedded client, the in-process ASGI app,
what-if trials or the trainer — passes ``validate_plan`` against the batch it was planned
from (tokens, trainable flags and keys included). Set ``TREEPACK_TEST_VALIDATE=0`` to
switch it off when profiling.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
from hypothesis import settings

# CI replays the same examples every run (a red CI must mean a real regression); the
# "explore" profile draws fresh ones: HYPOTHESIS_PROFILE=explore make test.
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("explore", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

VALIDATED: Counter = Counter()

_OWN_VENV_TESTS = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), d) for d in ("verl_engine", "megatron")
)


def pytest_ignore_collect(collection_path, config):
    """tests/verl_engine and tests/megatron run in their own venvs (``make test-verl``,
    ``make test-megatron``): each is collected only when named."""
    if str(collection_path) not in _OWN_VENV_TESTS:
        return None
    here = str(collection_path)
    named = any(os.path.abspath(str(a).split("::")[0]).startswith(here) for a in config.args)
    return None if named else True


@pytest.fixture(autouse=True)
def _validate_every_plan(monkeypatch):
    if os.environ.get("TREEPACK_TEST_VALIDATE", "1") == "0":
        yield
        return
    import treepack.service.planner.api as api
    from treepack.service.planner.validate import validate_plan

    original = api.plan_with_tree

    def checked(batch, options, **kwargs):
        result = original(batch, options, **kwargs)
        validate_plan(result.plan, batch, dense_check_max=512)
        VALIDATED["plans"] += 1
        return result

    for name, mod in list(sys.modules.items()):
        if name.startswith("treepack.") and getattr(mod, "plan_with_tree", None) is original:
            monkeypatch.setattr(mod, "plan_with_tree", checked)
    yield


def pytest_sessionfinish(session):
    """Under pytest-xdist (``-n``, when installed) each worker hands its count back."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["validated_plans"] = VALIDATED["plans"]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    VALIDATED["plans"] += getattr(node, "workeroutput", {}).get("validated_plans", 0)


def pytest_terminal_summary(terminalreporter):
    if VALIDATED["plans"]:
        terminalreporter.write_line(f"validate_plan ran on {VALIDATED['plans']} plans made by the tests")
    # Every skip, counted by reason, on one line: a skip is a test that did not run. A reason
    # is counted by its words before any "(...)" detail (an error message, say).
    reasons: Counter = Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(rep, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ").split(" (")[0]] += 1
    if reasons:
        summary = "; ".join(f"{n} x {r}" for r, n in reasons.most_common())
        terminalreporter.write_line(f"skipped {sum(reasons.values())} tests: {summary}")


@pytest.fixture(scope="session")
def golden():
    from treepack.service.cli.workloads import golden_example

    return golden_example()
