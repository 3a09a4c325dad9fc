"""The treepack command line in-process: plan, demo, the serve hook (``bench`` as a process: tests/e2e/test_cli_process.py)."""

from __future__ import annotations

import json
import sys

import pytest

from treepack.service.cli import main
from treepack.service.planner import plan_batch


def _write_jsonl(path, golden):
    with open(path, "w") as f:
        for seq, p, g in zip(golden.sequences, golden.trainable, golden.groups):
            f.write(json.dumps({"tokens": seq.tolist(), "prompt_len": p, "group": g}) + "\n")


def test_plan_json_matches_planner(tmp_path, golden, capsys):
    path = tmp_path / "golden.jsonl"
    _write_jsonl(path, golden)
    assert main(["plan", str(path), "--seq-len", "131072", "--placement", "bfd", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 2 and out["row_tokens"] == [130_105, 122_114]
    assert out["tree_tokens"] == 236_124 and out["unpacked_tokens"] == 699_072
    assert out["packed_tokens"] == 252_219 and out["lower_bound_rows"] == 2 and out["placement"] == "bfd"
    assert set(out["timings_ms"]) >= {"tree", "placement", "layout", "metadata", "total"}
    ref = plan_batch(**golden.plan_kwargs(), placement="bfd")
    assert out["row_tokens"] == ref.row_len.tolist()


def test_plan_table_and_trainable_masks(tmp_path, capsys):
    path = tmp_path / "b.jsonl"
    prefix = list(range(100))
    lines = [
        {"tokens": prefix + [1000 + i, 2000 + i], "trainable": [0] * 100 + [1, 1]} for i in range(3)
    ] + [{"tokens": [7, 8, 9]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert main(["plan", str(path), "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "rows" in out and "saved %" in out
    assert main(["plan", str(path), "--seq-len", "512", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    # 99 shared prompt tokens once, each leaf = join token + 2 completion tokens, plus [7,8,9].
    assert js["tree_tokens"] == 99 + 3 * 3 + 3 and js["rows"] == 1


@pytest.mark.parametrize(
    "content,needle",
    [
        pytest.param('{"tokens": [1, 2, 3]}\n{"tokens": [1, 2\n', "invalid JSON: Expecting ',' delimiter (column 17) - at line 2", id="truncated JSON"),
        pytest.param('{"tokens": [1, -2, 3]}\n', "token id must be >= 0", id="negative token id"),
        pytest.param('{"tokens": [1, 2, 3], "trainable": [0, 1]}\n', "line 1.trainable", id="trainable length mismatch"),
        pytest.param('{"tokens": [1, 2, 3], "colour": 1}\n', "unknown field", id="unknown field"),
        pytest.param('[1, 2, 3]\n', "expected a JSON object", id="not an object"),
        pytest.param('{"tokens": "abc"}\n', "line 1.tokens", id="tokens not a list"),
        pytest.param("\n", "the batch is empty", id="empty batch"),
        pytest.param('{"tokens": [1, 2, 3]}\n' * 2 + '{"tokens": ' + json.dumps(list(range(600))) + "}\n", "at line 3", id="sequence over capacity"),
    ],
)
def test_plan_bad_input_exits_2_naming_the_line(tmp_path, capsys, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert main(["plan", str(path), "--seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_demo_prints_table_and_draws(tmp_path, capsys):
    png = tmp_path / "rows.png"
    assert main(["demo", "--groups", "12", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "130,105, 122,114" in out  # bfd's golden rows
    assert "120,113, 125,105, 23,096" in out  # in_order's
    assert "fewer rows" in out
    assert png.stat().st_size > 10_000 and (tmp_path / "rows-curriculum.png").stat().st_size > 10_000


def test_cli_works_without_the_service_extra(monkeypatch, capsys):
    """A planner-only install (no FastAPI, no pydantic-settings) still runs demo/plan, and
    `serve` says what to install instead of a traceback."""
    for mod in [m for m in sys.modules if m.startswith("treepack.service.") and m.split(".")[2] in ("serve", "settings", "app")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "pydantic_settings", None)  # import fails like a missing package
    monkeypatch.setitem(sys.modules, "fastapi", None)
    from treepack.service.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert args.func(args) == 2
    assert "pip install 'treepack[service]'" in capsys.readouterr().err
    assert parser.parse_args(["demo", "--groups", "4"]).groups == 4
