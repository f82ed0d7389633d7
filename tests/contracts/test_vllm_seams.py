"""Seam contracts: every vLLM name, signature and attribute kvcached's patches rely on,
read from each vLLM minor's source with ``ast`` (vLLM is never imported).

For every patch of ``kvcached.integration.vllm.versions.all_patches()`` and every
minor in ``VERSIONS``, the patch's contract (``CONTRACTS`` below: what its code
touches in vLLM) is checked against that release's source:

* a version inside the patch's range must satisfy the contract (a failure is a
  patch that no longer fits the engine it claims);
* a version outside the range where the contract is known to break is an
  expected failure (``versions.KNOWN_BREAKS``, ``xfail(strict=True)`` with the reason). When
  the range is widened the xfail no longer applies and the check must pass for
  real; when vLLM or the contract changes so that it passes, strict xfail
  reports XPASS and ``KNOWN_BREAKS`` has to be updated;
* a version outside the range not listed in ``KNOWN_BREAKS`` must pass: the patch's
  seams are all there, only nobody has proven it yet.

A new patch needs its entry in ``CONTRACTS`` (``test_every_patch_has_a_contract``).
When a patch learns a new vLLM shape (a guard, a second code path), change its
contract to accept both shapes and drop the ``KNOWN_BREAKS`` entries that then pass.

Sources come from ``scripts/engine_sources.py`` (sdist, cached outside the
clone). A version not cached is skipped with the reason, unless
``KVCACHED_REQUIRE_SEAM_SOURCES=1`` (``scripts/test.sh`` sets it), which downloads it and
fails the contract when it cannot.

``python tests/contracts/test_vllm_seams.py`` prints the seam x version table
with ``file:line`` evidence (what docs/notes/vllm_seams.md is written from).

Why this module is long: the contract table (one entry per vLLM name a patch relies on) is the point of it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from kvcached.integration.vllm import profile as vllm_profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from seam_ast import (  # noqa: E402
    Check,
    Finding,
    Tree,
    accepts_engine_call,
    all_of,
    annotation_excludes,
    annotation_includes,
    any_of,
    callers_within,
    calls_in,
    class_member,
    defines,
    has_methods,
    importers_within,
    lacks,
    mentions,
    methods_touching,
    module_binds,
    overrides_match,
    sets_attrs,
    signature,
    subclass,
)
from seam_harness import ROOT, EngineSeams, run_as_script  # noqa: E402

# The newest patch release of each supported minor: the profile's (kvcached/integration/vllm/profile.py).
VERSIONS = vllm_profile.sources()

BP = "vllm.v1.core.block_pool"
COORD = "vllm.v1.core.kv_cache_coordinator"
KVU = "vllm.v1.core.kv_cache_utils"
KVM = "vllm.v1.core.kv_cache_manager"
STM = "vllm.v1.core.single_type_kv_cache_manager"
SCHED = "vllm.v1.core.sched.scheduler"
CORE = "vllm.v1.engine.core"
EXEC = "vllm.v1.executor.abstract"
KVI = "vllm.v1.kv_cache_interface"
WUTILS = "vllm.v1.worker.utils"
CPUW = "vllm.v1.worker.cpu_worker"
GPUW = "vllm.v1.worker.gpu_worker"
GPUMR = "vllm.v1.worker.gpu_model_runner"
CPUMR = "vllm.v1.worker.cpu_model_runner"
OFFC = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
OFFCOMMON = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
OFFSCHED = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
V2ATTN = "vllm.v1.worker.gpu.attn_utils"


def _offload_update_reads(*attrs: str) -> list:
    """OffloadingConnectorScheduler.update_connector_output reads each attr itself
    (0.26-0.32) or through _update_connector_output, which it calls under the
    manager's lock (0.33+)."""
    q = "OffloadingConnectorScheduler"
    return [
        any_of(
            mentions(OFFSCHED, f"{q}.update_connector_output", a),
            mentions(OFFSCHED, f"{q}._update_connector_output", a),
        )
        for a in attrs
    ]


