"""Measure what a plan costs on this device: :func:`calibrate` -> a :class:`~treepack.proto.cost.CostModel`.

:func:`calibrate` times one training step (``packed_forward``, the SFT token-mean loss,
``backward``) of the caller's model on synthetic batches of varied shape
(:func:`calibration_batches`: GRPO groups, agent trees with a shared system prompt, plain
unshared sequences, many short ones; from under one row to several), planned by the
embedded planner (each as the tree plan and plain packing), times them in interleaved
rounds, and fits the cost model's non-negative coefficients to the median step times
(:func:`~treepack.proto.cost_fit.fit_cost_model`). The model's token-mixer kinds
(GDN, Mamba2, short conv, ...; sparse indexer attention) are read from its modules, so
their per-level and per-chunk terms are measured too. Save the result with
``cost.save(path)`` and give it to the planner (``plan_batch(..., cost_model=cost)``, the
sidecar's ``cost_model_path`` setting).

:func:`time_step` is the same measured step for one plan, to check a prediction.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from treepack.proto.cost import MIXER_KINDS, CostModel
from treepack.proto.cost_fit import fit_cost_model
from treepack.proto.errors import CostModelError, RequestError
from treepack.proto.plan import Plan
from treepack.trainer.data import materialize
from treepack.trainer.hf import packed_forward, unwrap_model
from treepack.trainer.hf.layers import layer_of
from treepack.trainer.losses import sft_loss

__all__ = ["calibrate", "calibration_batches", "time_step", "model_mixers", "model_conv_width", "CLOCKS"]

SPARSE_KINDS = ("dsa", "glm_dsa", "dsa_indexer")  # layer kinds timed by the ``sparse`` terms


def model_mixers(model: Any) -> tuple[str, ...]:
    """The model's token-mixer kinds beside attention, in :data:`~treepack.proto.cost.MIXER_KINDS` order."""
    found = set()
    for mod in unwrap_model(model).modules():
        layer = layer_of(mod)
        if layer is not None:
            found.add("sparse" if layer.kind in SPARSE_KINDS else layer.kind)
    return tuple(k for k in MIXER_KINDS if k in found)


def model_conv_width(model: Any, default: int = 4) -> int:
    """The widest depthwise causal conv of the model's mixers (the plan's ``conv_width``)."""
    widths = [
        m.kernel_size[0]
        for m in unwrap_model(model).modules()
        if isinstance(m, torch.nn.Conv1d) and m.groups == m.in_channels > 1
    ]
    return max(widths, default=default)


