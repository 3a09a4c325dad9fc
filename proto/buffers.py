"""How arrays travel on the wire: typed little-endian buffers.

A **buffer field** (``tokens``, ``offsets``, ``trainable``, ...) has one dtype fixed by the
schema and is sent as

- msgpack: a ``bin`` holding the items little-endian, back to back (the fast path: the
  receiver views it with ``np.frombuffer``, no per-item work);
- JSON: a base64 string of those same bytes, or a plain list of numbers (for debugging
  with curl). msgpack may carry a list of numbers too.

An **array object** (every plan array) is ``{"dtype": "<i8", "shape": [n, ...], "data": d}``
with ``d`` a buffer as above (C order). The receiver checks dtype and number of dimensions
against what the field must hold.

Dtype strings are numpy's with explicit byte order: ``<u4`` (token ids), ``<i8`` (offsets,
indices), ``<u8`` (keys, hashes), ``<i4`` (``cu_seqlens``), ``<f8`` (costs), ``|u1`` (flags).
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Literal

import numpy as np

from treepack.proto.errors import InputTypeError, RequestError

__all__ = [
    "DTYPES",
    "exact_sum",
    "decode_buffer",
    "encode_buffer",
    "encode_request_buffer",
    "array_to_wire",
    "array_from_wire",
    "Format",
]

Format = Literal["msgpack", "json"]

DTYPES = ("<u4", "<i8", "<u8", "<i4", "<f8", "|u1")

_INT_RANGE = {
    "<u4": (0, 2**32 - 1),
    "<i8": (-(2**63), 2**63 - 1),
    "<u8": (0, 2**64 - 1),
    "<i4": (-(2**31), 2**31 - 1),
    "|u1": (0, 255),
}


_ITEMSIZE = {d: np.dtype(d).itemsize for d in DTYPES}


def exact_sum(arr: np.ndarray) -> int:
    """The exact sum of an integer array, as a Python int (numpy's int64 sum wraps).

    Args:
        arr: [n] integer array.

    Returns:
        The sum; computed in int64 when ``n * max|x|`` cannot wrap, else item by item.
    """
    if arr.size == 0:
        return 0
    big = max(abs(int(arr.max())), abs(int(arr.min())))
    if big * arr.size < 2**63:
        return int(arr.sum(dtype=np.int64)) if arr.dtype != np.uint64 else int(arr.sum(dtype=np.uint64))
    return sum(arr.tolist())


def _native(arr: np.ndarray) -> np.ndarray:
    """The array in native byte order (a no-op view on little-endian hosts)."""
    if arr.dtype.byteorder in ("=", "|") or arr.dtype.isnative:
        return arr
    return arr.astype(arr.dtype.newbyteorder("="))


def _first(value: list, pred: Any) -> int:
    return next(i for i, v in enumerate(value) if pred(v))


def _from_list(value: list, dtype: str, path: str) -> np.ndarray:
    """Decode a list of numbers, naming the first item that breaks the rule.

    Types are checked first (one C-speed pass over the item types): numpy would otherwise
    turn ``true`` into 1 and ``2.5`` into 2 without a word.
    """
    allowed = {"<f8": (int, float), "|u1": (int, bool)}.get(dtype, (int,))
    bad = set(map(type, value)) - set(allowed)
    if bad:
        i = _first(value, lambda v: type(v) not in allowed)
        want = "a number" if dtype == "<f8" else "an integer"
        raise InputTypeError(f"expected {want}, got {type(value[i]).__name__}", path=f"{path}[{i}]", rule="type")
    if dtype == "<f8":
        return np.asarray(value, dtype=np.float64)
    lo, hi = _INT_RANGE[dtype]
    arr = None
    for wide in (np.int64, np.uint64):
        try:
            arr = np.asarray(value, dtype=wide)
            break
        except OverflowError:
            continue
    if arr is None:
        i = _first(value, lambda v: not lo <= v <= hi)
        raise RequestError(f"value {value[i]} is outside [{lo}, {hi}] ({dtype})", path=f"{path}[{i}]", rule="range")
    out = (arr < lo) | (arr > hi)
    if out.any():
        i = int(np.argmax(out))
        raise RequestError(f"value {value[i]} is outside [{lo}, {hi}] ({dtype})", path=f"{path}[{i}]", rule="range")
    return arr.astype(np.dtype(dtype).newbyteorder("="))


def decode_buffer(value: Any, dtype: str, path: str) -> np.ndarray:
    """Decode a buffer field into a 1-D native-order array.

    Args:
        value: bytes (msgpack bin), a base64 string (JSON) or a list of numbers.
        dtype: the field's dtype, one of :data:`DTYPES`.
        path: where the field sits in the request, for error messages.

    Returns:
        [n] array of ``dtype`` (a zero-copy view of ``value`` when it is bytes; read-only).

    Raises:
        RequestError: base64 that does not decode, a byte length that is not a multiple of
            the item size, a number out of the dtype's range.
        InputTypeError: a value of another type.
    """
    dt = np.dtype(dtype)
    if isinstance(value, str):
        try:
            value = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("expected base64 (RFC 4648, with padding)", path=path, rule="base64") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        n = len(value) if not isinstance(value, memoryview) else value.nbytes
        if n % dt.itemsize:
            raise RequestError(
                f"buffer of {n} bytes is not a whole number of {dtype} items ({dt.itemsize} bytes each)",
                path=path,
                rule="buffer_size",
            )
        return _native(np.frombuffer(value, dtype=dt))
    if isinstance(value, list):
        return _from_list(value, dtype, path)
    raise InputTypeError(
        f"expected a buffer (msgpack bin, base64 string or list of numbers), got {type(value).__name__}",
        path=path,
        rule="type",
    )


def encode_buffer(arr: np.ndarray, dtype: str, fmt: Format) -> Any:
    """Encode a 1-D (or any C-order) array as a buffer field.

    Args:
        arr: the values; converted to ``dtype`` (a copy only when the dtype differs).
        dtype: the field's dtype.
        fmt: ``msgpack`` gives a byte view (packed as ``bin`` without another copy),
            ``json`` a list of numbers.
    """
    a = np.ascontiguousarray(arr, dtype=np.dtype(dtype))
    if fmt == "json":
        return a.reshape(-1).tolist()
    return a.reshape(-1).data.cast("B") if a.size else b""


def encode_request_buffer(arr: np.ndarray, dtype: str, fmt: Format) -> Any:
    """A buffer field of a request: as :func:`encode_buffer`, but base64 in JSON.

    One string per buffer: a server decodes it within a small multiple of the body's
    size, where a list costs an object per number (see :mod:`treepack.proto.bounded`).
    """
    if fmt != "json":
        return encode_buffer(arr, dtype, fmt)
    return base64.b64encode(np.ascontiguousarray(arr, dtype=np.dtype(dtype)).tobytes()).decode("ascii")


def array_to_wire(arr: np.ndarray, dtype: str, fmt: Format) -> dict[str, Any]:
    """An array object ``{"dtype", "shape", "data"}`` (module docstring)."""
    return {"dtype": dtype, "shape": [int(d) for d in arr.shape], "data": encode_buffer(arr, dtype, fmt)}


def array_from_wire(obj: Any, *, dtype: str, ndim: int, path: str) -> np.ndarray:
    """Decode an array object, checking its dtype and number of dimensions.

    Args:
        obj: the array object as a dict, or any object with ``dtype``, ``shape`` and
            ``data`` attributes (a validated ``ArrayMessage``: read as it is, not dumped).
        dtype: the dtype the field must hold.
        ndim: the number of dimensions it must have.
        path: where it sits in the message, for error messages.

    Returns:
        A writable native-order array of ``dtype`` and the sent shape (a private copy, so
        the plan owns its arrays whatever buffer they came in).

    Raises:
        RequestError: a dtype, rank or size that does not match.
    """
    if isinstance(obj, dict):
        got, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    else:
        try:
            got, shape, data = obj.dtype, obj.shape, obj.data
        except AttributeError:
            raise InputTypeError(
                f"expected an array object, got {type(obj).__name__}", path=path, rule="type"
            ) from None
    if got != dtype:
        raise RequestError(f"expected dtype {dtype}, got {got!r}", path=f"{path}.dtype", rule="dtype")
    if type(shape) is not list or len(shape) != ndim or any(type(d) is not int or d < 0 for d in shape):
        raise RequestError(
            f"expected a shape of {ndim} non-negative ints, got {shape!r}", path=f"{path}.shape", rule="shape"
        )
    if type(data) is bytes and len(data) % _ITEMSIZE[dtype] == 0:
        flat = np.frombuffer(data, dtype=dtype)  # the common case, msgpack; decode_buffer names any fault
    else:
        flat = decode_buffer(data, dtype, f"{path}.data")
    size = math.prod(shape)
    if flat.shape[0] != size:
        raise RequestError(
            f"shape {shape} needs {size} items, data holds {flat.shape[0]}", path=f"{path}.data", rule="shape"
        )
    out = np.empty(shape, dtype=flat.dtype.newbyteorder("="))
    out.reshape(-1)[:] = flat
    return out
