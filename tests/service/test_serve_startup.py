"""``treepack serve`` refuses what it cannot run with one line each and exit status 2 (no
traceback): bad setting values, a bad cost file; ``--docs none`` is the ``off`` its help
offers; ``--token`` is in the usage line; unknown ``TREEPACK_*`` variables are warned about.

The command as a process: tests/e2e/test_serve_process.py.
"""

from __future__ import annotations

import argparse
import json

import pytest

from treepack.proto.cost import CostModel, cost_terms
from treepack.service.serve import add_serve_arguments, run_serve, settings_from_args, warn_unknown_environment


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "content,expect",
    [
        ("{}", "not a treepack cost model: format is None, expected 'treepack-cost-model' (field $.format"),
        ('{"format": "treepack-cost-model", "version": 7}', "(field $.version"),
        ("not json", "is not JSON"),
    ],
    ids=["no format", "wrong version", "not json"],
)
def test_a_bad_cost_file_stops_startup_with_one_line_naming_file_and_field(tmp_path, capsys, content, expect):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert run_serve(_parse("--cost-model-path", str(bad), "--port", "1")) == 2
    err = _one_line(capsys)
    assert err.startswith("treepack serve: --cost-model-path: cost file ") and str(bad) in err and expect in err


@pytest.mark.parametrize("make", ["missing", "folder"])
def test_an_unreadable_cost_file_stops_startup_with_one_line(tmp_path, capsys, make):
    path = tmp_path / "cost.json"
    if make == "folder":
        path.mkdir()
    assert run_serve(_parse("--cost-model-path", str(path), "--port", "1")) == 2
    err = _one_line(capsys)
    assert err.startswith("treepack serve: --cost-model-path: ") and str(path) in err


def test_a_good_cost_file_passes_the_startup_check(tmp_path):
    from treepack.service.serve import startup_problem

    good = tmp_path / "cost.json"
    CostModel(backend="flash", coefficients={t: 1.0 for t in cost_terms("flash")}).save(good)
    assert json.loads(good.read_text())["format"] == "treepack-cost-model"
    assert startup_problem(settings_from_args(_parse("--cost-model-path", str(good)))) is None


@pytest.mark.parametrize(
    "argv,env,expect",
    [
        ((), {"TREEPACK_MAX_QUEUE": "-1"}, "treepack serve: invalid setting TREEPACK_MAX_QUEUE=-1: Input should be"),
        (("--port", "70000"), {}, "treepack serve: invalid setting --port 70000: Input should be less than"),
        (("--token-file", "/nonexistent/token"), {}, "treepack serve: invalid settings: cannot read the token file"),
        ((), {"TREEPACK_TOKEN": "  "}, "treepack serve: invalid settings: the bearer token (TREEPACK_TOKEN) is empty"),
    ],
    ids=["env", "flag", "token file", "empty token"],
)
def test_a_bad_setting_is_one_line_naming_where_it_came_from(monkeypatch, capsys, argv, env, expect):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        settings_from_args(_parse(*argv))
    assert e.value.code == 2
    assert _one_line(capsys).startswith(expect)


def test_docs_none_is_off_as_the_help_offers(monkeypatch, capsys):
    assert settings_from_args(_parse("--docs", "none")).docs == "off"
    monkeypatch.setenv("TREEPACK_DOCS", "none")
    assert settings_from_args(_parse()).docs == "off"
    assert settings_from_args(_parse("--docs", "swagger")).docs == "swagger"  # the flag wins
    with pytest.raises(SystemExit) as e:  # negative control: another word is refused, naming the choices
        _parse("--docs", "html")
    assert e.value.code == 2 and "invalid choice: 'html'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--log-level", "verbose")
    assert "choose from critical, error, warning, info, debug, trace" in capsys.readouterr().err.replace("'", "")


def test_the_token_flag_is_in_the_usage_line():
    from treepack.service.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "serve" in a.choices)
    serve = sub.choices["serve"]
    assert "[--token TOKEN]" in " ".join(serve.format_usage().split())
    assert "process list" in serve.format_help()
    assert settings_from_args(_parse("--token", "s3cret")).token.get_secret_value() == "s3cret"


def test_unknown_treepack_variables_are_warned_about_with_a_guess(capsys):
    env = {
        "TREEPACK_HISTORY_PAHT": "/x",
        "TREEPACK_NOPE": "1",
        "TREEPACK_PORT": "9000",  # negative controls: a setting, a variable the client reads, another prefix
        "TREEPACK_URL": "http://x",
        "TREEPACKING": "1",
    }
    lines = warn_unknown_environment(env)
    assert lines == [
        "treepack serve: warning: TREEPACK_HISTORY_PAHT is not a treepack setting "
        "(did you mean TREEPACK_HISTORY_PATH?); it is ignored",
        "treepack serve: warning: TREEPACK_NOPE is not a treepack setting; it is ignored",
    ]
    assert capsys.readouterr().err.splitlines() == lines


def test_serve_warns_about_an_unknown_variable_at_startup(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TREEPACK_MAX_QEUE", "4")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert run_serve(_parse("--cost-model-path", str(bad), "--port", "1")) == 2  # stops before serving
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("treepack serve: warning: TREEPACK_MAX_QEUE is not a treepack setting (did you mean")
