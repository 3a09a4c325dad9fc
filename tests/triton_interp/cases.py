"""One table of kernel cases, shared by the interpreter tests and ``benchmarks/gpu_check.py``.

A case is a kernel name, per-token inputs flat over rows ([N, ...], leaves with
``requires_grad``) and parameters; :func:`run_case` runs it over a tree schedule in one
of three modes:

- ``gpu``: the project's GPU wrapper (``treepack.trainer.kernels.gpu``), on whatever
  device the tensors are (CUDA, or CPU under ``TRITON_INTERPRET=1``);
- ``reference``: the fp64 token loops of :mod:`loop_refs` walked over the plan's segments
  (no level metadata), the oracle;
- ``smoke``: the same wrappers with a token-loop stand-in for each stock kernel
  (:data:`STOCK`, same signature and semantics, CPU, no kernel package needed): every
  line of the wrappers runs but the kernel, so ``gpu_check --cpu-smoke`` keeps them (and
  itself) from rotting in CI.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from loop_refs import (
    loop_delta_rule,
    loop_mamba2,
    loop_selective_scan,
    naive_tree,
    stock_causal_conv1d_fn,
    stock_chunk_gated_delta_rule,
    stock_fla_causal_conv1d,
    stock_mamba_chunk_scan_combined,
    stock_selective_scan_fn,
)

from treepack.trainer.kernels import gpu, gpu_ssm
from treepack.trainer.kernels.gdn import naive_tree_causal_conv1d, tree_gated_delta_rule

__all__ = ["KERNELS", "SHAPES", "STOCK", "make_inputs", "run_case"]

#: kernel case -> the GPU kernel it runs (a key of gpu.KERNELS)
KERNELS = {
    "gdn": "fla.chunk_gated_delta_rule",
    "kda": "fla.chunk_kda",
    "mamba2": "mamba_ssm.mamba_chunk_scan_combined",
    "mamba1": "mamba_ssm.selective_scan_fn",
    "short_conv_fla": "fla.causal_conv1d",
    "short_conv_cuda": "causal_conv1d.causal_conv1d_fn",
}

#: "tiny": the tests' shapes; "layer": shapes of real layers (Qwen3-Next GDN, Kimi-Linear
#: KDA, Nemotron-H Mamba2, a narrowed Jamba Mamba1, an LFM2-width short conv)
SHAPES = {
    "tiny": dict(Hk=1, Hv=2, K=16, V=16, H=2, P=8, G=1, N=8, chunk=64, Dm=16, Nm=4, Dc=24, W=4),
    "layer": dict(Hk=16, Hv=32, K=128, V=128, H=64, P=64, G=8, N=128, chunk=256, Dm=512, Nm=16, Dc=2048, W=4),
}

_FP32 = {"g", "A", "D", "dt_bias", "delta_bias"}  # gates and SSM parameters stay fp32, as in HF


def make_inputs(
    kernel: str, n: int, dtype: torch.dtype, gen: torch.Generator, *, shape: str = "tiny", device: str = "cpu"
) -> tuple[dict, dict]:
    """(per-token tensors [n, ...], parameters) for one case; every tensor a leaf with grad."""
    s = SHAPES[shape]
    r = lambda *sh: torch.randn(*sh, generator=gen)  # noqa: E731
    u = lambda *sh: torch.rand(*sh, generator=gen)  # noqa: E731
    params: dict = {}
    if kernel in ("gdn", "kda"):
        g = -0.3 * u(n, s["Hv"], s["K"]) if kernel == "kda" else -0.3 * u(n, s["Hv"])
        toks = dict(q=r(n, s["Hk"], s["K"]), k=r(n, s["Hk"], s["K"]), v=r(n, s["Hv"], s["V"]), g=g, beta=u(n, s["Hv"]))
    elif kernel == "mamba2":
        H, P, G, N = s["H"], s["P"], s["G"], s["N"]
        toks = dict(x=r(n, H, P), dt=r(n, H) - 1.0, B=r(n, G, N) / math.sqrt(N), C=r(n, G, N), z=r(n, H, P))
        params = dict(A=-(0.5 + u(H)), D=r(H), dt_bias=0.5 * r(H))
    elif kernel == "mamba1":
        Dm, N = s["Dm"], s["Nm"]
        toks = dict(u=r(n, Dm), delta=r(n, Dm) - 1.0, B=r(n, N), C=r(n, N), z=r(n, Dm))
        params = dict(A=-(0.5 + u(Dm, N)), D=r(Dm), delta_bias=0.5 * r(Dm))
    elif kernel.startswith("short_conv"):
        toks = dict(x=r(n, s["Dc"]))
        params = dict(weight=0.5 * r(s["Dc"], s["W"]), bias=0.1 * r(s["Dc"]))
    else:
        raise KeyError(kernel)
    cast = lambda k, t: (t if k in _FP32 else t.to(dtype)).to(device).requires_grad_()  # noqa: E731
    return {k: cast(k, t) for k, t in toks.items()}, {k: cast(k, t) for k, t in params.items()}


#: case -> the stand-in for its stock kernel (``smoke`` mode)
STOCK = {
    "gdn": stock_chunk_gated_delta_rule,
    "kda": stock_chunk_gated_delta_rule,
    "mamba2": stock_mamba_chunk_scan_combined,
    "mamba1": stock_selective_scan_fn,
    "short_conv_fla": stock_fla_causal_conv1d,
    "short_conv_cuda": stock_causal_conv1d_fn,
}


def _no_fork(level_fn):
    """``level_fn`` with the parents' states dropped (every segment from zeros): a negative control."""

    def level(*a, initial_state=None, **kw):
        return level_fn(*a, initial_state=None, **kw)

    return level


