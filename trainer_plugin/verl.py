"""verl on tree-packed rows: :class:`TreepackFSDPEngine`, a drop-in for verl's FSDP LM engine.

verl (0.9.1) computes every actor log-probability (old policy, reference, policy update)
in ``FSDPEngineWithLMHead.forward_step``: the micro-batch arrives jagged (one nested row
per sequence, prompt then response, ``left_right_2_no_padding``), the model runs on it,
and the step returns full-sequence jagged ``log_probs`` / ``entropy`` (the value at
position t belongs to token t + 1) that verl's loss reads back with
``no_padding_2_padding``. :class:`TreepackFSDPEngine` overrides that one method:

1. the micro-batch's sequences are planned on tree rows (a prompt's responses share its
   tokens; the planner's groups are the identical prompts);
2. :func:`~treepack.trainer.data.materialize` builds the rows, the model runs through
   :func:`~treepack.trainer.packed_forward` with ``output="hidden"`` and the chunked head
   (:func:`~treepack.trainer.output_head`: never the full ``[tokens, vocab]`` logits), with
   verl's temperature (logits divided by it) and entropy (of the tempered distribution);
3. the values land in verl's jagged layout at every response position (0 elsewhere:
   verl's loss reads only the response), and verl's own ``loss_function`` runs on them.

:class:`TreepackFSDPValueEngine` does the same for the critic (verl's
``FSDPEngineWithValueHead``, model type ``value_model``: a ``*ForTokenClassification`` with
``num_labels=1``): the value head runs on the tree rows (``packed_forward`` gives its
per-position values, :mod:`treepack.trainer.hf.task_head`) and every sequence's values at
all its tokens land in verl's jagged ``values`` layout, read by verl's own ``value_loss``.
TRL's ``AutoModelForCausalLMWithValueHead`` (a ``v_head`` on a causal LM, verl's fallback
when the checkpoint is no token-classification model) is refused by name.

verl's loss normalisation uses whole-mini-batch counts, so regrouping inside a micro-batch
leaves gradients unchanged. What a micro-batch saves depends on whole groups arriving in
it; docs/verl.md lists the verl settings that keep them together.

Refused by name before any compute: Ulysses sequence parallel, fused kernels, per-sample
temperatures, top-k distillation, ``sum_pi_squared``, multimodal inputs (and 3-D
position ids), routing replay, position ids other than 0..n-1, batches without prompts
(SFT).

Every planned sequence carries the run's tag (:attr:`VerlPacking.tag`, ``TREEPACK_VERL_TAG``),
which the planner's shape history records.

Logged into verl's metrics per micro-batch: ``treepack/saved_fraction``,
``treepack/rows``, ``treepack/plan_ms``. Printed on the first data-parallel rank (unless
``VerlPacking(verbose=False)`` / ``TREEPACK_VERL_VERBOSE=0``): when the engine's first packed
step verifies packing on its model and how long that took, and when the process exits one
line of what packing saved over the run (:class:`~treepack.trainer.planning.tally.PackingTally`).

Importing this module imports verl; it is loaded only on request (or by the
``verl.plugins`` entry point, :mod:`treepack.trainer.verl_plugin`, when switched on).
"""

from __future__ import annotations

import atexit
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from treepack.proto.errors import RequestError
from treepack.trainer import BACKENDS, materialize, output_head, packed_forward, parity_report
from treepack.trainer.hf import unwrap_model
from treepack.trainer.hf.parity import sample_on_every_rank
from treepack.trainer.kernels.attention import AUTO, resolve_backend
from treepack.trainer.planning import plan_microbatches
from treepack.trainer.planning.bridge import prompt_groups
from treepack.trainer.planning.tally import PackingTally

__all__ = ["VerlPacking", "TreepackFSDPEngine", "TreepackFSDPValueEngine", "SUPPORTED_VERL"]

