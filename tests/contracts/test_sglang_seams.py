"""Seam contracts: every SGLang name, signature and attribute kvcached's SGLang integration
relies on, read from each SGLang release's source with ``ast`` (SGLang is never imported).

Two tables:

* ``PATCHES``: for every patch of ``kvcached.integration.sglang.patches.all_patches()``
  and every release in ``VERSIONS``, what the patch touches in SGLang. A release inside
  the patch's range must satisfy it; outside the range it must fail exactly where
  ``patches.KNOWN_BREAKS`` says (``xfail(strict=True)`` with the reason: that table
  is the seam x version evidence and cannot go stale), or pass.
* ``CLASSES``: what the version-neutral parts (elastic pools and allocators, the
  eviction helpers, the scheduler hooks' reads, activation) rely on, on every
  supported release. An item may carry its own range: a hook SGLang only calls
  from some release on (``check_decode_capacity`` from 0.5.19, ...).

Sources come from ``scripts/engine_sources.py`` (the release wheel, cached outside
the clone). A release not cached is skipped with the reason, unless
``KVCACHED_REQUIRE_SEAM_SOURCES=1`` (``scripts/test.sh`` sets it), which downloads it and
fails the contract when it cannot.
``python tests/contracts/test_sglang_seams.py [-v]`` prints the seam x version table
with ``file:line`` evidence (what docs/notes/sglang_seams.md is written from).

Why this module is long: the contract table (one entry per SGLang name a patch relies on) is the point of it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from kvcached.integration.sglang import profile as sglang_profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from seam_ast import (  # noqa: E402
    Check,
    Finding,
    Tree,
    all_of,
    any_of,
    calls_in,
    class_member,
    defines,
    has_methods,
    mentions,
    module_binds,
    overrides_match,
    sets_attrs,
    signature,
)
from seam_harness import ROOT, EngineSeams, run_as_script  # noqa: E402
from sglang_checks import (  # noqa: E402
    constant,
    fields_declared,
    is_property,
    names_not_compared,
    release_paths_covered,
    uses_name,
)

from kvcached.integration.patch_base import VersionRange, parse_version  # noqa: E402

OURS = ROOT / "kvcached" / "integration" / "sglang"

SA = "sglang.srt.server_args"
MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"
RUNNER = "sglang.srt.model_executor.model_runner"
KCC = "sglang.srt.mem_cache.kv_cache_configurator"
MP = "sglang.srt.mem_cache.memory_pool"
ALLOC = "sglang.srt.mem_cache.allocator"
BASE = "sglang.srt.mem_cache.allocator.base"
TOKEN = "sglang.srt.mem_cache.allocator.token"
PAGED = "sglang.srt.mem_cache.allocator.paged"
SWA = "sglang.srt.mem_cache.allocator.swa"
MAMBA_ALLOC = "sglang.srt.mem_cache.allocator.mamba"
BPC = "sglang.srt.mem_cache.base_prefix_cache"
POLICY = "sglang.srt.managers.schedule_policy"
BATCH = "sglang.srt.managers.schedule_batch"
SCHED = "sglang.srt.managers.scheduler"
BUDGET = "sglang.srt.mem_cache.prefill_budget"
WU = "sglang.srt.managers.scheduler_components.weight_updater"
CC = "sglang.srt.managers.cache_controller"
IDLE = "sglang.srt.managers.scheduler_components.idle_sleeper"

FROM_0519 = VersionRange.parse(">=0.5.19,<0.6")
FROM_0521 = VersionRange.parse(">=0.5.21,<0.6")
FROM_0516 = VersionRange.parse(">=0.5.16,<0.6")

# Where the paged module imports its Triton kernels from (moved in 0.5.16).
KERNEL_MODULES = ("sglang.srt.mem_cache.triton_ops.allocator", "sglang.kernels.ops.memory.allocator")

Item = Tuple[str, Check, Optional[VersionRange]]


def item(label: str, check: Check, when: Optional[VersionRange] = None) -> Item:
    return (label, check, when)


def _conflict_fields() -> Check:
    # The flags conflicts.server_args_conflicts reads without a default that would hide
    # a rename (the newer flags it reads with getattr defaults are optional).
    return fields_declared(
        SA,
        "ServerArgs",
        ["speculative_algorithm", "disaggregation_mode", "enable_hierarchical_cache"],
        "sglang.srt.arg_groups.fields",
    )


def _builds_allocators(mod: str, qual: str) -> Check:
    return all_of(
        module_binds(mod, "TokenToKVPoolAllocator", ALLOC),
        module_binds(mod, "PagedTokenToKVPoolAllocator", ALLOC),
        calls_in(mod, qual, "TokenToKVPoolAllocator"),
        calls_in(mod, qual, "PagedTokenToKVPoolAllocator"),
        names_not_compared(mod, ["TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"]),
    )


def _builds_pools(mod: str, qual: str) -> Check:
    return all_of(
        module_binds(mod, "MHATokenToKVPool", MP),
        module_binds(mod, "MLATokenToKVPool", MP),
        uses_name(mod, qual, "MHATokenToKVPool"),
        uses_name(mod, qual, "MLATokenToKVPool"),
        names_not_compared(mod, ["MHATokenToKVPool", "MLATokenToKVPool"]),
    )


def _sizes_mamba_state(mod: str, sizer: str) -> Check:
    """The profile (what sglang-capacity replaces) sizes a hybrid's state pool with ``sizer``."""
    cls, method = sizer.split(".")
    profile = f"{cls}._profile_available_bytes"
    return all_of(
        mentions(mod, profile, "mambaish_config"),
        calls_in(mod, profile, f".{method}"),
        signature(mod, sizer, exactly=("self", "total_rest_memory")),
    )


