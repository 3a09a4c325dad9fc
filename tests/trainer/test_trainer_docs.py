"""Every Python example of the README and of the guides below runs as written (CPU).

docs/service.md's blocks build on each other and run in order in tests/service/test_docs.py;
docs/context-parallel.md's needs several ranks (tests/e2e/test_trainer_cp.py);
:func:`test_every_python_block_of_the_docs_is_run` holds that no guide's block is left unrun.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = (
    "README.md",
    "docs/planner.md",
    "docs/trainer.md",
    "docs/vision.md",
    "docs/trl.md",
)
#: Guides whose blocks another test runs, and which.
RUN_ELSEWHERE = {
    "docs/service.md": "tests/service/test_docs.py",
    "docs/context-parallel.md": "tests/e2e/test_trainer_cp.py (on 2 gloo ranks)",
    "docs/megatron.md": "tests/megatron/test_docs.py (make test-megatron: needs megatron-core and megatron-bridge)",
}

#: Blocks not run here, by what they contain, and why (where they are run instead).
NOT_RUN_HERE = {
    "ContextParallel(": "needs a process group of several ranks: tests/e2e/test_trainer_cp.py runs it",
    "from_pretrained(": "downloads a checkpoint: a real run's sketch (tests/trainer/test_trl_vlm.py runs a tiny one)",
}


def _python_blocks(text: str) -> list[tuple[int, str]]:
    """The ``python`` blocks of a markdown text: (line of the fence, code)."""
    return [
        (text[: m.start()].count("\n") + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    ]


def _blocks():
    out = []
    for doc in DOCS:
        for line, code in _python_blocks((ROOT / doc).read_text()):
            if any(marker in code for marker in NOT_RUN_HERE):
                continue
            out.append(pytest.param(code, id=f"{doc}:{line}"))
    return out


BLOCKS = _blocks()


def test_the_docs_have_examples():
    ids = [p.id for p in BLOCKS]
    assert sum(i.startswith("README.md:") for i in ids) >= 2, ids
    for doc in DOCS[1:]:
        assert any(i.startswith(f"{doc}:") for i in ids), (doc, ids)


def test_every_python_block_of_the_docs_is_run():
    docs = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
    unrun = [d for d in docs if _python_blocks((ROOT / d).read_text()) and d not in DOCS and d not in RUN_ELSEWHERE]
    assert unrun == [], f"python blocks that no test runs: add the guide to DOCS ({unrun})"


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def library_warnings():
    """Collect what transformers logs at WARNING and above (its config checks warn through
    ``logger.warning_once``: its once-per-process cache is cleared so an earlier test cannot hide one)."""
    import torch

    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]  # transformers adds it
    caught, logger, threads = _Caught(), logging.getLogger("transformers"), torch.get_num_threads()
    logger.addHandler(caught)
    try:
        yield caught.messages
    finally:
        logger.removeHandler(caught)
        torch.set_num_threads(threads)  # an example may pin its threads; the other tests keep theirs


@pytest.mark.parametrize("code", BLOCKS)
def test_example_runs_as_written(code):
    import transformers  # noqa: F401  (its logger and warning_once exist once it is imported)

    with warnings.catch_warnings(), library_warnings() as logged:
        warnings.simplefilter("error")  # an example that warns is not an example to copy
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
    assert logged == [], logged  # nor one that makes the libraries print warnings


def test_the_library_warning_check_sees_a_config_warning():
    import transformers as tf

    with library_warnings() as logged:  # negative control: the vocabulary check of a tiny config warns
        tf.Qwen2Config(vocab_size=16, bos_token_id=151643)
    assert any("bos_token_id must be" in m for m in logged), logged


def test_the_context_parallel_example_is_a_file_with_its_launch_line():
    text = (ROOT / "docs" / "context-parallel.md").read_text()
    (block,) = [code for _, code in _python_blocks(text) if "ContextParallel(" in code]
    example = (ROOT / "examples" / "cp_step.py").read_text()
    assert example.endswith("\n\n" + block) or example.endswith('"""\n\n' + block), "examples/cp_step.py != the block"
    assert "torchrun --nproc-per-node 2 examples/cp_step.py" in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)[0]
    assert re.search(r"^print\(", block, re.M)  # it says what it did on every rank
