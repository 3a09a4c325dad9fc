"""docs/megatron.md's examples: the GRPO step runs as written (this process: one gloo rank, TP = 1);
the API block is a sketch of names defined elsewhere (checked to name only the public API)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import treepack.trainer.megatron as mg

DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)


def test_the_guide_has_the_sketch_and_the_step():
    blocks = _blocks()
    assert len(blocks) == 2 and "plan_batch(" in blocks[1]
    for name in re.findall(r"import (.*)$", blocks[0], re.M)[0].split(", "):
        assert name in mg.__all__, name


def test_grpo_step_runs_as_written():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron and Bridge warn about missing GPU fusions on a CPU host
        exec(compile(_blocks()[1], str(DOC), "exec"), {"__name__": "__doc_example__"})
