"""The precision tests' negative control and batch: :func:`broken_mask` and :func:`golden_batch`
from ``benchmarks/precision_parity.py`` (loaded once per process, as the benchmark runs them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "precision_parity.py"


def precision_parity() -> Any:
    """``benchmarks/precision_parity.py`` as a module."""
    name = "_bench_precision_parity"
    if name not in sys.modules:
        sys.path.insert(0, str(_PATH.parent))
        spec = importlib.util.spec_from_file_location(name, _PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def broken_mask() -> Any:
    """Every packed batch's attention as plain causal packing inside the block (every backend)."""
    return precision_parity().broken_mask()