def _builds_mamba_state(pool_callee: str) -> Check:
    init = "HybridReqToTokenPool._init_mamba_pool"
    return all_of(
        calls_in(MP, init, pool_callee),
        calls_in(MP, init, "MambaSlotAllocator"),
        lambda tree: _stores(tree, MP, init, ["mamba_pool", "mamba_allocator"]),
    )


PATCHES: Dict[str, List[Item]] = {
    "sglang-conflicts-post-init": [
        item("ServerArgs.__post_init__(self) validates", signature(SA, "ServerArgs.__post_init__", exactly=("self",))),
        item(
            "ServerArgs has no resolve_once (validation is __post_init__)",
            lambda tree: _absent(tree, SA, "ServerArgs.resolve_once"),
        ),
        item("conflict flags", _conflict_fields()),
    ],
    "sglang-conflicts": [
        item("ServerArgs.resolve_once(self)", signature(SA, "ServerArgs.resolve_once", exactly=("self",))),
        item("launch_server resolves once", calls_in("sglang.launch_server", "run_server", ".resolve_once")),
        item("conflict flags", _conflict_fields()),
    ],
    "sglang-capacity-0.5.15": [
        item(
            "ModelRunnerKVCacheMixin._profile_available_bytes(self, pre_model_load_memory)",
            signature(MIXIN, "ModelRunnerKVCacheMixin._profile_available_bytes", has=("self", "pre_model_load_memory")),
        ),
        item(
            "the mixin profiles through it",
            calls_in(MIXIN, "ModelRunnerKVCacheMixin._resolve_memory_pool_config", "._profile_available_bytes"),
        ),
        item("ModelRunner.device", sets_attrs(RUNNER, "ModelRunner", ["device"])),
        item(
            "Mamba hybrids: the profile sizes the state pool with handle_max_mamba_cache(total_rest_memory)",
            _sizes_mamba_state(MIXIN, "ModelRunnerKVCacheMixin.handle_max_mamba_cache"),
        ),
    ],
    "sglang-capacity": [
        item(
            "KVCacheConfigurator._profile_available_bytes(self, pre_model_load_memory)",
            signature(KCC, "KVCacheConfigurator._profile_available_bytes", exactly=("self", "pre_model_load_memory")),
        ),
        item(
            "the configurator profiles through it",
            calls_in(KCC, "KVCacheConfigurator._resolve_memory_pool_config", "._profile_available_bytes"),
        ),
        item("KVCacheConfigurator.device", sets_attrs(KCC, "KVCacheConfigurator", ["device"])),
        item(
            "Mamba hybrids: the profile sizes the state pool with _handle_max_mamba_cache(total_rest_memory)",
            _sizes_mamba_state(KCC, "KVCacheConfigurator._handle_max_mamba_cache"),
        ),
    ],
    "sglang-pool-names-0.5.15": [
        item(
            "the runner builds pools by module-level name", _builds_pools(MIXIN, "ModelRunnerKVCacheMixin._init_pools")
        ),
    ],
    "sglang-pool-names": [
        item("the configurator builds pools by module-level name", _builds_pools(KCC, "KVCacheConfigurator")),
        item(
            "no pool class resolver yet (the names are what it builds)",
            lambda tree: _absent(tree, KCC, "KVCacheConfigurator._resolve_kv_pool_class"),
        ),
    ],
    "sglang-pools": [
        item(
            "KVCacheConfigurator._resolve_kv_pool_class(self, *, kind, default)",
            signature(KCC, "KVCacheConfigurator._resolve_kv_pool_class", has=("kind", "default")),
        ),
        item(
            "SGLang's pool classes",
            all_of(module_binds(KCC, "MHATokenToKVPool", MP), module_binds(KCC, "MLATokenToKVPool", MP)),
        ),
        item(
            "the MHA pool class is resolved",
            calls_in(
                KCC,
                "KVCacheConfigurator._build_token_to_kv_pool",
                "._resolve_kv_pool_class",
                keywords=("kind", "default"),
            ),
        ),
    ],
    "sglang-pool-buffers-0.5.15": [
        item(
            "MHATokenToKVPool._create_buffers builds buffers and pointer tables in one method",
            lambda tree: _stores(
                tree, MP, "MHATokenToKVPool._create_buffers", ["k_buffer", "k_data_ptrs", "data_ptrs", "data_strides"]
            ),
        ),
        item(
            "no _create_buffers_normal to override",
            lambda tree: _absent(tree, MP, "MHATokenToKVPool._create_buffers_normal"),
        ),
    ],
    "sglang-allocators-0.5.15": [
        item(
            "the runner builds allocators by module-level name",
            _builds_allocators(MIXIN, "ModelRunnerKVCacheMixin._init_pools"),
        ),
        item(
            "ModelRunnerKVCacheMixin._init_pools(self) sets the pool and allocator",
            all_of(
                signature(MIXIN, "ModelRunnerKVCacheMixin._init_pools", exactly=("self",)),
                lambda tree: _stores(
                    tree,
                    MIXIN,
                    "ModelRunnerKVCacheMixin._init_pools",
                    ["token_to_kv_pool", "token_to_kv_pool_allocator"],
                ),
            ),
        ),
        item("ModelRunner.is_draft_worker", sets_attrs(RUNNER, "ModelRunner", ["is_draft_worker"])),
    ],
    "sglang-allocators": [
        item(
            "the configurator builds allocators by module-level name",
            _builds_allocators(KCC, "KVCacheConfigurator._build_token_to_kv_pool_allocator"),
        ),
        item(
            "_build_token_to_kv_pool_allocator(self, *, token_to_kv_pool, token_to_kv_pool_allocator, ...)",
            signature(
                KCC,
                "KVCacheConfigurator._build_token_to_kv_pool_allocator",
                has=("token_to_kv_pool", "token_to_kv_pool_allocator"),
            ),
        ),
        item(
            "_init_pools passes both by keyword",
            calls_in(
                KCC,
                "KVCacheConfigurator._init_pools",
                "._build_token_to_kv_pool_allocator",
                keywords=("token_to_kv_pool", "token_to_kv_pool_allocator"),
            ),
        ),
    ],
    "sglang-mamba-state-0.5.15": [
        item("the runner builds memory_pool's HybridReqToTokenPool", module_binds(MIXIN, "HybridReqToTokenPool", MP)),
        item(
            "_init_mamba_pool builds MambaPool by module-level name, then the slot allocator",
            _builds_mamba_state("MambaPool"),
        ),
    ],
    "sglang-mamba-state": [
        item(
            "the configurator builds memory_pool's HybridReqToTokenPool", module_binds(KCC, "HybridReqToTokenPool", MP)
        ),
        item(
            "_init_mamba_pool builds self.mamba_pool_cls (MambaPool by default), then the slot allocator",
            all_of(class_member(MP, "HybridReqToTokenPool", "mamba_pool_cls"), _builds_mamba_state(".mamba_pool_cls")),
        ),
    ],
    "sglang-swa-builder": [
        item(
            "the configurator builds the SWA composite by module-level name",
            all_of(
                module_binds(KCC, "SWATokenToKVPoolAllocator", SWA),
                calls_in(KCC, "KVCacheConfigurator._build_token_to_kv_pool_allocator", "SWATokenToKVPoolAllocator"),
            ),
        ),
    ],
    "sglang-swa-allocators": [
        item(
            "the composite builds its sub-allocators by module-level name",
            all_of(
                module_binds(SWA, "TokenToKVPoolAllocator", TOKEN),
                module_binds(SWA, "PagedTokenToKVPoolAllocator", PAGED),
                uses_name(SWA, "SWATokenToKVPoolAllocator.__init__", "PagedTokenToKVPoolAllocator"),
                names_not_compared(SWA, ["TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"]),
            ),
        ),
        item(
            "SWATokenToKVPoolAllocator state and helpers ElasticSWATokenToKVPoolAllocator uses",
            all_of(
                sets_attrs(
                    SWA, "SWATokenToKVPoolAllocator", ["full_attn_allocator", "swa_attn_allocator", "_swa_req_ring"]
                ),
                has_methods(
                    SWA,
                    "SWATokenToKVPoolAllocator",
                    ["full_available_size", "swa_available_size", "set_full_to_swa_mapping", "new_pages_available"],
                ),
            ),
        ),
        item(
            "ElasticSWATokenToKVPoolAllocator overrides take SGLang's parameters",
            overrides_match(
                SWA, "SWATokenToKVPoolAllocator", OURS / "swa_allocator.py", "ElasticSWATokenToKVPoolAllocator"
            ),
        ),
        item(
            "SWAPrefillBudget (ElasticSWAPrefillBudget)",
            all_of(
                has_methods(BUDGET, "SWAPrefillBudget", ["_available_and_evictable", "remaining_swa"]),
                sets_attrs(BUDGET, "SWAPrefillBudget", ["all_swa", "req_ring", "swa_offset"], bases_in=(BUDGET,)),
            ),
        ),
    ],
    "sglang-prefill-adder": [
        item(
            "PrefillAdder.rem_total_tokens / cur_rem_tokens are properties over available_size()",
            all_of(
                is_property(POLICY, "PrefillAdder", "rem_total_tokens"),
                is_property(POLICY, "PrefillAdder", "cur_rem_tokens"),
                mentions(POLICY, "PrefillAdder.rem_total_tokens", "available_size"),
                mentions(POLICY, "PrefillAdder.cur_rem_tokens", "available_size"),
            ),
        ),
        item(
            "PrefillAdder.token_to_kv_pool_allocator",
            sets_attrs(POLICY, "PrefillAdder", ["token_to_kv_pool_allocator"]),
        ),
        item(
            "PrefillAdder._update_prefill_budget(self, prefix_len, extend_input_len, ...), cur_rem_token_offset, "
            "ceil_paged_tokens (the admitted tokens set aside)",
            all_of(
                signature(POLICY, "PrefillAdder._update_prefill_budget", has=("prefix_len", "extend_input_len")),
                sets_attrs(POLICY, "PrefillAdder", ["cur_rem_token_offset"]),
                has_methods(POLICY, "PrefillAdder", ["ceil_paged_tokens"]),
            ),
        ),
    ],
    "sglang-check-decode-mem": [
        item(
            "ScheduleBatch.check_decode_mem(self, selected_indices) compares available_size()",
            all_of(
                signature(BATCH, "ScheduleBatch.check_decode_mem", exactly=("self", "selected_indices")),
                calls_in(BATCH, "ScheduleBatch.check_decode_mem", ".new_tokens_required_next_decode"),
                mentions(BATCH, "ScheduleBatch.check_decode_mem", "available_size"),
            ),
        ),
        item(
            "ScheduleBatch.token_to_kv_pool_allocator / tree_cache",
            sets_attrs(BATCH, "ScheduleBatch", ["token_to_kv_pool_allocator", "tree_cache"]),
        ),
    ],
    "sglang-retract-to-limit": [
        item(
            "ScheduleBatch.check_decode_mem(self, selected_indices), reqs, token_to_kv_pool_allocator",
            all_of(
                signature(BATCH, "ScheduleBatch.check_decode_mem", exactly=("self", "selected_indices")),
                sets_attrs(BATCH, "ScheduleBatch", ["reqs", "token_to_kv_pool_allocator"]),
            ),
        ),
        item(
            "ScheduleBatch.retract_decode retracts while check_decode_mem(selected_indices=...) fails, "
            "keeping one request",
            calls_in(BATCH, "ScheduleBatch.retract_decode", ".check_decode_mem", keywords=("selected_indices",)),
        ),
        item(
            "Scheduler.update_running_batch retracts when check_decode_mem() fails",
            all_of(
                calls_in(SCHED, "Scheduler.update_running_batch", ".check_decode_mem"),
                calls_in(SCHED, "Scheduler.update_running_batch", ".retract_decode"),
            ),
        ),
    ],
    "sglang-scheduler": [
        item(
            "Scheduler event methods",
            all_of(
                has_methods(SCHED, "Scheduler", ["__init__", "run_batch", "on_idle"]),
                signature(SCHED, "Scheduler.process_batch_result", has=("self", "batch", "result")),
                signature(SCHED, "Scheduler.flush_cache", has=("self",)),
            ),
        ),
        item(
            "Scheduler state the hooks read",
            sets_attrs(
                SCHED,
                "Scheduler",
                ["tree_cache", "token_to_kv_pool_allocator", "waiting_queue", "last_batch", "max_total_num_tokens"],
            ),
        ),
        item("kvcached_report runs through collective_rpc", calls_in(SCHED, "Scheduler.handle_rpc_request", "getattr")),
    ],
    "sglang-idle-sleeper-wake": [
        item(
            "IdleSleeper sleeps in a zmq poll of its poller (a pipe registered there ends it)",
            all_of(
                has_methods(IDLE, "IdleSleeper", ["__init__", "maybe_sleep"]),
                sets_attrs(IDLE, "IdleSleeper", ["poller"]),
                calls_in(IDLE, "IdleSleeper.maybe_sleep", ".poll"),
            ),
        ),
        item("the scheduler keeps its sleeper as idle_sleeper", sets_attrs(SCHED, "Scheduler", ["idle_sleeper"])),
    ],
    "sglang-hicache": [
        item(
            "HiCacheController: copies submitted by start_writing/start_loading, acks with a finish_event",
            all_of(
                has_methods(CC, "HiCacheController", ["__init__", "write", "load", "start_writing", "start_loading"]),
                sets_attrs(
                    CC,
                    "HiCacheController",
                    ["mem_pool_device_allocator", "write_queue", "load_queue", "ack_write_queue", "ack_load_queue"],
                ),
                calls_in(CC, "HiCacheController.start_writing", ".append"),
                calls_in(CC, "HiCacheController.start_loading", ".append"),
                mentions(CC, "HiCacheController.start_writing", "device_indices"),
                class_member(CC, "HiCacheAck", "finish_event"),
            ),
        ),
        item(
            "--enable-hierarchical-cache / --hicache-size",
            fields_declared(
                SA, "ServerArgs", ["enable_hierarchical_cache", "hicache_size"], "sglang.srt.arg_groups.fields"
            ),
        ),
    ],
    "sglang-memory-saver": [
        item(
            "SchedulerWeightUpdaterManager.release/resume_memory_occupation keep offload_tags",
            all_of(
                has_methods(
                    WU, "SchedulerWeightUpdaterManager", ["release_memory_occupation", "resume_memory_occupation"]
                ),
                sets_attrs(WU, "SchedulerWeightUpdaterManager", ["offload_tags"]),
                mentions(WU, "SchedulerWeightUpdaterManager.release_memory_occupation", "offload_tags"),
                mentions(WU, "SchedulerWeightUpdaterManager.resume_memory_occupation", "offload_tags"),
            ),
        ),
        item(
            "releasing kv_cache flushes the cache (every block freed) and synchronises the device",
            all_of(
                calls_in(WU, "SchedulerWeightUpdaterManager.release_memory_occupation", ".flush_cache"),
                calls_in(WU, "SchedulerWeightUpdaterManager.release_memory_occupation", ".synchronize"),
                constant("sglang.srt.constants", "GPU_MEMORY_TYPE_KV_CACHE", "kv_cache"),
            ),
        ),
        item(
            "--enable-memory-saver",
            fields_declared(SA, "ServerArgs", ["enable_memory_saver"], "sglang.srt.arg_groups.fields"),
        ),
        item(
            "--enable-weights-cpu-backup (the router's sleep: engine requires it: the release keeps the weights)",
            fields_declared(SA, "ServerArgs", ["enable_weights_cpu_backup"], "sglang.srt.arg_groups.fields"),
        ),
    ],
}


