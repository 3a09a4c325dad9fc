"""``treepack serve`` (and ``python -m treepack.service``): run the sidecar under uvicorn.

Every :class:`~.settings.Settings` field is a flag (``--max-tokens``, ``--history-path``, ...);
a flag wins over its ``TREEPACK_*`` environment variable, which wins over the default.
The token is best passed as ``TREEPACK_TOKEN`` or ``--token-file`` (a ``--token`` flag is
visible to every user of the machine in the process list).

The CLI hooks this in with ``add_serve_parser(subparsers)``; the parser's ``func`` is
:func:`run_serve`.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

__all__ = [
    "add_serve_parser",
    "add_serve_arguments",
    "settings_from_args",
    "startup_problem",
    "warn_unknown_environment",
    "run_serve",
    "main",
]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


_UNSET = "none"  # a flag value that clears an optional setting (e.g. no age limit)


def _typed(base: type) -> Any:
    def parse(text: str) -> Any:
        return _UNSET if text.strip().lower() == _UNSET else base(text)

    parse.__name__ = base.__name__
    return parse


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Add one flag per setting (default None: 'not given, use the environment')."""
    from treepack.service.settings import CHOICES, Settings

    for name, field in Settings.model_fields.items():
        if name in ("token", "token_file", "history_enabled", "history_recover"):
            continue
        flag, env = "--" + name.replace("_", "-"), f"TREEPACK_{name.upper()}"
        default = "unset" if field.default is None else repr(field.default)
        if name in CHOICES:  # a word from a list: argparse names the list when another is given
            words = CHOICES[name]
            p.add_argument(flag, dest=name, choices=words, default=None, help=f"env {env}; default {default}")
            continue
        args = [a for a in typing.get_args(field.annotation) if a is not type(None)]
        base = args[0] if args else field.annotation
        optional = bool(args)
        hint = " ('none' clears it)" if optional else ""
        kind: type = int if base is int else float if base is float else str
        p.add_argument(
            flag,
            dest=name,
            type=_typed(kind) if optional else kind,
            default=None,
            help=f"env {env}; default {default}{hint}",
        )
    p.add_argument(
        "--no-history",
        dest="history_enabled",
        action="store_const",
        const=False,
        default=None,
        help="record no batch shapes",
    )
    p.add_argument(
        "--recover-history",
        dest="history_recover",
        action="store_const",
        const=True,
        default=None,
        help="move a damaged history file aside and start a fresh one (env TREEPACK_HISTORY_RECOVER)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="read the bearer token from this file, stripped (or env TREEPACK_TOKEN_FILE / TREEPACK_TOKEN)",
    )
    p.add_argument(
        "--token",
        default=None,
        help="the bearer token itself (every user of the machine can read it in the process list: "
        "prefer --token-file or TREEPACK_TOKEN)",
    )


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on an argparse sub-parser collection; returns the new parser."""
    p = subparsers.add_parser(
        "serve",
        help="run the HTTP packing sidecar (needs the 'service' extra)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    return p


def settings_from_args(args: argparse.Namespace) -> Any:
    """:class:`~.settings.Settings` from the environment, overridden by the given flags.

    Raises:
        SystemExit: (status 2) with the offending setting named, for invalid values.
    """
    from pydantic import ValidationError

    from treepack.service.settings import Settings

    given = {
        k: (None if v == _UNSET else v) for k, v in vars(args).items() if k in Settings.model_fields and v is not None
    }
    if getattr(args, "token_file", None):
        given["token_file"] = args.token_file
    try:
        return Settings(**given)
    except ValidationError as exc:
        for e in exc.errors():  # one line per bad setting, naming the flag or variable it came from
            print(f"treepack serve: {_setting_error(e, given)}", file=sys.stderr)
        raise SystemExit(2) from None


def _setting_error(error: Any, given: dict[str, Any]) -> str:
    """One pydantic error as a line: ``--max-queue -1: Input should be ...`` or ``TREEPACK_MAX_QUEUE=-1: ...``."""
    msg = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:  # a check across settings (the token): its message names what it read
        return f"invalid settings: {msg}"
    name = str(error["loc"][0])
    where = (
        f"--{name.replace('_', '-')} {given[name]}"
        if name in given
        else f"TREEPACK_{name.upper()}={os.environ.get(f'TREEPACK_{name.upper()}', '')}"
    )
    return f"invalid setting {where}: {msg}"


def startup_problem(settings: Any) -> str | None:
    """What stops the service at startup, as one line without a traceback; None when nothing does.

    Checks the files the settings name: the history file's folder (can it be created and
    written) and the cost file (readable, a cost model whose predictions stay finite over
    every request the settings admit; the message names the file and the field).
    """
    if settings.history_enabled and settings.history_path is not None:
        from treepack.proto.history_schema import history_path_problem

        problem = history_path_problem(settings.history_path)
        if problem is not None:
            return str(problem)
    if settings.cost_model_path is not None:
        from treepack.proto.errors import CostModelError
        from treepack.service.planning import load_service_cost_model

        try:  # readable, a cost model, and finite over every request the service accepts
            load_service_cost_model(settings)
        except CostModelError as e:
            return f"--cost-model-path: {e.message} (field {e.path}, rule {e.rule})"
        except OSError as e:  # a folder, no permission: not a file it can read
            return f"--cost-model-path: cannot read cost file {settings.cost_model_path!r}: {e.strerror or e}"
    return None


def warn_unknown_environment(environ: Any = None) -> list[str]:
    """Warn (stderr) about ``TREEPACK_*`` variables that are no setting (a misspelled one is
    otherwise ignored without a word); returns the warnings.

    Args:
        environ: the environment to look at (default ``os.environ``).
    """
    from treepack.service.settings import unknown_environment

    out = []
    for name, guess in unknown_environment(os.environ if environ is None else environ):
        hint = f" (did you mean {guess}?)" if guess else ""
        out.append(f"treepack serve: warning: {name} is not a treepack setting{hint}; it is ignored")
        print(out[-1], file=sys.stderr)
    return out


def _export(settings: Any) -> None:
    """Put the effective settings in the environment, where every uvicorn worker reads them."""
    for name, value in settings.model_dump().items():
        key = f"TREEPACK_{name.upper()}"
        if value is None:
            os.environ[key] = _UNSET  # read back as None (env_parse_none_str), not as the default
        elif name == "token":
            os.environ[key] = settings.token.get_secret_value()
        elif name == "token_file":
            os.environ.pop(key, None)  # the token itself is exported, already read and stripped
        else:
            os.environ[key] = str(value).lower() if isinstance(value, bool) else str(value)


def run_serve(args: argparse.Namespace) -> int:
    """Run uvicorn until interrupted; returns the exit status (2 for bad settings or files, one line each)."""
    warn_unknown_environment()
    settings = settings_from_args(args)
    try:
        import uvicorn

        import treepack.service.app  # noqa: F401  (fail here, clearly, without FastAPI)
        from treepack.service.protocol import guarded_protocol
    except ImportError as exc:
        print(f"treepack serve needs the service extra: pip install 'treepack[service]' ({exc})", file=sys.stderr)
        return 2
    problem = startup_problem(settings)
    if problem is not None:  # one line that says what to do, not a worker's traceback
        print(f"treepack serve: {problem}", file=sys.stderr)
        return 2
    if settings.host not in _LOOPBACK and settings.token is None:
        print(
            f"treepack serve: warning: binding {settings.host} without a bearer token (set TREEPACK_TOKEN)",
            file=sys.stderr,
        )
    _export(settings)
    uvicorn.run(
        "treepack.service.app:create_app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        log_level=settings.log_level,
        http=guarded_protocol(),
        timeout_keep_alive=settings.keep_alive_s,
        limit_concurrency=settings.max_connections,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m treepack.service [flags]``."""
    p = argparse.ArgumentParser(prog="python -m treepack.service", description="treepack packing sidecar")
    add_serve_arguments(p)
    return run_serve(p.parse_args(argv))
