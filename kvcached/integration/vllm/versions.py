"""The vLLM patches, each with the seam shape it is written for.

Supported: the minors of ``profile.MINORS`` (vLLM 0.26-0.34). Each patch names
the shape of the seam it needs (``profile.Seams``); its version range, and the
minors where its seam contract is known to break (``KNOWN_BREAKS``), follow from
the profile. Run for real in CI on the CPU build (``profile.ci_versions()``,
scripts/test_engines.sh); every supported minor is proven from its source:
every seam contract of every patch in range holds there
(tests/contracts/test_vllm_seams.py; docs/notes/vllm_seams.md is the seam x
version table with the patch that covers each difference).

A new vLLM minor is refused at start-up until its seams have been checked and
it has a line in the profile: a patch that silently misfits the engine would
corrupt KV state, which is worse than not starting.

Importing this module imports neither vLLM nor torch: the patch functions
import their seam modules when they run.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, Dict, List, Tuple

from kvcached.integration.patch_base import BasePatch, Version
from kvcached.integration.patch_base import deferred_call as _call
from kvcached.integration.seam_table import Needs
from kvcached.integration.vllm import profile

_range = profile.version_range


SUPPORTED = _range(None)
# Named for the tests that pick their checks by shape.
V026_028 = _range(("kv_buffer", "shared_by"))
V029_034 = _range(("kv_buffer", "layers"))
CPU_STARTUP_CHECK = _range(("cpu_startup_check", True))

# Modules that bind ``allocate_kv_cache`` by name at import time
# (``from vllm.v1.worker.utils import allocate_kv_cache``): patching only the
# defining module would miss them. Each with the shape it is patched for and
# whether it is absent outside it (then nothing there can break: hisparse
# before 0.30, gpu_model_runner in 0.34, the CPU V2 runner before 0.34).
ALLOCATE_KV_CACHE_IMPORTER_NEEDS: Tuple[Tuple[str, Needs, bool], ...] = (
    ("vllm.v1.worker.gpu_model_runner", ("kv_buffer", "layers"), False),  # V1 runner (CPU and GPU), up to 0.33
    ("vllm.v1.worker.gpu.attn_utils", ("kv_buffer", "layers"), False),  # V2 runner (GPU; CPU with triton-cpu)
    ("vllm.v1.hisparse.binding", ("kv_buffer", "layers"), True),
    ("vllm.v1.worker.cpu.attn_utils", ("cpu_v2_runner", True), True),  # 0.34: the CPU worker's V2 runners
)
ALLOCATE_KV_CACHE_IMPORTERS = tuple(name for name, _, _ in ALLOCATE_KV_CACHE_IMPORTER_NEEDS)
BY_NAME = "allocate_kv_cache_by_name:"


_POOL = "kvcached.integration.vllm.block_pool"
_SCHED = "kvcached.integration.vllm.scheduler_patches"
_LAYOUT = "kvcached.integration.vllm.kv_layout"
_WKV = "kvcached.integration.vllm.worker_kv"
_CAP = "kvcached.integration.vllm.worker_capacity"
_CONFIG = "kvcached.integration.vllm.config_patches"
_SLEEP = "kvcached.integration.vllm.sleep_mode"


def _set(module: str, owner: str, attr: str, value: str, wrap: Callable[[object], object] = lambda f: f):
    """A patch's apply that sets ``module[.owner].attr`` to ``module.value`` (the shape's variant)."""

    def apply(target: ModuleType) -> None:
        mod = importlib.import_module(module)
        setattr(getattr(mod, owner) if owner else mod, attr, wrap(getattr(mod, value)))

    return apply


def _seam_only(target: ModuleType) -> None:
    """The apply of a row that only names a seam kvcached reads (its range and contract
    tests): the code that reads it binds to what the engine's object has."""