def _absent(tree: Tree, mod: str, qual: str) -> Finding:
    m = tree.module(mod)
    if m is None:
        return Finding(False, tree.rel(mod), f"module {mod} does not exist")
    fn = m.function(qual)
    return Finding(fn is None, m.at(fn["line"]) if fn else m.rel, f"{qual} {'exists' if fn else 'is absent'}")


def _stores(tree: Tree, mod: str, qual: str, attrs: List[str]) -> Finding:
    m = tree.module(mod)
    if m is None:
        return Finding(False, tree.rel(mod), f"module {mod} does not exist")
    fn = m.function(qual)
    if fn is None:
        return Finding(False, m.rel, f"{qual} is not defined here")
    missing = [a for a in attrs if a not in fn["self_stores"]]
    found = ", ".join(a for a in attrs if a not in missing)
    return Finding(
        not missing, m.at(fn["line"]), f"{qual} sets {found}" + (f"; not {', '.join(missing)}" if missing else "")
    )


_RELEASE = ("free", "_release", "clear", "alloc")

CLASSES: Dict[str, List[Item]] = {
    "elastic-pools": [
        item(
            "MHATokenToKVPool fields the elastic pool reads",
            sets_attrs(
                MP,
                "MHATokenToKVPool",
                ["size", "page_size", "head_num", "head_dim", "v_head_dim", "layer_num", "device", "store_dtype"]
                + ["kv_cache_layout"],
                bases_in=(MP,),
            ),
        ),
        item(
            "MHATokenToKVPool.__init__ calls _create_buffers",
            calls_in(MP, "MHATokenToKVPool.__init__", "._create_buffers"),
        ),
        item(
            "from 0.5.16 _create_buffers carves the plain layout in _create_buffers_normal",
            calls_in(MP, "MHATokenToKVPool._create_buffers", "._create_buffers_normal"),
            FROM_0516,
        ),
        item(
            "MLATokenToKVPool: kv_buffer made in _create_buffers from kv_cache_dim",
            all_of(
                lambda tree: _stores(tree, MP, "MLATokenToKVPool._create_buffers", ["kv_buffer"]),
                sets_attrs(MP, "MLATokenToKVPool", ["kv_cache_dim"]),
                calls_in(MP, "MLATokenToKVPool.__init__", "._create_buffers"),
            ),
        ),
    ],
    "elastic-allocators": [
        item(
            "TokenToKVPoolAllocator.__init__(size, dtype, device, kvcache, need_sort)",
            signature(
                TOKEN,
                "TokenToKVPoolAllocator.__init__",
                exactly=("self", "size", "dtype", "device", "kvcache", "need_sort"),
            ),
        ),
        item(
            "PagedTokenToKVPoolAllocator.__init__(size, page_size, dtype, device, kvcache, need_sort)",
            signature(
                PAGED,
                "PagedTokenToKVPoolAllocator.__init__",
                exactly=("self", "size", "page_size", "dtype", "device", "kvcache", "need_sort"),
            ),
        ),
        item(
            "our overrides take SGLang's parameters",
            all_of(
                overrides_match(BASE, "BaseTokenToKVPoolAllocator", OURS / "allocator.py", "_ElasticAllocatorMixin"),
                overrides_match(
                    TOKEN, "TokenToKVPoolAllocator", OURS / "allocator.py", "ElasticTokenToKVPoolAllocator"
                ),
                overrides_match(
                    PAGED, "PagedTokenToKVPoolAllocator", OURS / "allocator.py", "ElasticPagedTokenToKVPoolAllocator"
                ),
            ),
        ),
        item(
            "every release, clear and alloc path of SGLang's allocators is ours",
            all_of(
                release_paths_covered(
                    [(TOKEN, "TokenToKVPoolAllocator"), (BASE, "BaseTokenToKVPoolAllocator")],
                    OURS / "allocator.py",
                    ["_ElasticAllocatorMixin", "ElasticTokenToKVPoolAllocator"],
                    _RELEASE,
                ),
                release_paths_covered(
                    [(PAGED, "PagedTokenToKVPoolAllocator"), (BASE, "BaseTokenToKVPoolAllocator")],
                    OURS / "allocator.py",
                    ["_ElasticAllocatorMixin", "ElasticPagedTokenToKVPoolAllocator"],
                    _RELEASE,
                ),
            ),
        ),
        item(
            "slot placement: Triton kernels and the torch extend fallback in the paged module",
            all_of(
                *(
                    any_of(*(module_binds(PAGED, kernel, src) for src in KERNEL_MODULES))
                    for kernel in ("alloc_extend_kernel", "alloc_decode_kernel")
                ),
                signature(
                    PAGED,
                    "alloc_extend_naive",
                    exactly=("prefix_lens", "seq_lens", "last_loc", "free_pages", "out_indices", "page_size", "device"),
                ),
            ),
        ),
        item(
            "get_num_new_pages(seq_lens, page_size, prefix_lens, decode), next_power_of_2",
            all_of(
                signature(
                    "sglang.srt.utils.common",
                    "get_num_new_pages",
                    has=("seq_lens", "page_size", "prefix_lens", "decode"),
                ),
                defines("sglang.srt.utils.common", "next_power_of_2"),
            ),
        ),
        item(
            "from 0.5.19 the decode check asks the allocator",
            all_of(
                calls_in(
                    BATCH,
                    "ScheduleBatch.check_decode_mem",
                    ".check_decode_capacity",
                    keywords=("num_tokens", "tree_cache"),
                ),
                has_methods(BASE, "BaseTokenToKVPoolAllocator", ["check_decode_capacity", "evict_to_free_tokens"]),
            ),
            FROM_0519,
        ),
        item(
            "from 0.5.21 prefill admission asks the allocator for a budget",
            all_of(
                calls_in(POLICY, "PrefillAdder.__init__", ".create_prefill_budget"),
                signature(
                    BASE,
                    "BaseTokenToKVPoolAllocator.create_prefill_budget",
                    has=("tree_cache", "num_mixed_decode_tokens"),
                ),
                overrides_match(BUDGET, "PrefillBudget", OURS / "prefill_budget.py", "ElasticPrefillBudget"),
                sets_attrs(BUDGET, "PrefillBudget", ["allocator", "tree_cache"]),
            ),
            FROM_0521,
        ),
        item(
            "PrefillBudget.reserve(self, extend_input_len, max_new_tokens, ..., extra_tokens) takes each "
            "admitted prefill (the budgets set its tokens aside), ceil_paged_tokens",
            all_of(
                signature(BUDGET, "PrefillBudget.reserve", has=("extend_input_len", "max_new_tokens", "extra_tokens")),
                signature(BUDGET, "PrefillBudget.__init__", has=("allocator", "tree_cache", "num_mixed_decode_tokens")),
                has_methods(BUDGET, "PrefillBudget", ["ceil_paged_tokens"]),
                calls_in(POLICY, "PrefillAdder._update_prefill_budget", ".reserve"),
            ),
            FROM_0521,
        ),
    ],
    "elastic-mamba-state": [
        item(
            "MambaPool(*, size, cache_params, mamba_layer_ids, device, ...) and the options it refuses",
            signature(
                MP,
                "MambaPool.__init__",
                has=("size", "cache_params", "mamba_layer_ids", "device")
                + ("speculative_num_draft_tokens", "enable_linear_replayssm", "envelope_layout"),
            ),
        ),
        item(
            "MambaPool fields it replaces; State(conv, temporal) per layer index",
            all_of(
                sets_attrs(MP, "MambaPool", ["size", "device", "mamba_cache", "mem_usage"]),
                calls_in(MP, "MambaPool.__init__", ".State"),
                calls_in(MP, "MambaPool.mamba2_layer_cache", ".at_layer_idx"),
            ),
        ),
        item(
            "our slot allocator overrides MambaSlotAllocator's methods with its parameters",
            all_of(
                has_methods(
                    MAMBA_ALLOC,
                    "MambaSlotAllocator",
                    ["available_size", "schedulable_available_size", "alloc", "_do_alloc", "free", "clear"],
                ),
                overrides_match(MAMBA_ALLOC, "MambaSlotAllocator", OURS / "mamba.py", "ElasticMambaSlotAllocator"),
                calls_in(MAMBA_ALLOC, "MambaSlotAllocator.alloc", "._do_alloc"),
                calls_in(MAMBA_ALLOC, "MambaSlotAllocator.alloc_group_begin", "._do_alloc"),
            ),
        ),
        item(
            "admission counts schedulable slots; a fresh slot is cleared before use",
            all_of(
                calls_in(POLICY, "PrefillAdder.__init__", ".schedulable_available_size"),
                mentions(BATCH, "ScheduleBatch._collect_deferred_mamba_cow_and_clear", "mamba_needs_clear"),
            ),
        ),
        item(
            "HybridLinearKVPool keeps the state pool and the attention leaf",
            sets_attrs(MP, "HybridLinearKVPool", ["mamba_pool", "full_kv_pool"]),
        ),
        item(
            "a hybrid's radix cache: supports_mamba, full_/mamba_evictable_size, evict(EvictParams(mamba_num))",
            all_of(
                has_methods(BPC, "BasePrefixCache", ["supports_mamba", "full_evictable_size", "full_protected_size"]),
                any_of(
                    has_methods("sglang.srt.mem_cache.mamba_radix_cache", "MambaRadixCache", ["mamba_evictable_size"]),
                    has_methods(
                        "sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", ["mamba_evictable_size"]
                    ),
                ),
                sets_attrs(BPC, "EvictParams", ["mamba_num"]),
                sets_attrs(BPC, "EvictResult", ["mamba_num_evicted"]),
                sets_attrs(SCHED, "Scheduler", ["req_to_token_pool", "tree_cache"]),
            ),
        ),
    ],
    "prefix-cache": [
        item(
            "EvictParams(num_tokens) / EvictResult.num_tokens_evicted",
            all_of(
                sets_attrs(BPC, "EvictParams", ["num_tokens"]),
                sets_attrs(BPC, "EvictResult", ["num_tokens_evicted"]),
            ),
        ),
        item(
            "BasePrefixCache.evict(params), evictable_size, protected_size",
            all_of(
                signature(BPC, "BasePrefixCache.evict", exactly=("self", "params")),
                has_methods(BPC, "BasePrefixCache", ["evictable_size", "protected_size"]),
            ),
        ),
        item(
            "a cache says whether it shares prefixes",
            any_of(
                has_methods(BPC, "BasePrefixCache", ["supports_prefix_sharing"]),
                has_methods(BPC, "BasePrefixCache", ["is_chunk_cache"]),
            ),
        ),
    ],
    "activation": [
        item("sglang.__version__", module_binds("sglang", "__version__", "sglang.version")),
        item(
            "entry-point group sglang.srt.plugins",
            constant("sglang.srt.plugins", "GENERAL_PLUGINS_GROUP", "sglang.srt.plugins"),
        ),
        item("the scheduler process loads plugins", calls_in(SCHED, "run_scheduler_process", "load_plugins")),
    ],
}


