"""Every bad value of every plan option: one error, whichever way the batch travels.

The embedded planner, the app in-process (``httpx.ASGITransport``) and a real
``python -m treepack.service`` process must raise the same exception type with the same
rule, path and message: the options are checked once, by the planner's
``check_options``, never restated by the wire models.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from treepack.client import AsyncPacker, Packer
from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.options import OPTION_NAMES
from treepack.service import Settings, create_app

from helpers.service import running_server

SEQS = [np.arange(40, dtype=np.uint32), np.arange(30, dtype=np.uint32)]
MAX_SEQ_LEN = 2**31 - 1

# (option, bad value, exception, rule, message): the embedded planner's answer.
BAD = [
    ("seq_len", 0, RequestError, "positive", "seq_len must be > 0, got 0"),
    ("seq_len", -3, RequestError, "positive", "seq_len must be > 0, got -3"),
    ("seq_len", MAX_SEQ_LEN + 1, RequestError, "maximum", f"seq_len must be <= {MAX_SEQ_LEN}, got {MAX_SEQ_LEN + 1}"),
    ("seq_len", "512", InputTypeError, "type", "seq_len must be an int, got str"),
    ("seq_len", 64.0, InputTypeError, "type", "seq_len must be an int, got float"),
    ("seq_len", True, InputTypeError, "type", "seq_len must be an int, got bool"),
    ("seq_len", None, InputTypeError, "type", "seq_len must be an int, got NoneType"),
    ("min_shared_len", 0, RequestError, "minimum", "min_shared_len must be >= 1, got 0"),
    (
        "min_shared_len",
        MAX_SEQ_LEN + 1,
        RequestError,
        "maximum",
        f"min_shared_len must be <= {MAX_SEQ_LEN}, got {MAX_SEQ_LEN + 1}",
    ),
    ("min_shared_len", 2.5, InputTypeError, "type", "min_shared_len must be an int, got float"),
    ("min_shared_len", "64", InputTypeError, "type", "min_shared_len must be an int, got str"),
    ("min_shared_len", False, InputTypeError, "type", "min_shared_len must be an int, got bool"),
    (
        "placement",
        "best",
        RequestError,
        "enum",
        "unknown placement 'best'; expected one of ('auto', 'bfd', 'in_order', 'no_share')",
    ),
    (
        "placement",
        "",
        RequestError,
        "enum",
        "unknown placement ''; expected one of ('auto', 'bfd', 'in_order', 'no_share')",
    ),
    (
        "placement",
        3,
        RequestError,
        "enum",
        "unknown placement 3; expected one of ('auto', 'bfd', 'in_order', 'no_share')",
    ),
    (
        "placement",
        None,
        RequestError,
        "enum",
        "unknown placement None; expected one of ('auto', 'bfd', 'in_order', 'no_share')",
    ),
    ("num_ranks", 0, RequestError, "minimum", "num_ranks must be >= 1, got 0"),
    ("num_ranks", 65537, RequestError, "maximum", "num_ranks must be <= 65536, got 65537"),
    ("num_ranks", "2", InputTypeError, "type", "num_ranks must be an int, got str"),
    ("num_ranks", 1.0, InputTypeError, "type", "num_ranks must be an int, got float"),
    ("conv_width", 0, RequestError, "range", "conv_width must be in [1, 64], got 0"),
    ("conv_width", 65, RequestError, "range", "conv_width must be in [1, 64], got 65"),
    ("conv_width", "4", InputTypeError, "type", "conv_width must be an int, got str"),
    ("conv_width", None, InputTypeError, "type", "conv_width must be an int, got NoneType"),
    ("share_trainable", "yes", InputTypeError, "type", "share_trainable must be a bool, got str"),
    ("share_trainable", 1, InputTypeError, "type", "share_trainable must be a bool, got int"),
    ("share_trainable", None, InputTypeError, "type", "share_trainable must be a bool, got NoneType"),
    (
        "on_overflow",
        "clip",
        RequestError,
        "enum",
        "on_overflow must be one of ('error', 'truncate', 'drop'), got 'clip'",
    ),
    ("on_overflow", 0, RequestError, "enum", "on_overflow must be one of ('error', 'truncate', 'drop'), got 0"),
    ("on_overflow", None, RequestError, "enum", "on_overflow must be one of ('error', 'truncate', 'drop'), got None"),
    ("min_shared_saving", -1, RequestError, "minimum", "min_shared_saving must be >= 0, got -1"),
    ("min_shared_saving", 1.5, InputTypeError, "type", "min_shared_saving must be an int, got float"),
    ("min_shared_saving", None, InputTypeError, "type", "min_shared_saving must be an int, got NoneType"),
    ("repair_ms", -1, RequestError, "range", "repair_ms must be in [0, 60000], got -1"),
    ("repair_ms", 1e9, RequestError, "range", "repair_ms must be in [0, 60000], got 1000000000.0"),
    ("repair_ms", "5", InputTypeError, "type", "repair_ms must be a number, got str"),
    ("repair_ms", True, InputTypeError, "type", "repair_ms must be a number, got bool"),
    ("cp_size", 0, RequestError, "range", "cp_size must be in [1, 1024], got 0"),
    ("cp_size", 1025, RequestError, "range", "cp_size must be in [1, 1024], got 1025"),
    ("cp_size", "2", InputTypeError, "type", "cp_size must be an int, got str"),
    ("cp_size", None, InputTypeError, "type", "cp_size must be an int, got NoneType"),
    (
        "cp_attention",
        "ring",
        RequestError,
        "enum",
        "cp_attention must be one of ('auto', 'ulysses', 'allgather'), got 'ring'",
    ),
    (
        "cp_attention",
        None,
        RequestError,
        "enum",
        "cp_attention must be one of ('auto', 'ulysses', 'allgather'), got None",
    ),
]
IDS = [f"{name}={value!r}" for name, value, *_ in BAD]


def _kwargs(name, value):
    return {"seq_len": 64, name: value}


def _seen(exc):
    return type(exc), exc.rule, exc.path, exc.message


@pytest.fixture(scope="module")
def server():
    with running_server() as (url, _):
        yield url


@pytest.fixture(scope="module")
def app():
    app = create_app(Settings(history_enabled=False))
    yield app
    app.state.service.close()


def test_every_option_has_bad_values():
    assert {name for name, *_ in BAD} == set(OPTION_NAMES)


@pytest.mark.parametrize("name,value,exc,rule,message", BAD, ids=IDS)
async def test_one_error_for_a_bad_option(server, app, name, value, exc, rule, message):
    with pytest.raises(exc) as embedded:
        Packer().pack(SEQS, **_kwargs(name, value))
    assert _seen(embedded.value) == (exc, rule, f"$.{name}", message)
    async with AsyncPacker("http://asgi", transport=httpx.ASGITransport(app), retries=0) as asgi:
        with pytest.raises(exc) as in_process:
            await asgi.pack(SEQS, **_kwargs(name, value))
    with Packer(server, retries=0) as remote:
        with pytest.raises(exc) as over_http:
            remote.pack(SEQS, **_kwargs(name, value))
    assert _seen(in_process.value) == _seen(embedded.value)
    assert _seen(over_http.value) == _seen(embedded.value)


@pytest.mark.parametrize("name,value,exc,rule,message", BAD, ids=IDS)
def test_one_error_for_a_bad_whatif_option(server, name, value, exc, rule, message):
    with Packer(server, retries=0) as remote:
        remote.pack(SEQS, seq_len=64)  # something recorded to sample from
        with pytest.raises(exc) as over_http:
            remote.whatif([1], trials=2, **_kwargs(name, value))
    with pytest.raises(exc) as embedded:
        Packer().whatif([1], trials=2, shapes=None, **_kwargs(name, value))
    assert _seen(over_http.value) == _seen(embedded.value) == (exc, rule, f"$.{name}", message)
