"""One table of kernel cases, shared by the interpreter tests and ``benchmarks/gpu_check.py``.

A case is a kernel name, per-token inputs flat over rows ([N, ...], leaves with
``requires_grad``) and parameters; :func:`run_case` runs it over a tree schedule in one
of three modes:

- ``gpu``: the project's GPU wrapper (``treepack.trainer.kernels.gpu``), on whatever
  device the tensors are (CUDA, or CPU under ``TRITON_INTERPRET=1``);
- ``reference``: the fp64 token loops of :mod:`loop_refs` walked over the plan's segments
  (no level metadata), the oracle;
- ``smoke``: :func:`~treepack.trainer.kernels.gpu.scan_tree` with a token-loop level
  function in place of the GPU kernel (CPU, no kernel package needed): the driver's code
  path without the kernel, so ``gpu_check --cpu-smoke`` keeps running in CI.
"""

from __future__ import annotations

import math

import torch

from loop_refs import loop_delta_rule, loop_mamba2, loop_selective_scan, naive_tree

from treepack.trainer.gdn import naive_tree_causal_conv1d, tree_causal_conv1d, tree_gated_delta_rule
from treepack.trainer.kernels import gpu

__all__ = ["KERNELS", "SHAPES", "make_inputs", "run_case", "loop_level"]

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


def make_inputs(kernel: str, n: int, dtype: torch.dtype, gen: torch.Generator, *, shape: str = "tiny", device: str = "cpu") -> tuple[dict, dict]:
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


def loop_level(loop_fn):
    """A level function (the ``gpu.*_level`` contract) that runs ``loop_fn`` per segment."""

    def level(*tensors, initial_state=None, output_final_state=True, cu_seqlens=None, **kw):
        cu = cu_seqlens.tolist()
        outs, finals = [], []
        for i in range(len(cu) - 1):
            seg = [t[0, cu[i] : cu[i + 1]] for t in tensors]
            o, h = loop_fn(*seg, None if initial_state is None else initial_state[i], **kw)
            outs.append(o)
            finals.append(h)
        return torch.cat(outs)[None].to(tensors[0].dtype), torch.stack(finals)

    return level


def _mamba2_fns(params, chunk):
    A, D, dt_bias = params["A"], params["D"], params["dt_bias"]

    def loop(x, dt, B, C, z, h0):
        return loop_mamba2(x, dt, A, B, C, h0, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)

    def level(x, dt, B, C, z, **kw):
        return gpu.mamba2_level(x, dt, A, B, C, chunk_size=chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True, **kw)

    return loop, level


def _mamba1_fns(params):
    A, D, bias = params["A"], params["D"], params["delta_bias"]

    def loop(u, delta, B, C, z, h0):
        return loop_selective_scan(u, delta, A, B, C, h0, D=D, z=z, delta_bias=bias, delta_softplus=True)

    def level(u, delta, B, C, z, **kw):
        return gpu.selective_scan_level(u, delta, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True, **kw)

    return loop, level


def _no_fork(level_fn):
    """``level_fn`` with the parents' states dropped (every segment from zeros): a negative control."""

    def level(*a, initial_state=None, **kw):
        return level_fn(*a, initial_state=None, **kw)

    return level


def run_case(kernel: str, plan, sched, toks: dict, params: dict, *, mode: str, shape: str = "tiny", fork: bool = True) -> torch.Tensor:
    """The tree output [N, ...] of one case (modes: module docstring).

    ``fork=False`` (scan kernels, ``gpu``/``smoke`` modes) starts every segment from zeros.
    """
    t = tuple(toks.values())
    wrap = (lambda f: f) if fork else _no_fork
    if kernel.startswith("short_conv"):
        w, b = params["weight"], params["bias"]
        if mode == "reference":
            return naive_tree_causal_conv1d(t[0].double(), w.double(), b.double(), plan, "silu")
        if mode == "smoke":
            return tree_causal_conv1d(t[0], w, b, sched, "silu")
        return gpu.tree_short_conv(t[0], w, b, sched, "silu", backend="fla" if kernel == "short_conv_fla" else "causal_conv1d")
    if kernel in ("gdn", "kda"):
        loop = lambda *a: loop_delta_rule(*a, use_qk_l2norm_in_kernel=True)  # noqa: E731
        if mode == "reference":
            return naive_tree(loop, plan, t)
        if mode == "smoke":
            return gpu.scan_tree(wrap(loop_level(loop)), sched, t)
        if kernel == "gdn":
            return tree_gated_delta_rule(*t, sched, use_qk_l2norm_in_kernel=True, kernel=wrap(gpu.gated_delta_rule_level))
        return gpu.scan_tree(wrap(gpu.kda_level), sched, t, use_qk_l2norm_in_kernel=True)
    if kernel == "mamba2":
        loop, level = _mamba2_fns(params, SHAPES[shape]["chunk"])
    elif kernel == "mamba1":
        loop, level = _mamba1_fns(params)
    else:
        raise KeyError(kernel)
    if mode == "reference":
        return naive_tree(loop, plan, t)
    return gpu.scan_tree(wrap(loop_level(loop) if mode == "smoke" else level), sched, t)
