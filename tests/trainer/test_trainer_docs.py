"""Every Python example of the README and docs/trainer.md runs as written (CPU)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/trainer.md")


def _blocks():
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for _i, m in enumerate(re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)):
            line = text[: m.start()].count("\n") + 1
            if "ContextParallel(" in m.group(1):
                continue  # needs a process group of several ranks: tests/e2e/test_trainer_cp.py runs it
            out.append(pytest.param(m.group(1), id=f"{doc}:{line}"))
    return out


BLOCKS = _blocks()


def test_the_docs_have_examples():
    ids = [p.id for p in BLOCKS]
    assert (
        sum(i.startswith("README.md") for i in ids) >= 2 and sum(i.startswith("docs/trainer.md") for i in ids) >= 1
    ), ids


@pytest.mark.parametrize("code", BLOCKS)
def test_example_runs_as_written(code):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an example that warns is not an example to copy
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
