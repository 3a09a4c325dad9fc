"""The Megatron test env: ``make test-megatron`` (``.venv-megatron``: megatron-core 0.19.2,
megatron-bridge 0.6.2, CPU torch).

The main ``make test`` run never collects this folder (``tests/conftest.py`` ignores it
unless named). Named without megatron installed, its tests are skipped with the reason,
except with ``CI`` set, where a missing megatron is a collection error.

The CPU stand-ins (:mod:`cpu_standins`: ``typing.override`` on Python 3.11, the
triton-importing paged-stash module, Bridge's TE-importing LoRA layers,
``torch.cuda.current_device``, the RNG tracker) are installed here, test-side only, before
anything imports megatron. This process is one gloo rank with tensor parallel size 1; the
multi-rank tests start their ranks as processes (``ranks_worker.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

MISSING = importlib.util.find_spec("megatron.core") is None or importlib.util.find_spec("megatron.bridge") is None
if MISSING and os.environ.get("CI"):
    raise ImportError("megatron-core / megatron-bridge are not installed: run `make test-megatron`")
if not MISSING:
    import cpu_standins

    cpu_standins.install()
    cpu_standins.init_ranks(0, 1, 1, tempfile.mktemp(prefix="treepack-megatron-gloo-"))


def pytest_collection_modifyitems(config, items):
    """Without megatron (and without CI), every test of this folder is skipped with the reason."""
    if MISSING:
        why = pytest.mark.skip(reason="megatron is not installed: run `make test-megatron` (.venv-megatron)")
        for item in items:
            if str(item.path).startswith(HERE):
                item.add_marker(why)


def pytest_terminal_summary(terminalreporter):
    """The exactness table of this run (``oracle.EXACTNESS``), and the negative controls (``oracle.CONTROLS``)."""
    oracle = sys.modules.get("oracle")
    EXACTNESS, CONTROLS = getattr(oracle, "EXACTNESS", []), getattr(oracle, "CONTROLS", [])
    if EXACTNESS:
        terminalreporter.section("Megatron tree rows vs HF running each sequence alone (max abs error)")
        terminalreporter.write_line(f"{'family':22s} {'TP':>2s} {'DP':>2s} {'backend':7s} logprob    grad(rel)  loss")
        for fam, tp, dp, backend, lp, grad, loss in EXACTNESS:
            terminalreporter.write_line(f"{fam:22s} {tp:2d} {dp:2d} {backend:7s} {lp:.2e}   {grad:.2e}   {loss:.2e}")
    if CONTROLS:
        terminalreporter.section("negative controls (must miss HF by far more than the tolerance)")
        for name, err in CONTROLS:
            terminalreporter.write_line(f"{name:70s} {err:.2e}")
    for name, seconds in getattr(oracle, "TIMINGS", []):
        terminalreporter.write_line(f"multi-rank run {name}: {seconds:.0f} s wall")
