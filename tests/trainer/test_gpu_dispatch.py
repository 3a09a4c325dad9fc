"""treepack.trainer.kernels.gpu without GPU packages: the probe, the import errors, the buckets.

The wrappers themselves run in tests/triton_interp (Triton interpreter) and gpu_check (GPU).
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treepack.trainer.kernels import gpu, gpu_ssm


def test_available_names_every_kernel_with_a_reason():
    avail = gpu.available()
    assert set(avail) == set(gpu.KERNELS)
    for name, (module, _) in gpu.KERNELS.items():
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            assert avail[name] and top in avail[name], (name, avail[name])


def test_load_kernel_error_names_the_kernel():
    name = next((n for n, (m, _) in gpu.KERNELS.items() if importlib.util.find_spec(m.split(".")[0]) is None), None)
    if name is None:
        pytest.skip("every kernel package imports here")
    with pytest.raises(ImportError, match=name.replace(".", r"\.")):
        gpu.load_kernel(name)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_length_buckets_cover_once_and_bound_padding(lens, ratio):
    groups = gpu_ssm.length_buckets(lens, ratio)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lens)))
    for g in groups:
        longest, real = lens[g[0]], sum(lens[i] for i in g)
        assert longest == max(lens[i] for i in g)
        assert len(g) * longest - real <= ratio * real or len(g) == 1


def _cases():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "triton_interp"))
    import cases

    return cases


@pytest.mark.parametrize("kernel", ["mamba2", "mamba1", "short_conv_cuda"])
def test_wrappers_with_stock_stand_ins_match_the_tree_oracle(kernel):
    """The wrappers' own code (left-padded buckets, the Mamba1 state terms, conv context
    prefixes) on CPU, with loop stand-ins for the stock kernels; without forking the
    states the same wrapper misses the oracle (negative control)."""
    import torch

    from treepack.trainer.kernels.tree_scan import tree_schedule

    from helpers.trees import tree_plan

    cases = _cases()
    _, _, plan = tree_plan(0, trees=2, depth=3, max_len=140)
    sched = tree_schedule(plan)
    toks, params = cases.make_inputs(kernel, sched.num_positions, torch.float64, torch.Generator().manual_seed(3))
    real = torch.from_numpy(plan.segment_ids().reshape(-1) >= 0)
    ref = cases.run_case(kernel, plan, sched, toks, params, mode="reference")
    out = cases.run_case(kernel, plan, sched, toks, params, mode="smoke")
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    leaves = list(toks.values()) + list(params.values())
    g = torch.autograd.grad((out.nan_to_num() * w)[real].sum(), leaves)
    g_ref = torch.autograd.grad((ref * w)[real].sum(), leaves)
    # fp64 inputs; the stand-ins hand states over in fp32, as the stock kernels do
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if not kernel.startswith("short_conv"):
        with torch.no_grad():
            cut = cases.run_case(kernel, plan, sched, toks, params, mode="smoke", fork=False)
        assert float((cut[real] - ref[real].detach()).abs().max()) > 1e-2 * float(ref[real].detach().abs().max())


def _varlen_inputs(gen, lens=(5, 64, 130, 1, 77), H=2, P=4, N=4):
    import torch

    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x, dt, B, C, z = r(1, T, H, P), r(1, T, H) - 1, r(1, T, 1, N), r(1, T, 1, N), r(1, T, H, P)
    A, D, bias = -(0.5 + torch.rand(H, generator=gen, dtype=torch.float64)), r(H), 0.5 * r(H)
    h0 = 0.3 * r(len(lens), H, P, N)
    return cu, [t.requires_grad_() for t in (x, dt, B, C, z, h0, A, D, bias)]


def test_mamba_chunk_scan_varlen_takes_one_initial_state_per_sequence():
    """mamba_ssm's signature with per-sequence states (the stock kernel has one per batch
    row), through the left-padded batches, vs the token loop sequence by sequence."""
    import torch

    from treepack.trainer.kernels.gpu_varlen import mamba_chunk_scan_varlen

    cases = _cases()
    loops = __import__("loop_refs")
    cu, leaves = _varlen_inputs(torch.Generator().manual_seed(5))
    x, dt, B, C, z, h0, A, D, bias = leaves
    kw = dict(D=D, z=z, dt_bias=bias, dt_softplus=True, initial_states=h0, kernel=cases.STOCK["mamba2"])
    y, states = mamba_chunk_scan_varlen(x, dt, A, B, C, 16, cu_seqlens=cu, return_varlen_states=True, **kw)
    seq_idx = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])[None]
    y2, last = mamba_chunk_scan_varlen(x, dt, A, B, C, 16, seq_idx=seq_idx, return_final_states=True, **kw)
    ys, hs = [], []
    for i in range(len(cu) - 1):
        s = slice(int(cu[i]), int(cu[i + 1]))
        o, h = loops.loop_mamba2(
            x[0, s], dt[0, s], A, B[0, s], C[0, s], h0[i], D=D, z=z[0, s], dt_bias=bias, dt_softplus=True
        )
        ys.append(o)
        hs.append(h)
    y_ref, s_ref = torch.cat(ys)[None], torch.stack(hs)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states, s_ref, rtol=1e-5, atol=1e-6, check_dtype=False)  # states: fp32, as the kernel's
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(last, states[-1:])
    w = torch.randn(y.shape, dtype=torch.float64)
    g = torch.autograd.grad((y * w).sum() + states.square().sum(), leaves)
    g_ref = torch.autograd.grad((y_ref * w).sum() + s_ref.square().sum(), leaves)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_selective_scan_with_state_gives_the_last_state_a_gradient():
    """The stock kernel's last state has no gradient (its stand-in here detaches it, as the
    CUDA kernel drops it); the drop-in recomputes it so children's gradients reach the parent."""
    import torch

    from treepack.trainer.kernels.gpu_varlen import selective_scan_with_state

    cases = _cases()
    loops = __import__("loop_refs")
    g = torch.Generator().manual_seed(6)
    b, Dm, N, L = 3, 5, 4, 40
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    u, delta, B, C, z, D, bias = r(b, Dm, L), r(b, Dm, L), r(b, N, L), r(b, N, L), r(b, Dm, L), r(Dm), r(Dm)
    A = (-(0.5 + torch.rand(Dm, N, generator=g, dtype=torch.float64))).requires_grad_()
    leaves = [u, delta, B, C, z, D, bias, A]
    kw = dict(D=D, z=z, delta_bias=bias, delta_softplus=True)
    _, stock_last = cases.STOCK["mamba1"](u, delta, A, B, C, return_last_state=True, **kw)
    assert not stock_last.requires_grad
    y, last = selective_scan_with_state(u, delta, A, B, C, return_last_state=True, kernel=cases.STOCK["mamba1"], **kw)
    refs = [
        loops.loop_selective_scan(
            u[i].T,
            delta[i].T,
            A,
            B[i].T,
            C[i].T,
            None,
            **{k: (v if k in ("D", "delta_bias", "delta_softplus") else v[i].T) for k, v in kw.items()},
        )
        for i in range(b)
    ]
    y_ref = torch.stack([o.T for o, _ in refs])
    last_ref = torch.stack([h for _, h in refs])
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(last, last_ref, rtol=1e-6, atol=1e-8)
    gr = torch.autograd.grad(last.square().sum(), leaves, allow_unused=True)
    gr_ref = torch.autograd.grad(last_ref.square().sum(), leaves, allow_unused=True)
    for name, a, b_ in zip("u delta B C z D bias A".split(), gr, gr_ref):
        if b_ is None:
            assert a is None or torch.count_nonzero(a) == 0, name
        else:
            torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-8, msg=name)


def test_causal_conv1d_varlen_fla_path_equals_the_causal_conv1d_path():
    import torch

    from treepack.trainer.kernels.gpu_varlen import causal_conv1d_varlen

    cases = _cases()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 6, 50, generator=g, dtype=torch.float64)
    w, b = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    seq_idx = torch.tensor([0] * 3 + [1] * 20 + [2] * 1 + [3] * 26, dtype=torch.int32)[None]
    a = causal_conv1d_varlen(
        x, w, b, seq_idx=seq_idx, activation="silu", backend="causal_conv1d", kernel=cases.STOCK["short_conv_cuda"]
    )
    f = causal_conv1d_varlen(
        x, w, b, seq_idx=seq_idx, activation="silu", backend="fla", kernel=cases.STOCK["short_conv_fla"]
    )
    torch.testing.assert_close(a, f)
    whole = causal_conv1d_varlen(x, w, b, activation="silu", backend="fla", kernel=cases.STOCK["short_conv_fla"])
    assert not torch.allclose(whole, f)  # seq_idx does cut the conv