# BlockPool methods that use self.free_block_queue, read against ElasticBlockPool
# (which keeps only evictable cached blocks there): overridden, or compatible.
BLOCK_POOL_QUEUE_USERS = {
    "__init__",  # ElasticBlockPool.__init__ replaces the queue after super().__init__
    "get_new_blocks",  # overridden
    "free_blocks",  # overridden
    "get_num_free_blocks",  # overridden
    "evict_blocks",  # overridden (calls super, then frees unhashed evictable blocks)
    "reset_prefix_cache",  # overridden
    "touch",  # a prefix hit removes a ref_cnt-0 block from the queue: evictable blocks are exactly those
    "unpin_blocks",  # HiSparse only; kvcached refuses host-resident (HiSparse) KV tensors
}

# What kv_layout.KVLayoutPlan.from_kv_cache_config and worker_kv read from the
# KV cache config, in the scheduler (VllmBackend.create) and in every worker,
# whatever the KVCacheTensor shape (kv_tensors_* patches have their own).
LAYOUT = [
    sets_attrs(KVI, "KVCacheSpec", ["block_size"]),
    has_methods(KVI, "KVCacheSpec", ["page_size_bytes"]),
    sets_attrs(KVI, "KVCacheConfig", ["num_blocks", "kv_cache_tensors", "kv_cache_groups"]),
    sets_attrs(KVI, "KVCacheGroupSpec", ["layer_names", "kv_cache_spec"]),
    sets_attrs(KVI, "UniformTypeKVCacheSpecs", ["kv_cache_specs"], bases_in=(KVI,)),
]

# What worker_kv reads in a worker process to name its instance and socket.
WORKER_RANKS = all_of(
    defines("vllm.distributed.parallel_state", "get_tp_group"),
    defines("vllm.distributed.parallel_state", "get_pp_group"),
    defines("vllm.distributed.parallel_state", "get_dp_group"),
    sets_attrs("vllm.distributed.parallel_state", "GroupCoordinator", ["rank_in_group", "world_size"]),
    has_methods("vllm.platforms.interface", "Platform", ["is_rocm"]),
)