SUPPORTED_VERL = "0.9.1"
_WHO = "treepack.trainer.verl.TreepackFSDPEngine"


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlPacking:
    """How :class:`TreepackFSDPEngine` packs a micro-batch.

    Attributes:
        backend: tree attention backend, ``auto`` (default: ``flash``, the copy-free
            varlen path, on a GPU where flash-attn imports and on a CPU for rows of at least
            2,048 tokens; ``sdpa`` elsewhere: :func:`~treepack.trainer.kernels.attention.resolve_backend`)
            | ``sdpa`` | ``flex`` | ``flash``.
        min_shared_len: shortest shared run the planner keeps.
        max_seq_len: row length cap (never below the longest sequence).
        planner: a ``treepack.client.Packer``, a sidecar URL, or None (embedded).
        head_chunk: positions per chunk of the output head.
        tag: the task tag every planned sequence is recorded with in the planner's shape
            history (what-ifs sample one run's batches by ``history_tags`` or ``by_tag``);
            ``""``: untagged. Set it to the run's name (``TREEPACK_VERL_TAG``).
        verbose: print the first step's verification and the run's summary (first
            data-parallel rank only).
        report_parity: at the first packed forward, print the parity report's log-probability
            figures of its micro-batch (:func:`~treepack.trainer.parity_report`, without
            gradients; every rank runs it, rank 0 prints).
    """

    backend: str = AUTO
    min_shared_len: int = 16
    max_seq_len: int = 8192
    planner: Any = None
    head_chunk: int = 4096
    tag: str = "verl"
    verbose: bool = True
    report_parity: bool = False

    def __post_init__(self) -> None:
        if self.backend not in (*BACKENDS, AUTO):
            raise RequestError(
                f"backend must be one of {(*BACKENDS, AUTO)}, got {self.backend!r}",
                path="$.packing.backend",
                rule="enum",
            )
        if not isinstance(self.tag, str) or len(self.tag) > 256:
            raise RequestError(
                f"tag must be a string of at most 256 characters, got {self.tag!r:.80}",
                path="$.packing.tag",
                rule="type",
            )

    @classmethod
    def from_env(cls) -> VerlPacking:
        """The defaults, overridden by ``TREEPACK_VERL_BACKEND`` / ``TREEPACK_VERL_MIN_SHARED_LEN`` /
        ``TREEPACK_VERL_MAX_SEQ_LEN`` / ``TREEPACK_VERL_TAG`` / ``TREEPACK_VERL_VERBOSE`` (``0`` is quiet) /
        ``TREEPACK_VERL_REPORT_PARITY`` (``1``: on)."""
        env = os.environ
        return cls(
            backend=env.get("TREEPACK_VERL_BACKEND", AUTO),
            min_shared_len=int(env.get("TREEPACK_VERL_MIN_SHARED_LEN", 16)),
            max_seq_len=int(env.get("TREEPACK_VERL_MAX_SEQ_LEN", 8192)),
            tag=env.get("TREEPACK_VERL_TAG", "verl"),
            verbose=env.get("TREEPACK_VERL_VERBOSE", "1") != "0",
            report_parity=env.get("TREEPACK_VERL_REPORT_PARITY", "0") == "1",
        )


def _say_on_first_rank(line: str) -> None:
    """Print ``line`` on the first rank only (every rank runs the engine)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def _refuse(what: str, why: str) -> RequestError:
    return RequestError(f"{_WHO}: {what} is not supported ({why})", path=f"$.{what}", rule="unsupported")


def _scalar_temperature(t: Any) -> float:
    """verl's ``temperature`` as one float; a per-sample tensor with differing values is refused."""
    if isinstance(t, torch.Tensor):
        flat = t.detach().float().reshape(-1)
        if flat.numel() == 0 or bool((flat != flat[0]).any()):
            raise _refuse(
                "temperature", "per-sample temperatures: the chunked head takes one temperature per micro-batch"
            )
        return float(flat[0])
    return float(t)


