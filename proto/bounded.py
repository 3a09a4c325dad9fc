"""Request bodies decoded within a memory bound: at most about 4x the body, whatever its shape.

A generic decoder turns every byte of a body into Python objects before any rule is
checked: a msgpack body of empty maps (one byte each) grows ~80x, a JSON one ~23x. Here
decoding is driven by the message's shape and charged as it goes:

- **msgpack**: a walk over the body with ``msgpack.Unpacker`` (headers, scalars, and the
  C ``skip`` of anything it need not build). Only what the message can hold is built:
  a ``bin`` buffer is one bytes object; a container where the message has a
  scalar, and the value of a field the message does not have, are skipped without being
  built (the validator then names them: "unknown field", "expected ..., got map").
  Every object built is charged its size; past the budget the body is refused (413
  ``decode_budget``). The walk calls ``check`` every few thousand items, so decoding
  counts against the request's deadline. (msgpack tells an int from a float: a float
  where an integer belongs is refused, as the embedded planner refuses it.)
- **JSON**: the standard decoder, after a count of the bytes that open containers and
  separate items (``{ [ , :``, C-speed, nothing built) prices what it would build; a body
  priced over the budget is refused before decoding. Buffers travel as base64 (one
  string each); a list of numbers (for debugging) costs ~64 bytes per item, so lists of
  more than a few thousand items beyond what the body's size pays for are refused.
  JSON has one number type: a whole number written ``2.0`` or ``2e0`` is the integer 2.

The budget: ``BUDGET_FACTOR x body`` bytes of objects (the unpacker's copy of the body
or JSON's text counted in) plus ``ALLOWANCE``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, Union

import msgpack

from treepack.proto.codec import Format, decode_body
from treepack.proto.errors import DecodeError, PayloadTooLargeError
from treepack.proto.pack_messages import PackRequest
from treepack.proto.whatif_messages import BatchShapeMessage, Composition, WhatIfRequest

__all__ = ["decode_request", "PACK_SPEC", "WHATIF_SPEC", "BUDGET_FACTOR", "ALLOWANCE", "decode_budget"]

BUDGET_FACTOR = 4
ALLOWANCE = 1 << 20
_CHECK_EVERY = 4096

# What a field holds (anything not named in a spec is a scalar).
BUFFER = "buffer"  # bin, base64 string, or a list of numbers
SCALARS = "scalars"  # a list of scalars
STRMAP = "strmap"  # a map of string -> scalar


class Spec:
    """A message map: its known field names and what each non-scalar one holds."""

    def __init__(self, fields: tuple[str, ...], kinds: Mapping[str, Any]) -> None:
        self.fields = frozenset(fields)
        self.kinds = dict(kinds)


class ListOf:
    """A list of message maps."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec


Kind = Union[str, Spec, ListOf, None]


def _spec(model: Any, kinds: Mapping[str, Any]) -> Spec:
    unknown = set(kinds) - set(model.model_fields)
    assert not unknown, unknown
    return Spec(tuple(model.model_fields), kinds)


def _specs() -> tuple[Spec, Spec]:
    buffers = ("tokens", "offsets", "trainable", "prompt_lens", "keys", "prefix_src", "prefix_len")
    pack = _spec(PackRequest, {**{b: BUFFER for b in buffers}, "groups": SCALARS, "tags": SCALARS})
    shape = _spec(
        BatchShapeMessage,
        {
            "seq_ptr": BUFFER,
            "run_hash": BUFFER,
            "run_len": BUFFER,
            "first_trainable": BUFFER,
            "groups": SCALARS,
            "tags": SCALARS,
        },
    )
    comp = _spec(Composition, {"by_tag": STRMAP})
    whatif = _spec(WhatIfRequest, {"compositions": ListOf(comp), "shapes": ListOf(shape)})
    return pack, whatif


PACK_SPEC, WHATIF_SPEC = _specs()


def decode_budget(nbytes: int) -> int:
    """Bytes of decoded objects a body of ``nbytes`` may cost."""
    return BUDGET_FACTOR * nbytes + ALLOWANCE


