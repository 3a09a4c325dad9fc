"""docs/service.md stays true: its Python blocks run, its tables name real settings and errors."""

from __future__ import annotations

import re

from treepack.proto import errors
from treepack.service.settings import Settings

from helpers.service import REPO

DOC = (REPO / "docs" / "service.md").read_text()


def test_python_blocks_run_in_order(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC, re.S)
    assert len(blocks) >= 4
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "docs/service.md", "exec"), scope)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "$.sequences[0] max_len sequence 0 has 300 tokens" in out
    assert "largest safe step:" in out
    # The timed example reports each estimate's noise and asks again where 8 trials cannot decide.
    assert "groups/s, 8/8 trials a tree" in out and " again: " in out and "most groups per second: " in out
    printed = re.search(r"^```text\n(6 groups: step.*?)^```", DOC, re.S | re.M)
    assert printed is not None

    # The output the guide shows is this run's, line for line up to the figures (auto's repair pass
    # has a time budget, so a loaded machine may move a figure). Which compositions are asked again
    # and which the last line cannot tell apart depend on the measured noise, so those lines are
    # compared by their form alone.
    def heads(text: str) -> list[str]:
        lines = [re.sub(r"\d+(\.\d+)?", "#", ln) for ln in text.splitlines()]
        lines = [re.sub(r" \(not told apart from [^)]*\)$", "", ln) for ln in lines]
        return [ln for i, ln in enumerate(lines) if not (" again: " in ln and i and " again: " in lines[i - 1])]

    assert heads(printed.group(1)) == heads(out[out.index("6 groups: step") :].strip())


def test_settings_table_is_complete():
    rows = re.findall(r"^\| `(\w+)` \| ", DOC, re.M)
    assert set(Settings.model_fields) <= set(rows)


def test_error_table_names_every_kind():
    kinds = {
        cls.kind for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.TreepackError)
    }
    kinds.discard("treepack_error")
    for k in kinds:
        assert f"`{k}`" in DOC, k
