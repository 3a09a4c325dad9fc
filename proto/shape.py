"""Batch shapes (fingerprints): what the history keeps of a batch (no tokens), and token runs made back from them.

A batch's **shape** lists, per kept sequence, its **runs** root first: one run per internal
tree node on its path (the token run the node's sharers have in common), then its leaf
split in two: the leaf's shareable rest (positions up to the first scored one) and its
unshareable tail. A run is ``(hash, length)``; :func:`treepack.service.planner.fingerprint.shape_of` takes
the shape of a planned batch; the hash is a 64-bit BLAKE2b of the run's
tokens (and keys, when any is non-zero); the tail from the first scored position on gets
hash 0: the default mode never shares it, and its content does not matter to the tree. The same system prompt in
two batches is the same node run, hence the same hash, so what-if sampling across
batches shares it as the real batch would. (A prefix that was a node nowhere, say a
system prompt used by one sequence only in its batch, is inside a longer run and does not
match across batches; the recorded node boundaries are all a shape knows.)

:func:`run_tokens` turns runs back into token ids: equal hashes give equal runs, and runs
of different hashes differ at their first token (a 2**-32 collision chance per pair);
tails get run ids unique to their sequence (:func:`treepack.service.planner.whatif.synthesize`), so made-up
tails never match, not even in the generalized mode. Hence
:func:`treepack.service.planner.tree.build_tree` on the made-up tokens rebuilds the recorded tree exactly (same
nodes, lengths, sharers; tested), with the same ``min_shared_len``. A larger
``min_shared_len`` is exact too; a smaller one misses short runs the shape never saw.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from treepack.proto.errors import RequestError
from treepack.proto.index import ragged_arange

__all__ = ["BatchShape", "run_hash", "run_tokens"]

_PERSON = b"treepack-run-v1"  # versions the hash: a new scheme must not match old records


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchShape:
    """A batch without its tokens (module docstring).

    Attributes (S kept sequences, P runs):
        seq_len: the row capacity the batch was packed for.
        min_shared_len: the rule-4 threshold its tree was built with.
        seq_ptr: [S+1] int64 CSR: sequence i's runs are ``seq_ptr[i]:seq_ptr[i+1]``.
        run_hash: [P] uint64 hash of each run (0: unshareable tail).
        run_len: [P] int64 length of each run (>= 1).
        first_trainable: [S] int64 index of the first trainable token (length if none).
        groups: [S] group label per sequence (int, str or None: a group of its own).
        tags: [S] task tag per sequence, or None.
    """

    seq_len: int
    min_shared_len: int
    seq_ptr: np.ndarray
    run_hash: np.ndarray
    run_len: np.ndarray
    first_trainable: np.ndarray
    groups: tuple[Any, ...]
    tags: tuple[str | None, ...] | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.seq_ptr.shape[0]) - 1

    @property
    def lens(self) -> np.ndarray:
        """[S] int64 sequence lengths."""
        csum = np.concatenate([[0], np.cumsum(self.run_len)])
        return (csum[self.seq_ptr[1:]] - csum[self.seq_ptr[:-1]]).astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.run_len.sum())

    def check(self, path: str = "$") -> None:
        """Raise :class:`RequestError` (at ``path``) unless the arrays are consistent.

        Shapes also arrive inline in what-if requests, so this is a caller-facing check.
        """
        s = self.num_sequences
        p = int(self.run_hash.shape[0])
        ptr = self.seq_ptr
        if ptr.shape[0] < 1 or ptr[0] != 0 or ptr[-1] != p:
            raise RequestError(f"seq_ptr must run from 0 to the run count {p}", path=f"{path}.seq_ptr", rule="bounds")
        if np.any(np.diff(ptr) < 1):
            i = int(np.argmax(np.diff(ptr) < 1))
            raise RequestError(
                f"sequence {i} has no runs (seq_ptr must increase)", path=f"{path}.seq_ptr[{i + 1}]", rule="monotone"
            )
        if self.run_len.shape[0] != p:
            raise RequestError(
                f"run_len has {self.run_len.shape[0]} entries for {p} runs",
                path=f"{path}.run_len",
                rule="length_mismatch",
            )
        if p and self.run_len.min() < 1:
            i = int(np.argmax(self.run_len < 1))
            raise RequestError(
                f"run length must be >= 1, got {int(self.run_len[i])}", path=f"{path}.run_len[{i}]", rule="range"
            )
        if self.first_trainable.shape[0] != s:
            raise RequestError(
                f"first_trainable has {self.first_trainable.shape[0]} entries for {s} sequences",
                path=f"{path}.first_trainable",
                rule="length_mismatch",
            )
        bad = (self.first_trainable < 0) | (self.first_trainable > self.lens)
        if bad.any():
            i = int(np.argmax(bad))
            raise RequestError(
                f"first_trainable must be in [0, {int(self.lens[i])}], got {int(self.first_trainable[i])}",
                path=f"{path}.first_trainable[{i}]",
                rule="range",
            )
        if len(self.groups) != s:
            raise RequestError(
                f"groups has {len(self.groups)} entries for {s} sequences",
                path=f"{path}.groups",
                rule="length_mismatch",
            )
        if self.tags is not None and len(self.tags) != s:
            raise RequestError(
                f"tags has {len(self.tags)} entries for {s} sequences", path=f"{path}.tags", rule="length_mismatch"
            )


def run_hash(tokens: np.ndarray, keys: np.ndarray | None = None) -> int:
    """The 64-bit hash of a token run (never 0, which marks unshareable tails).

    Args:
        tokens: [n] uint32 the run's token ids (C-contiguous).
        keys: [n] uint64 the run's keys, or None; all-zero keys hash like no keys, as
            the tree treats them alike.
    """
    h = hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.uint32).data.cast("B"), digest_size=8, person=_PERSON)
    if keys is not None and keys.shape[0] and keys.any():
        h.update(b"keys")
        h.update(np.ascontiguousarray(keys, dtype=np.uint64).data.cast("B"))
    return int.from_bytes(h.digest(), "little") or 1


def run_tokens(hashes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Token ids for runs: ``[sum(lengths)] uint32``, run after run.

    Token i of a run with hash h is the top half of splitmix64(h + (i + 1) * golden), so
    equal hashes give equal runs and different hashes differ at once (module docstring).
    Vectorized: about 10 numpy passes over the tokens.
    """
    h = np.repeat(hashes.astype(np.uint64), lengths)
    i = ragged_arange(lengths).astype(np.uint64)
    x = h + (i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(32)).astype(np.uint32)