def _over(cost: int, nbytes: int, fmt: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"decoding this {nbytes}-byte {fmt} body would build over {cost} bytes of objects, more than "
        f"{BUDGET_FACTOR} x its size + {ALLOWANCE >> 20} MiB; "
        "send buffers as msgpack bin or base64, not lists of numbers",
        path="$",
        rule="decode_budget",
    )


# msgpack type bytes -> what they start.
_KIND: tuple[str, ...] = tuple(
    "map" if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)
    else "array" if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)
    else "str" if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB)
    else "bin" if b in (0xC4, 0xC5, 0xC6)
    else "scalar"
    for b in range(256)
)  # fmt: skip
_BIN_HEADER = {0xC4: 2, 0xC5: 3, 0xC6: 5}
_EMPTY_MAP: dict = {}  # stands in for a container the message cannot hold (shared, never changed)
_EMPTY_LIST: list = []
_SKIPPED = None  # the value of a field the message does not have (the validator names the field)


class _Walk:
    """One msgpack body walked along a :class:`Spec` (module docstring)."""

    def __init__(self, body: bytes | bytearray | memoryview, check: Callable[[], None] | None) -> None:
        self.view = memoryview(body).cast("B").toreadonly()
        self.n = self.view.nbytes
        self.u = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(self.n, 1))
        self.u.feed(self.view)
        self.cost = self.n  # the unpacker's copy of the body
        self.budget = decode_budget(self.n)
        self.check = check
        self.items = 0

    def charge(self, nbytes: int) -> None:
        self.cost += nbytes
        if self.cost > self.budget:
            raise _over(self.cost, self.n, "msgpack")

    def tick(self) -> None:
        self.items += 1
        if self.check is not None and self.items % _CHECK_EVERY == 0:
            self.check()

    def kind(self) -> str:
        pos = self.u.tell()
        if pos >= self.n:
            raise DecodeError("malformed msgpack: the body ends in the middle of an object", path="$", rule="msgpack")
        return _KIND[self.view[pos]]

    def room(self, count: int, per_item: int) -> None:
        """A container announcing ``count`` items: each takes at least ``per_item`` bytes of what is left."""
        if count * per_item > self.n - self.u.tell():
            raise DecodeError(
                f"malformed msgpack: a container of {count} items is longer than the body", path="$", rule="msgpack"
            )

    def skip(self, kind: str) -> Any:
        self.u.skip()
        return _EMPTY_MAP if kind == "map" else _EMPTY_LIST

    def bin_view(self) -> bytes:
        pos = self.u.tell()
        head = _BIN_HEADER[self.view[pos]]
        size = int.from_bytes(self.view[pos + 1 : pos + head], "big")
        start = pos + head
        if start + size > self.n:
            raise DecodeError("malformed msgpack: a bin is longer than the body", path="$", rule="msgpack")
        self.u.skip()
        self.charge(40 + size)
        # A copy: a view at the bin's offset would leave numpy arrays unaligned.
        return self.view[start : start + size].tobytes()

    def scalar(self) -> Any:
        self.tick()
        k = self.kind()
        if k in ("map", "array"):
            self.charge(8)
            return self.skip(k)
        v = self.u.unpack()
        if v is None or v is True or v is False or (type(v) is int and -5 <= v <= 256):
            self.charge(8)
        else:
            self.charge(8 + sys.getsizeof(v))
        return v

    def key(self) -> str:
        if self.kind() != "str":
            raise DecodeError("malformed msgpack: a map key is not a string", path="$", rule="msgpack")
        k = self.u.unpack()
        self.charge(8 + sys.getsizeof(k))
        return k

    def value(self, kind: Kind) -> Any:
        if kind is None or kind == STRMAP and self.kind() != "map":
            return self.scalar()
        k = self.kind()
        if kind == BUFFER:
            if k == "bin":
                return self.bin_view()
            return self.scalars() if k == "array" else self.scalar()
        if kind == SCALARS:
            return self.scalars() if k == "array" else self.scalar()
        if kind == STRMAP:
            return self.strmap()
        if isinstance(kind, ListOf):
            if k != "array":
                return self.scalar()
            count = self.u.read_array_header()
            self.room(count, 1)
            self.charge(56 + 8 * count)
            return [self.message(kind.spec) for _ in range(count)]
        assert isinstance(kind, Spec)
        return self.message(kind)

    def scalars(self) -> list[Any]:
        count = self.u.read_array_header()
        self.room(count, 1)
        self.charge(56 + 8 * count)
        return [self.scalar() for _ in range(count)]

    def strmap(self) -> dict[str, Any]:
        count = self.u.read_map_header()
        self.room(count, 2)
        self.charge(64 + 100 * count)
        out: dict[str, Any] = {}
        for _ in range(count):
            key = self.key()
            value = self.scalar()
            if key in out:
                raise _duplicate(key)
            out[key] = value
        return out

    def message(self, spec: Spec) -> Any:
        k = self.kind()
        if k != "map":
            return self.skip(k) if k == "array" else self.scalar()
        count = self.u.read_map_header()
        self.room(count, 2)
        self.charge(64 + 100 * count)
        out: dict[str, Any] = {}
        for _ in range(count):
            self.tick()
            key = self.key()
            if key in spec.fields:
                value = self.value(spec.kinds.get(key))
            else:
                self.u.skip()  # never built: the validator refuses the field by its name
                value = _SKIPPED
            if key in out:
                raise _duplicate(key)
            out[key] = value
        return out


