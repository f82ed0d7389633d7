"""The SGLang patches, one per seam, each with the SGLang versions it is written for.

Seams (SGLang 0.5.23; file:line in docs/notes/sglang_seams.md):

  conflicts       server_args            ServerArgs.resolve_once: refuse memory saver,
                                         post-capture VMM arena, spec decoding, PD, ...
  capacity        kv_cache_configurator  _profile_available_bytes: a virtual KV budget
                                         (the device's usable memory), not the free memory
  pools           kv_cache_configurator  _resolve_kv_pool_class: elastic MHA/MLA pools
  allocators      kv_cache_configurator  the allocator class names the builder uses, and a
                                         check that an elastic pool got an elastic allocator
  swa-allocators  allocator.swa          the sub-allocator class names of the SWA composite
  scheduler       managers.scheduler     run_batch / process_batch_result / on_idle /
                                         flush_cache: deferred release, prefix-cache bound;
                                         kvcached_report for collective_rpc

A patch's ``apply(module)`` runs once per module object (``patch_base``
marks it); wrappers keep the original in ``__kvcached_wrapped__``.
Version notes: 0.5.23 releases paged memory through ``free_segments`` ->
``free_page_ids`` -> ``_release_page_ids`` and has no ``cache_finished_req``;
the allocators here are written against that API, hence the ranges.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, List

from kvcached.integration.patch_base import BasePatch, VersionRange, wrap_method

SGLANG_0_5_23 = VersionRange.parse(">=0.5.23,<0.5.24")
SUPPORTED = SGLANG_0_5_23


# --------------------------------------------------------------------- conflicts
def _apply_conflicts(mod: ModuleType) -> None:
    from kvcached.integration.sglang.conflicts import check_server_args

    def make(orig: Callable) -> Callable:
        def resolve_once(self: Any, *a: Any, **k: Any) -> Any:
            # Raw fields are enough and checking first stops before any
            # resolution side effects; children re-check (cheap, same answer).
            check_server_args(self)
            return orig(self, *a, **k)

        return resolve_once

    wrap_method(mod.ServerArgs, "resolve_once", make)


# ---------------------------------------------------------------------- capacity
def virtual_kv_bytes(device: str) -> int:
    """The KV budget an elastic pool is sized for: the device's usable memory.

    It does not depend on what is free when the engine starts: physical pages
    are mapped on demand and capped by the instance limit (kvctl limit) and the
    device. ``--max-total-tokens`` still caps the pool (SGLang applies it after).
    """
    from kvcached.devices import normalize_device
    from kvcached.limits import usable_device_bytes

    return int(usable_device_bytes(normalize_device(device)))


def _apply_capacity(mod: ModuleType) -> None:
    def make(orig: Callable) -> Callable:
        def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> int:
            return virtual_kv_bytes(self.device)

        return _profile_available_bytes

    wrap_method(mod.KVCacheConfigurator, "_profile_available_bytes", make)


# ------------------------------------------------------------------------- pools
def _apply_pools(mod: ModuleType) -> None:
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool, ElasticMLATokenToKVPool

    elastic = {mod.MHATokenToKVPool: ElasticMHATokenToKVPool, mod.MLATokenToKVPool: ElasticMLATokenToKVPool}

    def make(orig: Callable) -> Callable:
        def _resolve_kv_pool_class(self: Any, *, kind: str, default: type) -> type:
            cls = orig(self, kind=kind, default=default)
            # Only SGLang's own classes are swapped; a platform's pool class is
            # left alone (and refused by the allocator check below).
            return elastic.get(cls, cls)

        return _resolve_kv_pool_class

    wrap_method(mod.KVCacheConfigurator, "_resolve_kv_pool_class", make)


# -------------------------------------------------------------------- allocators
def _apply_allocators(mod: ModuleType) -> None:
    from kvcached.integration.sglang import allocator as ea
    from kvcached.integration.sglang.conflicts import refuse
    from kvcached.integration.sglang.pool import is_elastic_pool

    # The builder looks these names up in its module at call time; the elastic
    # classes construct SGLang's own allocator for a pool that is not elastic.
    mod.TokenToKVPoolAllocator = ea.ElasticTokenToKVPoolAllocator
    mod.PagedTokenToKVPoolAllocator = ea.ElasticPagedTokenToKVPoolAllocator
    mod.SWATokenToKVPoolAllocator = ea.ElasticSWATokenToKVPoolAllocator

    def make(orig: Callable) -> Callable:
        def _build_token_to_kv_pool_allocator(self: Any, *a: Any, **k: Any) -> Any:
            pool = k.get("token_to_kv_pool")
            if k.get("token_to_kv_pool_allocator") is not None:
                raise refuse(
                    "a draft worker shares the target's allocator (speculative decoding)",
                    "drop --speculative-algorithm",
                )
            alloc = orig(self, *a, **k)
            elastic_alloc = isinstance(alloc, (ea._ElasticAllocatorMixin, ea.ElasticSWATokenToKVPoolAllocator))
            if not is_elastic_pool(pool) or not elastic_alloc:
                # Fail closed: a native allocator over elastic buffers would
                # hand out slots on pages nobody maps, and a pool kvcached does
                # not replace would silently run without it.
                raise refuse(
                    f"SGLang built {type(alloc).__name__} over {type(pool).__name__}, a combination kvcached "
                    "does not make elastic (supported: MHA/GQA and MLA models, SWA hybrids)",
                    "use a supported model and configuration",
                )
            return alloc

        return _build_token_to_kv_pool_allocator

    wrap_method(mod.KVCacheConfigurator, "_build_token_to_kv_pool_allocator", make)


def _apply_swa_allocators(mod: ModuleType) -> None:
    from kvcached.integration.sglang import allocator as ea

    mod.TokenToKVPoolAllocator = ea.ElasticTokenToKVPoolAllocator
    mod.PagedTokenToKVPoolAllocator = ea.ElasticPagedTokenToKVPoolAllocator


# --------------------------------------------------------------------- scheduler
def _apply_scheduler(mod: ModuleType) -> None:
    from kvcached.integration.sglang import scheduler_hooks as sh

    def make_run(orig: Callable) -> Callable:
        def run_batch(self: Any, batch: Any, *a: Any, **k: Any) -> Any:
            result = orig(self, batch, *a, **k)
            sh.after_launch(result)
            return result

        return run_batch

    def make_process(orig: Callable) -> Callable:
        def process_batch_result(self: Any, batch: Any, result: Any, *a: Any, **k: Any) -> Any:
            out = orig(self, batch, result, *a, **k)
            sh.after_result(self, result)
            return out

        return process_batch_result

    def make_idle(orig: Callable) -> Callable:
        def on_idle(self: Any, *a: Any, **k: Any) -> Any:
            out = orig(self, *a, **k)
            sh.on_idle(self)
            return out

        return on_idle

    def make_flush(orig: Callable) -> Callable:
        def flush_cache(self: Any, *a: Any, **k: Any) -> Any:
            ok = orig(self, *a, **k)
            sh.after_flush(self, ok)
            return ok

        return flush_cache

    cls = mod.Scheduler
    wrap_method(cls, "run_batch", make_run)
    wrap_method(cls, "process_batch_result", make_process)
    wrap_method(cls, "on_idle", make_idle)
    wrap_method(cls, "flush_cache", make_flush)
    cls.kvcached_report = sh.kvcached_report


def all_patches() -> List[BasePatch]:
    r = SGLANG_0_5_23
    return [
        BasePatch(
            "sglang-conflicts",
            "sglang.srt.server_args",
            r,
            _apply_conflicts,
            "refuse SGLang features that own or re-address the KV memory",
        ),
        BasePatch(
            "sglang-capacity",
            "sglang.srt.mem_cache.kv_cache_configurator",
            r,
            _apply_capacity,
            "size the pool from a virtual budget, not from free device memory",
        ),
        BasePatch(
            "sglang-pools",
            "sglang.srt.mem_cache.kv_cache_configurator",
            r,
            _apply_pools,
            "elastic MHA/MLA pools (FTensor-backed buffers)",
        ),
        BasePatch(
            "sglang-allocators",
            "sglang.srt.mem_cache.kv_cache_configurator",
            r,
            _apply_allocators,
            "elastic token/paged/SWA allocators (0.5.23 release API)",
        ),
        BasePatch(
            "sglang-swa-allocators",
            "sglang.srt.mem_cache.allocator.swa",
            r,
            _apply_swa_allocators,
            "elastic sub-allocators inside the SWA composite",
        ),
        BasePatch(
            "sglang-scheduler",
            "sglang.srt.managers.scheduler",
            r,
            _apply_scheduler,
            "deferred physical release, prefix-cache bound, kvcached_report",
        ),
    ]
