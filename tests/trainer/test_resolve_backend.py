"""``resolve_backend``: what ``backend="auto"`` becomes per device and row length, explicit
backends passed through untouched, and an unknown name refused before any compute."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.trainer import materialize, tree_attention
from treepack.trainer.kernels.attention import AUTO, BACKENDS, CPU_FLASH_MIN_LEN, resolve_backend
from treepack.trainer.trl.config import PackingConfig

from helpers.trainer_cases import plan_of


def test_auto_on_a_cpu_is_sdpa_below_the_threshold_and_flash_from_it():
    """On a CPU ``auto`` is the dense-mask ``sdpa`` below :data:`CPU_FLASH_MIN_LEN` and the
    copy-free ``flash`` path from it (and when the length is unknown); one token short of the
    threshold is still ``sdpa`` (negative control: the boundary is where the docs say)."""
    assert CPU_FLASH_MIN_LEN == 2048
    for L in (1, 512, CPU_FLASH_MIN_LEN - 1):
        assert resolve_backend(AUTO, "cpu", L) == "sdpa", L
    for L in (CPU_FLASH_MIN_LEN, CPU_FLASH_MIN_LEN + 1, 131_072):
        assert resolve_backend(AUTO, "cpu", L) == "flash", L
    assert resolve_backend(AUTO, torch.device("cpu"), None) == "flash"
    assert resolve_backend(AUTO, "cpu", CPU_FLASH_MIN_LEN - 1) != resolve_backend(AUTO, "cpu", CPU_FLASH_MIN_LEN)


def test_auto_on_a_gpu_follows_whether_flash_attn_imports(monkeypatch):
    """On a CUDA device ``auto`` is ``flash`` exactly when ``flash_attn`` imports, whatever the
    row length, else ``sdpa``. No device is touched (only its type is read), so this runs on a
    CPU; an importable module object stands in for the package, and the control removes it."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # None in sys.modules: import raises ImportError
    assert resolve_backend(AUTO, "cuda", 512) == "sdpa"
    assert resolve_backend(AUTO, "cuda:0", 8192) == "sdpa"
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert resolve_backend(AUTO, "cuda", 512) == "flash"
    assert resolve_backend(AUTO, "cuda", 8192) == "flash"


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_backends_are_untouched(backend):
    """An explicit backend is returned as given on every device and length (negative control:
    ``auto`` at the same short CPU length differs from ``flash``)."""
    for device, L in (("cpu", 16), ("cpu", 4096), ("cuda", 16), ("cpu", None)):
        assert resolve_backend(backend, device, L) == backend
    assert resolve_backend(AUTO, "cpu", 16) != "flash"


def test_an_unknown_backend_is_refused_before_any_compute():
    """``tree_attention`` refuses a backend outside ``BACKENDS`` + ``auto`` with a RequestError
    naming it (rule ``enum``), and so does the trainers' config; the same call with ``auto``
    runs (negative control: the refusal is about the name, not the inputs)."""
    seqs = [np.arange(1, 9), np.r_[np.arange(1, 5), 20, 21]]  # a shared 4-token prefix: a tree row
    case = dict(sequences=seqs, trainable=[4, 4], groups=None, seq_len=16, min_shared_len=2)
    batch = materialize(plan_of(case), case["sequences"], trainable=case["trainable"], advise=False)
    K, L = batch.num_rows, batch.seq_len
    q, k, v = (torch.randn(K, 2, L, 8) for _ in range(3))
    with pytest.raises(RequestError, match="'flash2'") as err:
        tree_attention(q, k, v, batch, backend="flash2")
    assert err.value.rule == "enum"
    with pytest.raises(RequestError, match="backend must be one of"):
        PackingConfig(backend="flash2")
    out = tree_attention(q, k, v, batch, backend=AUTO)
    assert out.shape == q.shape and torch.isfinite(out).all()
