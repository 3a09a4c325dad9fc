"""Message bodies: msgpack (default) or JSON, content negotiation, and validation errors.

Media types: ``application/msgpack`` (also ``application/x-msgpack``,
``application/vnd.msgpack``) and ``application/json``. Never pickle.

- :func:`request_format` reads ``Content-Type`` (missing: msgpack);
- :func:`response_format` reads ``Accept`` (missing or ``*/*``: the request's format);
- :func:`decode_body` / :func:`encode_body` turn bytes into Python objects and back;
- :func:`parse_message` validates an object against a message model and turns pydantic's
  errors into the project's (:class:`~treepack.proto.errors.RequestError` family) with a
  JSON path such as ``$.compositions[2].by_tag``.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from treepack.proto.errors import (
    DecodeError,
    InputTypeError,
    RequestError,
    UnsupportedMediaTypeError,
    UnsupportedVersionError,
)
from treepack.proto.version import READ_VERSIONS, WIRE_VERSION

__all__ = [
    "MSGPACK",
    "JSON",
    "Format",
    "request_format",
    "response_format",
    "decode_body",
    "encode_body",
    "parse_message",
    "check_version",
    "json_path",
    "content_type",
]

MSGPACK = "application/msgpack"
JSON = "application/json"
Format = Literal["msgpack", "json"]
_TYPES: dict[str, Format] = {
    "application/msgpack": "msgpack",
    "application/x-msgpack": "msgpack",
    "application/vnd.msgpack": "msgpack",
    "application/json": "json",
}

M = TypeVar("M", bound=BaseModel)


def content_type(fmt: Format) -> str:
    return MSGPACK if fmt == "msgpack" else JSON


def request_format(header: str | None, *, default: Format = "msgpack") -> Format:
    """The body format named by a ``Content-Type`` header.

    Raises:
        UnsupportedMediaTypeError: for any other media type.
    """
    if not header or not header.strip():
        return default
    media = header.split(";", 1)[0].strip().lower()
    fmt = _TYPES.get(media)
    if fmt is None:
        raise UnsupportedMediaTypeError(
            f"Content-Type {_clip(media)!r} is not spoken here; use {MSGPACK} or {JSON}",
            path="Content-Type",
            rule="media_type",
        )
    return fmt


def response_format(header: str | None, *, default: Format) -> Format:
    """The response format an ``Accept`` header asks for (highest q wins, ties: msgpack).

    ``*/*``, ``application/*`` or no header give ``default`` (the request's own format).

    Raises:
        UnsupportedMediaTypeError: when every listed type is unsupported (or has q=0).
    """
    if not header or not header.strip():
        return default
    best: tuple[float, int, Format] | None = None
    for i, part in enumerate(header.split(",")):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        q = 1.0
        for f in fields[1:]:
            if f.lower().startswith("q="):
                # RFC 9110 qvalue: 0, 0.x.., 1, 1.0..; anything else (nan, inf, 2, -1) is not a weight.
                q = float(f[2:]) if _QVALUE.fullmatch(f[2:]) else 0.0
        if q <= 0 or not media:
            continue
        fmt = default if media in ("*/*", "application/*") else _TYPES.get(media)
        if fmt is None:
            continue
        key = (q, -i, fmt)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        raise UnsupportedMediaTypeError(
            f"Accept {_clip(header)!r} names no format spoken here; accept {MSGPACK} or {JSON}",
            path="Accept",
            rule="media_type",
        )
    return best[2]


_QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A map from its key/value pairs, refusing a key given twice (no silent last-wins)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: Any) -> None:
        super().__init__(f"key {_short(key)} appears twice in one map")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def whole_number(text: str) -> int | float:
    """A JSON number literal with a fraction or exponent: an int when its value is whole
    (``2.0``, ``1e3``: JSON has one number type), exactly; else a float."""
    try:
        d = Decimal(text)
    except InvalidOperation:  # pragma: no cover - the scanner only passes number literals
        return float(text)
    if d.is_finite() and d == d.to_integral_value() and abs(d) < 2**64:
        return int(d)
    return float(text)


def decode_body(
    body: bytes | bytearray | memoryview, fmt: Format, *, unique_keys: bool = True, whole_floats: bool = False
) -> Any:
    """Parse a request or response body.

    Args:
        body: the bytes.
        fmt: their format.
        unique_keys: refuse a map that names a key twice (requests: no silent
            last-wins); the client reads its own server's answers with False (the check
            costs a Python call per map, and a plan has dozens).
        whole_floats: JSON number literals with a whole value (``2.0``) become ints
            (:func:`whole_number`; requests: JSON does not tell 2.0 from 2).

    Raises:
        DecodeError: the bytes are not one complete msgpack object / JSON document.
    """
    hook = _unique_map if unique_keys else None
    if not body:
        raise DecodeError("the body is empty", path="$", rule="empty_body")
    if fmt == "msgpack":
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True, object_pairs_hook=hook)
        except _DuplicateKey as exc:
            raise DecodeError(f"malformed msgpack: {exc}", path="$", rule="duplicate_key") from None
        except msgpack.ExtraData:
            raise DecodeError(
                "msgpack body has trailing bytes after the first object", path="$", rule="msgpack"
            ) from None
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
            # Truncated data, bad type bytes, non-string map keys, invalid UTF-8 strings.
            raise DecodeError(f"malformed msgpack: {exc}", path="$", rule="msgpack") from None
    try:
        return json.loads(
            body.tobytes() if isinstance(body, memoryview) else body,  # json reads no memoryview
            parse_constant=_reject_constant,
            object_pairs_hook=hook,
            parse_float=whole_number if whole_floats else None,
        )
    except _DuplicateKey as exc:
        raise DecodeError(f"malformed JSON: {exc}", path="$", rule="duplicate_key") from None
    except UnicodeDecodeError as exc:
        raise DecodeError(f"JSON body is not UTF-8: {exc.reason} at byte {exc.start}", path="$", rule="json") from None
    except json.JSONDecodeError as exc:
        raise DecodeError(
            f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", path="$", rule="json"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"malformed JSON: {exc}", path="$", rule="json") from None


def encode_body(obj: Any, fmt: Format) -> bytes:
    """Serialize a message (buffers already in the format's form, see ``buffers``)."""
    if fmt == "msgpack":
        return msgpack.packb(obj, use_bin_type=True)
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def check_version(obj: Any) -> None:
    """Reject a message of another wire version before its fields are looked at.

    Raises:
        InputTypeError: the body is not a map, or ``version`` is not an integer.
        RequestError: ``version`` is missing.
        UnsupportedVersionError: ``version`` is an integer this build does not read
            (:data:`~treepack.proto.version.READ_VERSIONS`).
    """
    if not isinstance(obj, dict):
        raise InputTypeError(f"expected a map (object) at the top level, got {_type_name(obj)}", path="$", rule="type")
    if "version" not in obj:
        raise RequestError(
            f"missing required field `version` (this build speaks {WIRE_VERSION})", path="$.version", rule="required"
        )
    v = obj["version"]
    if type(v) is not int:
        raise InputTypeError(f"version must be an integer, got {_type_name(v)}", path="$.version", rule="type")
    if v not in READ_VERSIONS:
        raise UnsupportedVersionError(
            f"wire version {v} is not supported; this build speaks {WIRE_VERSION} (and reads "
            f"{', '.join(map(str, READ_VERSIONS[:-1]))})",
            path="$.version",
            rule="version",
        )


_TAG = re.compile(
    r"^(constrained-|function-|lax-|json-or-python|tagged-union|nullable|literal\[|list\[|dict\[|(int|str|float|bool|bytes|none)$)"
)


def json_path(loc: tuple[Any, ...]) -> str:
    """``("compositions", 2, "by_tag")`` -> ``$.compositions[2].by_tag`` (union tags dropped)."""
    out = "$"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _TAG.match(part):
            continue
        elif isinstance(part, str) and part.isidentifier() and len(part) <= _ECHO:
            out += f".{part}"
        else:
            out += f"[{json.dumps(_clip(str(part)))}]"
    return out


_ECHO = 64  # characters of a request's own text echoed back in an error


def _clip(text: str) -> str:
    return text if len(text) <= _ECHO else text[: _ECHO - 3] + "..."


def _type_name(v: Any) -> str:
    return {dict: "map", list: "array", str: "string", bytes: "binary", type(None): "null"}.get(
        type(v), type(v).__name__
    )


def _short(v: Any) -> str:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return f"<{len(v)} bytes>"
    r = repr(v) if not isinstance(v, str) or len(v) <= _ECHO else repr(v[:_ECHO])
    return r if len(r) <= 60 else r[:57] + "..."


def _convert(err: ValidationError) -> RequestError:
    errors = err.errors(include_url=False)
    first = errors[0]
    path = json_path(first["loc"])
    same = [e for e in errors if json_path(e["loc"]) == path]
    # A union reports one error per member: when the value had a member's type but broke
    # its constraint (a 300-character group label), that error is the one to name, not
    # "expected int" from the member it never meant to be.
    constraint = [e for e in same if not (e["type"].endswith("_type") or e["type"] == "none_required")]
    if constraint:
        first = constraint[0]
    more = len({json_path(e["loc"]) for e in errors}) - 1
    tail = f" (and {more} more error{'s' * (more > 1)})" if more > 0 else ""
    kind = first["type"]
    got = first.get("input")
    if kind == "missing":
        return RequestError(
            f"missing required field `{_clip(str(first['loc'][-1]))}`{tail}", path=path, rule="required"
        )
    if kind == "extra_forbidden":
        return RequestError(f"unknown field `{_clip(str(first['loc'][-1]))}`{tail}", path=path, rule="unknown_field")
    if all(e["type"].endswith("_type") or e["type"] == "none_required" for e in same):
        wanted = sorted({e["type"].removesuffix("_type").replace("none_required", "null") for e in same})
        return InputTypeError(f"expected {' or '.join(wanted)}, got {_type_name(got)}{tail}", path=path, rule="type")
    if kind.endswith("_type"):
        return InputTypeError(f"{first['msg']}, got {_type_name(got)}{tail}", path=path, rule="type")
    rule = {
        "greater_than_equal": "range",
        "less_than_equal": "range",
        "greater_than": "range",
        "less_than": "range",
        "literal_error": "enum",
        "too_long": "length",
        "too_short": "length",
        "string_too_long": "length",
    }.get(kind, kind)
    return RequestError(f"{first['msg']}, got {_short(got)}{tail}", path=path, rule=rule)


def parse_message(model: type[M], obj: Any) -> M:
    """Validate ``obj`` (a decoded body) as ``model``, version first.

    Raises:
        RequestError: (or a subclass) naming the first offending field, its rule and path.
    """
    if "version" in model.model_fields:
        check_version(obj)
    elif not isinstance(obj, dict):
        raise InputTypeError(f"expected a map (object), got {_type_name(obj)}", path="$", rule="type")
    try:
        return model.model_validate(obj)
    except ValidationError as err:
        raise _convert(err) from None
