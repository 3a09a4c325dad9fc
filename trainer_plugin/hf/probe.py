"""Run-time proof that packing is exact for one model setup: :func:`verify_packing`.

:func:`~treepack.trainer.hf.support.check_model` reads a model's structure; it cannot see
what runs (a layer that does not pass its context on, a mask a model builds for itself, a
hook). So before the first packed step of a setup, :func:`~treepack.trainer.hf.packed_forward`
runs a small probe on the model itself and refuses the setup unless packing is exact:

- a tree batch built from the model's own config (:func:`probe_sequences`): every
  sequence longer than the largest window, chunk or convolution the config declares,
  several trees in one row, a branch inside a chunk, shared scored tokens (a deep tree),
  a strict prefix and a sequence of its own;
- the packed forward (through :func:`packed_forward`, with the caller's backend) against
  every sequence alone, with the model as the caller holds it: train or eval mode,
  gradient checkpointing (reentrant or not), dtype, device;
- forward log-probabilities and gradients: a fixed random weighting of every scored
  log-probability is backpropagated, and every parameter's gradient is reduced to its
  norm and three random projections (so nothing of the model's size is kept twice);
- tolerances from the dtype, measured rather than guessed: the unpacked path's own noise
  is the difference between each sequence alone and all of them right-padded in one
  batch (two batch shapes, the same mathematics). Packed log-probabilities must lie within
  4x that noise plus a floor of a few ulps of the dtype, each parameter's projected
  gradient within 8x its noise plus a floor (the larger of 1024 ulps capped at 1e-3, and
  two ulps) of its norm. When the two unpacked shapes
  themselves differ by more than the dtype allows, something random runs (dropout) or
  the model reads the batch shape, and the probe refuses too: it cannot prove anything.

On a mismatch it raises :class:`~treepack.proto.errors.UnsupportedModelError` naming the
first module whose output diverges (a forward pass with every module's output hooked,
compared module by module in the order they finish), or, when every output agrees but the
gradients do not (a checkpoint replay that ran something else), the last module, in
forward order, whose parameters' gradients differ, with the measured error and its bound.

A passing probe is remembered per model and :func:`probe_signature` (backend, layer
patches, train/eval, checkpointing and its reentrancy, dtype, device), so each setup is
proven once per process. The random streams of torch (CPU and the model's device) are
forked: the caller's random draws are unchanged by the probe.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer.hf.walk_cache import forget_walks

__all__ = [
    "ProbeReport",
    "verify_packing",
    "dropout_off",
    "run_probe",
    "probe_signature",
    "probe_sequences",
    "declared_sizes",
    "forget_probes",
]

PROBE_SEED = 1729
NOISE_FACTOR = 4.0
# Floors, in units of the dtype's eps: the unpacked noise can be exactly 0 in fp32 (same
# kernels on both shapes) while packing reorders sums. Capped so a coarse dtype still
# relies on its measured noise, not on a floor wider than a real discrepancy.
LOGPROB_FLOOR_EPS, GRAD_FLOOR_EPS = 64, 1024
FLOOR_CAP = 1e-3
# Beyond this relative difference between the two unpacked batch shapes, the unpacked path
# is not deterministic (dropout, batch-dependent code) and no tolerance can be derived.
NOISE_CAP = 0.05
_PROJECTIONS = 3
_MIN_SPAN = 16
_SIZE_FIELD = re.compile(r"window|chunk|conv_kernel|d_conv|conv_L_cache|conv_width")
_DROPOUT = re.compile(r"dropout|pdrop|drop_rate|drop_prob", re.I)
_SUBCONFIGS = ("text_config", "decoder", "language_config", "llm_config")

_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, ProbeReport]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """What a passing probe measured.

    Attributes:
        signature: the :func:`probe_signature` it proved.
        tokens: tokens of the probe's sequences (each alone).
        logprob_err: max |packed - alone| over every scored log-probability.
        logprob_tol: the bound it had to stay under.
        grad_err: max over parameters of |packed - alone| projected gradient / the bound.
        seconds: wall time of the probe.
    """

    signature: tuple
    tokens: int
    logprob_err: float
    logprob_tol: float
    grad_err: float
    seconds: float


def _configs(hf: Any) -> list[Any]:
    cfg = getattr(hf, "config", None)
    out = [cfg] if cfg is not None else []
    out += [
        getattr(cfg, a)
        for a in _SUBCONFIGS
        if getattr(cfg, a, None) is not None and hasattr(getattr(cfg, a), "to_dict")
    ]
    return out


def declared_sizes(hf: Any) -> dict[str, int]:
    """Every window, chunk and convolution width the model's config declares (``{field: size}``).

    Integer fields (or lists of integers, per layer) whose names say window / chunk / conv
    kernel; a size at or above ``max_position_embeddings`` never applies and is left out.
    """
    out: dict[str, int] = {}
    for cfg in _configs(hf):
        limit = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        for k, v in vars(cfg).items():
            if not _SIZE_FIELD.search(k) or isinstance(v, bool):
                continue
            vals = [
                x
                for x in (v if isinstance(v, (list, tuple)) else [v])
                if isinstance(x, int) and not isinstance(x, bool)
            ]
            vals = [x for x in vals if 1 < x < limit]
            if vals:
                out[k] = max(out.get(k, 0), max(vals))
    return out


def probe_sequences(hf: Any) -> tuple[list[np.ndarray], int]:
    """The probe's sequences for ``hf`` and the span W they cross.

    W is the largest declared size (:func:`declared_sizes`), at least 16. Trees: a prompt
    of W/2 + 3 tokens (its branch point falls inside a chunk) with a completion of W + 5
    tokens, a second completion that shares its first 3 scored tokens, a short one and a
    strict prefix of the prompt; a 7-token prompt with two completions; a sequence of
    W + 3 tokens on its own.

    Returns:
        (sequences as int64 arrays, W).
    """
    cfg = _configs(hf)[-1] if _configs(hf) else None
    vocab = int(getattr(cfg, "vocab_size", 0) or getattr(getattr(hf, "config", None), "vocab_size", 0) or 2)
    span = max([_MIN_SPAN, *declared_sizes(hf).values()])
    rng = np.random.default_rng(PROBE_SEED)
    r = lambda n: rng.integers(0, vocab, n, dtype=np.int64)  # noqa: E731
    p = span // 2 + 3
    prompt = r(p)
    a0 = np.concatenate([prompt, r(span + 5)])
    a1 = np.concatenate([a0[: p + 3], r(span // 3 + 2)])
    q = r(7)
    seqs = [
        a0,
        a1,
        np.concatenate([prompt, r(4)]),
        prompt[: max(2, p // 2)].copy(),
        np.concatenate([q, r(span // 2 + 1)]),
        np.concatenate([q, r(3)]),
        r(span + 3),
    ]
    return seqs, span


def _checkpointing(hf: torch.nn.Module) -> tuple[bool, Any]:
    """(whether checkpointing runs in this mode, use_reentrant of its function or None)."""
    on = hf.training and any(getattr(m, "gradient_checkpointing", False) is True for m in hf.modules())
    fn = next(
        (
            m.__dict__.get("_gradient_checkpointing_func")
            for m in hf.modules()
            if "_gradient_checkpointing_func" in m.__dict__
        ),
        None,
    )
    reentrant = getattr(fn, "keywords", {}).get("use_reentrant") if fn is not None else None
    return on, reentrant


def probe_signature(hf: torch.nn.Module, *, backend: str, patch_layers: bool = True) -> tuple:
    """What a passing probe proves for ``hf``: (backend, patch_layers, training, checkpointing,
    reentrant, dtype, device, gradients enabled, autocast dtype or None)."""
    p = next(hf.parameters(), None)
    on, reentrant = _checkpointing(hf)
    dev = p.device.type if p is not None else "cpu"
    autocast = str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
    return (
        backend,
        bool(patch_layers),
        bool(hf.training),
        on,
        reentrant if on else None,
        str(p.dtype) if p is not None else "",
        str(p.device) if p is not None else "",
        torch.is_grad_enabled(),
        autocast,
    )


@contextmanager
def dropout_off(hf: torch.nn.Module) -> Iterator[None]:
    """Every dropout rate of ``hf`` (modules, module attributes, config fields) at 0 inside the block."""
    saved: list[tuple[Any, str, Any]] = []
    objs: list[Any] = list(hf.modules()) + [c for c in _configs(hf)]
    for obj in objs:
        if isinstance(obj, torch.nn.modules.dropout._DropoutNd):
            saved.append((obj, "p", obj.p))
            obj.p = 0.0
        for name, v in list(vars(obj).items()):
            if _DROPOUT.search(name) and isinstance(v, float) and v > 0:
                saved.append((obj, name, v))
                setattr(obj, name, 0.0)
    try:
        yield
    finally:
        for obj, name, v in reversed(saved):
            setattr(obj, name, v)


def forget_probes(hf: torch.nn.Module | None = None) -> None:
    """Drop the remembered probes and model walks (of ``hf``, or all): the next packed call walks and probes again."""
    forget_walks(hf)
    if hf is None:
        _VERIFIED.clear()
    else:
        _VERIFIED.pop(hf, None)


@contextmanager
def _own_random_stream(device: torch.device) -> Iterator[None]:
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if device.type != "cpu" else "cuda"):
        yield


def _seed() -> None:
    torch.manual_seed(PROBE_SEED)


def _alone_logprobs(hf: Any, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence [n]: NaN at 0, then log p(token i | tokens < i), each sequence run alone."""
    out = []
    for s in seqs:
        _seed()
        logits = hf(input_ids=s[None], use_cache=False).logits[0].float()
        out.append(_shifted(logits, s))
    return out