def run_case(
    kernel: str, plan, sched, toks: dict, params: dict, *, mode: str, shape: str = "tiny", fork: bool = True
) -> torch.Tensor:
    """The tree output [N, ...] of one case (modes: module docstring).

    ``fork=False`` (scan kernels, ``gpu``/``smoke`` modes) starts every segment from zeros.
    """
    t = tuple(toks.values())
    p = params
    if mode == "reference":
        return _reference(kernel, plan, t, p)
    stock = STOCK[kernel] if mode == "smoke" else None
    wrap = (lambda f: f) if fork else _no_fork
    if kernel.startswith("short_conv"):
        backend = "fla" if kernel == "short_conv_fla" else "causal_conv1d"
        return gpu.tree_short_conv(t[0], p["weight"], p["bias"], sched, "silu", backend=backend, kernel=stock)
    if kernel == "gdn":
        level = partial(gpu.gated_delta_rule_level, kernel=stock)
        return tree_gated_delta_rule(*t, sched, use_qk_l2norm_in_kernel=True, kernel=wrap(level))
    if kernel == "kda":
        level = partial(gpu.kda_level, kernel=stock, use_qk_l2norm_in_kernel=True)
    elif kernel == "mamba2":
        chunk = SHAPES[shape]["chunk"]

        def level(x, dt, B, C, z, **kw):
            return gpu_ssm.mamba2_level(
                x,
                dt,
                p["A"],
                B,
                C,
                chunk_size=chunk,
                D=p["D"],
                z=z,
                dt_bias=p["dt_bias"],
                dt_softplus=True,
                kernel=stock,
                **kw,
            )
    elif kernel == "mamba1":

        def level(u, delta, B, C, z, **kw):
            return gpu_ssm.selective_scan_level(
                u,
                delta,
                p["A"],
                B,
                C,
                D=p["D"],
                z=z,
                delta_bias=p["delta_bias"],
                delta_softplus=True,
                kernel=stock,
                **kw,
            )
    else:
        raise KeyError(kernel)
    return gpu.scan_tree(wrap(level), sched, t)


def _reference(kernel: str, plan, t: tuple, p: dict) -> torch.Tensor:
    """The fp64 token-loop oracle: segments walked parents first, no level metadata."""
    if kernel.startswith("short_conv"):
        return naive_tree_causal_conv1d(t[0].double(), p["weight"].double(), p["bias"].double(), plan, "silu")
    if kernel in ("gdn", "kda"):
        return naive_tree(partial(loop_delta_rule, use_qk_l2norm_in_kernel=True), plan, t)
    if kernel == "mamba2":
        loop = lambda x, dt, B, C, z, h0: loop_mamba2(
            x, dt, p["A"], B, C, h0, D=p["D"], z=z, dt_bias=p["dt_bias"], dt_softplus=True
        )  # noqa: E731
    elif kernel == "mamba1":
        loop = lambda u, delta, B, C, z, h0: loop_selective_scan(
            u, delta, p["A"], B, C, h0, D=p["D"], z=z, delta_bias=p["delta_bias"], delta_softplus=True
        )  # noqa: E731
    else:
        raise KeyError(kernel)
    return naive_tree(loop, plan, t)