# (name, target module, needs, apply, what it does). One line per patch; the
# order is the order they apply in within a module.
_SPECS: List[Tuple[str, str, Needs, Callable[[ModuleType], None], str]] = [
    # ------------------------------------------------ scheduler (EngineCore)
    ("elastic_block_pool", "vllm.v1.core.kv_cache_coordinator", None, _call(_POOL, "patch_coordinator_module"),
     "the coordinator builds its BlockPool through this module's name: swap in ElasticBlockPool"),
    ("scheduler_lifecycle", "vllm.v1.core.sched.scheduler", None, _call(_SCHED, "patch_scheduler_module"),
     "hand the KV config to the pool, fence physical release by finished steps, close at shutdown"),
    ("engine_core_idle_return", "vllm.v1.engine.core", None, _call(_SCHED, "patch_engine_core_module"),
     "an idle engine gives cached pages back to a short peer or a lowered limit (idle callbacks)"),
    ("engine_core_sleep_kv", "vllm.v1.engine.core", None, _call(_SLEEP, "patch_engine_core_sleep"),
     "sleep mode: the KV cache kvcached backs is given back while vLLM's kv_cache sleeps (weights: vLLM's pool)"),
    ("engine_core_kv_discard", "vllm.v1.engine.core", ("kv_discard", True), _seam_only,
     "0.31+: release_kv_cache_memory discards the KV cache alone (Executor.discard): give its pages back too "
     "(sleep_mode.bind_executor wraps the discard of an executor that has one)"),
    ("allocate_slots_rollback", "vllm.v1.core.kv_cache_manager", None, _call(_SCHED, "patch_kv_cache_manager_module"),
     "a physical shortage found while allocating becomes None (preemption), after an exact rollback"),
    ("block_owner_none_0_29", "vllm.v1.core.block_pool", ("block_owner", "none"), _call(_POOL, "use_unowned_blocks"),
     "<=0.29: KVCacheBlock has no pool field (every block a pool frees is its own)"),
    ("block_owner_by_reference", "vllm.v1.core.block_pool", ("block_owner", "pool"),
     _call(_POOL, "use_block_owners_by_reference"),
     "KVCacheBlock.pool is the owning pool itself (ElasticBlockPool.free_blocks forwards foreign blocks)"),
    ("block_owner_weakref", "vllm.v1.core.block_pool", ("block_owner", "weakref"),
     _call(_POOL, "use_weak_block_owners"),
     "0.34: KVCacheBlock.pool is weakref.ref(owner) (BlockPool._weak_self)"),
    ("no_reuse_watchers_0_29", "vllm.v1.core.block_pool", ("reuse_watchers", False),
     _call(_POOL, "use_no_reuse_watchers"),
     "<=0.29: BlockPool has no _reuse_watchers (no unpin_blocks); get_new_blocks reads an empty one"),
    ("offloading_connector_fence", "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", None,
     _call("kvcached.integration.vllm.offload", "patch_offloading_connector"),
     "--kv-offloading-size (native OffloadingConnector): its store/load jobs hold their blocks until every worker "
     "reported them finished, so the fence never unmaps a page under a copy"),
    # ------------------------------------- KV layout (scheduler and workers)
    ("kv_tensors_shared_by_0_28", "vllm.v1.kv_cache_interface", ("kv_buffer", "shared_by"),
     _set(_LAYOUT, "KVLayoutPlan", "tensor_reader", "read_shared_by_tensors", staticmethod),
     "<=0.28: KVCacheTensor(size, shared_by, ...) is one buffer per tensor, block b at b * block bytes"),
    ("kv_tensors_by_layers", "vllm.v1.kv_cache_interface", ("kv_buffer", "layers"),
     _set(_LAYOUT, "KVLayoutPlan", "tensor_reader", "read_layer_tensors", staticmethod),
     "KVCacheTensor(size, layers, layer_stride, block_stride, offset): placements in one buffer"),
    ("kv_regions_page_aligned", "vllm.v1.engine.core", ("kv_buffer", "layers"),
     _call("kvcached.integration.vllm.kv_regions", "patch_kv_cache_configs"),
     "the engine core's KV cache configs get page-aligned layer regions before workers and scheduler see them"),
    ("mamba_state_shared_by_0_28", "vllm.v1.kv_cache_interface", ("kv_buffer", "shared_by"),
     lambda target: importlib.import_module(_LAYOUT).serve_specs_of_patch("mamba_state_shared_by_0_28"),
     "<=0.28: Mamba / gated-delta-net state (MambaSpec) blocks at b * page bytes of their shared_by buffer: "
     "backed like KV blocks (proven on the 0.26 and 0.28 CPU engines with Qwen3-Next)"),
    ("mamba_state_0_29", "vllm.v1.kv_cache_interface", ("kv_buffer", "layers"),
     lambda target: importlib.import_module(_LAYOUT).serve_specs_of_patch("mamba_state_0_29"),
     "Mamba / gated-delta-net state (MambaSpec) blocks at their layer's block address in the one buffer: "
     "backed like KV blocks (proven on 0.29 and 0.32 CPU engines with Qwen3-Next)"),
    ("mamba_state_views_as_strided_0_26", "vllm.v1.kv_cache_interface", ("mamba_views", "as_strided"),
     _set(_WKV, "", "fix_state_views", "rebase_state_views"),
     "0.26: the runners cut Mamba state views with as_strided(storage_offset=...) from the storage's start, "
     "the FTensor's here: moved onto each layer's buffer (worker_kv.rebase_state_views)"),
    # ----------------------------------------------------- worker: KV buffer
    ("runner_v1_kv_buffer_0_28", "vllm.v1.worker.gpu_model_runner", ("kv_buffer", "shared_by"),
     _call(_WKV, "patch_runner_v1_kv_buffer"),
     "<=0.28: the V1 runner (GPU and CPU) allocates its KV buffers itself: back them with an FTensor"),
    ("runner_v2_kv_buffer_0_28", "vllm.v1.worker.gpu.attn_utils", ("kv_buffer", "shared_by"),
     _call(_WKV, "patch_runner_v2_kv_buffer"),
     "<=0.28: the V2 runner (the GPU default) allocates its KV buffers itself: back them with an FTensor"),
    ("worker_allocate_kv_cache", "vllm.v1.worker.utils", ("kv_buffer", "layers"),
     _call(_WKV, "patch_allocate_kv_cache", ALLOCATE_KV_CACHE_IMPORTERS),
     "back vLLM's one KV buffer with an FTensor of the same size (views and strides unchanged)"),
    ("kv_blocks_uniform_0_29", "vllm.v1.worker.utils", ("blocks_of", "uniform"),
     _set(_WKV, "", "blocks_of", "num_blocks_uniform"),
     "0.29: every KV cache tensor holds kv_cache_config.num_blocks blocks (no num_blocks_of)"),
    ("kv_blocks_per_tensor", "vllm.v1.worker.utils", ("blocks_of", "per_tensor"),
     _set(_WKV, "", "blocks_of", "num_blocks_of_tensor"),
     "KVCacheConfig.num_blocks_of(tensor): the blocks one KV cache tensor holds"),
    # ------------------------------------------------------ worker: capacity
    ("cpu_worker_capacity", "vllm.v1.worker.cpu_worker", None, _call(_CAP, "patch_cpu_worker_capacity"),
     "KV capacity from the virtual budget, not from the memory this node has free now"),
    ("gpu_worker_capacity", "vllm.v1.worker.gpu_worker", None, _call(_CAP, "patch_gpu_worker_capacity"),
     "KV capacity from the virtual budget, not from whole-device free-memory deltas"),
    # With kvcached the KV bytes are virtual, and another instance holding memory
    # must not stop this one from starting.
    ("cpu_worker_startup_check_0_32", "vllm.v1.worker.cpu_worker", ("cpu_startup_check", True),
     _call(_CAP, "patch_cpu_worker_init_capacity"),
     "<=0.32's CPUWorker start-up check compares the whole reservation with free memory"),
    # ------------------------------------------------------------ config
    ("extensible_kv_cache_off", "vllm.config.vllm", ("extensible_kv", True),
     _call(_CONFIG, "patch_extensible_kv_cache_off"),
     "0.34: vLLM's own extensible KV cache (on by default on CUDA/ROCm) would own the buffer kvcached backs"),
] + [
    (BY_NAME + name, name, needs, _call(_WKV, "rebind_allocate_kv_cache"),
     "this module imported allocate_kv_cache by name before (or after) the utils patch")
    for name, needs, _ in ALLOCATE_KV_CACHE_IMPORTER_NEEDS
]  # fmt: skip