def _model_chunk_size(model: Any, default: int = 64) -> int:
    cfg = getattr(unwrap_model(model), "config", None)
    for name in ("mamba_chunk_size", "chunk_size"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return default


def calibration_batches(seq_len: int, *, vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    """Synthetic batches of varied shape for rows of ``seq_len`` tokens.

    Returns:
        ``dict(name, sequences, trainable, groups)`` per batch: prompt lengths as
        ``trainable``, every sequence at most ``seq_len`` tokens.
    """
    C = int(seq_len)
    rng = np.random.default_rng(seed)
    top = max(2, int(vocab))

    def toks(n: int) -> list[int]:
        return rng.integers(0, top, max(int(n), 1)).tolist()

    def tree(name: str, system: int, groups: int, group_prefix: int, per_group: int, completion: int) -> dict[str, Any]:
        sys_ = toks(system) if system else []
        seqs, prompt, grp = [], [], []
        for g in range(groups):
            pre = sys_ + toks(group_prefix)
            for _ in range(per_group):
                c = max(1, int(completion * rng.uniform(0.5, 1.5)))
                s = (pre + toks(c))[:C]
                seqs.append(s)
                prompt.append(min(len(pre), len(s) - 1))
                grp.append(g)
        return dict(name=name, sequences=seqs, trainable=prompt, groups=grp)

    def plain(name: str, n: int, lo: float, hi: float) -> dict[str, Any]:
        lens = rng.integers(max(2, int(C * lo)), max(3, int(C * hi)) + 1, n)
        seqs = [toks(x) for x in lens]
        return dict(name=name, sequences=seqs, trainable=[len(s) // 2 for s in seqs], groups=list(range(n)))

    return [
        tree("grpo 2x8", 0, 2, C // 4, 8, C // 32),
        tree("grpo 4x4", 0, 4, C // 8, 4, C // 16),
        tree("grpo 1x16", 0, 1, C // 2, 16, C // 48),
        tree("grpo 8x2", 0, 8, C // 16, 2, C // 8),
        tree("grpo 3x6", 0, 3, C // 3, 6, C // 12),
        tree("agent 3x4", C // 4, 3, C // 8, 4, C // 32),
        tree("agent 4x6", C // 8, 4, C // 16, 6, C // 64),
        tree("short 16x4", 0, 16, C // 64, 4, C // 64),
        plain("plain 6", 6, 1 / 8, 1 / 2),
        plain("plain 24", 24, 1 / 32, 1 / 8),
        plain("plain 4 long", 4, 1 / 2, 1),
        plain("plain 2", 2, 1 / 8, 1 / 4),
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(
    model: Any,
    plan: Plan,
    sequences: Sequence[Any],
    *,
    backend: str = "flash",
    varlen_fn: Callable | None = None,
    repeats: int = 3,
    warmup: int = 1,
    clock: str = "wall",
) -> float:
    """Median ms of ``repeats`` training steps of ``plan`` after ``warmup`` (forward, SFT
    token-mean loss, backward; gradients cleared before each). ``varlen_fn`` and ``clock``
    as for :func:`calibrate`."""
    device = next(unwrap_model(model).parameters()).device
    now = _clock(clock, device)
    fn = varlen_fn if varlen_fn is not None else _default_varlen(backend, device)
    batch = materialize(plan, sequences, device=device, advise=False)
    times = []
    for i in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        _sync(device)
        t0 = now()
        logits = packed_forward(model, batch, backend=backend, varlen_fn=fn)
        sft_loss(batch.target_logprobs(logits), batch, normalization="token").backward()
        _sync(device)
        if i >= warmup:
            times.append((now() - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


CLOCKS = ("wall", "cpu")


def _clock(clock: str, device: torch.device) -> Callable[[], float]:
    if clock == "wall":
        return time.perf_counter
    if clock == "cpu" and device.type == "cpu":
        return time.process_time
    raise RequestError(
        f"clock must be 'wall', or 'cpu' for a model on the CPU; got {clock!r} on {device.type}",
        path="$.clock",
        rule="enum",
    )


def _default_varlen(backend: str, device: torch.device) -> Callable | None:
    if backend != "flash" or device.type == "cuda":
        return None
    from treepack.trainer.kernels.varlen import varlen_attention

    return varlen_attention


def calibrate(
    model: Any,
    *,
    backend: str = "flash",
    seq_len: int,
    vocab: int | None = None,
    batches: Sequence[dict[str, Any]] | None = None,
    varlen_fn: Callable | None = None,
    repeats: int = 3,
    warmup: int = 1,
    min_shared_len: int | None = None,
    seed: int = 0,
    planner: Any = None,
    report: Callable[[str, Plan, float], None] | None = None,
    clock: str = "wall",
) -> CostModel:
    """Measure the cost model of ``model`` with ``backend`` on this device.

    Args:
        model: an HF causal LM as :func:`~treepack.trainer.packed_forward` takes it, on its device.
        backend: ``sdpa`` | ``flex`` | ``flash``.
        seq_len: row capacity C of the plans to measure (that of the training run).
        vocab: token ids are drawn below this (default: the model's ``vocab_size``).
        batches: the batches to time (default :func:`calibration_batches`), each
            ``dict(sequences, trainable, groups)``; each is timed twice (as the tree and
            as plain packing), so at least half as many batches as the model has cost terms
            (fewer are refused before anything is timed: the fit would be underdetermined).
        varlen_fn: the ``flash`` kernel (default: flash-attn on CUDA, the batched CPU
            kernel :func:`~treepack.trainer.kernels.varlen.varlen_attention` elsewhere).
        repeats, warmup: timed and untimed rounds; a round steps every plan once (so a
            change in load reaches all alike), and each plan's median is fitted.
        min_shared_len: planner option (default ``min(64, max(1, seq_len // 64))``).
        seed: of the synthetic batches.
        planner: a ``treepack.client.Packer`` (default: embedded).
        report: called with (batch name, plan, median ms) for each plan at the end.
        clock: ``wall`` (default; synchronized on CUDA), or ``cpu``: the process's CPU
            time, for a model on the CPU of a machine that other work shares (with
            ``torch.set_num_threads(1)`` it is the step's wall time on a quiet machine,
            without the other processes' share).

    Returns:
        The fitted :class:`~treepack.proto.cost.CostModel`; ``fit`` holds its errors on
        these batches and held out (leave-one-out: each plan's time predicted by the fit to
        the others), the rank of the measured features and the number of terms
        (:func:`~treepack.proto.cost_fit.fit_cost_model`).

    Raises:
        CostModelError: fewer plans to time than cost terms (before any timing).
    """
    from treepack.client import Packer

    hf = unwrap_model(model)
    device = next(hf.parameters()).device
    mixers = model_mixers(model)
    conv_width = model_conv_width(model)
    vocab = int(vocab if vocab is not None else getattr(hf.config, "vocab_size", 1024))
    fn = varlen_fn if varlen_fn is not None else _default_varlen(backend, device)
    msl = min_shared_len if min_shared_len is not None else min(64, max(1, seq_len // 64))
    todo = list(batches) if batches is not None else calibration_batches(seq_len, vocab=vocab, seed=seed)
    packer = planner if planner is not None else Packer()
    chunk = _model_chunk_size(model)
    terms = _terms(backend, mixers)
    if 2 * len(todo) < len(terms):
        raise CostModelError(
            f"{len(todo)} batches (timed as {2 * len(todo)} plans) cannot determine the {len(terms)} cost terms "
            f"of this model ({', '.join(terms)}): give at least {-(-len(terms) // 2)} batches",
            path="$.batches",
            rule="underdetermined",
        )
    probe = CostModel(backend=backend, mixers=mixers, chunk_size=chunk, coefficients={t: 0.0 for t in terms})
    plans, names = _plans(packer, todo, seq_len=seq_len, min_shared_len=msl, conv_width=conv_width)

    def run(plan: Plan, seqs: Any) -> float:
        return time_step(model, plan, seqs, backend=backend, varlen_fn=fn, repeats=1, warmup=0, clock=clock)

    for _ in range(warmup):
        for plan, seqs in plans:
            run(plan, seqs)
    # Interleaved rounds (each plan once per round, the median kept): a change in the
    # machine's load reaches every plan alike instead of the ones timed during it.
    rounds = np.array([[run(plan, seqs) for plan, seqs in plans] for _ in range(repeats)])
    times = np.median(rounds, axis=0)
    feats = [probe.features(plan) for plan, _ in plans]
    if report is not None:
        for name, (plan, _), ms in zip(names, plans, times):
            report(name, plan, float(ms))
    dev = _device_description(device)
    dtype = next(hf.parameters()).dtype
    desc = f"{type(hf).__name__} {dtype}, backend {backend}, seq_len {seq_len}, {len(times)} plans, {clock} clock"
    return fit_cost_model(
        np.stack(feats), times, backend=backend, mixers=mixers, chunk_size=chunk, device=dev, description=desc
    )


def _plans(
    packer: Any, batches: Sequence[dict[str, Any]], *, seq_len: int, min_shared_len: int, conv_width: int
) -> tuple[list[tuple[Plan, Any]], list[str]]:
    """Each batch planned twice, as the tree plan (``auto``) and as plain packing (``no_share``).

    Args:
        packer: the planner (``pack``).
        batches: ``dict(sequences, trainable, groups[, name])`` each.
        seq_len, min_shared_len, conv_width: the planner's options.

    Returns:
        ([(plan, sequences)], ["name / placement"]) in the same order.
    """
    plans, names = [], []
    for b in batches:
        for placement in ("auto", "no_share"):
            plan = packer.pack(
                b["sequences"],
                trainable=b["trainable"],
                groups=b.get("groups"),
                seq_len=seq_len,
                min_shared_len=min_shared_len,
                conv_width=conv_width,
                placement=placement,
                record=False,
            )
            plans.append((plan, b["sequences"]))
            names.append(f"{b.get('name', '')} / {placement}")
    return plans, names


def _device_description(device: torch.device) -> str:
    """The device, its name (CUDA) or machine, the threads and the torch version, for the cost model."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    return f"{device.type} {name}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def _terms(backend: str, mixers: Sequence[str]) -> tuple[str, ...]:
    from treepack.proto.cost import cost_terms

    return cost_terms(backend, mixers)
