"""treepack.trainer.kernels.gpu without GPU packages: the probe, the import errors, the buckets.

The wrappers themselves run in tests/triton_interp (Triton interpreter) and gpu_check (GPU).
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treepack.trainer.kernels import gpu


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
    groups = gpu.length_buckets(lens, ratio)
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

    from helpers.trees import tree_plan
    from treepack.trainer.gdn import gdn_schedule

    cases = _cases()
    _, _, plan = tree_plan(0, trees=2, depth=3, max_len=140)
    sched = gdn_schedule(plan)
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