def all_patches() -> List[BasePatch]:
    return [BasePatch(name, target, _range(needs), apply, why) for name, target, needs, apply, why in _SPECS]


def apply_installed(targets: Tuple[str, ...]) -> Version:
    """Applies now, once per module, the installed vLLM's patches of the modules
    ``targets`` (what activation does in an engine process; for tests and
    benchmarks that build pools or buffers without an engine). Returns the version."""
    import vllm

    from kvcached.integration.patch_base import mark, parse_version

    v = parse_version(vllm.__version__)
    for patch in all_patches():
        if v in patch.versions and patch.target_module in targets:
            module = importlib.import_module(patch.target_module)
            if mark(module, patch.name):
                patch.apply(module)
    return v


# ------------------------------------------------------------ known breaks

# The minors whose source tests/contracts/test_vllm_seams.py reads.
CHECKED_MINORS = tuple(profile.MINORS)
_IDLE_OUTSIDE = {BY_NAME + name for name, _, idle in ALLOCATE_KV_CACHE_IMPORTER_NEEDS if idle}


def _known_breaks() -> Dict[Tuple[str, str], str]:
    out: Dict[Tuple[str, str], str] = {}
    for name, _, needs, _, _ in _SPECS:
        if name in _IDLE_OUTSIDE:
            continue  # its module does not exist outside its range: nothing there to break
        for minor in profile.MINORS:
            why = profile.why_not(needs, minor)
            if why:
                out[(name, minor)] = why
    return out


# (patch name, minor) -> why that patch's seam contract fails on that minor:
# every minor whose seam has another shape than the patch needs (profile.SHAPES
# says why). The contract test marks them strict xfail (so this table cannot go
# stale: a break that is fixed reports XPASS), and KVCACHED_ALLOW_UNSUPPORTED's
# warning names them.
KNOWN_BREAKS: Dict[Tuple[str, str], str] = _known_breaks()


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
