"""What verl 0.9.1 needs to run its FSDP engine on CPU in a test process (never in the product).

- a CPU platform (verl picks CUDA / NPU / ROCm by detection; ``set_platform`` overrides it);
- a gloo process group (verl's default is ``cpu:gloo,cuda:nccl``);
- an engine registry entry for device ``cpu`` (stock verl registers ``cuda`` / ``npu``);
- FSDP2, ``attn_implementation`` eager, no ``torch.compile``, fp32;
- the critic's model loaded with the configured (eager) attention: verl's ``load_valuehead_model``
  asks for ``flash_attention_2``, which a CPU has not, and then falls back to TRL.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
import torch.distributed as dist
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import set_platform


class CPUPlatform(PlatformBase):
    """verl's platform interface on the CPU (torch.cpu as the device module)."""

    device_name = "cpu"
    vendor_name = "cpu"

    @property
    def device_module(self):
        mod = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")})
        mod.max_memory_allocated = lambda *a, **k: 0
        mod.max_memory_reserved = lambda *a, **k: 0
        mod.memory_allocated = lambda *a, **k: 0
        mod.memory_reserved = lambda *a, **k: 0
        mod.empty_cache = lambda: None
        mod.manual_seed = torch.manual_seed
        mod.manual_seed_all = torch.manual_seed
        mod.get_rng_state = torch.get_rng_state
        mod.set_rng_state = torch.set_rng_state
        mod.mem_get_info = lambda *a, **k: (1 << 34, 1 << 35)
        mod.is_available = lambda: True
        mod.current_device = lambda: 0
        mod.get_device_name = lambda *a, **k: "CPU"  # the worker's MFU estimate looks the device up
        return mod

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def install(rank: int = 0, world_size: int = 1, init_file: str | None = None) -> None:
    """CPU platform, gloo group, and the ``cpu`` entries of verl's engine registry (idempotent)."""
    set_platform(CPUPlatform())
    if not dist.is_initialized():
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        url = f"file://{init_file}" if init_file else "tcp://127.0.0.1:29533"
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    import verl.utils.model as verl_model
    from verl.workers.engine.base import EngineRegistry

    for model_type in ("language_model", "value_model"):
        table = EngineRegistry._engines[model_type]
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in table[backend]:
                table[backend]["cpu"] = table[backend]["cuda"]
    verl_model.load_valuehead_model = _load_value_model


def _load_value_model(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's ``load_valuehead_model`` for a ``*ForTokenClassification`` checkpoint, without flash attention."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        local_path, torch_dtype=torch_dtype, config=model_config, trust_remote_code=trust_remote_code
    )
