"""The one tolerance helper of the tests, in the style of flash-linear-attention's ``assert_close``.

``assert_close(name, ref, got, atol=..., ratio=...)`` passes when, for every compared
tensor, ``max |got - ref| <= atol + ratio * max |ref|`` (``ratio`` is relative to the
reference tensor's largest entry, as gradients of different parameters live on different
scales). NaN must sit at the same places on both sides (the packed-batch format marks
unscored positions with NaN) and is left out of the difference. A failure names the
entry and gives the max abs diff, the allowed bound and the relative error.

``ref`` and ``got`` may be tensors, lists/tuples of tensors (e.g. per-sequence
logprobs; None entries must be None on both sides) or dicts of tensors (e.g. gradients
by parameter name; the keys must agree).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["assert_close", "assert_not_close", "max_abs_err"]


def _pairs(name: str, ref: Any, got: Any) -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor | None]]:
    if isinstance(ref, dict):
        assert isinstance(got, dict) and got.keys() == ref.keys(), (
            f"{name}: keys differ: {sorted(set(ref) ^ set(got or {}))}"
        )
        for k in ref:
            yield f"{name}[{k}]", ref[k], got[k]
    elif isinstance(ref, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(ref), (
            f"{name}: {len(ref)} reference entries, {len(got)} compared"
        )
        for i, (r, g) in enumerate(zip(ref, got)):
            yield f"{name}[{i}]", r, g
    else:
        yield name, ref, got


def _diff(label: str, ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, max abs ref) over the entries that are not NaN."""
    ref, got = torch.as_tensor(ref).detach(), torch.as_tensor(got).detach()
    assert ref.shape == got.shape, f"{label}: shapes differ: ref {tuple(ref.shape)}, got {tuple(got.shape)}"
    nan = torch.isnan(ref)
    assert torch.equal(nan, torch.isnan(got)), (
        f"{label}: NaN patterns differ ({int(nan.sum())} NaN in ref, {int(torch.isnan(got).sum())} in got)"
    )
    keep = ~nan
    if not bool(keep.any()):
        return 0.0, 0.0
    r, g = ref[keep].double(), got[keep].double()
    return float((g - r).abs().max()), float(r.abs().max())


def max_abs_err(ref: Any, got: Any) -> float:
    """The largest ``|got - ref|`` over every compared entry (NaN patterns must agree)."""
    worst = 0.0
    for label, r, g in _pairs("value", ref, got):
        assert (r is None) == (g is None), f"{label}: one side is None"
        if r is not None:
            worst = max(worst, _diff(label, r, g)[0])
    return worst


def assert_close(
    name: str, ref: Any, got: Any, *, atol: float = 0.0, ratio: float = 0.0, nonzero_ref: bool = False
) -> None:
    """Assert ``max |got - ref| <= atol + ratio * max |ref|`` for every compared tensor.

    Args:
        name: what is compared (shown in the failure message).
        ref: the reference (tensor, list/tuple or dict of tensors).
        got: the value under test, the same structure.
        atol: absolute tolerance.
        ratio: tolerance relative to the reference tensor's largest entry.
        nonzero_ref: also require every reference tensor to have a nonzero entry, so that
            a relative comparison cannot pass on zeros.
    """
    for label, r, g in _pairs(name, ref, got):
        assert (r is None) == (g is None), f"{label}: one side is None"
        if r is None:
            continue
        err, scale = _diff(label, r, g)
        assert not nonzero_ref or scale > 0, f"{label}: the reference is all zero, the comparison could not fail"
        allowed = atol + ratio * scale
        rel = err / scale if scale > 0 else float("inf") if err > 0 else 0.0
        assert err <= allowed, (
            f"{label}: max abs diff {err:.3g} > allowed {allowed:.3g} "
            f"(atol {atol:g} + ratio {ratio:g} x max |ref| {scale:.3g}); relative error {rel:.3g}"
        )


def assert_not_close(name: str, ref: Any, got: Any, *, atol: float) -> None:
    """Negative control: assert the largest ``|got - ref|`` exceeds ``atol`` (the oracle can fail)."""
    err = max_abs_err(ref, got)
    assert err > atol, f"{name}: max abs diff {err:.3g} <= {atol:g}: the negative control does not differ"
