"""Worker seam: a worker's KV capacity comes from the device budget, not from free memory.

With kvcached the KV bytes are virtual, so a worker takes its KV capacity from
the device budget (``KVCACHED_GPU_UTILIZATION`` / ``KVCACHED_HOST_MEMORY_BUDGET``:
what all kvcached instances on the device may map together) instead of the
memory the device has free right now; a second instance then starts while the
first holds memory. An explicit ``kv_cache_memory_bytes`` still wins.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable

from kvcached import config
from kvcached.errors import InvalidArgumentError
from kvcached.integration.patch_base import wrap_method
from kvcached.integration.vllm.worker_kv import device_string

logger = logging.getLogger("vllm.kvcached")


def virtual_capacity(device: str, consumed_bytes: int = 0) -> int:
    """KV bytes this worker may address: the device budget (what all kvcached
    instances on the device may map together), less ``consumed_bytes`` the
    model itself holds on a GPU, rounded down to whole pages."""
    from kvcached.limits.budget import usable_device_bytes

    budget = usable_device_bytes(device)
    page = config.page_size()
    cap = (budget - max(0, int(consumed_bytes))) // page * page
    if cap <= 0:
        raise InvalidArgumentError(
            f"kvcached: the device budget of {device} ({budget >> 20} MiB) leaves no room for a KV cache after "
            f"{consumed_bytes >> 20} MiB used by the model; raise KVCACHED_GPU_UTILIZATION / "
            "KVCACHED_HOST_MEMORY_BUDGET or pass --kv-cache-memory-bytes"
        )
    return cap


def _set_virtual_capacity(cache_config: Any, device: str, consumed: int = 0) -> None:
    if cache_config.kv_cache_memory_bytes is None:
        cache_config.kv_cache_memory_bytes = virtual_capacity(device, consumed)
        logger.info(
            "kvcached: KV capacity %.1f MiB from the %s budget (virtual; pages are mapped on demand)",
            cache_config.kv_cache_memory_bytes / (1 << 20),
            device,
        )


def patch_cpu_worker_capacity(module: ModuleType) -> None:
    def make(orig: Callable) -> Callable:
        def determine_available_memory(self) -> int:  # type: ignore[no-untyped-def]
            # Virtual bytes: no comparison with the node's free memory (another
            # instance may hold it now and give it back later).
            _set_virtual_capacity(self.cache_config, "cpu")
            return int(self.cache_config.kv_cache_memory_bytes)

        return determine_available_memory

    wrap_method(module.CPUWorker, "determine_available_memory", make)


def patch_cpu_worker_init_capacity(module: ModuleType) -> None:
    def make(orig: Callable) -> Callable:
        def __init__(self, vllm_config, *args, **kwargs):  # type: ignore[no-untyped-def]
            _set_virtual_capacity(vllm_config.cache_config, "cpu")
            orig(self, vllm_config, *args, **kwargs)

        return __init__

    wrap_method(module.CPUWorker, "__init__", make)


def patch_gpu_worker_capacity(module: ModuleType) -> None:
    def make(orig: Callable) -> Callable:
        def determine_available_memory(self) -> int:  # type: ignore[no-untyped-def]
            used = int(getattr(getattr(self, "model_runner", None), "model_memory_usage", 0) or 0)
            _set_virtual_capacity(self.cache_config, device_string(self.device), used)
            # With kv_cache_memory_bytes set vLLM skips the free-memory profiling.
            return orig(self)

        return determine_available_memory

    wrap_method(module.Worker, "determine_available_memory", make)