# ----------------------------------------------------------------- harness

# Every release of the supported range, newest patch of 0.5.15 too (pip index versions sglang).
VERSIONS = list(sglang_profile.RELEASES)  # every supported release (kvcached/integration/sglang/profile.py)


def run_items(items: List[Item], tree: Tree, version: str) -> List[Tuple[str, Finding]]:
    v = parse_version(version)
    return [(label, check(tree)) for label, check, when in items if when is None or v in when]


def _patches():
    from kvcached.integration.sglang.patches import all_patches

    return all_patches()


def _known_breaks() -> Dict[Tuple[str, str], str]:
    from kvcached.integration.sglang.patches import KNOWN_BREAKS

    return KNOWN_BREAKS


SEAMS = EngineSeams("sglang", "SGLang", VERSIONS, _patches, _known_breaks)
tree_of = SEAMS.tree_of


# ------------------------------------------------------------------- tests


@pytest.mark.parametrize("patch_name,version,in_range", SEAMS.patch_cases())
def test_seam_contract(patch_name: str, version: str, in_range: bool) -> None:
    SEAMS.assert_patch_holds(patch_name, version, in_range, run_items(PATCHES[patch_name], tree_of(version), version))


@pytest.mark.parametrize("group", sorted(CLASSES))
@pytest.mark.parametrize("version", VERSIONS)
def test_version_neutral_contract(group: str, version: str) -> None:
    SEAMS.assert_holds(run_items(CLASSES[group], tree_of(version), version), version, group)


