"""What the probe measures: log-probabilities and projected gradients, each sequence alone, in other shapes, packed.

Every run goes through the callable the caller trains with (a PEFT, DDP, accelerate or
``torch.compile`` wrapper), under the caller's autocast. Each sequence alone against the
same sequences in another legal batch shape (:data:`SHAPES`: all right-padded into one
batch; reordered into two batches of other sizes) gives the unpacked path's own noise (the
same mathematics, reductions in another order); a fixed random weighting of every scored
log-probability is backpropagated and every parameter's gradient is reduced to its norm and
three random projections (so nothing of the model's size is kept twice). Logits are read in
float32, or float64 for a float64 model. The random streams of torch are forked: the
caller's draws are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from treepack.trainer.hf.admission.probe_inputs import PROBE_SEED

__all__ = [
    "SHAPES",
    "own_random_stream",
    "seed",
    "upcast",
    "alone_logprobs",
    "right_padded",
    "padded_logprobs",
    "weighted",
    "projected_grads",
]

# The other legal batch shapes: name -> (batches, reversed order).
SHAPES = {"right-padded": (1, False), "reordered, 2 batches": (2, True)}


_PROJECTIONS = 3


@contextmanager
def own_random_stream(device: torch.device) -> Iterator[None]:
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if device.type != "cpu" else "cuda"):
        yield


def seed(offset: int = 0) -> None:
    torch.manual_seed(PROBE_SEED + offset)


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in float32, or float64 when they are float64 (the log-softmax's precision)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def alone_logprobs(call: Any, seqs: list[torch.Tensor], offset: int = 0) -> list[torch.Tensor]:
    """Per sequence [n]: NaN at 0, then log p(token i | tokens < i), each sequence run alone.

    Args:
        call: the model as the caller runs it (wrappers included).
        seqs: [n] token ids each.
        offset: of the random seed each run starts from.
    """
    out = []
    for s in seqs:
        seed(offset)
        logits = upcast(call(input_ids=s[None], use_cache=False).logits[0])
        out.append(_shifted(logits, s))
    return out


def right_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` ids and attention mask of the sequences right-padded into one batch (T: the longest)."""
    n = max(s.shape[0] for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.int64, device=seqs[0].device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = 1
    return ids, mask


def padded_logprobs(call: Any, seqs: list[torch.Tensor], shape: str = "right-padded") -> list[torch.Tensor]:
    """The same as :func:`alone_logprobs`, the sequences right-padded into the batches of ``shape``.

    Args:
        call: the model as the caller runs it.
        seqs: [n] token ids each.
        shape: a key of :data:`SHAPES`: ``right-padded`` (one batch, in order) or
            ``reordered, 2 batches`` (reversed, dealt into two batches).
    """
    parts, rev = SHAPES[shape]
    order = list(range(len(seqs)))[::-1] if rev else list(range(len(seqs)))
    out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for k in range(parts):
        idx = order[k::parts]
        if not idx:
            continue
        ids, mask = right_padded([seqs[i] for i in idx])
        seed()
        logits = upcast(call(input_ids=ids, attention_mask=mask, use_cache=False).logits)
        for row, i in enumerate(idx):
            out[i] = _shifted(logits[row, : seqs[i].shape[0]], seqs[i])
    return out


def _shifted(logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None])[:, 0]
    return torch.cat([lp.new_full((1,), float("nan")), lp])


def weighted(lps: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    return sum((torch.where(torch.isnan(lp), torch.zeros_like(lp), lp) * w).sum() for lp, w in zip(lps, weights))


def projected_grads(
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
