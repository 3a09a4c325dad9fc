"""The GPU wrappers the ``select_*`` dispatch points return on CUDA are drop-ins for the tree paths.

On CPU each wrapper runs with the pure-torch reference standing in for its GPU kernel
(``kernel=``), so what is checked is the wrapper's own work (per-sequence states, the
differentiable last state of the selective scan, the varlen conv): the tree outputs and the
gradients reaching every input, the parents' states included, equal the reference path's.
"""

from __future__ import annotations

import functools

import pytest
import torch

from treepack.trainer.kernels.gpu import kda_level
from treepack.trainer.kernels.gpu_varlen import causal_conv1d_varlen, mamba_chunk_scan_varlen, selective_scan_with_state
from treepack.trainer.kernels.kda import torch_chunk_kda, tree_kda
from treepack.trainer.kernels.mamba import torch_selective_scan, tree_selective_scan
from treepack.trainer.kernels.mamba2 import torch_ssd_chunk_scan, tree_ssd_scan
from treepack.trainer.kernels.short_conv import select_causal_conv1d, torch_causal_conv1d
from treepack.trainer.kernels.tree_scan import tree_conv, tree_schedule

from helpers.trees import tree_plan

F64 = torch.float64


@pytest.fixture(scope="module")
def sched():
    _, _, plan = tree_plan(3, min_shared_len=2, conv_width=4, trees=3, depth=3, max_len=120, seq_len=160)
    return plan, tree_schedule(plan)


def _same(fast_fn, ref_fn, inputs):
    for x in inputs:
        x.requires_grad_(True)
    a, b = fast_fn(), ref_fn()
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    w = torch.randn_like(a)
    for ga, gb in zip(torch.autograd.grad((a * w).sum(), inputs), torch.autograd.grad((b * w).sum(), inputs)):
        torch.testing.assert_close(ga, gb, rtol=1e-8, atol=1e-8)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_selective_scan_with_state_forks_gradients(sched):
    plan, s = sched
    N, Dd, S = plan.num_rows * plan.seq_len, 4, 3
    u, dt, B, C, z = (
        _randn(N, Dd, seed=1),
        _randn(N, Dd, seed=2),
        _randn(N, S, seed=3),
        _randn(N, S, seed=4),
        _randn(N, Dd, seed=5),
    )
    A = -torch.rand(Dd, S, dtype=F64) - 0.1
    kw = dict(D=_randn(Dd, seed=6), z=z, delta_bias=_randn(Dd, seed=7), delta_softplus=True)
    dropin = functools.partial(selective_scan_with_state, kernel=torch_selective_scan)
    _same(
        lambda: tree_selective_scan(u, dt, A, B, C, s, scan_fn=dropin, **kw),
        lambda: tree_selective_scan(u, dt, A, B, C, s, **kw),
        [u, dt, B, C, A],
    )


def test_mamba_chunk_scan_varlen_is_a_dropin(sched):
    plan, s = sched
    N, H, P, G, S = plan.num_rows * plan.seq_len, 4, 3, 2, 5
    x, dt, B, C = _randn(N, H, P, seed=1), _randn(N, H, seed=2), _randn(N, G, S, seed=3), _randn(N, G, S, seed=4)
    A = -torch.rand(H, dtype=F64) - 0.1
    kw = dict(chunk_size=16, D=_randn(H, seed=5), dt_bias=_randn(H, seed=6), dt_softplus=True)
    dropin = functools.partial(mamba_chunk_scan_varlen, kernel=torch_ssd_chunk_scan)
    _same(
        lambda: tree_ssd_scan(x, dt, A, B, C, s, scan_fn=dropin, **kw),
        lambda: tree_ssd_scan(x, dt, A, B, C, s, **kw),
        [x, dt, B, C, A],
    )


def test_kda_level_is_a_dropin(sched):
    plan, s = sched
    N, H, K, V = plan.num_rows * plan.seq_len, 2, 4, 3
    q, k, v = _randn(N, H, K, seed=1), _randn(N, H, K, seed=2), _randn(N, H, V, seed=3)
    g, beta = -torch.rand(N, H, K, dtype=F64) * 0.5, torch.rand(N, H, dtype=F64)
    dropin = functools.partial(kda_level, kernel=torch_chunk_kda)
    _same(
        lambda: tree_kda(q, k, v, g, beta, s, use_qk_l2norm_in_kernel=True, kernel=dropin),
        lambda: tree_kda(q, k, v, g, beta, s, use_qk_l2norm_in_kernel=True),
        [q, k, v, g, beta],
    )


def test_causal_conv1d_varlen_is_a_dropin(sched):
    plan, s = sched
    N, D = plan.num_rows * plan.seq_len, 5
    x, w, b = _randn(N, D, seed=1), _randn(D, 4, seed=2), _randn(D, seed=3)

    def stock(
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        return torch_causal_conv1d(
            x,
            weight,
            bias,
            seq_idx=seq_idx,
            initial_states=initial_states,
            return_final_states=return_final_states,
            activation=activation,
        )

    dropin = functools.partial(causal_conv1d_varlen, kernel=stock, backend="causal_conv1d")
    _same(lambda: tree_conv(x, w, b, s, "silu", conv_fn=dropin), lambda: tree_conv(x, w, b, s, "silu"), [x, w, b])


def test_cpu_tensors_dispatch_to_the_references():
    from treepack.trainer.kernels.kda import select_kda
    from treepack.trainer.kernels.mamba import select_selective_scan
    from treepack.trainer.kernels.mamba2 import select_ssd

    x = torch.zeros(1)
    assert select_causal_conv1d(x) is torch_causal_conv1d and select_ssd(x) is torch_ssd_chunk_scan
    assert select_selective_scan(x) is torch_selective_scan and select_kda(x.bfloat16()) is torch_chunk_kda