def _right_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` ids and attention mask of the sequences right-padded into one batch."""
    n = max(s.shape[0] for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.int64, device=seqs[0].device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = 1
    return ids, mask


def _padded_logprobs(hf: Any, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same as :func:`_alone_logprobs`, all sequences right-padded into one batch."""
    ids, mask = _right_padded(seqs)
    _seed()
    logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    return [_shifted(logits[i, : s.shape[0]], s) for i, s in enumerate(seqs)]


def _shifted(logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None])[:, 0]
    return torch.cat([lp.new_full((1,), float("nan")), lp])


def _weighted(lps: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    return sum((torch.where(torch.isnan(lp), torch.zeros_like(lp), lp) * w).sum() for lp, w in zip(lps, weights))


def _projected_grads(
    hf: torch.nn.Module, loss: torch.Tensor, reentrant: bool, want: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] gradient norms, [P, 3] random projections) of every trainable parameter.

    With reentrant checkpointing ``torch.autograd.grad`` is refused by torch, so the
    gradients go through ``.grad`` (the caller's ``.grad`` are put back afterwards);
    otherwise ``autograd.grad`` leaves ``.grad`` and gradient hooks (DDP) alone.
    """
    params = [p for p in hf.parameters() if p.requires_grad] if want else []
    if not params:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, _PROJECTIONS, dtype=torch.float64)
    if reentrant:
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss.backward()
            grads = [p.grad for p in params]
        finally:
            for p, g in zip(params, saved):
                p.grad = g
    else:
        grads = list(torch.autograd.grad(loss, params, allow_unused=True))
    norms = torch.zeros(len(params), dtype=torch.float64)
    proj = torch.zeros(len(params), _PROJECTIONS, dtype=torch.float64)
    for i, g in enumerate(grads):
        if g is None:
            continue
        flat = g.detach().reshape(-1).float()
        norms[i] = float(flat.norm())
        gen = torch.Generator(device=flat.device).manual_seed(PROBE_SEED + i)
        for k in range(_PROJECTIONS):
            proj[i, k] = float(flat @ torch.randn(flat.shape[0], generator=gen, device=flat.device))
    return norms, proj


def _lp_err(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    worst = 0.0
    for r, g in zip(ref, got):
        if not torch.equal(torch.isnan(r), torch.isnan(g)):
            return float("inf")
        keep = ~torch.isnan(r)
        if bool(keep.any()):
            worst = max(worst, float((r[keep].double() - g[keep].double()).abs().max()))
    return worst


def _lp_scale(ref: list[torch.Tensor]) -> float:
    return max(1.0, max(float(torch.nan_to_num(r.double()).abs().max()) for r in ref))


def run_probe(
    model: Any,
    *,
    run_packed: Callable[[Any], torch.Tensor],
    plan_and_batch: Callable[[list[np.ndarray]], tuple[Any, Any]],
    signature: tuple = (),
) -> ProbeReport:
    """Run the probe once (no cache): packed vs every sequence alone, forward and gradients.

    Args:
        model: the unwrapped HF causal LM, in the caller's mode.
        run_packed: batch -> [K, L, V] logits of the packed call (the caller's backend).
        plan_and_batch: sequences -> (plan, PackedBatch) with every token after the first scored.
        signature: recorded in the report.

    Returns:
        The :class:`ProbeReport`.

    Raises:
        UnsupportedModelError: packed and alone differ beyond the measured bound (naming the
            first diverging module), or the unpacked path is not deterministic.
    """
    t0 = time.perf_counter()
    hf = model
    first = next(hf.parameters())
    device, dtype = first.device, first.dtype
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    _, reentrant = _checkpointing(hf)
    reentrant = bool(reentrant) if _checkpointing(hf)[0] else False
    arrays, span = probe_sequences(hf)
    plan, batch = plan_and_batch(arrays)
    seqs = [torch.as_tensor(a, device=device) for a in arrays]
    gen = torch.Generator().manual_seed(PROBE_SEED)
    weights = [torch.randn(s.shape[0], generator=gen).to(device) for s in seqs]
    # Gradients are proven where the caller computes them (a no-grad scoring call proves the forward).
    grads = torch.is_grad_enabled()
    with _own_random_stream(device):
        alone = _alone_logprobs(hf, seqs)
        g_alone = _projected_grads(hf, _weighted(alone, weights), reentrant, grads)
        padded = _padded_logprobs(hf, seqs)
        g_padded = _projected_grads(hf, _weighted(padded, weights), reentrant, grads)
        _seed()
        lp = batch.target_logprobs(run_packed(batch).float())
        packed = [x for x in batch.unpack_logprobs(lp)]
        g_packed = _projected_grads(hf, _weighted(packed, weights), reentrant, grads)
    alone = [x.detach() for x in alone]
    scale = _lp_scale(alone)
    noise = _lp_err(alone, [x.detach() for x in padded])
    norms = g_alone[0]
    gscale = torch.clamp(norms, min=1e-3 * float(norms.max()) if norms.numel() else 0.0)
    gnoise = (g_padded[1] - g_alone[1]).abs().amax(1) if norms.numel() else norms
    what = f"{type(hf).__name__} ({', '.join(f'{k}={v}' for k, v in zip(('backend', 'patch_layers', 'training', 'checkpointing', 'reentrant', 'dtype', 'device'), signature))})"
    if noise > NOISE_CAP * scale or bool((gnoise > NOISE_CAP * gscale).any()):
        path = _first_divergence(hf, seqs, lambda: _padded_outputs(hf, seqs), NOISE_CAP)
        raise UnsupportedModelError(
            f"{what}: the unpacked model is not deterministic across batch shapes (each sequence alone vs right-padded: "
            f"logprobs differ by {noise:.3g}); something random or batch-dependent runs{_at(path, _cls(hf, path))}, so packing cannot be verified "
            "(dropout while training? call model.eval() or set the dropout to 0)",
            path="$.model" + (f".{path}" if path else ""),
            rule="probe_nondeterministic",
        )
    floor = min(LOGPROB_FLOOR_EPS * eps, FLOOR_CAP)
    lp_tol = NOISE_FACTOR * noise + floor * scale
    lp_err = _lp_err(alone, [x.detach() for x in packed])
    # Gradients sum over every position and layer: a coarse dtype keeps two of its ulps.
    gfloor = max(min(GRAD_FLOOR_EPS * eps, FLOOR_CAP), 2 * eps)
    gtol = 2 * NOISE_FACTOR * gnoise + gfloor * gscale
    gerr = (g_packed[1] - g_alone[1]).abs().amax(1)
    ratio = gerr / gtol
    grad_ratio = float(ratio.max()) if ratio.numel() else 0.0
    if lp_err > lp_tol or grad_ratio > 1.0:
        rel = lp_tol / scale
        path = _first_divergence(hf, seqs, lambda: _packed_outputs(hf, batch, run_packed), rel)
        kind = "forward output"
        if path is None and grad_ratio > 1.0:
            path, kind = _gradient_divergence(hf, ratio), "parameter gradients"
        msg = (
            f"{what}: packed rows differ from each sequence alone: logprobs by {lp_err:.3g} (bound {lp_tol:.3g}), "
            f"gradients up to {grad_ratio:.3g}x their bound; first diverging {kind}{_at(path, _cls(hf, path))}"
        )
        raise UnsupportedModelError(
            msg,
            path="$.model" + (f".{path}" if path else ""),
            rule="probe_mismatch",
            refusals=((path or "", _cls(hf, path), msg),),
        )
    return ProbeReport(
        signature=signature,
        tokens=int(sum(a.shape[0] for a in arrays)),
        logprob_err=lp_err,
        logprob_tol=lp_tol,
        grad_err=grad_ratio,
        seconds=time.perf_counter() - t0,
    )


def _at(path: str | None, cls: str = "") -> str:
    return (f": {path} ({cls})" if cls else f": {path}") if path else ""


def _cls(hf: Any, path: str | None) -> str:
    if not path:
        return type(hf).__name__
    try:
        return type(hf.get_submodule(path)).__name__
    except AttributeError:
        return ""


def _gradient_divergence(hf: Any, ratio: torch.Tensor) -> str | None:
    """The owner of the last parameter, in registration (forward) order, whose gradient is off."""
    names = [n for n, p in hf.named_parameters() if p.requires_grad]
    bad = [n for n, r in zip(names, ratio.tolist()) if r > 1.0]
    if not bad:
        return None
    name = bad[-1]
    return name.rsplit(".", 1)[0] if "." in name else name


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((x for x in out if isinstance(x, torch.Tensor)), None)
    if hasattr(out, "to_tuple"):
        return next((x for x in out.to_tuple() if isinstance(x, torch.Tensor)), None)
    return None


def _first_tensor_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    return _first_tensor(tuple(args) + tuple(kwargs.values()))


@contextmanager
def _recording(hf: Any) -> Iterator[list[tuple[tuple[str, str], torch.Tensor]]]:
    """Every module call's first float tensor input and output, in the order the calls finish."""
    seen: list[tuple[tuple[str, str], torch.Tensor]] = []
    handles = []
    for name, mod in hf.named_modules():
        if not name:
            continue

        def hook(m: Any, args: tuple, kwargs: dict, out: Any, name: str = name) -> None:
            for side, t in (("in", _first_tensor_of(args, kwargs)), ("out", _first_tensor(out))):
                if t is not None and t.is_floating_point() and t.ndim >= 2:
                    seen.append(((name, side), t.detach().float().clone()))

        handles.append(mod.register_forward_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _per_call(seen: list[tuple[tuple[str, str], torch.Tensor]]) -> dict[tuple[str, int, str], torch.Tensor]:
    """``{(module, call index, "in" | "out"): tensor}`` in finishing order."""
    count: dict[tuple[str, str], int] = {}
    out = {}
    for (name, side), t in seen:
        c = count.get((name, side), 0)
        count[(name, side)] = c + 1
        out[(name, c, side)] = t
    return out


def _alone_outputs(hf: Any, seqs: list[torch.Tensor]) -> list[dict]:
    out = []
    for s in seqs:
        with _recording(hf) as seen:
            _seed()
            hf(input_ids=s[None], use_cache=False)
        out.append({k: t[0] for k, t in _per_call(seen).items() if t.shape[0] == 1 and t.shape[1] == s.shape[0]})
    return out


def _padded_outputs(hf: Any, seqs: list[torch.Tensor]) -> tuple[list, list[dict]]:
    ids, mask = _right_padded(seqs)
    with _recording(hf) as seen:
        _seed()
        hf(input_ids=ids, attention_mask=mask, use_cache=False)
    calls = _per_call(seen)
    per = [{k: t[i, : s.shape[0]] for k, t in calls.items() if t.shape[:2] == ids.shape} for i, s in enumerate(seqs)]
    return list(calls), per


def _packed_outputs(hf: Any, batch: Any, run_packed: Callable[[Any], torch.Tensor]) -> tuple[list, list[dict]]:
    with _recording(hf) as seen:
        _seed()
        run_packed(batch)
    calls = _per_call(seen)
    K, L = batch.input_ids.shape
    per = []
    for s in range(batch.plan.num_sequences):
        row, idx = batch.plan.locate(s)
        idx_t = torch.as_tensor(idx)
        per.append(
            {key: t[row].index_select(0, idx_t.to(t.device)) for key, t in calls.items() if t.shape[:2] == (K, L)}
        )
    return list(calls), per


def _first_divergence(
    hf: Any, seqs: list[torch.Tensor], other: Callable[[], tuple[list, list[dict]]], rel: float
) -> str | None:
    """The module where ``other``'s run first departs from every sequence alone.

    The first call, in finishing order, whose output differs by more than ``rel`` of its
    largest entry while its input does not (the module that made the difference; a
    projection after an attention function sees a differing input and is passed over);
    else the first call whose output differs. None when no recorded output differs.
    """
    with torch.no_grad():
        ref = _alone_outputs(hf, seqs)
        order, got = other()

    def differs(key: tuple) -> bool | None:
        seen = None
        for r, g in zip(ref, got):
            if key not in r or key not in g or r[key].shape != g[key].shape:
                continue
            a, b = r[key].double(), g[key].double()
            if not bool(torch.isfinite(a).all()):
                continue
            seen = False
            if float((a - b).abs().max()) > rel * max(float(a.abs().max()), 1e-6):
                return True
        return seen

    first = None
    for name, c, side in order:
        if side != "out" or not differs((name, c, "out")):
            continue
        if differs((name, c, "in")) is False:
            return name
        first = first or name
    return first


def verify_packing(hf: Any, *, backend: str, patch_layers: bool, extra: tuple = (), **probe: Any) -> ProbeReport:
    """:func:`run_probe` once per (model, :func:`probe_signature` + ``extra``); later calls return the first report.

    Args:
        hf: the unwrapped model; backend, patch_layers: as for ``packed_forward``.
        extra: more of the setup, part of the signature.
        **probe: ``run_packed`` and ``plan_and_batch`` of :func:`run_probe`.

    Raises:
        UnsupportedModelError: as :func:`run_probe` (a refused setup is probed again next call).
    """
    sig = probe_signature(hf, backend=backend, patch_layers=patch_layers) + tuple(extra)
    done = _VERIFIED.setdefault(hf, {})
    if sig not in done:
        done[sig] = run_probe(hf, signature=sig, **probe)
    return done[sig]