def _check_supported(engine: Any, mb: Any) -> None:
    """Raise before any compute for what the packed forward cannot do exactly."""
    flag = lambda k: bool(tu.get_non_tensor_data(data=mb, key=k, default=False))  # noqa: E731
    if getattr(engine, "use_ulysses_sp", False):
        raise _refuse(
            "ulysses_sequence_parallel_size", "Ulysses sequence parallel splits rows across ranks; tree rows are whole"
        )
    if flag("use_fused_kernels"):
        raise _refuse("use_fused_kernels", "verl's fused kernels replace the head; treepack runs its own chunked head")
    if flag("distillation_use_topk") or flag("distillation_only"):
        raise _refuse("distillation_use_topk", "top-k distillation needs the full logits")
    if flag("calculate_sum_pi_squared"):
        raise _refuse("calculate_sum_pi_squared", "sum_pi_squared needs the full logits")
    if flag("enable_routing_replay"):
        raise _refuse("enable_routing_replay", "routing replay arrays are per sequence token, not per tree row")
    if "multi_modal_inputs" in mb.keys():
        raise _refuse("multi_modal_inputs", "multimodal inputs are not packed on tree rows")
    if "prompts" not in mb.keys() or "responses" not in mb.keys():
        raise _refuse("prompts", "a batch without prompts/responses (SFT) has no prompt to share")
    if mb["position_ids"].dim() == 3:
        raise _refuse("position_ids", "3-D (multimodal rope) position ids")


def _lengths(mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] sequence lengths, [B] response lengths) of the jagged micro-batch, as verl's loss reads them."""
    offsets = mb["input_ids"].offsets()
    seq_lens = offsets.diff()
    responses = mb["responses"]
    if responses.is_nested:
        resp_lens = responses.offsets().diff()
    else:
        P = mb["prompts"].shape[1]
        resp_lens = mb["attention_mask"][:, P:].sum(dim=1)
    return seq_lens.cpu(), resp_lens.cpu()


