"""A parity report a user can run and paste: :func:`parity_report` -> :class:`ParityReport`.

On the user's own model and a sample of their packed batch it measures what "exact" means at
the precision the step computes in:

- per-token log-probability drift of the packed rows against each sequence run alone (max,
  p99, p50 over every scored token of the sample);
- the same figures for the same sequences in other legal unpacked batch shapes (all
  right-padded into one batch; reordered into two batches): the model's own **noise floor**
  at this precision (the figure the run-time probe accepts packed drift against:
  :mod:`~treepack.trainer.hf.admission.tolerance`);
- gradient drift per parameter group (``model.layers.*.mlp.up_proj.weight``: every layer's
  tensor of that name), ``|g - g_alone| / |g_alone|`` of the sum of the sample's scored
  log-probabilities, packed and for the noise floor;
- how many scored tokens cross a PPO clip band: ``|exp(lp - lp_alone) - 1| > epsilon``
  (default 0.2), the tokens whose clipped ratio would change if the old policy's
  log-probabilities came from the other shape.

:meth:`ParityReport.table` renders it as Markdown tables. Every run goes through the model
as passed (its wrappers) under the caller's autocast, from one seed, in the caller's mode;
the caller's random stream and ``.grad`` are left as they were. Its cost: one packed
forward and backward of the batch, and each sampled sequence alone and in two more shapes,
forward and backward; with ``grads`` one copy of the trainable parameters' gradients is held.
In a distributed run (DDP, FSDP) every rank calls it with the same ``sequences``
(:func:`sample_on_every_rank`): their forwards are collective.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.distributed import comm_device
from treepack.trainer.hf.admission.draws import watch_forward
from treepack.trainer.hf.admission.measure import SHAPES, alone_logprobs, own_random_stream, padded_logprobs, seed
from treepack.trainer.hf.admission.measure import upcast as _upcast
from treepack.trainer.hf.admission.probe import checkpointing
from treepack.trainer.hf.admission.tolerance import MULTIPLE, grad_floor, logprob_floor, logprob_scale
from treepack.trainer.hf.context import use_packed
from treepack.trainer.hf.forward import packed_forward
from treepack.trainer.hf.wrapped import no_sync, unwrap_model

__all__ = ["ParityReport", "Drift", "parity_report", "parameter_group", "sample_on_every_rank"]

PACKED = "packed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Drift:
    """Per-token |lp - lp_alone| over the scored tokens of the sample, and PPO clip crossings.

    Attributes:
        max, p99, p50: of the absolute drift (nats).
        clipped: scored tokens with ``|exp(lp - lp_alone) - 1| > epsilon``.
    """

    max: float
    p99: float
    p50: float
    clipped: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ParityReport:
    """What :func:`parity_report` measured.

    Attributes:
        model: the model's class; setup: backend, mode, checkpointing, parameter dtype, autocast.
        compute_dtype: the coarsest float dtype the forward computes in.
        sequences, tokens: the sample (scored tokens compared).
        epsilon: the PPO clip band.
        drift: ``{"packed": Drift, <shape>: Drift}`` against each sequence alone.
        noise_floor: the larger of the shapes' max drift and the compute dtype's rounding
            floor (:func:`~treepack.trainer.hf.admission.tolerance.logprob_floor`).
        grads: ``(group, packed relative drift, unpacked shapes' relative drift)`` per
            parameter group (empty without gradients).
        grad_floor: the gradients' relative noise floor: the largest shape drift of any group
            (rounding noise scales with a gradient's magnitude, and a group whose own shape
            drift happens to be tiny still receives every other layer's noise), at least the
            compute dtype's rounding floor (:func:`~treepack.trainer.hf.admission.tolerance.grad_floor`).
    """

    model: str
    setup: str
    compute_dtype: str
    sequences: int
    tokens: int
    epsilon: float
    drift: dict[str, Drift]
    noise_floor: float
    grads: tuple[tuple[str, float, float], ...]
    grad_floor: float = 0.0

    @property
    def noise(self) -> Drift:
        """The noise floor's figures: per statistic, the largest over the unpacked shapes."""
        shapes = [d for k, d in self.drift.items() if k != PACKED]
        return Drift(
            max=max(d.max for d in shapes),
            p99=max(d.p99 for d in shapes),
            p50=max(d.p50 for d in shapes),
            clipped=max(d.clipped for d in shapes),
        )

    @property
    def ratio(self) -> float:
        """Packed max logprob drift / noise floor (the run-time probe accepts up to its stated multiple)."""
        return self.drift[PACKED].max / self.noise_floor if self.noise_floor > 0 else 0.0

    @property
    def grad_ratio(self) -> float:
        """The largest packed gradient drift of a group / the gradients' noise floor (0 without gradients)."""
        return max((p for _, p, _ in self.grads), default=0.0) / self.grad_floor if self.grad_floor > 0 else 0.0

    def table(self) -> str:
        """The report as Markdown tables (paste it into a bug report)."""
        n = self.tokens
        lines = [
            f"treepack parity report: {self.model} ({self.setup}); computes in {self.compute_dtype}; "
            f"{self.sequences} sequences, {n} scored tokens",
            "",
            f"| per-token logprob drift vs alone | max | p99 | p50 | PPO clip crossings (eps {self.epsilon:g}) |",
            "|---|---|---|---|---|",
        ]
        for k, d in self.drift.items():
            lines.append(f"| {k} | {d.max:.3g} | {d.p99:.3g} | {d.p50:.3g} | {d.clipped} / {n} |")
        lines.append(
            f"| noise floor (unpacked shapes, at least {self.compute_dtype} rounding) | {self.noise_floor:.3g} "
            f"| {self.noise.p99:.3g} | {self.noise.p50:.3g} | {self.noise.clipped} / {n} |"
        )
        lines += [
            "",
            f"packed max logprob drift = {self.ratio:.2f}x the noise floor (the probe accepts up to {MULTIPLE:g}x)",
        ]
        if self.grads:
            lines += [
                "",
                "| gradient drift, norm(g - g_alone) / norm(g_alone) | packed | unpacked shapes | packed / floor |",
                "|---|---|---|---|",
            ]
            for name, p, q in self.grads:
                lines.append(f"| {name} | {p:.3g} | {q:.3g} | {p / self.grad_floor:.2f}x |")
            lines += [
                "",
                f"gradient noise floor {self.grad_floor:.3g} (the largest group's shape drift, at least "
                f"{self.compute_dtype} rounding); packed worst group = {self.grad_ratio:.2f}x it",
            ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def parameter_group(name: str) -> str:
    """A parameter's group: its name with every layer index replaced by ``*``."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


def _drift(ref: list[torch.Tensor], got: list[torch.Tensor], epsilon: float) -> Drift:
    d = torch.cat([(g - r)[~torch.isnan(r)].double() for r, g in zip(ref, got)])
    if d.numel() == 0:
        return Drift(max=0.0, p99=0.0, p50=0.0, clipped=0)
    a = d.abs().cpu().numpy()
    bad = float(np.isnan(a).sum())
    a = np.nan_to_num(a, nan=np.inf)
    return Drift(
        max=float(a.max()),
        p99=float(np.quantile(a, 0.99)),
        p50=float(np.quantile(a, 0.5)),
        clipped=int(((d.exp() - 1).abs() > epsilon).sum()) + int(bad),
    )


def _params(hf: Any) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in hf.named_parameters() if p.requires_grad]


def _grads(hf: Any, loss: torch.Tensor, reentrant: bool) -> list[torch.Tensor | None]:
    """The gradient of ``loss`` for every trainable parameter; ``.grad`` left as it was."""
    params = [p for _, p in _params(hf)]
    if not reentrant:
        return [None if g is None else g.detach() for g in torch.autograd.grad(loss, params, allow_unused=True)]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        loss.backward()
        return [None if p.grad is None else p.grad.detach() for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def _sum_lp(lps: list[torch.Tensor], scored: list[torch.Tensor]) -> torch.Tensor:
    # The sum, not the mean: per-token gradients of order 1 keep fp16 out of its subnormal
    # range, as a loss scaler does (a mean over 500 tokens puts attention's fp16 gradients
    # there, where they round 2% apart).
    return sum(torch.where(m, x, torch.zeros_like(x)).sum() for x, m in zip(lps, scored))


def _sample(batch: PackedBatch, sequences: int | None) -> list[int]:
    if batch.cp is not None:
        raise RequestError(
            "parity_report runs whole rows; this batch is one context-parallel shard (pass batch.cp_full's rows)",
            path="$.batch.cp",
            rule="cp_shard",
        )
    here = [int(s) for s in batch.local_seqs.tolist()]
    if sequences is not None and sequences < 1:
        raise RequestError(f"sequences must be >= 1, got {sequences}", path="$.sequences", rule="range")
    return here if sequences is None else here[:sequences]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _class_name(hf: Any) -> str:
    """The model's class name; under FSDP2 (``fully_shard`` swaps in a subclass ``FSDP<class>``) the class it wraps."""
    cls = type(hf)
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)  # not imported: no FSDP2 model
    if fsdp is not None and isinstance(hf, fsdp):
        cls = next((c for c in cls.__mro__[1:] if not issubclass(c, fsdp)), cls)
    return cls.__name__


def _setup(hf: Any, backend: str) -> str:
    p = next(hf.parameters())
    on, reentrant = checkpointing(hf)
    dev = p.device.type
    ac = f"autocast {_name(torch.get_autocast_dtype(dev))}" if torch.is_autocast_enabled(dev) else "no autocast"
    ckpt = f", checkpointing{' (reentrant)' if reentrant else ''}" if on else ""
    return f"{backend}, {'train' if hf.training else 'eval'}{ckpt}, {_name(p.dtype)} on {p.device}, {ac}"


def sample_on_every_rank(batch: PackedBatch, most: int = 16) -> int:
    """How many sequences every rank can compare: at most ``most``, at most what the batch of
    each rank of the default process group holds (one all-reduce). A drop-in calls this before
    :func:`parity_report` on every rank, since DDP and FSDP forwards are collective: each
    rank must run as many as the others."""
    n = torch.tensor([min(most, len(batch.local_seqs))], dtype=torch.int64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        n = n.to(comm_device())
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
    return int(n.item())


def parity_report(
    model: Any,
    batch: PackedBatch,
    *,
    backend: str = "sdpa",
    sequences: int | None = 16,
    epsilon: float = 0.2,
    grads: bool = True,
    **options: Any,
) -> ParityReport:
    """Measure packed rows against each sequence alone and the model's own noise floor.

    Args:
        model: the HF causal LM as the step runs it (bare or wrapped), in its training mode,
            under the step's autocast (call this inside it).
        batch: a packed batch of whole rows (:func:`~treepack.trainer.materialize`).
        backend: ``sdpa`` | ``flex`` | ``flash``.
        sequences: how many of the batch's sequences to compare (the first ones; None: all).
        epsilon: the PPO clip band of the crossing counts.
        grads: also measure gradient drift per parameter group (needs gradients enabled).
        **options: :func:`~treepack.trainer.hf.packed_forward` options (``varlen_fn``,
            ``compile``, ``allow_dropout``, ``allow_stochastic``); the packed call runs its
            static admission but not the probe.

    Returns:
        The :class:`ParityReport` (``print(report)`` gives the table).

    Raises:
        RequestError: a CP shard, ``sequences`` < 1, or ``epsilon`` not positive.
        UnsupportedModelError: the model's static admission refuses it.
    """
    if not epsilon > 0:
        raise RequestError(f"epsilon must be > 0, got {epsilon}", path="$.epsilon", rule="range")
    hf = unwrap_model(model)
    sample = _sample(batch, sequences)
    seqs = []
    for s in sample:
        row, idx = batch.locate(s)
        seqs.append(batch.input_ids[row, idx.to(batch.input_ids.device)])
    grads = grads and torch.is_grad_enabled()
    on, reentrant = checkpointing(hf)
    reentrant = bool(reentrant) if on else False
    runs: dict[str, list[torch.Tensor]] = {}
    drifts: dict[str, list[float]] = {}
    with own_random_stream(seqs[0].device), use_packed(None), no_sync(model):
        watch = watch_forward(hf, max(seqs, key=lambda s: s.shape[0]))
        seed()
        logits = packed_forward(model, batch, backend=backend, verify=False, **options)
        got = batch.unpack_logprobs(batch.target_logprobs(_upcast(logits)))
        runs[PACKED] = [got[s] for s in sample]  # type: ignore[misc]
        scored = [~torch.isnan(x) for x in runs[PACKED]]
        mask = lambda lps: [torch.where(m, x, torch.full_like(x, float("nan"))) for x, m in zip(lps, scored)]  # noqa: E731
        alone = mask(alone_logprobs(model, seqs))
        ref = _grads(hf, _sum_lp(alone, scored), reentrant) if grads else []
        for name in [PACKED, *SHAPES]:
            lps = runs[PACKED] if name == PACKED else mask(padded_logprobs(model, seqs, name))
            runs[name] = lps
            if grads:
                drifts[name] = [_sq_diff(a, b) for a, b in zip(ref, _grads(hf, _sum_lp(lps, scored), reentrant))]
    alone_d = [x.detach() for x in alone]
    drift = {k: _drift(alone_d, [x.detach() for x in v], epsilon) for k, v in runs.items()}
    noise = max(d.max for k, d in drift.items() if k != PACKED)
    eps = torch.finfo(watch.compute_dtype).eps
    groups = _groups(hf, ref, drifts) if grads else ()
    shape_noise = torch.tensor([max((q for _, _, q in groups), default=0.0)], dtype=torch.float64)
    gfloor = grad_floor(shape_noise, torch.ones(1, dtype=torch.float64), eps)[1] if groups else 0.0
    return ParityReport(
        model=_class_name(hf),
        setup=_setup(hf, backend),
        compute_dtype=_name(watch.compute_dtype),
        sequences=len(sample),
        tokens=int(sum(int(m.sum()) for m in scored)),
        epsilon=float(epsilon),
        drift=drift,
        noise_floor=logprob_floor(noise, logprob_scale(alone_d), eps),
        grads=groups,
        grad_floor=gfloor,
    )


def _sq_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    return float((b.double() - a.double()).pow(2).sum())


def _groups(hf: Any, ref: list[torch.Tensor | None], drifts: dict[str, list[float]]) -> tuple:
    """(group, packed relative drift, noise relative drift) per parameter group, in model order."""
    acc: dict[str, list[float]] = {}
    for (name, _), g, *d in zip(_params(hf), ref, *(drifts[k] for k in drifts)):
        row = acc.setdefault(parameter_group(name), [0.0] * (1 + len(d)))
        row[0] += 0.0 if g is None else float(g.double().pow(2).sum())
        for i, v in enumerate(d):
            row[1 + i] += v
    out = []
    for name, (norm, packed, *shapes) in acc.items():
        scale = norm**0.5 if norm > 0 else 1.0
        out.append((name, packed**0.5 / scale, max(shapes) ** 0.5 / scale))
    return tuple(out)
