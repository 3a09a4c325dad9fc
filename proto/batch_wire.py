"""Batches on the wire: ``PackRequest`` <-> :class:`~treepack.proto.batch.PackInput`.

Request side of :mod:`treepack.proto.pack_messages`, shared by the service (decode) and the
HTTP client (encode). No FastAPI here: the client imports it.

Encoding builds the columns with :mod:`~.batch_columns` (which writes the msgpack body
straight from the caller's arrays). Decoding slices the columnar token buffer into
per-sequence views and hands them to :func:`~treepack.proto.batch.normalize_batch`, which validates
them without copying (uint32 input), so a msgpack request's tokens are copied once, out
of the body; only a sequence sent with a prefix reference is copied again, rebuilt into
an array of its own.
Errors about one sequence carry the planner's paths (``$.sequences[i]`` is
``tokens[offsets[i]:offsets[i+1]]``); errors about the columns name the column
(``$.offsets[7]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from treepack.proto.batch import PackInput
from treepack.proto.batch_columns import BodyChunks, Column, batch_columns, msgpack_body, msgpack_parts
from treepack.proto.buffers import Format, decode_buffer, encode_request_buffer
from treepack.proto.codec import encode_body
from treepack.proto.errors import PayloadTooLargeError, RequestError
from treepack.proto.options import OPTION_NAMES, PlanOptions
from treepack.proto.pack_messages import PackRequest

__all__ = ["Limits", "decode_pack_request", "encode_pack_request", "encode_pack_body", "encode_pack_chunks"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Per-request size limits (the service's settings); None = unlimited."""

    max_sequences: int | None = None
    max_tokens: int | None = None


def _offsets(msg: PackRequest, num_tokens: int) -> np.ndarray:
    off = decode_buffer(msg.offsets, "<i8", "$.offsets")
    if off.shape[0] == 0:
        raise RequestError("offsets must hold S+1 entries, the first 0; got none", path="$.offsets", rule="non_empty")
    s = off.shape[0] - 1
    if off[0] != 0:
        raise RequestError(f"offsets must start at 0, got {int(off[0])}", path="$.offsets[0]", rule="start")
    step = np.diff(off)
    if step.size and step.min() < 0:
        i = int(np.argmax(step < 0)) + 1
        raise RequestError(
            f"offsets must not decrease: {int(off[i])} after {int(off[i - 1])}", path=f"$.offsets[{i}]", rule="monotone"
        )
    if off[-1] != num_tokens:
        what = "points past the end of" if off[-1] > num_tokens else "leaves tokens unused at the end of"
        raise RequestError(
            f"the last offset {int(off[-1])} {what} the {num_tokens}-token buffer (it must equal the token count)",
            path=f"$.offsets[{s}]",
            rule="buffer_end",
        )
    return off


def _trainable_columns(msg: PackRequest, off: np.ndarray, num_tokens: int) -> np.ndarray | None:
    """[T] bool flags, or [S] int64 prompt lengths, or None (nothing trainable)."""
    s = off.shape[0] - 1
    if msg.trainable is not None and msg.prompt_lens is not None:
        raise RequestError("give trainable or prompt_lens, not both", path="$.prompt_lens", rule="exclusive")
    if msg.trainable is not None:
        flags = decode_buffer(msg.trainable, "|u1", "$.trainable")
        if flags.shape[0] != num_tokens:
            raise RequestError(
                f"trainable has {flags.shape[0]} flags for {num_tokens} tokens",
                path="$.trainable",
                rule="length_mismatch",
            )
        if flags.size and flags.max() > 1:
            i = int(np.argmax(flags > 1))
            raise RequestError(
                f"trainable flags must be 0 or 1, got {int(flags[i])}", path=f"$.trainable[{i}]", rule="flag"
            )
        return flags.view(np.bool_)  # 0/1 bytes are valid bools: no copy
    if msg.prompt_lens is not None:
        plen = decode_buffer(msg.prompt_lens, "<i8", "$.prompt_lens")
        if plen.shape[0] != s:
            raise RequestError(
                f"prompt_lens has {plen.shape[0]} entries for {s} sequences",
                path="$.prompt_lens",
                rule="length_mismatch",
            )
        lens = np.diff(off)
        bad = (plen < 0) | (plen > lens)
        if bad.any():
            i = int(np.argmax(bad))
            raise RequestError(
                f"prompt length must be in [0, {int(lens[i])}], got {int(plen[i])}",
                path=f"$.prompt_lens[{i}]",
                rule="range",
            )
        return plen
    return None


