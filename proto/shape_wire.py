"""Batch shapes on the wire: :class:`~treepack.proto.shape.BatchShape` <-> ``BatchShapeMessage``.

Used by the history store (rows are shape messages) and by what-if requests that send
shapes inline.
"""

from __future__ import annotations

from typing import Any

from treepack.proto.buffers import Format, decode_buffer, encode_buffer
from treepack.proto.messages import BatchShapeMessage
from treepack.proto.shape import BatchShape

__all__ = ["shape_to_wire", "shape_from_wire"]


def shape_to_wire(shape: BatchShape, fmt: Format) -> dict[str, Any]:
    """A :class:`BatchShape` as a ``BatchShapeMessage`` dict."""
    return {
        "seq_len": shape.seq_len,
        "min_shared_len": shape.min_shared_len,
        "seq_ptr": encode_buffer(shape.seq_ptr, "<i8", fmt),
        "run_hash": encode_buffer(shape.run_hash, "<u8", fmt),
        "run_len": encode_buffer(shape.run_len, "<i8", fmt),
        "first_trainable": encode_buffer(shape.first_trainable, "<i8", fmt),
        "groups": list(shape.groups),
        "tags": None if shape.tags is None else list(shape.tags),
    }


def shape_from_wire(msg: BatchShapeMessage, path: str = "$") -> BatchShape:
    """Decode and check a shape (``path`` locates it in the request, for errors)."""
    shape = BatchShape(
        seq_len=msg.seq_len,
        min_shared_len=msg.min_shared_len,
        seq_ptr=decode_buffer(msg.seq_ptr, "<i8", f"{path}.seq_ptr"),
        run_hash=decode_buffer(msg.run_hash, "<u8", f"{path}.run_hash"),
        run_len=decode_buffer(msg.run_len, "<i8", f"{path}.run_len"),
        first_trainable=decode_buffer(msg.first_trainable, "<i8", f"{path}.first_trainable"),
        groups=tuple(msg.groups),
        tags=None if msg.tags is None else tuple(msg.tags),
    )
    shape.check(path)
    return shape
