"""Scheduler-side patches of vLLM: the Scheduler, EngineCore and KVCacheManager seams.

* ``Scheduler.__init__`` builds its block pool inside ``backend.building_pools``
  (so the coordinator's ``BlockPool(...)`` becomes an ``ElasticBlockPool`` of
  this scheduler) and counts its steps for the release fence: a marker after
  each ``schedule()``, a finished step at each ``update_from_output``.
* an offloading connector's copy jobs hold the blocks they copy (``offload.attach``).
* ``Scheduler.shutdown`` closes the pool's kvcached side.
* ``EngineCore.__init__`` starts the idle watcher (only EngineCore processes
  have the input queue it wakes).
* ``KVCacheManager.allocate_slots``: a ``PoolShortage`` (memory taken by
  another process after vLLM counted it) rolls the call back and returns None;
  every None is a shortage, which publishes a want to idle peers.
"""

from __future__ import annotations

import functools
import inspect
import logging
from types import ModuleType
from typing import Any, Callable, Dict

from kvcached.elastic import IdleAction, StallBackoff
from kvcached.integration.patch_base import wrap_method
from kvcached.integration.vllm import offload
from kvcached.integration.vllm.backend import building_pools
from kvcached.integration.vllm.block_pool import ElasticBlockPool, PoolShortage
from kvcached.integration.vllm.slot_rollback import rollback, snapshot

logger = logging.getLogger("vllm.kvcached")


def _bind(fn: Callable, *args: Any, **kwargs: Any) -> Dict[str, Any]:
    return inspect.signature(fn).bind(*args, **kwargs).arguments


def _pool_of(scheduler: Any) -> Any:
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    return pool if isinstance(pool, ElasticBlockPool) else None


def count_steps(scheduler: Any, pool: ElasticBlockPool) -> None:
    """Wraps this scheduler's ``schedule`` / ``update_from_output`` (instance
    attributes shadow the class's) to drive the pool's release fence and want,
    and to pace a scheduler that admits nothing (``StallBackoff``)."""
    fence = pool.backend.fence
    instance = pool.backend.instance
    schedule = scheduler.schedule
    update = scheduler.update_from_output
    stall = StallBackoff(pool.backend.pool)

    @functools.wraps(schedule)
    def schedule_wrapper(*args: Any, **kwargs: Any) -> Any:
        fence.depth += 1
        try:
            out = schedule(*args, **kwargs)
        finally:
            fence.depth -= 1
        fence.launched()
        instance.end_step()
        if getattr(out, "total_num_scheduled_tokens", 1) or scheduler.running or not scheduler.waiting:
            stall.progress()
        else:  # requests wait, none was admitted, none runs
            stall.stalled(len(scheduler.waiting))
        return out

    @functools.wraps(update)
    def update_wrapper(*args: Any, **kwargs: Any) -> Any:
        fence.finished()
        fence.depth += 1
        try:
            return update(*args, **kwargs)
        finally:
            fence.depth -= 1
            fence.settle()

    scheduler.schedule = schedule_wrapper
    scheduler.update_from_output = update_wrapper


def patch_scheduler_module(module: ModuleType) -> None:
    def make_init(init: Callable) -> Callable:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            a = _bind(init, self, *args, **kwargs)
            with building_pools(a["vllm_config"], a["kv_cache_config"]):
                init(self, *args, **kwargs)
            pool = _pool_of(self)
            if pool is not None:
                count_steps(self, pool)
                offload.attach(self, pool)  # the offload connector's copies join the fence

        return __init__

    def make_shutdown(shutdown: Callable) -> Callable:
        def shutdown_wrapper(self: Any) -> None:
            try:
                shutdown(self)
            finally:
                pool = _pool_of(self)
                if pool is not None:
                    pool.close()

        return shutdown_wrapper

    wrap_method(module.Scheduler, "__init__", make_init)
    wrap_method(module.Scheduler, "shutdown", make_shutdown)


def start_idle_watch(core: Any, pool: ElasticBlockPool) -> None:
    """An idle EngineCore runs no step: a watcher thread queues the give-back on
    the EngineCore's own thread (vLLM's idle callbacks, woken with a WAKEUP
    request), where the pool may be touched."""
    from vllm.v1.engine import EngineCoreRequestType

    backend = pool.backend

    def busy() -> bool:
        return bool(core.scheduler.has_requests())

    def has_memory() -> bool:
        return (
            pool.free_block_queue.num_free_blocks > 0
            or int(backend.manager.page_allocator.get_num_reserved_pages()) > 0
        )

    def schedule(act: IdleAction) -> None:
        def run_on_core(_core: Any) -> None:
            try:
                if not backend.instance.closed:
                    pool.idle_return_memory(act)
            finally:
                watcher.done()

        core._idle_state_callbacks.append(run_on_core)
        core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    watcher = backend.instance.start_idle_watch(busy, has_memory, schedule)


def patch_engine_core_module(module: ModuleType) -> None:
    def make_init(init: Callable) -> Callable:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            pool = _pool_of(getattr(self, "scheduler", None))
            if pool is not None and hasattr(self, "input_queue") and hasattr(self, "_idle_state_callbacks"):
                start_idle_watch(self, pool)

        return __init__

    wrap_method(module.EngineCore, "__init__", make_init)


def patch_kv_cache_manager_module(module: ModuleType) -> None:
    def make(orig: Callable) -> Callable:
        def allocate_slots(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not isinstance(self.block_pool, ElasticBlockPool):
                return orig(self, request, *args, **kwargs)
            managers = self.coordinator.single_type_managers
            rid = request.request_id
            snap = [snapshot(m, rid) for m in managers]  # a few dict lookups: cheap enough per call
            try:
                out = orig(self, request, *args, **kwargs)
            except PoolShortage as e:
                for m, s in zip(managers, snap):
                    rollback(m, rid, s, self.block_pool)
                logger.debug("kvcached: allocation of %s rolled back: %s", rid, e)
                out = None
            if out is None:
                # The tokens this step tried to place (allocate_slots' num_new_tokens, every version).
                need = args[0] if args else kwargs.get("num_new_tokens", 0)
                self.block_pool.backend.instance.note_shortage(int(need or 0))
            return out

        return allocate_slots

    wrap_method(module.KVCacheManager, "allocate_slots", make)
