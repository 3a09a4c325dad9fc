"""The treepack command line in-process: plan, demo, the serve hook.

``bench`` as a process: tests/e2e/test_cli_process.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from treepack.service.cli import main
from treepack.service.planner import plan_batch, validate_plan

from helpers.service import REPO

_find_spec = importlib.util.find_spec


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


@pytest.mark.parametrize(
    "flags,expect",
    [
        (
            ["--seq-len", "100"],
            "sequence 0 has 178 tokens, longer than --seq-len 100 (set --on-overflow truncate or --on-overflow drop "
            "to allow) - at batch.jsonl, line 1 [max_len]",
        ),
        (["--seq-len", "512", "--min-shared-len", "0"], "--min-shared-len must be >= 1, got 0 [minimum]"),
        (["--seq-len", "512", "--repair-ms", "-1"], "--repair-ms must be in [0, 60000], got -1.0 [range]"),
        (["--seq-len", "512", "--conv-width", "0"], "--conv-width must be in [1, 64], got 0 [range]"),
        (["--seq-len", "512", "--min-shared-saving", "-3"], "--min-shared-saving must be >= 0, got -3 [minimum]"),
        (["--seq-len", "512", "--cp-size", "0"], "--cp-size must be in [1, 1024], got 0 [range]"),
    ],
    ids=["over capacity", "min-shared-len", "repair-ms", "conv-width", "min-shared-saving", "cp-size"],
)
def test_plan_errors_spell_the_flags(monkeypatch, capsys, flags, expect):
    monkeypatch.chdir(REPO / "examples")
    assert main(["plan", "batch.jsonl", *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"treepack plan: error: {expect}\n"
    assert "_" not in err.split(" - at ")[0].replace("max_len", ""), err  # no Python argument name left


def test_plan_flags_reach_the_planner(tmp_path, capsys):
    path = REPO / "examples" / "batch.jsonl"
    argv = ["plan", str(path), "--seq-len", "512", "--json"]
    assert main(argv) == 0
    base = json.loads(capsys.readouterr().out)
    extra = ["--share-trainable", "--min-shared-saving", "100", "--repair-ms", "0", "--conv-width", "3"]
    assert main([*argv, *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    want = {"share_trainable": True, "min_shared_saving": 100, "repair_ms": 0.0, "conv_width": 3}
    assert {k: out["options"][k] for k in want} == want
    assert {k: base["options"][k] for k in want} == {  # negative control: the defaults without them
        "share_trainable": False,
        "min_shared_saving": 0,
        "repair_ms": 10.0,
        "conv_width": 4,
    }
    assert out["packing"] == {"kind": "tree", "min_shared_len": 64}


def test_plan_table_and_trainable_masks(tmp_path, capsys):
    path = tmp_path / "b.jsonl"
    prefix = list(range(100))
    lines = [{"tokens": prefix + [1000 + i, 2000 + i], "trainable": [0] * 100 + [1, 1]} for i in range(3)] + [
        {"tokens": [7, 8, 9], "trainable": False}
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert main(["plan", str(path), "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "rows" in out and "saved %" in out
    assert main(["plan", str(path), "--seq-len", "512", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    # 99 shared prompt tokens once, each leaf = join token + 2 completion tokens, plus [7,8,9].
    assert js["tree_tokens"] == 99 + 3 * 3 + 3 and js["rows"] == 1


_OK = '{"tokens": [1, 2, 3], "trainable": false}\n'


@pytest.mark.parametrize(
    "content,needle",
    [
        pytest.param(
            _OK + '{"tokens": [1, 2\n',
            "invalid JSON: Expecting ',' delimiter (column 17) - at bad.jsonl, line 2 [json]",
            id="truncated JSON",
        ),
        pytest.param(
            '{"tokens": [1, -2, 3], "prompt_len": 1}\n',
            "token id must be in [0, 2**32), got -2 - at bad.jsonl, line 1.tokens[1] [range]",
            id="negative token id",
        ),
        pytest.param(
            '{"tokens": [1, 2, 3], "trainable": [0, 1]}\n', "line 1.trainable", id="trainable length mismatch"
        ),
        pytest.param(
            '{"tokens": [1, 2, 3], "trainable": [0, 1, 2]}\n',
            "expected 0 or 1, got 2 - at bad.jsonl, line 1.trainable[2] [type]",
            id="trainable flag not 0/1",
        ),
        pytest.param(
            _OK + '{"tokens": [1, 2, 3], "colour": 1}\n',
            "unknown field(s) ['colour'] - at bad.jsonl, line 2 [unknown_field]",
            id="unknown field",
        ),
        pytest.param("[1, 2, 3]\n", "expected a JSON object", id="not an object"),
        pytest.param('{"tokens": "abc", "prompt_len": 1}\n', "line 1.tokens [type]", id="tokens not a list"),
        pytest.param(
            _OK * 2 + '{"tokens": [5, 6, "7"], "prompt_len": 1}\n',
            "expected an integer token id, got '7' - at bad.jsonl, line 3.tokens[2] [type]",
            id="token not an integer",
        ),
        pytest.param(
            _OK + '{"tokens": [5, 6, 1.5], "prompt_len": 1}\n',
            "got 1.5 - at bad.jsonl, line 2.tokens[2] [type]",
            id="token a float",
        ),
        pytest.param('{"tokens": [5, 2e40], "prompt_len": 1}\n', "line 1.tokens[1] [type]", id="token a huge float"),
        pytest.param(
            '{"tokens": [5, 99999999999999999999999], "prompt_len": 1}\n',
            "line 1.tokens[1] [range]",
            id="token beyond int64",
        ),
        pytest.param(
            _OK + '{"prompt_len": 1}\n',
            '"tokens" is missing - at bad.jsonl, line 2.tokens [missing]',
            id="tokens missing",
        ),
        pytest.param(
            _OK + '{"tokens": [1, 2, 3]}\n',
            "--no-trainable / --all-trainable for lines that give neither - at bad.jsonl, line 2.trainable [missing]",
            id="trainable info missing",
        ),
        pytest.param(
            '{"tokens": [1, 2, 3], "prompt_len": "3"}\n', "line 1.prompt_len [type]", id="prompt_len a string"
        ),
        pytest.param("\n", "the batch is empty", id="empty batch"),
        pytest.param(
            _OK * 2 + '{"tokens": ' + json.dumps(list(range(600))) + ', "trainable": false}\n',
            "at bad.jsonl, line 3",
            id="sequence over capacity",
        ),
    ],
)
def test_plan_bad_input_exits_2_naming_the_line(tmp_path, monkeypatch, capsys, content, needle):
    (tmp_path / "bad.jsonl").write_text(content)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "bad.jsonl", "--seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treepack plan: error: ") and err.count("\n") == 1, err  # one line, no traceback
    assert needle in err, err


@pytest.mark.parametrize(
    "make",
    [lambda d: d / "absent.jsonl", lambda d: d, lambda d: _binary(d / "b.jsonl")],
    ids=["missing", "directory", "not utf-8"],
)
def test_plan_unreadable_file_exits_2_naming_it(tmp_path, capsys, make):
    path = make(tmp_path)
    assert main(["plan", str(path), "--seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"treepack plan: error: cannot read {path}: ") and err.count("\n") == 1, err


def _binary(path):
    path.write_bytes(b"\xff\xfe\x00{")
    return path


@pytest.mark.parametrize(
    "flag,line,trainable_tokens",
    [
        (None, '{"tokens": [1, 2, 3, 4], "trainable": false}', 0),
        (None, '{"tokens": [1, 2, 3, 4], "trainable": true}', 4),
        ("--no-trainable", '{"tokens": [1, 2, 3, 4]}', 0),
        ("--all-trainable", '{"tokens": [1, 2, 3, 4]}', 4),
        ("--all-trainable", '{"tokens": [1, 2, 3, 4], "prompt_len": 3}', 1),  # a line's own value wins
    ],
)
def test_plan_trainable_said_explicitly(tmp_path, capsys, flag, line, trainable_tokens):
    from treepack.service.cli.plan import _DEFAULTS, read_jsonl

    path = tmp_path / "b.jsonl"
    path.write_text(line + "\n")
    assert main(["plan", str(path), "--seq-len", "8", "--json", *([flag] if flag else [])]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 1
    seqs, trainable, _ = read_jsonl(
        [line], _DEFAULTS[{None: None, "--no-trainable": "none", "--all-trainable": "all"}[flag]]
    )
    plan = plan_batch(seqs, seq_len=8, trainable=trainable)
    validate_plan(plan, seqs, trainable=trainable)
    assert int(sum(plan.trainable_of(0))) == trainable_tokens


def test_demo_prints_table_and_draws(tmp_path, capsys):
    png = tmp_path / "rows.png"
    assert main(["demo", "--groups", "12", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "130,105, 122,114" in out  # bfd's golden rows
    assert "120,113, 125,105, 23,096" in out  # in_order's
    assert "fewer rows" in out and "SPEC" not in out  # user output names no development file
    assert png.stat().st_size > 10_000 and (tmp_path / "rows-curriculum.png").stat().st_size > 10_000


def test_demo_png_without_matplotlib_fails_before_any_work(tmp_path, monkeypatch, capsys):
    import treepack.service.cli.demo as demo

    monkeypatch.setattr(
        demo.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else _find_spec(name, *a)
    )
    monkeypatch.setattr(
        demo, "golden_example", lambda: pytest.fail("the demo started planning before saying --png cannot draw")
    )
    assert main(["demo", "--png", str(tmp_path / "rows.png")]) == 2
    cap = capsys.readouterr()
    assert (
        cap.out == "" and cap.err.count("\n") == 1 and "--png needs matplotlib" in cap.err and "pip install" in cap.err
    ), cap


def test_cli_works_without_the_service_extra(monkeypatch, capsys):
    """A planner-only install (no FastAPI, no pydantic-settings) still runs demo/plan, and
    `serve` says what to install instead of a traceback."""
    for mod in [
        m for m in sys.modules if m.startswith("treepack.service.") and m.split(".")[2] in ("serve", "settings", "app")
    ]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "pydantic_settings", None)  # import fails like a missing package
    monkeypatch.setitem(sys.modules, "fastapi", None)
    from treepack.service.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert args.func(args) == 2
    assert "pip install -e '.[service]'" in capsys.readouterr().err
    assert parser.parse_args(["demo", "--groups", "4"]).groups == 4