CONTRACTS: Dict[str, List[Tuple[str, Check]]] = {
    "elastic_block_pool": [
        ("coordinator binds BlockPool by module-level name", module_binds(COORD, "BlockPool", BP)),
        (
            "KVCacheCoordinator.__init__ builds BlockPool(num_gpu_blocks=...)",
            calls_in(COORD, "KVCacheCoordinator.__init__", "BlockPool", keywords=("num_gpu_blocks",)),
        ),
        (
            "BlockPool.__init__ signature (forwarded untouched)",
            signature(BP, "BlockPool.__init__", has=("num_gpu_blocks", "enable_caching", "hash_block_size")),
        ),
        (
            "BlockPool state the subclass reads",
            sets_attrs(
                BP,
                "BlockPool",
                [
                    "blocks",
                    "free_block_queue",
                    "num_gpu_blocks",
                    "enable_caching",
                    "metrics_collector",
                ],
            ),
        ),
        (
            "BlockPool methods overridden or called",
            has_methods(
                BP,
                "BlockPool",
                [
                    "get_num_free_blocks",
                    "get_new_blocks",
                    "free_blocks",
                    "evict_blocks",
                    "reset_prefix_cache",
                    "get_usage",
                    "_maybe_evict_cached_block",
                ],
            ),
        ),
        (
            "get_new_blocks tells BlockPool's reuse watchers, or there are none (<=0.29: no_reuse_watchers_0_29)",
            any_of(
                all_of(
                    sets_attrs(BP, "BlockPool", ["_reuse_watchers"]), has_methods(BP, "BlockPool", ["_notify_reuse"])
                ),
                lacks(BP, "BlockPool", ["_reuse_watchers", "_notify_reuse", "unpin_blocks"]),
            ),
        ),
        (
            "free_block_queue users all reviewed",
            methods_touching(BP, "BlockPool", "free_block_queue", BLOCK_POOL_QUEUE_USERS),
        ),
        (
            "KVCacheBlock fields",
            sets_attrs(KVU, "KVCacheBlock", ["block_id", "ref_cnt", "is_null", "prev_free_block", "next_free_block"]),
        ),
        (
            "KVCacheBlock.block_hash (property or field)",
            any_of(
                has_methods(KVU, "KVCacheBlock", ["block_hash"]),
                sets_attrs(KVU, "KVCacheBlock", ["block_hash"]),
            ),
        ),
        (
            "ElasticBlockPool overrides take BlockPool's parameters",
            overrides_match(BP, "BlockPool", ROOT / "kvcached/integration/vllm/block_pool.py", "ElasticBlockPool"),
        ),
        (
            "FreeKVCacheBlockQueue API",
            all_of(
                signature(KVU, "FreeKVCacheBlockQueue.__init__", exactly=("self", "blocks")),
                has_methods(
                    KVU,
                    "FreeKVCacheBlockQueue",
                    ["popleft_n", "append_n", "prepend_n", "remove", "get_all_free_blocks"],
                ),
                sets_attrs(KVU, "FreeKVCacheBlockQueue", ["num_free_blocks"]),
            ),
        ),
        (
            "vllm_config fields VllmBackend.create reads",
            all_of(
                sets_attrs(
                    "vllm.config.parallel",
                    "ParallelConfig",
                    [
                        "tensor_parallel_size",
                        "pipeline_parallel_size",
                        "data_parallel_size",
                        "data_parallel_rank",
                        "decode_context_parallel_size",
                        "prefill_context_parallel_size",
                    ],
                ),
                sets_attrs(
                    "vllm.config.vllm",
                    "VllmConfig",
                    [
                        "parallel_config",
                        "scheduler_config",
                        "device_config",
                        "kv_transfer_config",
                        "model_config",
                        "cache_config",
                    ],
                ),
                sets_attrs("vllm.config.device", "DeviceConfig", ["device"]),
                # backend.refuse_unsupported: sleep mode backends other than cumem, KV offloading
                sets_attrs("vllm.config.model", "ModelConfig", ["enable_sleep_mode", "sleep_mode_backend"]),
                sets_attrs("vllm.config.cache", "CacheConfig", ["kv_offloading_size", "kv_offloading_backend"]),
            ),
        ),
    ]
    + [("KV cache config read by the layout plan", all_of(*LAYOUT))],
    "scheduler_lifecycle": [
        (
            "Scheduler.__init__(vllm_config, kv_cache_config, ...)",
            signature(SCHED, "Scheduler.__init__", has=("vllm_config", "kv_cache_config")),
        ),
        (
            "Scheduler defines shutdown, schedule, update_from_output",
            has_methods(SCHED, "Scheduler", ["__init__", "shutdown", "schedule", "update_from_output"]),
        ),
        ("Scheduler.__init__ builds the KVCacheManager", calls_in(SCHED, "Scheduler.__init__", "KVCacheManager")),
        (
            "scheduler.kv_cache_manager.block_pool",
            all_of(
                sets_attrs(SCHED, "Scheduler", ["kv_cache_manager"]),
                sets_attrs(KVM, "KVCacheManager", ["block_pool"]),
            ),
        ),
        (
            "AsyncScheduler(Scheduler) forwards its __init__ to Scheduler.__init__",
            all_of(
                subclass("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", "Scheduler"),
                calls_in("vllm.v1.core.sched.async_scheduler", "AsyncScheduler.__init__", ".__init__"),
            ),
        ),
        (
            "parallel / scheduler config fields",
            all_of(
                sets_attrs(
                    "vllm.config.parallel", "ParallelConfig", ["tensor_parallel_size", "pipeline_parallel_size"]
                ),
                sets_attrs("vllm.config.scheduler", "SchedulerConfig", ["async_scheduling"]),
            ),
        ),
    ],
    "engine_core_idle_return": [
        (
            "EngineCore.__init__ sets scheduler and _idle_state_callbacks",
            sets_attrs(CORE, "EngineCore", ["scheduler", "_idle_state_callbacks"]),
        ),
        ("EngineCoreProc.input_queue", sets_attrs(CORE, "EngineCoreProc", ["input_queue"])),
        ("idle callbacks get the core", calls_in(CORE, "EngineCoreProc._notify_idle_state_callbacks", "callback")),
        ("EngineCoreRequestType.WAKEUP", class_member("vllm.v1.engine", "EngineCoreRequestType", "WAKEUP")),
        ("Scheduler.has_requests", has_methods(SCHED, "Scheduler", ["has_requests"])),
    ],
    "engine_core_sleep_kv": [
        (
            "EngineCore.__init__ sets scheduler and model_executor (the executor bound to the pool)",
            sets_attrs(CORE, "EngineCore", ["scheduler", "model_executor"]),
        ),
        ("EngineCore.sleep calls model_executor.sleep(level)", calls_in(CORE, "EngineCore.sleep", ".sleep")),
        ("EngineCore.wake_up calls model_executor.wake_up(tags)", calls_in(CORE, "EngineCore.wake_up", ".wake_up")),
        (
            "EngineCore.sleep pauses the scheduler first (its abort/wait/keep frees the blocks)",
            calls_in(CORE, "EngineCore.sleep", ".pause_scheduler"),
        ),
        (
            "Executor.sleep / wake_up keep sleeping_tags (what sleep_mode follows)",
            all_of(
                has_methods(EXEC, "Executor", ["sleep", "wake_up"]),
                sets_attrs(EXEC, "Executor", ["sleeping_tags"]),
                mentions(EXEC, "Executor.wake_up", "sleeping_tags"),
            ),
        ),
        (
            "the worker's sleep synchronises the device before it returns (no step reads a page after)",
            calls_in(GPUW, "Worker.sleep", ".synchronize"),
        ),
        (
            "ModelConfig.enable_sleep_mode / sleep_mode_backend",
            sets_attrs("vllm.config.model", "ModelConfig", ["enable_sleep_mode", "sleep_mode_backend"]),
        ),
    ],
    "engine_core_kv_discard": [
        (
            "EngineCore.release_kv_cache_memory calls model_executor.discard",
            calls_in(CORE, "EngineCore.release_kv_cache_memory", ".discard"),
        ),
        (
            "Executor.discard marks sleeping_tags",
            all_of(has_methods(EXEC, "Executor", ["discard"]), mentions(EXEC, "Executor.discard", "sleeping_tags")),
        ),
    ],
    "allocate_slots_rollback": [
        (
            "KVCacheManager.allocate_slots(self, request, ...)",
            signature(KVM, "KVCacheManager.allocate_slots", has=("self", "request")),
        ),
        ("KVCacheManager.coordinator / block_pool", sets_attrs(KVM, "KVCacheManager", ["coordinator", "block_pool"])),
        ("coordinator.single_type_managers", sets_attrs(COORD, "KVCacheCoordinator", ["single_type_managers"])),
        (
            "single-type manager state rolled back",
            sets_attrs(
                STM,
                "SingleTypeKVCacheManager",
                ["req_to_blocks", "num_cached_block", "new_block_ids", "_partial_hit_reqs"],
            ),
        ),
        ("Request.request_id", sets_attrs("vllm.v1.request", "Request", ["request_id"])),
        (
            "the pool's blocks are allocated only inside allocate_slots",
            callers_within(
                KVM, "KVCacheManager", (".allocate_new_blocks", ".allocate_new_computed_blocks"), ("allocate_slots",)
            ),
        ),
    ],
    "worker_allocate_kv_cache": [
        (
            "worker_kv's allocate_kv_cache wrapper accepts vLLM's allocate_kv_cache calls",
            accepts_engine_call(
                WUTILS, "allocate_kv_cache", ROOT / "kvcached/integration/vllm/worker_kv.py", "allocate_kv_cache"
            ),
        ),
        (
            "create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size)",
            signature(KVI, "create_kv_cache_views", has=("spec", "num_blocks", "layout", "kernel_block_size")),
        ),
        ("worker ranks (parallel_state groups) and platform", WORKER_RANKS),
        ("every by-name importer of allocate_kv_cache is patched", None),  # filled in below
    ]
    + [("KV cache config read by the layout plan", all_of(*LAYOUT))],
    "cpu_worker_capacity": [
        ("CPUWorker.determine_available_memory", has_methods(CPUW, "CPUWorker", ["determine_available_memory"])),
        (
            "CacheConfig.kv_cache_memory_bytes",
            sets_attrs("vllm.config.cache", "CacheConfig", ["kv_cache_memory_bytes"]),
        ),
        (
            "worker.cache_config",
            sets_attrs(CPUW, "CPUWorker", ["cache_config"], bases_in=(GPUW, "vllm.v1.worker.worker_base")),
        ),
    ],
    "gpu_worker_capacity": [
        ("Worker.determine_available_memory", has_methods(GPUW, "Worker", ["determine_available_memory"])),
        (
            "Worker.determine_available_memory honours kv_cache_memory_bytes",
            mentions(GPUW, "Worker.determine_available_memory", "kv_cache_memory_bytes"),
        ),
        (
            "CacheConfig.kv_cache_memory_bytes",
            sets_attrs("vllm.config.cache", "CacheConfig", ["kv_cache_memory_bytes"]),
        ),
    ],
    "block_owner_by_reference": [
        (
            "KVCacheBlock.pool is the pool itself (not a weakref)",
            all_of(
                sets_attrs(KVU, "KVCacheBlock", ["pool"]),
                annotation_excludes(KVU, "KVCacheBlock", "pool", ("weakref",)),
            ),
        ),
    ],
    "block_owner_weakref": [
        (
            "KVCacheBlock.pool is a weakref.ref of BlockPool._weak_self",
            all_of(
                annotation_includes(KVU, "KVCacheBlock", "pool", ("weakref.ref",)),
                sets_attrs(BP, "BlockPool", ["_weak_self"]),
            ),
        ),
        (
            "BlockPool.free_blocks(ordered_blocks, evict_first) (ElasticBlockPool takes it)",
            signature(BP, "BlockPool.free_blocks", has=("ordered_blocks", "evict_first")),
        ),
    ],
    "offloading_connector_fence": [
        (
            "OffloadingConnector defines build_connector_meta, update_connector_output, request_finished(_all_groups)",
            has_methods(
                OFFC,
                "OffloadingConnector",
                ["build_connector_meta", "update_connector_output", "request_finished", "request_finished_all_groups"],
            ),
        ),
        (
            "OffloadingConnectorMetadata(load_jobs, store_jobs) of TransferJob(req_id, src_spec, dst_spec)",
            all_of(
                sets_attrs(OFFCOMMON, "OffloadingConnectorMetadata", ["load_jobs", "store_jobs"]),
                sets_attrs(OFFCOMMON, "TransferJob", ["src_spec", "dst_spec"]),
            ),
        ),
        (
            "workers report finished jobs in OffloadingWorkerMetadata.completed_jobs (job id -> workers)",
            all_of(
                sets_attrs(OFFCOMMON, "OffloadingWorkerMetadata", ["completed_jobs"]),
                *_offload_update_reads("kv_connector_worker_meta", "completed_jobs"),
            ),
        ),
        (
            "a job is done when every worker (parallel_config.world_size) reported it",
            all_of(*_offload_update_reads("pending_count")),
        ),
        (
            "GPULoadStoreSpec(block_ids) names the GPU blocks of a job",
            sets_attrs("vllm.v1.kv_offload.base", "GPULoadStoreSpec", ["block_ids"]),
        ),
        (
            "the scheduler hands each step's worker output to connector.update_connector_output",
            calls_in(SCHED, "Scheduler._update_from_kv_xfer_finished", ".update_connector_output"),
        ),
        (
            "the scheduler keeps stepping while the connector has jobs in flight (has_pending_push_work)",
            defines(OFFC, "OffloadingConnector.has_pending_push_work"),
        ),
    ],
    "extensible_kv_cache_off": [
        (
            "CacheConfig.enable_extensible_kv_cache (None: vLLM decides)",
            sets_attrs("vllm.config.cache", "CacheConfig", ["enable_extensible_kv_cache"]),
        ),
        (
            "VllmConfig.__post_init__ settles it through _resolve_extensible_kv_cache",
            calls_in("vllm.config.vllm", "VllmConfig.__post_init__", "._resolve_extensible_kv_cache"),
        ),
        (
            "_resolve_extensible_kv_cache runs once (_extensible_kv_cache_resolved)",
            mentions("vllm.config.vllm", "VllmConfig._resolve_extensible_kv_cache", "_extensible_kv_cache_resolved"),
        ),
        (
            "the V2 runner hands its allocator to allocate_kv_cache only when enabled (refused by the wrapper)",
            calls_in("vllm.v1.worker.gpu.attn_utils", "init_kv_cache", "allocate_kv_cache", keywords=("allocate",)),
        ),
    ],
    "cpu_worker_startup_check_0_32": [
        (
            "CPUWorker.__init__(self, vllm_config, ...)",
            signature(CPUW, "CPUWorker.__init__", has=("self", "vllm_config")),
        ),
        (
            "CPUWorker.__init__ refuses start-up unless kv_cache_memory_bytes is set (what the patch defuses)",
            mentions(CPUW, "CPUWorker.__init__", "kv_cache_memory_bytes"),
        ),
    ],
    "block_owner_none_0_29": [
        ("KVCacheBlock has no pool field (a pool frees only its own blocks)", lacks(KVU, "KVCacheBlock", ["pool"])),
    ],
    "no_reuse_watchers_0_29": [
        (
            "BlockPool has no reuse watchers and no unpin_blocks (nothing waits for a block's reuse)",
            lacks(BP, "BlockPool", ["_reuse_watchers", "_notify_reuse", "unpin_blocks"]),
        ),
    ],
    "kv_tensors_by_layers": [
        (
            "KVCacheTensor(size, layers, layer_stride, block_stride, offset)",
            sets_attrs(KVI, "KVCacheTensor", ["size", "layers", "layer_stride", "block_stride", "offset"]),
        ),
    ],
    "kv_regions_page_aligned": [
        (
            "the engine core binds get_kv_cache_configs by name (the patch rebinds it there)",
            any_of(
                module_binds(CORE, "get_kv_cache_configs", KVU),
                module_binds(CORE, "get_kv_cache_configs", "vllm.v1.core.kv_cache_planning"),
            ),
        ),
        (
            "EngineCore._initialize_kv_caches calls it (and hands its configs to the workers)",
            all_of(
                calls_in(CORE, "EngineCore._initialize_kv_caches", "get_kv_cache_configs"),
                calls_in(CORE, "EngineCore._initialize_kv_caches", ".initialize_from_config"),
            ),
        ),
        (
            "KVCacheTensor(size, layers, layer_stride, block_stride, offset) and KVCacheConfig.num_blocks",
            all_of(
                sets_attrs(KVI, "KVCacheTensor", ["size", "layers", "layer_stride", "block_stride", "offset"]),
                sets_attrs(KVI, "KVCacheConfig", ["num_blocks", "kv_cache_tensors", "kv_cache_groups"]),
            ),
        ),
        (
            "create_kv_cache_views cuts layer views from the tensor's own layer_stride and offset",
            all_of(
                mentions(KVI, "create_kv_cache_views", "layer_stride"), mentions(KVI, "create_kv_cache_views", "offset")
            ),
        ),
    ],
    "mamba_state_0_29": [
        (
            "KVCacheTensor(size, layers, layer_stride, block_stride, offset): state blocks at their block address",
            sets_attrs(KVI, "KVCacheTensor", ["size", "layers", "layer_stride", "block_stride", "offset"]),
        ),
        (
            "MambaSpec.page_size_bytes (evened out with the attention pages)",
            has_methods(KVI, "MambaSpec", ["page_size_bytes"]),
        ),
    ],
    "mamba_state_shared_by_0_28": [
        (
            "KVCacheTensor(size, shared_by, ...): a state block at b * page bytes of its layer's buffer",
            sets_attrs(KVI, "KVCacheTensor", ["size", "shared_by", "offset", "block_stride"]),
        ),
        (
            "MambaSpec.page_size_bytes (evened out with the attention pages)",
            has_methods(KVI, "MambaSpec", ["page_size_bytes"]),
        ),
    ],
    "mamba_state_views_as_strided_0_26": [
        (
            "both runners cut state views with as_strided(raw, storage_offset=...) (worker_kv.rebase_state_views)",
            all_of(
                calls_in(GPUMR, "GPUModelRunner._reshape_kv_cache_tensors", ".as_strided", ("storage_offset",)),
                calls_in(V2ATTN, "_reshape_kv_cache", ".as_strided", ("storage_offset",)),
            ),
        ),
    ],
    "kv_tensors_shared_by_0_28": [
        (
            "KVCacheTensor(size, shared_by, offset, block_stride) (no layers, no layer_stride)",
            all_of(
                sets_attrs(KVI, "KVCacheTensor", ["size", "shared_by", "offset", "block_stride"]),
                lacks(KVI, "KVCacheTensor", ["layers", "layer_stride"]),
            ),
        ),
        (
            "one tensor of page_size x num_blocks per slot, shared_by one layer per group",
            calls_in(KVU, "get_kv_cache_config_from_groups", "KVCacheTensor", keywords=("size", "shared_by")),
        ),
    ],
    "kv_blocks_per_tensor": [
        ("KVCacheConfig.num_blocks_of", has_methods(KVI, "KVCacheConfig", ["num_blocks_of"])),
        (
            "allocate_kv_cache cuts each tensor's views with num_blocks_of",
            calls_in(WUTILS, "allocate_kv_cache", ".num_blocks_of"),
        ),
    ],
    "kv_blocks_uniform_0_29": [
        ("KVCacheConfig has no num_blocks_of", lacks(KVI, "KVCacheConfig", ["num_blocks_of"])),
        ("allocate_kv_cache uses kv_cache_config.num_blocks", mentions(WUTILS, "allocate_kv_cache", "num_blocks")),
    ],
    "runner_v1_kv_buffer_0_28": [
        (
            "worker_kv's wrapper takes GPUModelRunner._allocate_kv_cache_tensors(self, kv_cache_config)",
            all_of(
                signature(GPUMR, "GPUModelRunner._allocate_kv_cache_tensors", exactly=("self", "kv_cache_config")),
                accepts_engine_call(
                    GPUMR,
                    "GPUModelRunner._allocate_kv_cache_tensors",
                    ROOT / "kvcached/integration/vllm/worker_kv.py",
                    "_allocate_kv_cache_tensors",
                ),
            ),
        ),
        (
            "initialize_kv_cache_tensors allocates, then reshapes (the views are checked after)",
            all_of(
                calls_in(GPUMR, "GPUModelRunner.initialize_kv_cache_tensors", "._allocate_kv_cache_tensors"),
                calls_in(GPUMR, "GPUModelRunner.initialize_kv_cache_tensors", "._reshape_kv_cache_tensors"),
                callers_within(
                    GPUMR, "GPUModelRunner", ("._allocate_kv_cache_tensors",), ("initialize_kv_cache_tensors",)
                ),
            ),
        ),
        (
            "GPUModelRunner.kv_cache_config and device (read by the wrappers)",
            sets_attrs(GPUMR, "GPUModelRunner", ["kv_cache_config", "device"]),
        ),
        (
            "CPUModelRunner(GPUModelRunner) inherits both (the CPU engine takes the same path)",
            all_of(
                subclass(CPUMR, "CPUModelRunner", "GPUModelRunner"),
                lacks(
                    CPUMR,
                    "CPUModelRunner",
                    ["_allocate_kv_cache_tensors", "_reshape_kv_cache_tensors", "initialize_kv_cache_tensors"],
                ),
            ),
        ),
        ("worker ranks (parallel_state groups) and platform", WORKER_RANKS),
        ("KV cache config read by the layout plan", all_of(*LAYOUT)),
    ],
    "runner_v2_kv_buffer_0_28": [
        (
            "worker_kv's wrapper takes attn_utils._allocate_kv_cache(kv_cache_config, shared_layers, device)",
            all_of(
                signature(V2ATTN, "_allocate_kv_cache", exactly=("kv_cache_config", "shared_layers", "device")),
                accepts_engine_call(
                    V2ATTN, "_allocate_kv_cache", ROOT / "kvcached/integration/vllm/worker_kv.py", "_allocate_kv_cache"
                ),
            ),
        ),
        (
            "init_kv_cache allocates, then reshapes naming kv_cache_config (looked up in this module)",
            all_of(
                calls_in(V2ATTN, "init_kv_cache", "_allocate_kv_cache"),
                calls_in(V2ATTN, "init_kv_cache", "_reshape_kv_cache", keywords=("kv_cache_config",)),
                signature(V2ATTN, "_reshape_kv_cache", has=("kv_cache_config",)),
            ),
        ),
        ("worker ranks (parallel_state groups) and platform", WORKER_RANKS),
        ("KV cache config read by the layout plan", all_of(*LAYOUT)),
    ],
}


