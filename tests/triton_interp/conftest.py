"""The Triton-interpreter test env: ``make test-triton`` (``.venv-triton``, ``TRITON_INTERPRET=1``).

Outside that env (``TRITON_INTERPRET`` unset, e.g. ``make test``) nothing here imports
triton or a kernel package, and every test of this folder is reported as skipped with
the reason. Inside it, this file imports triton, fla and mamba_ssm's Triton kernels at
load time, so a missing package is a collection error (a red run), never a silent skip;
``test_interpret_kernels.py`` ends with a guard test that every (kernel, dtype) case ran.

What running these kernels on CPU under the interpreter needs (each patch is the
smallest that works, applied once here and nowhere in the project's code):

- autotuning benchmarks every config on a GPU driver: keep one config per kernel
  (the first that the kernel's own pruning leaves);
- fla calls ``.to(tl.int64)`` on loop counters; the interpreter runs ``range`` as plain
  Python, so its counters are ints. The interpreter's AST rewrite is extended to turn a
  ``for i in range(...)`` counter into an interpreter tensor at the top of the body;
- mamba_ssm's wrappers enter ``torch.cuda.device(x.device.index)`` and read
  ``torch.cuda.get_device_properties(...).multi_processor_count``: on a CPU-only torch
  these become a null context and a 4-"SM" stand-in;
- (in the project, not here) ``import mamba_ssm`` runs its ``__init__``, which imports
  the CUDA-only extension ``selective_scan_cuda``; ``gpu.load_kernel`` registers the
  package bare so its Triton submodules (``mamba_ssm.ops.triton.*``) import alone.

bf16 is not run: the interpreter returns garbage for bf16 ``tl.dot`` (measured: errors
of 1e10 against the reference), so bf16 is a GPU-only check (``make gpu-check``).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import types

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: kernel name -> dtype name -> {"out": rel err, "grad": rel err, "seconds": s}
RESULTS: dict[str, dict[str, dict[str, float]]] = {}


def _one_config() -> None:
    import triton.runtime.autotuner as autotuner

    prune = autotuner.Autotuner.prune_configs

    def first_config(self, kwargs):
        return prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = first_config


def _tensor_loop_counters() -> None:
    import triton.runtime.interpreter as interpreter

    class LoopCounters(interpreter.ASTTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            it = node.iter
            func = it.func if isinstance(it, ast.Call) else None
            is_range = (isinstance(func, ast.Name) and func.id == "range") or (
                isinstance(func, ast.Attribute) and func.attr == "range"
            )
            if is_range and isinstance(node.target, ast.Name):
                to_tensor = ast.Attribute(
                    value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor", ctx=ast.Load()
                )
                node.body.insert(
                    0,
                    ast.Assign(
                        targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                        value=ast.Call(
                            func=to_tensor,
                            args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)],
                            keywords=[],
                        ),
                    ),
                )
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopCounters()


def _cpu_cuda_queries() -> None:
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.device = lambda device=None: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=4, name="triton-interpreter", gcnArchName=""
    )


#: the kernels this folder runs under the interpreter (the CUDA-only ones are GPU-check only)
INTERPRETED = (
    "fla.chunk_gated_delta_rule",
    "fla.chunk_kda",
    "fla.causal_conv1d",
    "mamba_ssm.mamba_chunk_scan_combined",
)

if INTERPRET:
    import triton  # noqa: F401  (a missing triton fails the run here, loudly)

    _one_config()
    _tensor_loop_counters()
    _cpu_cuda_queries()
    from treepack.trainer.kernels.gpu import load_kernel

    for _name in INTERPRETED:
        load_kernel(_name)  # raises ImportError naming the kernel and the cause


@pytest.fixture(scope="session")
def interp_results() -> dict:
    """The session's (kernel, dtype) results, printed at the end (and written to $TRITON_REPORT)."""
    return RESULTS


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    w = terminalreporter.write_line
    w("Triton interpreter: max relative error vs the fp64 token-loop reference (outputs, input gradients)")
    w("| kernel | dtype | out | grad | wrapper fwd+bwd s | passed |")
    w("|---|---|---:|---:|---:|---|")
    for name, per in RESULTS.items():
        for dt, r in per.items():
            w(f"| {name} | {dt} | {r['out']:.2e} | {r['grad']:.2e} | {r['seconds']:.1f} | {r['passed']} |")
    path = os.environ.get("TRITON_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=2)
