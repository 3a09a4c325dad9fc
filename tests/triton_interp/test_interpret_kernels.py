"""The project's GPU wrappers on Triton kernels, run on CPU under TRITON_INTERPRET=1.

One depth-3 tree plan (two trees sharing a row, a segment crossing a 64-token chunk, a
branch point off every chunk boundary, inner segments shorter than the conv width); per
(kernel, dtype): the wrapper runs the tree level by level (:func:`scan_tree` /
``tree_gated_delta_rule`` / :func:`tree_short_conv`), then outputs and the gradients of a
random weighting of the real outputs are compared with the fp64 token-loop reference
(``loop_refs``) run on the same (rounded) inputs; the case table is ``cases.py``.

The folder is not named ``triton``: ``tests/`` is on ``sys.path``, and a ``tests/triton``
directory would be imported as the ``triton`` package wherever none is installed (torch
then believes triton is there). The interpreter patches: ``conftest.py``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from cases import make_inputs, run_case

from treepack.trainer.kernels.tree_scan import tree_schedule

from helpers.trees import tree_plan

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton interpreter tests: run `make test-triton` (TRITON_INTERPRET=1 in .venv-triton)",
)

DTYPES = {"float32": torch.float32, "float16": torch.float16}
#: relative tolerance (max |err| / max |ref|) on outputs and on input gradients
TOL = {"float32": 1e-4, "float16": 2e-2}
#: the cases with a Triton kernel (mamba1 and short_conv_cuda are CUDA-only: gpu_check)
KERNELS = ("gdn", "kda", "mamba2", "short_conv_fla")


@pytest.fixture(scope="module")
def tree():
    seqs, _, plan = tree_plan(0, trees=2, depth=3, max_len=140)
    assert int(plan.segments.depth.max()) >= 3
    return plan, tree_schedule(plan)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_wrapper_matches_loop_reference(kernel, dtype, tree, interp_results):
    plan, sched = tree
    n = sched.num_positions
    gen = torch.Generator().manual_seed(10 * KERNELS.index(kernel) + list(DTYPES).index(dtype))
    toks, params = make_inputs(kernel, n, DTYPES[dtype], gen)
    leaves = list(toks.values()) + list(params.values())
    real = torch.from_numpy(plan.segment_ids().reshape(-1) >= 0)
    # A conv pad position is convolved alone (a one-token sequence): it is scored too.
    scored = torch.ones_like(real) if kernel.startswith("short_conv") else real

    t0 = time.perf_counter()
    out = run_case(kernel, plan, sched, toks, params, mode="gpu")
    weight = torch.randn(out[scored].shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out[scored].double() * weight).sum(), leaves, allow_unused=True)
    seconds = time.perf_counter() - t0

    ref = run_case(kernel, plan, sched, toks, params, mode="reference")
    ref_grads = torch.autograd.grad((ref[scored] * weight).sum(), leaves, allow_unused=True)

    assert not torch.isnan(out[scored]).any(), "unwritten or NaN outputs"
    if scored is real:
        assert torch.count_nonzero(out[~real]) == 0, "padding outputs must be zero"
    err_out = _rel(out[scored], ref[scored])
    errs = {}
    for name, g, gr in zip(list(toks) + list(params), grads, ref_grads):
        assert g is not None and gr is not None, f"no gradient reached {name}"
        errs[name] = _rel(g, gr)
    err_grad = max(errs.values())
    result = interp_results.setdefault(kernel, {})[dtype] = dict(
        out=err_out, grad=err_grad, seconds=seconds, passed=False
    )
    assert err_out <= TOL[dtype], f"{kernel} {dtype}: output rel err {err_out:.2e} > {TOL[dtype]}"
    assert err_grad <= TOL[dtype], f"{kernel} {dtype}: gradient rel errs {errs}"
    result["passed"] = True


def test_every_interpreter_case_ran(interp_results):
    """Guard: every (kernel, dtype) case above passed in this session (runs last)."""
    ran = {(k, d) for k, per in interp_results.items() for d, r in per.items() if r["passed"]}
    want = {(k, d) for k in KERNELS for d in DTYPES}
    assert ran == want, f"missing interpreter cases: {sorted(want - ran)}"


@pytest.mark.parametrize("kernel", ["gdn", "mamba2"])
def test_negative_control_without_state_forking(kernel, tree):
    """The same wrapper with every segment started from zeros misses the reference by far:
    the tree plan does exercise the forked states the tests above compare."""
    plan, sched = tree
    gen = torch.Generator().manual_seed(99)
    toks, params = make_inputs(kernel, sched.num_positions, torch.float32, gen)
    real = torch.from_numpy(plan.segment_ids().reshape(-1) >= 0)
    with torch.no_grad():
        ref = run_case(kernel, plan, sched, toks, params, mode="reference")
        out = run_case(kernel, plan, sched, toks, params, mode="gpu", fork=False)
    assert _rel(out[real], ref[real]) > 1e-2


def test_stock_signature_dropins_run_the_triton_kernels():
    """gpu_varlen's drop-ins on the real Triton kernels (fp32, forward): per-sequence Mamba2
    states through mamba_ssm, and the varlen conv through fla, vs the token loops."""
    from loop_refs import loop_mamba2, stock_causal_conv1d_fn

    from treepack.trainer.kernels.gpu_varlen import causal_conv1d_varlen, mamba_chunk_scan_varlen

    g = torch.Generator().manual_seed(11)
    lens = [5, 70, 1, 40]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    T, H, P, N = sum(lens), 2, 8, 8
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, dt, B, C = r(1, T, H, P), r(1, T, H) - 1, r(1, T, 1, N) / 3, r(1, T, 1, N)
    A, D, h0 = -(0.5 + torch.rand(H, generator=g)), r(H), 0.3 * r(len(lens), H, P, N)
    y, states = mamba_chunk_scan_varlen(
        x, dt, A, B, C, 64, D=D, dt_softplus=True, initial_states=h0, cu_seqlens=cu, return_varlen_states=True
    )
    for i in range(len(lens)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        o, h = loop_mamba2(x[0, s], dt[0, s], A, B[0, s], C[0, s], h0[i], D=D, dt_softplus=True)
        assert _rel(y[0, s], o) < 1e-4 and _rel(states[i], h) < 1e-4, i
    xc, w, b = r(1, 12, T), 0.5 * r(12, 4), r(12)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))[None]
    yc = causal_conv1d_varlen(xc, w, b, seq_idx=seq_idx, activation="silu", backend="fla")
    assert _rel(yc, stock_causal_conv1d_fn(xc, w, b, seq_idx=seq_idx, activation="silu")) < 1e-5