def by_name_contract(module: str) -> List[Tuple[str, Check]]:
    binds = module_binds(module, "allocate_kv_cache", WUTILS)

    def check(tree: Tree) -> Finding:
        if tree.module(module) is None:  # the hook never fires: nothing to rebind
            return Finding(True, tree.rel(module), f"module {module} does not exist in this version (patch idle)")
        return binds(tree)

    return [(f"{module} binds allocate_kv_cache by name", check)]


# Known breaks outside a patch's range: (patch, minor) -> why. Strict xfail.
# The table lives in versions.py (KVCACHED_ALLOW_UNSUPPORTED's warning names
# them); docs/notes/vllm_seams.md has the evidence (file:line) and the patch each needs.
def _known_breaks() -> Dict[Tuple[str, str], str]:
    from kvcached.integration.vllm.versions import KNOWN_BREAKS

    return KNOWN_BREAKS


BY_NAME_PREFIX = "allocate_kv_cache_by_name:"


def contract_of(patch_name: str) -> Optional[List[Tuple[str, Check]]]:
    if patch_name.startswith(BY_NAME_PREFIX):
        return by_name_contract(patch_name[len(BY_NAME_PREFIX) :])
    items = CONTRACTS.get(patch_name)
    if items is None:
        return None
    out = []
    for label, check in items:
        if check is None:  # the by-name importer list comes from versions.py
            from kvcached.integration.vllm.versions import ALLOCATE_KV_CACHE_IMPORTERS

            check = importers_within("allocate_kv_cache", WUTILS, "vllm", ALLOCATE_KV_CACHE_IMPORTERS)
        out.append((label, check))
    return out


