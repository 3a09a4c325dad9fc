"""Where packed and alone part: the first diverging module (:func:`first_divergence`).

A forward pass with every module's output hooked, compared module by module in the order the
calls finish; when every output agrees but the gradients do not (a checkpoint replay that ran
something else), :func:`gradient_divergence` names the last module, in forward order, whose
parameters' gradients differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from treepack.trainer.hf.admission.measure import right_padded, seed

__all__ = [
    "first_divergence",
    "gradient_divergence",
    "alone_outputs",
    "padded_outputs",
    "packed_outputs",
    "at_module",
    "class_at",
]


def at_module(path: str | None, cls: str = "") -> str:
    return (f": {path} ({cls})" if cls else f": {path}") if path else ""


def class_at(hf: Any, path: str | None) -> str:
    if not path:
        return type(hf).__name__
    try:
        return type(hf.get_submodule(path)).__name__
    except AttributeError:
        return ""


def gradient_divergence(hf: Any, ratio: torch.Tensor) -> str | None:
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


def alone_outputs(call: Any, hf: Any, seqs: list[torch.Tensor], offset: int = 0) -> tuple[list, list[dict]]:
    """Every module call's output of each sequence run alone through ``call`` (hooks on ``hf``'s
    modules), the random seed at ``offset``; (call order, per sequence ``{key: [n, ...]}``)."""
    out = []
    order: list = []
    for s in seqs:
        with _recording(hf) as seen:
            seed(offset)
            call(input_ids=s[None], use_cache=False)
        calls = _per_call(seen)
        order = order or list(calls)
        out.append({k: t[0] for k, t in calls.items() if t.shape[0] == 1 and t.shape[1] == s.shape[0]})
    return order, out


def padded_outputs(call: Any, hf: Any, seqs: list[torch.Tensor]) -> tuple[list, list[dict]]:
    ids, mask = right_padded(seqs)
    with _recording(hf) as seen:
        seed()
        call(input_ids=ids, attention_mask=mask, use_cache=False)
    calls = _per_call(seen)
    per = [{k: t[i, : s.shape[0]] for k, t in calls.items() if t.shape[:2] == ids.shape} for i, s in enumerate(seqs)]
    return list(calls), per


def packed_outputs(hf: Any, batch: Any, run_packed: Callable[[Any], torch.Tensor]) -> tuple[list, list[dict]]:
    with _recording(hf) as seen:
        seed()
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


def first_divergence(
    call: Any, hf: Any, seqs: list[torch.Tensor], other: Callable[[], tuple[list, list[dict]]], rel: float
) -> str | None:
    """The module where ``other``'s run first departs from every sequence alone (run through ``call``).

    The first call, in finishing order, whose output differs by more than ``rel`` of its
    largest entry while its input does not (the module that made the difference; a
    projection after an attention function sees a differing input and is passed over);
    else the first call whose output differs. None when no recorded output differs.
    """
    with torch.no_grad():
        _, ref = alone_outputs(call, hf, seqs)
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
