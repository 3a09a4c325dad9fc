"""``treepack serve``: flags and environment, in-process.

The entry points as processes: tests/e2e/test_serve_process.py.
"""

from __future__ import annotations

import argparse
import os

import pytest

from treepack.service.serve import _export, add_serve_arguments, run_serve, settings_from_args


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def test_flags_win_over_environment_which_wins_over_defaults(monkeypatch):
    monkeypatch.setenv("TREEPACK_PORT", "9001")
    monkeypatch.setenv("TREEPACK_MAX_QUEUE", "3")
    s = settings_from_args(_parse("--port", "9002"))
    assert s.port == 9002 and s.max_queue == 3 and s.host == "127.0.0.1" and s.token is None
    assert settings_from_args(_parse("--history-max-age-s", "none")).history_max_age_s is None
    assert settings_from_args(_parse("--no-history")).history_enabled is False


def test_token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text("abc\n")
    assert settings_from_args(_parse("--token-file", str(f))).token.get_secret_value() == "abc"


def test_invalid_settings_exit_2_naming_the_setting(monkeypatch, capsys):
    monkeypatch.setenv("TREEPACK_MAX_QUEUE", "-1")
    with pytest.raises(SystemExit) as e:
        settings_from_args(_parse())
    assert e.value.code == 2
    assert "TREEPACK_MAX_QUEUE" in capsys.readouterr().err


def test_export_passes_the_effective_settings_to_workers(monkeypatch):
    from treepack.service.settings import Settings

    for name in Settings.model_fields:  # registered with monkeypatch, so _export's writes are undone
        monkeypatch.setenv(f"TREEPACK_{name.upper()}", "")
        monkeypatch.delenv(f"TREEPACK_{name.upper()}")
    s = settings_from_args(
        _parse("--max-tokens", "123", "--no-history", "--token", "t0k", "--history-max-age-s", "none")
    )
    _export(s)
    again = Settings()
    assert again == s and os.environ["TREEPACK_HISTORY_ENABLED"] == "false" and again.history_max_age_s is None


def test_cli_hook():
    from treepack.service.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "9123", "--max-concurrent-plans", "3"])
    assert args.func is run_serve and args.port == 9123 and args.max_concurrent_plans == 3


def test_malloc_keep_flag():
    assert settings_from_args(_parse("--malloc-keep-mb", "0")).malloc_keep_mb == 0


def test_an_uncreatable_history_path_stops_startup_with_one_line(tmp_path, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    assert run_serve(_parse("--history-path", str(blocker / "history.sqlite3"), "--port", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treepack serve: ") and "\n" not in err and "--no-history" in err and "Traceback" not in err