# What activation relies on in every process, whatever the patches: the version
# read by plugin._vllm_version and the vllm.general_plugins load points that
# reach plugin.register in EngineCore and worker processes.
ACTIVATION: List[Tuple[str, Check]] = [
    ("vllm.__version__", module_binds("vllm", "__version__", "vllm.version")),
    ("EngineCore.__init__ loads general plugins", calls_in(CORE, "EngineCore.__init__", "load_general_plugins")),
    (
        "WorkerWrapperBase.init_worker loads general plugins",
        calls_in("vllm.v1.worker.worker_base", "WorkerWrapperBase.init_worker", "load_general_plugins"),
    ),
]


# ----------------------------------------------------------------- harness


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _patches():
    from kvcached.integration.vllm.versions import all_patches

    return all_patches()


SEAMS = EngineSeams("vllm", "vLLM", VERSIONS, _patches, _known_breaks, break_key=minor)
tree_of = SEAMS.tree_of


def run_contract(patch_name: str, tree: Tree) -> List[Tuple[str, Finding]]:
    return [(label, check(tree)) for label, check in contract_of(patch_name) or []]


# ------------------------------------------------------------------- tests


@pytest.mark.parametrize("patch_name,version,in_range", SEAMS.patch_cases())
def test_seam_contract(patch_name: str, version: str, in_range: bool) -> None:
    SEAMS.assert_patch_holds(patch_name, version, in_range, run_contract(patch_name, tree_of(version)))