def _row_len(seq_lens: np.ndarray, prompt_lens: np.ndarray, groups: np.ndarray, packing: VerlPacking) -> int:
    """Room for the largest group's tree (prompt once, all its responses, each with its own copy of
    the prompt's last token: the join token), capped, never below a sequence."""
    resp = seq_lens - prompt_lens
    tree = np.bincount(groups, weights=resp + 1, minlength=1)
    first = np.unique(groups, return_index=True)[1]
    tree[groups[first]] += prompt_lens[first] - 1
    need = max(int(seq_lens.max(initial=1)), min(int(tree.max(initial=1)), packing.max_seq_len))
    step = 128 if packing.backend == "flex" else 16
    return -(-need // step) * step


class TreepackFSDPEngine(FSDPEngineWithLMHead):
    """verl's ``FSDPEngineWithLMHead`` with ``forward_step`` on tree-packed rows.

    Constructed exactly as the stock engine (``model_config, engine_config,
    optimizer_config, checkpoint_config``), so it registers in its place
    (:func:`treepack.trainer.verl_plugin.register`). ``packing`` (class attribute, a
    :class:`VerlPacking`) says how to pack; default from the environment.
    """

    packing: VerlPacking = VerlPacking.from_env()

    @property
    def packing_tally(self) -> PackingTally:
        """This engine's :class:`~treepack.trainer.planning.tally.PackingTally`, made on first
        use; its summary is printed when the process exits (verl's engine has no end of training)."""
        tally = self.__dict__.get("_packing_tally")
        if tally is None:
            tally = PackingTally(say=_say_on_first_rank if self.packing.verbose else None)
            self.__dict__["_packing_tally"] = tally
            atexit.register(tally.report)
        return tally

    def forward_step(
        self, micro_batch: Any, loss_function: Any, forward_only: bool
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """verl's ``forward_step`` contract: ``(loss, {"model_output", "loss", "metrics"})``.

        ``model_output["log_probs"]`` (and ``["entropy"]`` when verl asks for it) are jagged
        like the input ids, the value at position t belonging to token t + 1; only the
        response positions are filled (0 elsewhere).
        """
        _check_supported(self, micro_batch)
        temperature = _scalar_temperature(micro_batch["temperature"])
        calc_entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        device_name = get_device_name()
        micro_batch = micro_batch.to(get_device_id())
        offsets = micro_batch["input_ids"].offsets()
        device = micro_batch["input_ids"].values().device
        sequences, seq_lens, prompt_lens = _read_sequences(micro_batch)
        groups = prompt_groups([s[:p] for s, p in zip(sequences, prompt_lens.tolist())])
        mb, batch = self._plan_rows(sequences, seq_lens, prompt_lens, groups, device)
        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast = (
            nullcontext()
            if autocast_dtype == torch.float32
            else torch.autocast(device_type=device_name, dtype=autocast_dtype)
        )
        shown = resolve_backend(self.packing.backend, batch.device, batch.seq_len)
        with self.packing_tally.first_step(unwrap_model(self.module), shown):
            out = self._packed_logprobs(batch, autocast, temperature=temperature, with_entropy=calc_entropy)
        with autocast:
            lp, ent = out if calc_entropy else (out, None)
            model_output = {"log_probs": _jagged(batch, lp, offsets, device)}
            if calc_entropy:
                model_output["entropy"] = _jagged(batch, ent, offsets, device)
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
                )
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss = torch.tensor(1.0, device=device_name)
                metrics = {}
        self.packing_tally.add(mb.plan.stats, mb.plan_ms)
        return _step_result(loss, model_output, metrics, mb)

    def _plan_rows(
        self,
        sequences: list[np.ndarray],
        seq_lens: np.ndarray,
        prompt_lens: np.ndarray,
        groups: np.ndarray,
        device: torch.device,
    ) -> tuple[Any, Any]:
        """Plan the sequences as one micro-batch of tree rows and materialize those rows.

        Args:
            sequences: B int64 token arrays (prompt then response).
            seq_lens: [B] int64 their lengths. prompt_lens: [B] int64 their prompts' lengths.
            groups: [B] int64 dense codes of the identical prompts.
            device: where the rows live.

        Returns:
            (the :class:`~treepack.trainer.planning.MicroBatches`, the materialized batch).
        """
        packing = self.packing
        mb = plan_microbatches(
            sequences,
            num_microbatches=1,
            planner=packing.planner,
            seq_len=_row_len(seq_lens, prompt_lens, groups, packing),
            trainable=prompt_lens.tolist(),
            groups=groups.tolist(),
            min_shared_len=packing.min_shared_len,
            **({"tags": [packing.tag] * len(sequences)} if packing.tag else {}),
        )
        rows = mb.rows[0, 0]
        batch = materialize(
            mb.plan,
            sequences,
            device=device,
            trainable=prompt_lens.tolist(),
            groups=groups.tolist(),
            rows=rows[rows >= 0],
        )
        return mb, batch

    def _packed_logprobs(self, batch: Any, autocast: Any, *, temperature: float, with_entropy: bool) -> Any:
        """The rows' target log-probabilities (and entropies): the packed forward to hidden
        states, then the chunked output head, under ``autocast``.

        FSDP2 reshards the root's own parameters (embeddings, final norm, lm_head) after
        its forward; the chunked head (and its first-call probe) run after that forward,
        so the root keeps them gathered through the step (resharded here without grad,
        by FSDP2's post-backward with it).

        Returns:
            [K, L] log-probabilities, or ([K, L], [K, L] entropies) with ``with_entropy``.
        """
        packing = self.packing
        root = self.module if isinstance(self.module, FSDPModule) else None
        if root is not None:
            root.set_reshard_after_forward(False, recurse=False)
            root.unshard()
        try:
            with autocast:
                backend = resolve_backend(packing.backend, batch.device, batch.seq_len)
                if packing.report_parity and not getattr(self, "_parity_logged", False):
                    self._parity_logged = True
                    n = sample_on_every_rank(batch)
                    if n:
                        rep = parity_report(self.module, batch, backend=backend, sequences=n, grads=False)
                        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                            print(rep.table(), flush=True)
                hidden = packed_forward(self.module, batch, backend=backend, output="hidden")
                return batch.target_logprobs_from_hidden(
                    hidden,
                    output_head(self.module),
                    chunk_size=packing.head_chunk,
                    temperature=temperature,
                    with_entropy=with_entropy,
                )
        finally:
            if root is not None:
                root.set_reshard_after_forward(bool(self.engine_config.reshard_after_forward), recurse=False)
                if not torch.is_grad_enabled():
                    root.reshard()


class TreepackFSDPValueEngine(TreepackFSDPEngine, FSDPEngineWithValueHead):
    """verl's critic engine, ``FSDPEngineWithValueHead``, with ``forward_step`` on tree-packed rows.

    Constructed and registered as the stock value engine (:func:`treepack.trainer.verl_plugin.register`);
    packs as :class:`TreepackFSDPEngine` does (its ``packing``).
    """

    def forward_step(
        self, micro_batch: Any, loss_function: Any, forward_only: bool
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """verl's ``forward_step`` contract for the critic: ``model_output["values"]`` is jagged like
        the input ids, every position's value (verl's loss reads the response's, shifted by one)."""
        _check_supported(self, micro_batch)
        if hasattr(unwrap_model(self.module), "v_head"):
            raise _refuse(
                "v_head",
                "TRL's AutoModelForCausalLMWithValueHead; give the critic a *ForTokenClassification checkpoint",
            )
        micro_batch = micro_batch.to(get_device_id())
        offsets = micro_batch["input_ids"].offsets()
        device = micro_batch["input_ids"].values().device
        sequences, seq_lens, prompt_lens = _read_sequences(micro_batch)
        groups = prompt_groups([s[:p] for s, p in zip(sequences, prompt_lens.tolist())])
        mb, batch = self._plan_rows(sequences, seq_lens, prompt_lens, groups, device)
        assert np.array_equal(batch.local_seqs, np.arange(len(sequences))), "a micro-batch holds all its rows"
        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        device_name = get_device_name()
        autocast = (
            nullcontext()
            if autocast_dtype == torch.float32
            else torch.autocast(device_type=device_name, dtype=autocast_dtype)
        )
        backend = resolve_backend(self.packing.backend, batch.device, batch.seq_len)
        with self.packing_tally.first_step(unwrap_model(self.module), backend), autocast:
            values = packed_forward(self.module, batch, backend=backend)  # [K, L, 1]
            flat = values.squeeze(-1).reshape(-1)[batch.seq_flat.to(values.device)]  # sequences in order
            model_output = {"values": torch.nested.nested_tensor_from_jagged(flat, offsets.to(values.device))}
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
                )
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss, metrics = torch.tensor(1.0, device=device_name), {}
        self.packing_tally.add(mb.plan.stats, mb.plan_ms)
        return _step_result(loss, model_output, metrics, mb)


def _step_result(loss: torch.Tensor, model_output: dict, metrics: dict, mb: Any) -> tuple[torch.Tensor, dict]:
    """``(loss, {"model_output", "loss", "metrics"})`` with the plan's ``treepack/*`` metrics added."""
    stats = mb.plan.stats
    metrics = dict(metrics)
    for k, v in (("saved_fraction", stats.saved_fraction), ("rows", stats.rows), ("plan_ms", mb.plan_ms)):
        metrics[f"treepack/{k}"] = Metric(value=float(v), aggregation=AggregationType.MEAN)
    detached = {k: v.detach() for k, v in model_output.items()}
    return loss, {"model_output": detached, "loss": loss.detach().item(), "metrics": metrics}


def _read_sequences(micro_batch: Any) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The jagged micro-batch's sequences (prompt then response, 0..n-1 positions each).

    Returns:
        (B int64 token arrays, [B] int64 sequence lengths, [B] int64 prompt lengths).

    Raises:
        RequestError: a sequence without prompt tokens, or position ids other than 0..n-1.
    """
    ids = micro_batch["input_ids"]
    offsets = ids.offsets()
    seq_lens, resp_lens = _lengths(micro_batch)
    prompt_lens = (seq_lens - resp_lens).numpy().astype(np.int64)
    if (prompt_lens <= 0).any():
        raise _refuse("prompts", "a sequence without prompt tokens")
    starts = offsets[:-1].cpu().numpy()
    pos = micro_batch["position_ids"].values().cpu().numpy()
    if not np.array_equal(pos, np.arange(int(offsets[-1])) - np.repeat(starts, seq_lens.numpy())):
        raise _refuse("position_ids", "position ids other than 0..n-1 per sequence")
    flat = ids.values().cpu().numpy()
    sequences = [flat[a : a + n] for a, n in zip(starts.tolist(), seq_lens.tolist())]
    return sequences, seq_lens.numpy(), prompt_lens


def _jagged(batch: Any, v: torch.Tensor, offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[K, L] per-position values -> verl's jagged layout: token p of sequence s is predicted
    at jagged index ``offsets[s] + p - 1`` (0 where nothing is scored)."""
    seq = batch.score_seq.to(device)
    where = offsets.to(device)[seq] + batch.score_pos.to(device) - 1
    src = batch.score_flat.to(device)
    vals = v.new_zeros(int(offsets[-1])).index_put((where,), v.reshape(-1)[src])
    return torch.nested.nested_tensor_from_jagged(vals, offsets)
