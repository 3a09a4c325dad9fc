"""What Megatron-Core 0.19.2 and Megatron-Bridge 0.6.2 need to import and build on a CPU-only
Python 3.11 test host (never in the product; a GPU host with Python >= 3.12, Transformer
Engine and triton needs none of them).

- ``typing.override`` (Python 3.12): ``megatron.training``, which Bridge imports, uses it;
  ``typing_extensions.override`` is the same decorator.
- ``megatron.core.transformer.moe.ops.paged_stash``: the one module on Megatron-Core's import
  path that imports triton (its paged-stash kernels, a GPU memory feature for MoE). A module
  of the same names whose kernels refuse to run stands in (faking triton itself breaks torch).
- ``megatron.bridge.peft.lora_layers``: Bridge's LoRA layers import Transformer Engine
  unconditionally; placeholders of its four classes stand in (no LoRA runs here, and the
  bridge's isinstance checks then match nothing). Faking Transformer Engine instead would make
  Megatron-Core believe it is installed.
- ``torch.cuda.current_device``: called at model build even with ``use_cpu_initialization``
  (and by the stock rotary embedding, which moves its frequencies there); it answers
  ``"cpu"`` here, a device every ``torch.empty(..., device=)`` and ``.to(device=)`` takes.
- the model-parallel RNG tracker, which Megatron's layers fork at build
  (``initialize_rng_tracker(inference_rng_tracker=True)`` is the CPU-safe one).
"""

from __future__ import annotations

import sys
import types
import typing


def _refuse(*args, **kwargs):
    raise RuntimeError("the paged-stash kernels need triton and CUDA (a test stand-in)")


def install() -> None:
    """Install the stand-ins (idempotent); call before importing megatron."""
    import typing_extensions

    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name not in sys.modules:
        stash = types.ModuleType(name)
        stash.GLOBAL_BLOCK_SIZE = 0
        stash.paged_stash_copy_kernel = _refuse
        stash.paged_stash_pop_kernel = _refuse
        sys.modules[name] = stash
    name = "megatron.bridge.peft.lora_layers"
    if name not in sys.modules:
        lora = types.ModuleType(name)
        for cls in ("LinearAdapter", "LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear"):
            setattr(lora, cls, type(cls, (), {"__init__": _refuse}))
        sys.modules[name] = lora
    import torch

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"


def init_ranks(rank: int, world: int, tp: int, init_file: str) -> None:
    """gloo over ``world`` ranks, parallel_state with TP ``tp`` (DP the rest), the RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