def _prefixes(msg: PackRequest, own: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(prefix_src, prefix_len) checked against the own lengths, or None when absent."""
    if (msg.prefix_src is None) != (msg.prefix_len is None):
        raise RequestError(
            "prefix_src and prefix_len go together",
            path="$.prefix_len" if msg.prefix_len is None else "$.prefix_src",
            rule="together",
        )
    if msg.prefix_src is None:
        return None
    s = own.shape[0]
    src = decode_buffer(msg.prefix_src, "<i8", "$.prefix_src")
    plen = decode_buffer(msg.prefix_len, "<i8", "$.prefix_len")
    for name, col in (("prefix_src", src), ("prefix_len", plen)):
        if col.shape[0] != s:
            raise RequestError(
                f"{name} has {col.shape[0]} entries for {s} sequences", path=f"$.{name}", rule="length_mismatch"
            )
    idx = np.arange(s)
    bad = (src < -1) | (src >= idx)
    if bad.any():
        i = int(np.argmax(bad))
        raise RequestError(
            f"prefix_src[{i}] must be -1 or an earlier sequence, got {int(src[i])}",
            path=f"$.prefix_src[{i}]",
            rule="earlier",
        )
    full = plen + own
    limit = np.where(src >= 0, full[np.maximum(src, 0)], 0)
    bad = (plen < 0) | (plen > limit)
    if bad.any():
        i = int(np.argmax(bad))
        raise RequestError(
            f"prefix length must be in [0, {int(limit[i])}] (the length of sequence {int(src[i])}), got {int(plen[i])}"
            if src[i] >= 0
            else f"prefix length must be 0 without a prefix_src, got {int(plen[i])}",
            path=f"$.prefix_len[{i}]",
            rule="range",
        )
    return src, plen


def _rebuild(tokens: np.ndarray, own_off: np.ndarray, src: np.ndarray, plen: np.ndarray) -> list[np.ndarray]:
    """Per sequence its uint32 tokens in full: a view of the sent buffer when it has no
    prefix reference, else its source's prefix and its own tokens in one new array.

    Only referencing sequences are copied (not every sequence into one new buffer).
    """
    a_own, b_own = own_off[:-1].tolist(), own_off[1:].tolist()
    out: list[np.ndarray] = []
    for i, (j, n) in enumerate(zip(src.tolist(), plen.tolist())):
        own = tokens[a_own[i] : b_own[i]]
        out.append(np.concatenate((out[j][:n], own)) if n else own)
    return out


def decode_pack_request(msg: PackRequest, limits: Limits = Limits()) -> PackInput:
    """Check a pack request's columns and slice them into per-sequence inputs.

    Args:
        msg: the parsed message.
        limits: size limits (413 beyond them; ``max_tokens`` counts every sequence in full).

    Returns:
        The :class:`PackInput`; the planner checks its options and normalizes it
        (``treepack.service.planner.api.plan_request``), so the per-sequence rules and
        the options get the embedded planner's errors.

    Raises:
        RequestError: (or a subclass) naming the column and the rule.
    """
    # Columns first (422), then size limits (413), then the per-sequence rules.
    tokens = decode_buffer(msg.tokens, "<u4", "$.tokens")
    own_off = _offsets(msg, tokens.shape[0])
    s = own_off.shape[0] - 1
    own = np.diff(own_off)
    pref = _prefixes(msg, own)
    full_off = own_off if pref is None else np.concatenate([[0], np.cumsum(pref[1] + own)]).astype(np.int64)
    t = int(full_off[-1])
    trainable_col = _trainable_columns(msg, full_off, t)
    key_col = None
    if msg.keys is not None:
        key_col = decode_buffer(msg.keys, "<u8", "$.keys")
        if key_col.shape[0] != t:
            raise RequestError(
                f"keys has {key_col.shape[0]} entries for {t} tokens", path="$.keys", rule="length_mismatch"
            )
    if msg.tags is not None and len(msg.tags) != s:
        raise RequestError(f"tags has {len(msg.tags)} entries for {s} sequences", path="$.tags", rule="length_mismatch")
    if limits.max_tokens is not None and t > limits.max_tokens:
        raise PayloadTooLargeError(
            f"{t} tokens, over the limit of {limits.max_tokens}", path="$.tokens", rule="max_tokens"
        )
    if limits.max_sequences is not None and s > limits.max_sequences:
        raise PayloadTooLargeError(
            f"{s} sequences, over the limit of {limits.max_sequences}", path="$.offsets", rule="max_sequences"
        )
    bounds = list(zip(full_off[:-1].tolist(), full_off[1:].tolist()))
    sequences = [tokens[a:b] for a, b in bounds] if pref is None else _rebuild(tokens, own_off, pref[0], pref[1])
    trainable = None
    if isinstance(trainable_col, np.ndarray) and trainable_col.dtype == np.bool_:
        trainable = [trainable_col[a:b] for a, b in bounds]
    elif trainable_col is not None:
        trainable = trainable_col.tolist()
    keys = None if key_col is None else [key_col[a:b] for a, b in bounds]
    options = PlanOptions(**{f: getattr(msg, f) for f in OPTION_NAMES})
    tags = None if msg.tags is None else tuple(msg.tags)
    return PackInput(
        sequences=sequences,
        trainable=trainable,
        groups=msg.groups,
        keys=keys,
        options=options,
        record=msg.record,
        tags=tags,
    )


def _request_fields(request: PackInput, *, dedup: bool = True, min_prefix: int = 64) -> dict[str, Any]:
    """The ``PackRequest`` fields in order, buffers as :class:`Column` s or little-endian arrays."""
    opts = request.options.to_wire()
    cols = batch_columns(
        request.sequences,
        trainable=request.trainable,
        groups=request.groups,
        keys=request.keys,
        dedup=dedup,
        min_prefix=min_prefix,
    )
    record = request.record
    fields: dict[str, Any] = {
        "version": 1,
        "seq_len": opts["seq_len"],
        "tokens": cols.tokens,
        "offsets": _le(cols.offsets),
        **{
            k: opts[k]
            for k in (
                "min_shared_len",
                "placement",
                "num_ranks",
                "on_overflow",
                "conv_width",
                "share_trainable",
                "min_shared_saving",
                "repair_ms",
                "cp_size",
                "cp_attention",
            )
        },
        "record": bool(record) if isinstance(record, np.bool_) else record,
    }
    if cols.trainable is not None:
        fields["trainable"] = cols.trainable
    elif cols.prompt_lens is not None:
        fields["prompt_lens"] = _le(cols.prompt_lens)
    if cols.prefix_src is not None and cols.prefix_len is not None:
        fields["prefix_src"] = _le(cols.prefix_src)
        fields["prefix_len"] = _le(cols.prefix_len)
    if cols.keys is not None:
        fields["keys"] = cols.keys
    if cols.groups is not None:
        fields["groups"] = cols.groups
    if request.tags is not None:
        fields["tags"] = list(request.tags)
    return fields


def _le(arr: np.ndarray) -> np.ndarray:
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False)


def encode_pack_request(
    request: PackInput, *, fmt: Format = "msgpack", dedup: bool = True, min_prefix: int = 64
) -> dict[str, Any]:
    """Build a ``PackRequest`` message from a :class:`~treepack.proto.batch.PackInput` (client side).

    Only what cannot be written as its column is checked here (with the embedded
    planner's errors, :mod:`~.batch_columns`); the server validates the rest, the options
    and capacity included (it applies ``seq_len`` and ``on_overflow``, so overflow events
    come back in the plan).

    Args:
        request: the batch, its options (as given), tags and ``record``.
        fmt: ``msgpack`` (buffers as bytes) or ``json`` (buffers as base64 text).
        dedup: send a sequence's common prefix with its group's first sequence (the
            previous sequence without groups) as a reference (``prefix_src``/``prefix_len``)
            when it is at least ``min_prefix`` tokens: a GRPO group's prompt travels once.
            The server rebuilds the same sequences; the plan does not change.

    Returns:
        The message as a dict of buffers (byte views for msgpack, base64 strings for JSON).
        :func:`encode_pack_body` writes the msgpack body without building it.
    """
    fields = _request_fields(request, dedup=dedup, min_prefix=min_prefix)
    for k, v in fields.items():
        if isinstance(v, Column):
            fields[k] = encode_request_buffer(v.concat(), v.dtype, fmt)
        elif isinstance(v, np.ndarray):
            fields[k] = encode_request_buffer(v, v.dtype.str, fmt)
    return fields


def encode_pack_body(request: PackInput, *, fmt: Format = "msgpack", dedup: bool = True, min_prefix: int = 64) -> bytes:
    """The body of ``POST /v1/pack`` (arguments as for :func:`encode_pack_request`).

    msgpack bodies are written straight from the token arrays (:func:`~treepack.proto.batch_columns.msgpack_body`),
    bytes-for-bytes equal to ``encode_body(encode_pack_request(...), "msgpack")``.
    """
    if fmt != "msgpack":
        return encode_body(encode_pack_request(request, fmt=fmt, dedup=dedup, min_prefix=min_prefix), fmt)
    return msgpack_body(_request_fields(request, dedup=dedup, min_prefix=min_prefix))


def encode_pack_chunks(request: PackInput, *, dedup: bool = True, min_prefix: int = 64) -> BodyChunks:
    """The msgpack body of :func:`encode_pack_body` as :class:`~treepack.proto.batch_columns.BodyChunks`:
    written chunk by chunk while it is sent, never whole."""
    return BodyChunks(msgpack_parts(_request_fields(request, dedup=dedup, min_prefix=min_prefix)))