@pytest.mark.parametrize("version", VERSIONS)
def test_activation_contract(version: str) -> None:
    tree = tree_of(version)
    SEAMS.assert_holds([(label, check(tree)) for label, check in ACTIVATION], version)


def test_every_patch_has_a_contract() -> None:
    missing = [p.name for p in _patches() if contract_of(p.name) is None]
    assert not missing, f"patches with no seam contract in tests/contracts/test_vllm_seams.py: {missing}"


def test_broken_table_names_real_patches() -> None:
    names = {p.name for p in _patches()}
    stale = sorted({p for p, _ in _known_breaks()} - names)
    assert not stale, f"KNOWN_BREAKS names patches that no longer exist: {stale}"


def test_known_breaks_cover_exactly_the_checked_minors() -> None:
    from kvcached.integration.vllm.versions import CHECKED_MINORS

    assert tuple(minor(v) for v in VERSIONS) == CHECKED_MINORS
    assert {m for _, m in _known_breaks()} <= set(CHECKED_MINORS)
    # A break inside a patch's own range would be a patch that does not fit what it claims.
    from kvcached.integration.patch_base import parse_version

    ranges = {p.name: p.versions for p in _patches()}
    claimed = sorted((p, m) for p, m in _known_breaks() if p in ranges and parse_version(m) in ranges[p])
    assert not claimed, f"KNOWN_BREAKS entries inside the patch's own range: {claimed}"


# ------------------------------------------------------------------- table


def main() -> int:
    groups = [
        (
            f"{p.name} ({p.target_module}, claims {p.versions})",
            p.versions,
            lambda tree, v, n=p.name: run_contract(n, tree),
        )
        for p in _patches()
    ]
    return SEAMS.print_table(groups, sys.argv)


if __name__ == "__main__":
    run_as_script(main)
