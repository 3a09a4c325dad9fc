"""The packed batch: a plan's rows as tensors, plus the index maps back to the sequences.

Built by :func:`treepack.trainer.data.materialize`. Shapes: K rows (the materialized rows, a
rank's share or all), L = ``plan.seq_len``, S sequences of the plan, T scored entries
(one per sequence and per position whose next token is trainable; in the default sharing
mode every scored position belongs to exactly one sequence, so T = ``loss_mask.sum()``).

Flat row positions are ``local_row * L + index``.

Under context parallelism (``materialize(..., cp=...)``) a batch holds this rank's shard
of every row: L is the plan's ``ranks.shard_len`` and CP rank k's column i of local row j
is row position ``cp_positions[k, j, i]`` (``Ranks.shard_positions``: ``k * shard_len + i``
for contiguous shards; positions past ``seq_len`` are padding). The per-token
tensors and the scored entries are the shard's; ``score_counts`` and ``groups`` stay the
whole batch's, so the losses' normalizations count every rank's entries. ``cp_full`` is
the whole-row view (same rows, ``seq_len`` long, no payloads) that the whole-row
attention masks, :meth:`locate` and :meth:`unpack_logprobs` read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, overload

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.proto.index import local_row_index, row_segments
from treepack.proto.plan import Plan
from treepack.trainer.data.advice import warn_dense_mask
from treepack.trainer.data.logprobs import check_temperature, chunked_target_stats, target_stats
from treepack.trainer.data.values import last_token_positions, token_values
from treepack.trainer.kernels.cp import gather_seq
from treepack.trainer.kernels.index import scatter_filled
from treepack.trainer.kernels.masks import VarlenMeta, block_mask, dense_mask, varlen_meta
from treepack.trainer.kernels.tree_scan import TreeSchedule, conv_width_refusal, tree_schedule
from treepack.trainer.kernels.varlen_levels import VarlenLevels, varlen_levels

__all__ = ["PackedBatch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedBatch:
    """Packed rows of a plan and the maps between rows and sequences.

    Attributes:
        plan: the plan.
        rows: [K] int64 global row of each local row, -1 for an empty padding row.
        input_ids: [K, L] int64 token ids (``pad_id`` at padding).
        position_ids: [K, L] int64 position of each token in its own sequence (0 at padding).
        subtree_end: [K, L] int64 mask contract: query i sees key j iff
            ``j <= i < subtree_end[j]`` (``i + 1`` at padding).
        targets: [K, L] int64 the next token of the sequence owning each scored position,
            -1 elsewhere.
        loss_mask: [K, L] bool scored positions.
        owner: [K, L] int64 a sequence scored at each position (the only one in the
            default mode), -1 elsewhere.
        payloads: packed payloads by name, [K, L, ...] (NaN / -1 / False where unwritten,
            and, for a target-aligned payload, where a shared position's sharers differ).
        entry_payloads: target-aligned payloads per scored entry by name, [T, ...]: each
            (position, sharer) its own value (what the losses read).
        local_seqs: [S_local] int64 (numpy) sequences held by these rows, ascending.
        seq_ptr: [S_local + 1] int64 (numpy) CSR of their tokens in ``seq_flat``.
        seq_flat: [sum len] int64 flat row position of every local sequence's tokens, in order.
        score_seq: [T] int64 sequence of each scored entry.
        score_pos: [T] int64 index of the token predicted (the entry sits at the row
            position of token ``score_pos - 1``).
        score_flat: [T] int64 flat row position of each entry.
        score_target: [T] int64 the token predicted.
        score_counts: [S] int64 scored entries of every sequence of the plan (all ranks).
        groups: [S] int64 dense group code of every sequence.
        device: where the tensors live.
        cp: the :class:`~treepack.trainer.kernels.cp.ContextParallel` group when this is one
            rank's shard of the rows, else None.
        cp_full: under CP, the whole-row view of the same rows (module docstring), else None.
        cp_positions: under CP, [cp_size, K, L] int64 the padded-row positions every CP
            rank's shard holds (module docstring), else None.
        cp_strategy: under CP, the attention strategy: ``"ulysses"``, ``"allgather"`` or
            ``"auto"`` (per layer: Ulysses where the heads divide by the CP size), else None.
        images: the local sequences' images, one per distinct content
            (:class:`~treepack.trainer.data.images.BatchImages`), or None.
    """

    plan: Plan
    rows: np.ndarray
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    owner: torch.Tensor
    payloads: dict[str, torch.Tensor]
    entry_payloads: dict[str, torch.Tensor]
    local_seqs: np.ndarray
    seq_ptr: np.ndarray
    seq_flat: torch.Tensor
    score_seq: torch.Tensor
    score_pos: torch.Tensor
    score_flat: torch.Tensor
    score_target: torch.Tensor
    score_counts: torch.Tensor
    groups: torch.Tensor
    device: torch.device
    cp: Any = None
    cp_full: PackedBatch | None = None
    cp_positions: torch.Tensor | None = None
    cp_strategy: str | None = None
    images: Any = None
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        """K, the rows of this batch (empty padding rows included)."""
        return int(self.rows.shape[0])

    @property
    def seq_len(self) -> int:
        """L, the row length of this batch's tensors (the plan's ``seq_len``; under CP its ``ranks.shard_len``)."""
        return int(self.input_ids.shape[1])

    @property
    def empty_rows(self) -> np.ndarray:
        """[K] bool rows that hold nothing (a rank's padding rows)."""
        return self.rows < 0

    @property
    def num_scored(self) -> int:
        """T, the scored entries of this batch."""
        return int(self.score_seq.shape[0])

    def local_row_of(self, s: int) -> int:
        """Local row holding sequence s.

        Raises:
            RequestError: if s is out of range, dropped, or held by rows not in this batch.
        """
        S = self.plan.num_sequences
        if not 0 <= s < S:
            raise RequestError(f"sequence index {s} is out of range [0, {S})", path="$.s", rule="range")
        r = int(self.plan.row_of[s])
        hit = np.flatnonzero(self.rows == r) if r >= 0 else np.zeros(0)
        if hit.shape[0] == 0:
            why = "was dropped (on_overflow='drop')" if r < 0 else f"is in row {r}, not materialized in this batch"
            raise RequestError(f"sequence {s} {why}", path="$.s", rule="not_local")
        return int(hit[0])

    def locate(self, s: int) -> tuple[int, torch.Tensor]:
        """(local row, [len(s)] int64 row indices of sequence s's tokens, in order).

        ``input_ids[row, idx]`` is sequence s and ``position_ids[row, idx]`` is 0..n-1.
        Under CP the indices are whole-row positions (of :attr:`cp_full`).
        """
        if self.cp_full is not None:
            return self.cp_full.locate(s)
        row = self.local_row_of(s)
        k = int(np.searchsorted(self.local_seqs, s))
        flat = self.seq_flat[int(self.seq_ptr[k]) : int(self.seq_ptr[k + 1])]
        return row, flat - row * self.seq_len

    @property
    def local_of_row(self) -> np.ndarray:
        """[R] int64 local row of each global row of the plan, -1 if not in this batch."""
        if "local_of_row" not in self._cache:
            self._cache["local_of_row"] = local_row_index(self.rows, self.plan.num_rows)
        return self._cache["local_of_row"]

    def local_segments(self) -> tuple[np.ndarray, np.ndarray]:
        """(global segment ids [G_local], their local rows [G_local]) in row order."""
        if "local_segments" not in self._cache:
            self._cache["local_segments"] = row_segments(self.plan.segments.row_ptr, self.rows)
        return self._cache["local_segments"]

    def dense_mask(self, sliding_window: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
        """[K, 1, L, L] bool tree mask (the reference); see :func:`~treepack.trainer.kernels.masks.dense_mask`."""
        self._whole_rows_only("the attention mask")
        key = ("dense", sliding_window, chunk_size)
        if key not in self._cache:
            warn_dense_mask(self.num_rows, self.seq_len)
            self._cache[key] = dense_mask(self.subtree_end, self.position_ids, sliding_window, chunk_size)
        return self._cache[key]

    def block_mask(
        self, block_size: int = 128, sliding_window: int | None = None, chunk_size: int | None = None
    ) -> Any:
        """FlexAttention BlockMask of the tree mask; see :func:`~treepack.trainer.kernels.masks.block_mask`."""
        self._whole_rows_only("the attention mask")
        key = ("block", block_size, sliding_window, chunk_size)
        if key not in self._cache:
            self._cache[key] = block_mask(
                self.subtree_end,
                self.position_ids,
                block_size=block_size,
                sliding_window=sliding_window,
                chunk_size=chunk_size,
            )
        return self._cache[key]

    def varlen_meta(self, chunk_size: int | None = None) -> VarlenMeta:
        """Varlen metadata over gathered ancestor keys; see :func:`~treepack.trainer.kernels.masks.varlen_meta`."""
        self._whole_rows_only("the attention mask")
        key = ("varlen", chunk_size)
        if key not in self._cache:
            self._cache[key] = varlen_meta(self.plan, self.rows, self.device, chunk_size=chunk_size)
        return self._cache[key]

    def varlen_levels(self) -> VarlenLevels:
        """The copy-free varlen calls (own level, one per depth); see
        :func:`~treepack.trainer.kernels.varlen_levels.varlen_levels`."""
        self._whole_rows_only("the attention mask")
        if "varlen_levels" not in self._cache:
            self._cache["varlen_levels"] = varlen_levels(self.plan, self.rows, self.device)
        return self._cache["varlen_levels"]

    def tree_schedule(self, kernel_width: int | None = None, who: str = "a layer") -> TreeSchedule:
        """The rows' :class:`~treepack.trainer.kernels.tree_scan.TreeSchedule` (built on first use, cached).

        Every recurrent / conv layer of a model reads this one schedule.

        Args:
            kernel_width: the causal conv width of the layer asking (None: no conv); the
                rule is :func:`~treepack.trainer.kernels.tree_scan.conv_width_refusal`.
            who: names the layer in the error.

        Raises:
            RequestError: when ``kernel_width`` is wider than the plan's ``conv_width``.
        """
        self._whole_rows_only(f"{who}: the tree schedule")
        reason = None if kernel_width is None else conv_width_refusal(kernel_width, self.plan.gdn.conv_width)
        if reason is not None:
            raise RequestError(f"{who}: {reason}", path="$.plan.gdn.conv_width", rule="conv_width")
        if "tree_schedule" not in self._cache:
            self._cache["tree_schedule"] = tree_schedule(self.plan, device=self.device, rows=self.rows)
        return self._cache["tree_schedule"]

    def _whole_rows_only(self, what: str) -> None:
        # A CP shard holds part of every row: the masks and schedules of whole rows live on
        # cp_full, read by the CP paths that run whole rows (Ulysses attention).
        if self.cp is not None:
            raise RequestError(
                f"{what} is a whole-row structure; this batch is one context-parallel shard (read batch.cp_full)",
                path="$.batch.cp",
                rule="cp_shard",
            )

    def _check_rows_tensor(self, x: torch.Tensor, what: str) -> None:
        K, L = self.num_rows, self.seq_len
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or tuple(x.shape[:2]) != (K, L):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise RequestError(
                f"{what} must have shape [{K}, {L}, ...] (rows, seq_len), got {shape}", path=f"$.{what}", rule="shape"
            )

    @overload
    def target_logprobs(
        self, logits: torch.Tensor, *, temperature: float = ..., with_entropy: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def target_logprobs(
        self, logits: torch.Tensor, *, temperature: float = ..., with_entropy: Literal[True]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def target_logprobs(
        self, logits: torch.Tensor, *, temperature: float = ..., with_entropy: bool = ...
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
    def target_logprobs(
        self, logits: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[K, L] log-probability of ``targets`` at every scored position, 0 elsewhere.

        Args:
            logits: [K, L, V] model outputs on the packed rows (any float dtype; the
                log-softmax runs in float32 or wider, on the scored positions only).
            temperature: the logits are divided by it first (TRL's ``temperature``: the
                distribution the completions were sampled from).
            with_entropy: also return the entropy of that distribution at every scored
                position (TRL's ``entropy_from_logits``), 0 elsewhere.

        Returns:
            [K, L] logprobs, or ([K, L] logprobs, [K, L] entropies) with ``with_entropy``.
        """
        self._check_rows_tensor(logits, "logits")
        if logits.ndim != 3:
            raise RequestError(
                f"logits must have shape [K, L, vocab], got {tuple(logits.shape)}", path="$.logits", rule="shape"
            )
        check_temperature(temperature)
        K, L, V = logits.shape
        pos = self._loss_positions(V, "logits")
        lp, ent = target_stats(logits.reshape(K * L, V)[pos], self.targets.reshape(-1)[pos], temperature, with_entropy)
        return self._spread(pos, lp, ent)

    def target_logprobs_from_hidden(
        self,
        hidden: torch.Tensor,
        head: Any,
        *,
        chunk_size: int = 4096,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`target_logprobs` from final hidden states, never holding [K, L, V] logits.

        The head runs on the scored positions only, ``chunk_size`` at a time, each chunk
        under activation checkpointing, so at most one chunk's logits exist at once
        (forward or backward).

        Args:
            hidden: [K, L, d] final hidden states (``packed_forward(..., output="hidden")``).
            head: callable [n, d] -> [n, V]: :func:`treepack.trainer.hf.head.output_head`
                (``lm_head`` plus the model's final logit transforms: Cohere's
                ``logit_scale``, Granite's ``logits_scaling``, Gemma 2's soft-cap). A bare
                ``model.lm_head`` is right only for models without such transforms.
            chunk_size: positions per chunk.
            temperature: as in :meth:`target_logprobs`.
            with_entropy: as in :meth:`target_logprobs`.

        Returns:
            [K, L] log-probabilities, 0 off the loss mask (and [K, L] entropies with
            ``with_entropy``).
        """
        self._check_rows_tensor(hidden, "hidden")
        check_temperature(temperature)
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise RequestError(
                f"chunk_size must be a positive int, got {chunk_size!r}", path="$.chunk_size", rule="range"
            )
        K, L, d = hidden.shape
        pos = self._loss_positions(None, "hidden")
        flat = hidden.reshape(K * L, d)
        lp, ent = chunked_target_stats(
            flat, self.targets.reshape(-1), pos, head, chunk_size, temperature=temperature, with_entropy=with_entropy
        )
        return self._spread(pos, lp, ent)

    def _spread(self, pos: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor | None) -> Any:
        """[U] values at the scored positions -> [K, L] (0 elsewhere); a pair with entropies."""
        K, L = self.num_rows, self.seq_len
        put = lambda v: torch.zeros(K * L, dtype=v.dtype, device=v.device).index_put((pos,), v).view(K, L)  # noqa: E731
        return put(lp) if ent is None else (put(lp), put(ent))

    def _loss_positions(self, vocab: int | None, what: str) -> torch.Tensor:
        """[U] flat scored positions (cached); checks ``vocab`` covers every target."""
        if "loss_positions" not in self._cache:
            self._cache["loss_positions"] = torch.nonzero(self.loss_mask.reshape(-1)).flatten()
            self._cache["max_target"] = int(self.targets.max()) if self.targets.numel() else -1
        if vocab is not None and vocab <= self._cache["max_target"]:
            raise RequestError(
                f"{what} have {vocab} vocabulary entries, but target token {self._cache['max_target']} needs more",
                path=f"$.{what}",
                rule="shape",
            )
        return self._cache["loss_positions"]

    def entry_logprobs(self, x: torch.Tensor) -> torch.Tensor:
        """[T] log-probability of each scored entry's target.

        Args:
            x: [K, L, V] logits, or [K, L] per-position log-probabilities from
                :meth:`target_logprobs`.
        """
        lp = x if isinstance(x, torch.Tensor) and x.ndim == 2 else self.target_logprobs(x)
        self._check_rows_tensor(lp, "logprobs")
        return lp.reshape(-1)[self.score_flat]

    def cp_to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Under CP: ``[K, cp * L, ...]`` every rank's shard in rank order (as gathered) ->
        ``[K, cp * L, ...]`` in row order (padded-row positions)."""
        key = "cp_row_order"
        if key not in self._cache:
            K = self.num_rows
            assert self.cp_positions is not None, "CP batches carry their shard positions"
            flat = self.cp_positions.permute(1, 0, 2).reshape(K, -1)
            self._cache[key] = torch.argsort(flat, dim=1)
        idx = self._cache[key].to(x.device)
        return x.gather(1, idx.view(*idx.shape, *([1] * (x.ndim - 2))).expand(-1, -1, *x.shape[2:]))

    def unpack_values(self, x: torch.Tensor) -> list[torch.Tensor | None]:
        """Per-sequence outputs of a per-position head (a value head's values), as if each sequence ran alone.

        Args:
            x: [K, L, ...] per-position outputs of the rows (``packed_forward`` of a
                ``*ForTokenClassification`` model); whole rows (not a CP shard).

        Returns:
            S entries: [len(s), ...] for a sequence of these rows (its output at every one of
            its tokens), None for one not materialized here (:func:`~treepack.trainer.data.values.token_values`).
        """
        whole, rows = self._whole_rows(x)
        return token_values(whole, rows)

    def sequence_values(self, x: torch.Tensor, pad_token_id: int | None = None) -> torch.Tensor:
        """[S_local, ...] outputs at each local sequence's pooled token (a reward model's scores).

        Args:
            x: [K, L, ...] per-position outputs of the rows (whole rows, not a CP shard).
            pad_token_id: HF's rule: each sequence is read at its last token that is not this
                id (None: at its last token; :func:`~treepack.trainer.data.values.last_token_positions`).

        Returns:
            One entry per sequence of :attr:`local_seqs`, in that order.
        """
        whole, rows = self._whole_rows(x)
        key = ("last_token", pad_token_id)
        if key not in whole._cache:
            whole._cache[key] = last_token_positions(whole, pad_token_id)
        return rows.reshape(-1, *rows.shape[2:])[whole._cache[key].to(rows.device)]

    def _whole_rows(self, x: torch.Tensor) -> tuple[PackedBatch, torch.Tensor]:
        """(this batch, ``x`` checked as [K, L, ...]); a CP shard is refused (its heads are not proven)."""
        self._whole_rows_only("a head's per-sequence outputs")
        self._check_rows_tensor(x, "outputs")
        return self, x

    def unpack_logprobs(self, x: torch.Tensor) -> list[torch.Tensor | None]:
        """Per-sequence token log-probabilities, as if each sequence ran alone.

        Args:
            x: [K, L, V] logits of the packed rows, or [K, L] from :meth:`target_logprobs`.

        Returns:
            S entries: for a sequence of these rows a [len(s)] tensor holding the
            log-probability of token i for every trainable i >= 1 and NaN elsewhere;
            None for a sequence not materialized here (dropped, or on another rank).
            Under CP ``x`` is this rank's shard; the log-probabilities are gathered over the
            group (one all-gather of [K, L] values), so every rank gets every sequence whole.
        """
        if self.cp is not None:
            lp = x if isinstance(x, torch.Tensor) and x.ndim == 2 else self.target_logprobs(x)
            self._check_rows_tensor(lp, "logprobs")
            assert self.cp_full is not None, "CP batches carry their whole-row view"
            return self.cp_full.unpack_logprobs(self.cp_to_rows(gather_seq(lp, self.cp))[:, : self.plan.seq_len])
        lp = self.entry_logprobs(x)
        total = int(self.seq_ptr[-1])
        slot = torch.from_numpy(np.searchsorted(self.local_seqs, self.score_seq.cpu().numpy())).to(lp.device)
        ptr = torch.from_numpy(self.seq_ptr).to(lp.device)
        cat = scatter_filled(lp, ptr[slot] + self.score_pos, total)
        parts = torch.split(cat, np.diff(self.seq_ptr).tolist())
        out: list[torch.Tensor | None] = [None] * self.plan.num_sequences
        for s, p in zip(self.local_seqs.tolist(), parts):
            out[s] = p
        return out