def test_every_patch_has_a_contract() -> None:
    missing = [p.name for p in _patches() if p.name not in PATCHES]
    assert not missing, f"patches with no seam contract in tests/contracts/test_sglang_seams.py: {missing}"
    stale = sorted(set(PATCHES) - {p.name for p in _patches()})
    assert not stale, f"contracts for patches that no longer exist: {stale}"


def test_known_breaks_cover_exactly_the_checked_versions() -> None:
    from kvcached.integration.sglang.patches import CHECKED_VERSIONS, SUPPORTED

    assert tuple(VERSIONS) == CHECKED_VERSIONS
    assert all(parse_version(v) in SUPPORTED for v in VERSIONS)
    assert {v for _, v in _known_breaks()} <= set(VERSIONS)
    ranges = {p.name: p.versions for p in _patches()}
    assert {p for p, _ in _known_breaks()} <= set(ranges), "KNOWN_BREAKS names patches that no longer exist"
    claimed = sorted((p, v) for p, v in _known_breaks() if parse_version(v) in ranges[p])
    assert not claimed, f"KNOWN_BREAKS entries inside the patch's own range: {claimed}"


# ------------------------------------------------------------------- table


def main() -> int:
    groups = [
        (
            f"{p.name} (claims {p.versions})",
            p.versions,
            lambda tree, v, items=PATCHES[p.name]: run_items(items, tree, v),
        )
        for p in _patches()
    ]
    groups += [
        (f"{g} (version-neutral)", None, lambda tree, v, items=items: run_items(items, tree, v))
        for g, items in sorted(CLASSES.items())
    ]
    return SEAMS.print_table(groups, sys.argv)


if __name__ == "__main__":
    run_as_script(main)