def _duplicate(key: str) -> DecodeError:
    shown = repr(key) if len(key) <= 64 else repr(key[:64])
    return DecodeError(f"malformed msgpack: key {shown} appears twice in one map", path="$", rule="duplicate_key")


def _msgpack(body: bytes | bytearray | memoryview, spec: Spec, check: Callable[[], None] | None) -> Any:
    if not len(body):
        raise DecodeError("the body is empty", path="$", rule="empty_body")
    walk = _Walk(body, check)
    try:
        obj = walk.message(spec)
        if walk.u.tell() != walk.n:
            raise DecodeError("msgpack body has trailing bytes after the first object", path="$", rule="msgpack")
    except msgpack.OutOfData:
        raise DecodeError(
            "malformed msgpack: the body ends in the middle of an object", path="$", rule="msgpack"
        ) from None
    except (DecodeError, PayloadTooLargeError):
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise DecodeError(f"malformed msgpack: {exc}", path="$", rule="msgpack") from None
    return obj


def json_price(body: bytes | bytearray | memoryview) -> int:
    """An upper bound of what decoding a JSON body builds, from a count of its structural bytes.

    The text itself (1x), every container (~240 bytes: a small dict, or a list and its
    slot), every item or key (~64 bytes: a short string or an int and its slot). Bytes
    inside strings count too (an over-estimate); base64 holds none of them.
    """
    b = bytes(body) if isinstance(body, memoryview) else body
    containers = b.count(b"{") + b.count(b"[")
    items = b.count(b",") + b.count(b":")
    return len(b) + 240 * containers + 64 * items


def decode_request(
    body: bytes | bytearray | memoryview, fmt: Format, spec: Spec, *, check: Callable[[], None] | None = None
) -> Any:
    """Decode a request body within :func:`decode_budget` of its size (module docstring).

    Args:
        body: the bytes.
        fmt: their format.
        spec: what the message holds (:data:`PACK_SPEC`, :data:`WHATIF_SPEC`).
        check: the request's deadline check, called as the walk goes (msgpack) and
            before and after decoding (JSON).

    Returns:
        The decoded object, for :func:`~treepack.proto.codec.parse_message`.

    Raises:
        DecodeError: the bytes are not one complete msgpack object / JSON document.
        PayloadTooLargeError: decoding would build more than the budget (413 ``decode_budget``).
    """
    if fmt == "msgpack":
        obj = _msgpack(body, spec, check)
    else:
        price = json_price(body)
        if price > decode_budget(len(body)):
            raise _over(price, len(body), "JSON")
        obj = decode_body(body, "json", whole_floats=True)
    if check is not None:
        check()
    return obj
