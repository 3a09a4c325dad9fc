"""Planner keys from MoE routing-replay arrays (SPEC 1 ``key``, SPEC 7 routing replay).

Routing replay feeds each token's expert choices of the rollout, ``[tokens, layers,
top_k]`` per sequence, back into the training forward. A token shared in a packed row
enters the forward once, so sequences may share it only if their routing arrays agree on
it, and (the planner's rule 1) on every earlier token. :func:`routing_keys` turns each
token's routing row into one uint64 key (a hash of its values); plan with these keys and
the planner never shares a token whose routing differs among sequences.

A hash can collide (two different routing rows with one key, probability about
``2**-64`` per pair): materialization then still refuses, because it checks every
sharer's token-aligned payload against the packed one
(:class:`~treepack.trainer.data.payloads.PayloadMismatchError`). So keys plus that
check are exact or refused, never silently merged. :func:`naive_routing_keys` is the
loop reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treepack.proto.errors import InputTypeError, RequestError

__all__ = ["routing_keys", "naive_routing_keys"]

_MASK = (1 << 64) - 1
_OFFSET = 0xCBF29CE484222325  # FNV-1a 64-bit offset basis
_PRIME = 0x100000001B3  # FNV-1a 64-bit prime


def _as_rows(x: Any, s: int) -> np.ndarray:
    """Sequence s's routing array as [n, m] uint64 (m = layers * top_k values per token)."""
    arr = np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)
    path = f"$.routing[{s}]"
    if arr.ndim < 1:
        raise RequestError(
            f"routing array must be [tokens, ...] (e.g. [tokens, layers, top_k]), got shape {arr.shape}",
            path=path,
            rule="shape",
        )
    if arr.dtype.kind not in "iub":
        raise InputTypeError(
            f"routing arrays hold expert indices (integers), got dtype {arr.dtype}", path=path, rule="dtype"
        )
    return arr.reshape(arr.shape[0], -1).astype(np.int64).view(np.uint64)


def _splitmix(h: np.ndarray) -> np.ndarray:
    """A 64-bit finalizer (splitmix64): spreads the FNV state over all bits."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def routing_keys(routing_arrays: Sequence[Any]) -> list[np.ndarray]:
    """One uint64 key per token from its routing values (vectorized over tokens).

    Args:
        routing_arrays: per sequence an integer array ``[tokens, layers, top_k]`` (any
            per-token shape; numpy or torch), the expert indices of each token.

    Returns:
        Per sequence a [tokens] uint64 array: pass it as the planner's ``keys``. Tokens with
        equal routing values (same per-token shape) get equal keys.
    """
    out = []
    with np.errstate(over="ignore"):
        for s, x in enumerate(routing_arrays):
            rows = _as_rows(x, s)
            h = np.full(rows.shape[0], _OFFSET ^ rows.shape[1], dtype=np.uint64)
            for j in range(rows.shape[1]):
                h = (h ^ rows[:, j]) * np.uint64(_PRIME)
            out.append(_splitmix(h))
    return out


def naive_routing_keys(routing_arrays: Sequence[Any]) -> list[np.ndarray]:
    """Reference for :func:`routing_keys` in Python integers, token by token."""
    out = []
    for s, x in enumerate(routing_arrays):
        rows = _as_rows(x, s)
        keys = []
        for t in range(rows.shape[0]):
            h = _OFFSET ^ rows.shape[1]
            for v in rows[t].tolist():
                h = ((h ^ v) * _PRIME) & _MASK
            h ^= h >> 30
            h = (h * 0xBF58476D1CE4E5B9) & _MASK
            h ^= h >> 27
            h = (h * 0x94D049BB133111EB) & _MASK
            h ^= h >> 31
            keys.append(h)
        out.append(np.array(keys, dtype=np.uint64))
    return out
