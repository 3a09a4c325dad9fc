"""Jamba's Mamba (S6) mixer: selective-scan references against HF's slow path, then the oracle.

mamba_ssm's selective scan has no initial state and no varlen, so the tree path pads each
level's segments into a batch and adds the parent's state by linearity
(:mod:`treepack.trainer.kernels.mamba`); the tests compare it with a segment walk of the
token-by-token scan and with every sequence run alone through the stock model.
"""

from __future__ import annotations

import math

import pytest
import torch

from treepack.trainer.hf.layers import is_handled, mixer_kind, patch_layers
from treepack.trainer.kernels.mamba import naive_selective_scan, torch_selective_scan, tree_selective_scan
from treepack.trainer.kernels.tree_scan import naive_tree_scan, tree_schedule

from helpers.mixers import VOCAB, assert_oracle, mixer_case, run_oracle
from helpers.trees import tree_plan

F64 = torch.float64


def _inputs(b, Dd, L, N=4, groups=None, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    BC = (b, N, L) if groups is None else (b, groups, N, L)
    args = [t(b, Dd, L), t(b, Dd, L), -torch.rand(Dd, N, generator=g, dtype=dtype) - 0.1, t(*BC), t(*BC)]
    return args, dict(D=t(Dd), z=t(b, Dd, L), delta_bias=t(Dd))


@pytest.mark.parametrize("L,groups", [(1, None), (13, None), (24, 2), (40, None)])
def test_selective_scan_chunked_equals_naive_with_gradients(L, groups):
    args, kw = _inputs(2, 6, L, groups=groups)
    for t in args + list(kw.values()):
        t.requires_grad_(True)
    y1, h1 = torch_selective_scan(*args, **kw, delta_softplus=True, return_last_state=True)
    y2, h2 = naive_selective_scan(*args, **kw, delta_softplus=True, return_last_state=True)
    torch.testing.assert_close(y1, y2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h1, h2, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(y1)
    leaves = args + list(kw.values())
    for a, c in zip(
        torch.autograd.grad((y1 * w).sum() + h1.sum(), leaves), torch.autograd.grad((y2 * w).sum() + h2.sum(), leaves)
    ):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9)


def test_selective_scan_equals_hf_slow_path():
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    args, kw = _inputs(2, 6, 29, dtype=torch.float32)
    y, h = torch_selective_scan(*args, **kw, delta_softplus=True, return_last_state=True)
    y_hf, h_hf = mamba_selective_scan(*args, **kw, delta_softplus=True, return_last_state=True)
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_hf, rtol=1e-5, atol=1e-5)


def test_tree_selective_scan_equals_segment_walk():
    _, _, plan = tree_plan(3, min_shared_len=2, conv_width=4, trees=3, depth=3, max_len=120, seq_len=160)
    sched = tree_schedule(plan)
    n, Dd, N = plan.num_rows * plan.seq_len, 5, 4
    (u, dt, A, B, C), kw = _inputs(1, Dd, n, N)
    u, dt, z = u[0].T, dt[0].T, kw["z"][0].T
    B, C = B[0].T, C[0].T
    fast = tree_selective_scan(u, dt, A, B, C, sched, D=kw["D"], z=z, delta_bias=kw["delta_bias"], delta_softplus=True)
    assert not fast.isnan().any()

    def run(seg, h0):  # one segment from its parent's state: prepend nothing, seed the state
        us, dts, Bs, Cs, zs = (x.T[None] for x in seg)
        if h0 is None:
            y, h = naive_selective_scan(
                us,
                dts,
                A,
                Bs,
                Cs,
                D=kw["D"],
                z=zs,
                delta_bias=kw["delta_bias"],
                delta_softplus=True,
                return_last_state=True,
            )
            return y[0].T, h
        dte = torch.nn.functional.softplus(dts + kw["delta_bias"][:, None])
        h, ys = h0[0], []
        for t in range(us.shape[-1]):
            h = (dte[0, :, t, None] * A).exp() * h + (dte[0, :, t] * us[0, :, t])[:, None] * Bs[0, :, t]
            ys.append(((h * Cs[0, :, t]).sum(-1) + kw["D"] * us[0, :, t]) * torch.nn.functional.silu(zs[0, :, t]))
        return torch.stack(ys), h[None]

    slow = naive_tree_scan(run, (u, dt, B, C, z), plan, (Dd,))
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)


def jamba():
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_layer_period=3,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_dt_rank=8,
        max_position_embeddings=512,
        initializer_range=0.08,
    )
    return JambaForCausalLM(cfg)


def test_jamba_oracle():
    torch.manual_seed(0)
    model = jamba().float().eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for m in model.modules():
            if mixer_kind(m) == "mamba":  # slow decay, so a wrong fork point shows
                m.A_log.uniform_(math.log(0.02), math.log(0.3))
                m.dt_proj.bias.uniform_(-3.0, -1.0)
    mixers = [q for q, m in model.named_modules() if mixer_kind(m) == "mamba"]
    assert len(mixers) == 2 and all(is_handled(m) for m in model.modules() if mixer_kind(m))
    assert patch_layers(model) == mixers
    figures = run_oracle(model, mixer_case(conv_width=4), model.get_input_embeddings())
    print(f"\njamba: {figures}")
    assert_oracle(figures)


def test_tree_selective_scan_runs_in_bf16():
    """Half-precision inputs (the GPU dtypes) go through the parent-state term in fp32."""
    _, _, plan = tree_plan(3, min_shared_len=2, conv_width=4, trees=3, depth=3, max_len=120, seq_len=160)
    sched = tree_schedule(plan)
    n, Dd, N = plan.num_rows * plan.seq_len, 5, 4
    (u, dt, A, B, C), kw = _inputs(1, Dd, n, N, dtype=torch.float32)
    args = (u[0].T, dt[0].T, A, B[0].T, C[0].T)
    ref = tree_selective_scan(*args, sched, D=kw["D"], delta_bias=kw["delta_bias"], delta_softplus=True)
    half = tree_selective_scan(
        *(x.to(torch.bfloat16) for x in args[:2]),
        A,
        *(x.to(torch.bfloat16) for x in args[3:]),
        sched,
        D=kw["D"],
        delta_bias=kw["delta_bias"],
        delta_softplus=True,
    )
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, rtol=5e-2, atol=5e-2)
