"""Batch shapes on the wire: :class:`~treepack.proto.shape.BatchShape` <-> ``BatchShapeMessage``.

Used by the history store (rows are shape messages) and by what-if requests that send
shapes inline.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treepack.proto.buffers import Format, decode_buffer, encode_request_buffer, exact_sum
from treepack.proto.errors import RequestError
from treepack.proto.shape import BatchShape
from treepack.proto.whatif_messages import BatchShapeMessage

__all__ = ["MAX_SHAPE_TOKENS", "shape_to_wire", "shape_from_wire"]

# Tokens one shape may describe: 4096 inline shapes of this many tokens still sum inside
# int64 (2**60), so every later sum over a pool is exact.
MAX_SHAPE_TOKENS = 2**48


def shape_to_wire(shape: BatchShape, fmt: Format) -> dict[str, Any]:
    """A :class:`BatchShape` as a ``BatchShapeMessage`` dict."""
    return {
        "seq_len": shape.seq_len,
        "min_shared_len": shape.min_shared_len,
        "seq_ptr": encode_request_buffer(shape.seq_ptr, "<i8", fmt),
        "run_hash": encode_request_buffer(shape.run_hash, "<u8", fmt),
        "run_len": encode_request_buffer(shape.run_len, "<i8", fmt),
        "first_trainable": encode_request_buffer(shape.first_trainable, "<i8", fmt),
        "groups": list(shape.groups),
        "tags": None if shape.tags is None else list(shape.tags),
    }


def shape_from_wire(msg: BatchShapeMessage, path: str = "$") -> BatchShape:
    """Decode and check a shape (``path`` locates it in the request, for errors).

    Run lengths are checked with exact integers before any sum over them is taken:
    lengths that wrap int64 would pass every later check on the wrapped value.

    Raises:
        RequestError: an inconsistent shape, or one of more than :data:`MAX_SHAPE_TOKENS`.
    """
    run_len = decode_buffer(msg.run_len, "<i8", f"{path}.run_len")
    if run_len.size and int(run_len.min()) < 1:
        i = int(np.argmax(run_len < 1))
        raise RequestError(f"run length must be >= 1, got {int(run_len[i])}", path=f"{path}.run_len[{i}]", rule="range")
    total = exact_sum(run_len)
    if total > MAX_SHAPE_TOKENS:
        raise RequestError(
            f"the runs sum to {total} tokens, over the limit of {MAX_SHAPE_TOKENS}",
            path=f"{path}.run_len",
            rule="max_tokens",
        )
    shape = BatchShape(
        seq_len=msg.seq_len,
        min_shared_len=msg.min_shared_len,
        seq_ptr=decode_buffer(msg.seq_ptr, "<i8", f"{path}.seq_ptr"),
        run_hash=decode_buffer(msg.run_hash, "<u8", f"{path}.run_hash"),
        run_len=run_len,
        first_trainable=decode_buffer(msg.first_trainable, "<i8", f"{path}.first_trainable"),
        groups=tuple(msg.groups),
        tags=None if msg.tags is None else tuple(msg.tags),
    )
    shape.check(path)
    return shape
