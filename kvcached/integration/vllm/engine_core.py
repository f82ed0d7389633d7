"""EngineCore seam: the scheduler-side kvcached state of one vLLM instance.

In the EngineCore process, while vLLM's ``Scheduler`` is being built, the
coordinator constructs its ``BlockPool``; the patched constructor
(``ElasticBlockPool``) calls ``ElasticBackend.create`` here, which

* removes what crashed instances left behind (dead records, stale sockets);
* builds the ``KVCacheManager`` over the KV buffer's logical pages
  (``kv_layout``) with the worker fan-out (``kvcached.ipc.TPCoordinator``)
  as its mapper: the workers are separate processes, even at TP=1 on CPU;
* gives it the instance's shared record and limit (``own_segment``:
  ``InstanceLimits``, shown by ``kvctl list``, capped by ``kvctl limit``), so
  every page it maps is admitted by the shared device budget;
* fences physical release by execution (``ExecutionFence``).

Execution lifetime: ``cuMemUnmap`` does not wait for running kernels, and with
async scheduling step N+1 is submitted before step N's output is processed,
so a block freed now may still be read by a submitted step. The manager runs
with deferred release: an emptied page stays mapped (and reusable) until
``release_retired_pages_through(marker)``. The fence captures a marker at the
end of every ``schedule()``; a page emptied while steps up to S were
scheduled is released when S's output reaches ``update_from_output`` (S and
every earlier step finished on every worker), and at once when no step is in
flight. On CPU vLLM forces synchronous scheduling, so that is every step.

A physical shortage discovered inside ``allocate_slots`` (another process
took the memory after ``get_num_free_blocks`` counted it) is rolled back and
returned as None, so the scheduler preempts instead of crashing.
"""

from __future__ import annotations

import collections
import functools
import glob
import inspect
import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from kvcached import config
from kvcached.errors import InvalidArgumentError
from kvcached.integration.patch_base import WRAPPED

logger = logging.getLogger("vllm.kvcached")

# How often an idle engine's watcher looks for memory to give back.
_IDLE_WATCH_S = 0.5


# ------------------------------------------------------------------ context


@dataclass
class PoolContext:
    """What the block pool needs from the Scheduler being built."""

    vllm_config: Any
    kv_cache_config: Any


_ctx = threading.local()


def take_pool_context() -> Optional[PoolContext]:
    """The context of the Scheduler being built in this thread (consumed: one pool per scheduler)."""
    ctx = getattr(_ctx, "value", None)
    _ctx.value = None
    return ctx


# -------------------------------------------------------------------- fence


class ExecutionFence:
    """Releases emptied pages only when no submitted step can still read them.

    Steps are numbered in ``schedule()`` order; outputs come back to
    ``update_from_output`` in the same order (vLLM's batch queue is FIFO).
    """

    def __init__(self, manager: Any) -> None:
        self._m = manager
        self.scheduled = 0
        self.finished = 0
        self.depth = 0  # > 0 while inside schedule() / update_from_output()
        self._markers: Deque[Tuple[int, int]] = collections.deque()
        self.closed = False

    @property
    def in_flight(self) -> int:
        return self.scheduled - self.finished

    def schedule_done(self) -> None:
        """After ``schedule()`` of step S returned (S is about to be submitted)."""
        self.scheduled += 1
        marker = self._m.capture_physical_release_marker()
        self._markers.append((self.scheduled, marker))
        if self.finished == self.scheduled - 1:
            # Nothing earlier is in flight and S does not reference a page that
            # is empty now: what emptied so far can go.
            self._release(marker)

    def update_begin(self) -> None:
        """``update_from_output`` of the oldest submitted step S: S and every
        earlier step finished on every worker."""
        self.finished += 1
        while self._markers and self._markers[0][0] <= self.finished:
            self._markers.popleft()
        # A page emptied before step S+1 was scheduled could be read only by
        # steps <= S (S+1 was built from live blocks): release through S+1's
        # marker; with no step in flight, release everything.
        marker = self._markers[0][1] if self._markers else self._m.capture_physical_release_marker()
        self._release(marker)

    def update_end(self) -> None:
        if self.in_flight <= 0:
            self._release(self._m.capture_physical_release_marker())

    def after_free(self) -> None:
        """After a free outside a step (abort, reset, cache trim)."""
        if self.depth == 0 and self.in_flight <= 0:
            self._release(self._m.capture_physical_release_marker())

    def _release(self, marker: int) -> None:
        if not self.closed:
            self._m.release_retired_pages_through(marker)

    def wrap(self, scheduler: Any, after_schedule: Optional[Callable[[], None]] = None) -> None:
        """Counts the steps of ``scheduler`` (instance attributes shadow its
        methods); ``after_schedule`` runs after each ``schedule()``."""
        schedule = scheduler.schedule
        update = scheduler.update_from_output
        fence = self

        @functools.wraps(schedule)
        def schedule_wrapper(*args: Any, **kwargs: Any) -> Any:
            fence.depth += 1
            try:
                out = schedule(*args, **kwargs)
            finally:
                fence.depth -= 1
            fence.schedule_done()
            if after_schedule is not None:
                after_schedule()
            return out

        @functools.wraps(update)
        def update_wrapper(*args: Any, **kwargs: Any) -> Any:
            fence.update_begin()
            fence.depth += 1
            try:
                return update(*args, **kwargs)
            finally:
                fence.depth -= 1
                fence.update_end()

        scheduler.schedule = schedule_wrapper
        scheduler.update_from_output = update_wrapper


# ----------------------------------------------------------------- backend


def _device_of(vllm_config: Any) -> str:
    dev = getattr(getattr(vllm_config, "device_config", None), "device", None)
    kind = getattr(dev, "type", str(dev or "cpu"))
    if kind == "cpu":
        return "cpu"
    idx = getattr(dev, "index", None)
    return f"cuda:{idx or 0}"


def _refuse_unsupported(vllm_config: Any) -> None:
    pc = vllm_config.parallel_config
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, attr, 1) or 1) > 1:
            raise InvalidArgumentError(f"kvcached does not support {attr} > 1 yet; unset ENABLE_KVCACHED")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise InvalidArgumentError(
            "kvcached does not support KV connectors (kv_transfer_config): they read blocks outside "
            "the scheduler's steps, so a page could be unmapped under a transfer; unset ENABLE_KVCACHED"
        )


def cleanup_dead_instances() -> None:
    """Deletes records whose owner died and socket directories nobody serves
    (what a killed engine leaves behind), for this user."""
    from kvcached import _C
    from kvcached.ipc import paths
    from kvcached.limits.records import list_records

    for r in list_records():
        if not r.alive:
            try:
                _C.delete_mem_info_record(r.name, False)  # re-checks liveness
                logger.info("kvcached: removed the record of dead instance %s", r.name)
            except _C.KvcachedError:
                pass
    uid = os.geteuid()
    for root in glob.glob(os.path.join(paths.BASE_DIR, "kvcached-tp-*")):
        try:
            st = os.lstat(root)
        except OSError:
            continue
        if st.st_uid != uid or not os.path.isdir(root) or os.path.islink(root):
            continue
        try:
            with paths.locked_root(root):
                paths.remove_stale(root)
                try:
                    os.rmdir(root)
                except OSError:
                    pass  # someone still listens there
        except (OSError, InvalidArgumentError):
            continue


def cleanup_instance(base: str, wait_s: float = 10.0) -> None:
    """Removes the record and socket directory of instance ``base`` (and its
    ``_dp<k>`` engines) once their owners are dead.

    Run at exit of the process that started the engine (API server / LLM
    script): vLLM's default shutdown (``--shutdown-timeout 0``) SIGKILLs the
    EngineCore and workers, so they cannot clean up themselves. Owners that
    are still alive after ``wait_s`` (dying) are left to the next start.
    """
    import time

    from kvcached import _C
    from kvcached.ipc import paths
    from kvcached.limits.records import list_records

    deadline = time.monotonic() + wait_s
    names = {base} | {r.name for r in list_records() if r.name.startswith(base + "_dp")}
    for name in sorted(names):
        while True:
            rec = next((r for r in list_records() if r.name == name), None)
            if rec is None:
                break
            if not rec.alive:  # dead, or killed and not yet reaped by this process
                try:
                    _C.delete_mem_info_record(name, False)  # re-checks liveness
                except _C.KvcachedError:
                    pass
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        root = paths.socket_root(name)
        while os.path.isdir(root):
            try:
                with paths.locked_root(root):
                    paths.remove_stale(root)
                    try:
                        os.rmdir(root)
                    except OSError:
                        pass  # a worker is still listening (dying)
            except (OSError, InvalidArgumentError):
                break
            if not os.path.isdir(root) or time.monotonic() > deadline:
                break
            time.sleep(0.05)


class ElasticBackend:
    """Manager, limits, worker fan-out and fence of one vLLM instance's KV pool."""

    def __init__(self, plan: Any, manager: Any, limits: Any, coordinator: Any, name: str) -> None:
        self.plan = plan
        self.manager = manager
        self.limits = limits
        self.coordinator = coordinator
        self.name = name
        self.fence = ExecutionFence(manager)
        self._bpp = int(manager.bytes_per_page)
        self._closed = False
        self._missed_in_step = False  # an allocate_slots -> None in the current schedule()

    @classmethod
    def create(cls, ctx: PoolContext, num_blocks: int) -> "ElasticBackend":
        from kvcached.integration.vllm.kv_layout import KVLayoutPlan
        from kvcached.integration.vllm.worker_tensors import instance_name
        from kvcached.ipc.coordinator import TPCoordinator
        from kvcached.kv_cache_manager import KVCacheManager

        vc = ctx.vllm_config
        _refuse_unsupported(vc)
        page = config.page_size()
        plan = KVLayoutPlan.from_kv_cache_config(ctx.kv_cache_config, page)
        if plan.num_blocks != num_blocks:
            raise InvalidArgumentError(
                f"kvcached: the block pool has {num_blocks} blocks but the KV cache config {plan.num_blocks}"
            )
        pc = vc.parallel_config
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
        dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        name = instance_name(dp_rank, dp_size)
        device = _device_of(vc)
        cleanup_dead_instances()
        coordinator = TPCoordinator(tp, pp_size=pp, pp_rank=-1, ipc_name=name, group_id=0)
        async_sched = bool(getattr(vc.scheduler_config, "async_scheduling", False))
        try:
            manager = KVCacheManager(
                num_blocks,
                plan.block_tokens,
                plan.cell_size,
                plan.physical_pages_per_logical_page(),
                world_size=tp * pp,
                pp_rank=-1,
                async_sched=async_sched,
                reserve_null_block=True,  # vLLM's null block 0: always mapped, never freed
                num_kv_buffers=1,
                group_id=0,
                pool_name=name,
                defer_physical_release=True,
                # The instance's record: kvctl shows and caps it; every page
                # the manager maps is admitted by the shared device budget.
                own_segment=True,
                map_fn=coordinator.map,
                unmap_fn=coordinator.unmap,
                page_size=page,
                engine="vllm",
                device=device,
            )
        except BaseException:
            coordinator.close()
            raise
        limits = manager.limits
        backend = cls(plan, manager, limits, coordinator, name)
        from kvcached.integration.vllm.plugin import manager as patch_manager

        logger.info(
            "kvcached: instance %s on %s, %d blocks (%d tokens each) over %d pages of %d KiB x %d; limit %.1f MiB. %s",
            name, device, num_blocks, plan.block_tokens, plan.num_logical_pages, page >> 10,
            plan.physical_pages_per_logical_page(), limits.limit / (1 << 20), patch_manager().summary(),
        )
        return backend

    def after_free(self) -> None:
        self.fence.after_free()

    # ---- idle give-back ----------------------------------------------------
    #
    # A busy engine returns memory from its scheduling steps (the pool checks
    # its limit whenever it counts free blocks). An idle one runs no step, yet
    # its prefix cache may hold pages that a loaded peer needs, or a lowered
    # limit may not be enforced yet. A thread watches for that (every 0.5 s,
    # and at once when a peer publishing a want wakes this instance's record)
    # and, when there is something to give back, queues the work on the EngineCore's own
    # thread (vLLM's idle callbacks, woken with a WAKEUP request), where the
    # pool may be touched.

    def peers_wanting_memory(self) -> List[str]:
        """Other live instances sharing the device budget that published a
        current want (their load misses memory the budget holds)."""
        budget = self.limits.budget
        return [] if budget is None else [r.name for r in budget.wanting(exclude=self.limits.name)]

    def note_shortage(self) -> None:
        """A request could not get blocks: if the device budget (not this
        instance's limit) is why, idle peers are asked for their cache."""
        self._missed_in_step = True
        self.limits.note_shortage()

    def step_scheduled(self) -> None:
        """After each ``schedule()``: a step that placed every request it
        tried withdraws the want, so idle peers keep their cache."""
        if self._missed_in_step:
            self._missed_in_step = False
        else:
            self.limits.clear_want()

    def start_idle_watch(self, core: Any, pool: Any) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        self._idle_poke = threading.Event()  # set by a peer's want (futex wake) or close()
        self._idle_queued = False
        self.limits.on_peer_short = self._idle_poke.set

        def run_on_core(_core: Any) -> None:
            self._idle_queued = False
            if not self._closed:
                pool.idle_return_memory(self.peers_wanting_memory())

        def watch() -> None:
            while True:
                self._idle_poke.wait(_IDLE_WATCH_S)
                self._idle_poke.clear()
                if self._closed:
                    return
                try:
                    if self._idle_queued or core.scheduler.has_requests():
                        continue  # a busy engine gives memory back from its own steps
                    has_cache = pool.free_block_queue.num_free_blocks > 0
                    reserve = int(self.manager.page_allocator.get_num_reserved_pages()) > 0
                    if not (has_cache or reserve):
                        continue
                    if self.pages_over_limit() <= 0 and not self.peers_wanting_memory():
                        continue
                    self._idle_queued = True
                    core._idle_state_callbacks.append(run_on_core)
                    core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
                except Exception as e:  # keep watching; say it once
                    if not getattr(self, "_idle_warned", False):
                        self._idle_warned = True
                        logger.warning("kvcached: idle memory watcher of %s: %s: %s", self.name, type(e).__name__, e)

        self._idle_thread = threading.Thread(target=watch, name=f"kvcached-idle-{self.name}", daemon=True)
        self._idle_thread.start()

    def pages_over_limit(self) -> int:
        """Pages mapped beyond the operator's limit (a lowered ``kvctl limit``)."""
        over = int(self.manager.page_allocator.get_num_mapped_pages()) * self._bpp - int(self.limits.limit)
        return -(-over // self._bpp) if over > 0 else 0

    def close(self) -> None:
        """Removes the record and closes the connections. The workers are gone
        or going (vLLM stops them first), so nothing is unmapped remotely:
        their pages die with them."""
        if self._closed:
            return
        self._closed = True
        self.fence.closed = True
        poke = getattr(self, "_idle_poke", None)
        if poke is not None:
            poke.set()  # the watcher sees _closed and ends
        try:
            self.limits.close()
        finally:
            self.coordinator.close()


# ------------------------------------------------------------------ patches


def _bind(fn: Callable, *args: Any, **kwargs: Any) -> Dict[str, Any]:
    return inspect.signature(fn).bind(*args, **kwargs).arguments


def patch_scheduler_module(module: ModuleType) -> None:
    """Scheduler.__init__ hands its configs to the pool and wires the fence;
    Scheduler.shutdown closes the pool's kvcached side."""
    cls = module.Scheduler
    init = cls.__init__
    shutdown = cls.shutdown

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[no-untyped-def]
        a = _bind(init, self, *args, **kwargs)
        _ctx.value = PoolContext(a["vllm_config"], a["kv_cache_config"])
        try:
            init(self, *args, **kwargs)
        finally:
            _ctx.value = None
        pool = _pool_of(self)
        if pool is not None:
            pool.backend.fence.wrap(self, after_schedule=pool.backend.step_scheduled)

    @functools.wraps(shutdown)
    def shutdown_wrapper(self) -> None:  # type: ignore[no-untyped-def]
        try:
            shutdown(self)
        finally:
            pool = _pool_of(self)
            if pool is not None:
                pool.close()

    setattr(__init__, WRAPPED, init)
    setattr(shutdown_wrapper, WRAPPED, shutdown)
    cls.__init__ = __init__
    cls.shutdown = shutdown_wrapper


def patch_engine_core_module(module: ModuleType) -> None:
    """EngineCore.__init__: start the idle watcher of a kvcached pool (only in
    EngineCore processes: they have the input queue the watcher wakes)."""
    cls = module.EngineCore
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        pool = _pool_of(getattr(self, "scheduler", None))
        if pool is not None and hasattr(self, "input_queue") and hasattr(self, "_idle_state_callbacks"):
            pool.backend.start_idle_watch(self, pool)

    setattr(__init__, WRAPPED, init)
    cls.__init__ = __init__


def _pool_of(scheduler: Any) -> Any:
    from kvcached.integration.vllm.block_pool import ElasticBlockPool

    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    return pool if isinstance(pool, ElasticBlockPool) else None


def patch_kv_cache_manager_module(module: ModuleType) -> None:
    """KVCacheManager.allocate_slots: a PoolShortage rolls the call back and
    returns None; every None (the request waits or is preempted) is noted as
    a shortage, so idle peers holding the device budget give it back."""
    cls = module.KVCacheManager
    orig = cls.allocate_slots

    @functools.wraps(orig)
    def allocate_slots(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        from kvcached.integration.vllm.block_pool import ElasticBlockPool, PoolShortage

        if not isinstance(self.block_pool, ElasticBlockPool):
            return orig(self, request, *args, **kwargs)
        managers = self.coordinator.single_type_managers
        rid = request.request_id
        snap = [_snapshot(m, rid) for m in managers]  # a few dict lookups: cheap enough per call
        try:
            out = orig(self, request, *args, **kwargs)
        except PoolShortage as e:
            for m, s in zip(managers, snap):
                _rollback(m, rid, s, self.block_pool)
            logger.debug("kvcached: allocation of %s rolled back: %s", rid, e)
            out = None
        if out is None:
            self.block_pool.backend.note_shortage()
        return out

    setattr(allocate_slots, WRAPPED, orig)
    cls.allocate_slots = allocate_slots


_MISSING = object()


def _snapshot(m: Any, rid: str) -> Tuple[Any, ...]:
    blocks = m.req_to_blocks.get(rid)
    partial = getattr(m, "_partial_hit_reqs", {})
    return (
        None if blocks is None else len(blocks),
        m.num_cached_block.get(rid, _MISSING),
        len(getattr(m, "new_block_ids", ())),
        partial.get(rid, _MISSING),
    )


def _rollback(m: Any, rid: str, snap: Tuple[Any, ...], pool: Any) -> None:
    """Puts one single-type manager back to its state before the failed call:
    blocks the call attached are released (touched hits back to evictable,
    new blocks back to the ledger) and its bookkeeping restored."""
    n_blocks, n_cached, n_new_ids, partial = snap
    blocks = m.req_to_blocks.get(rid)
    partials = getattr(m, "_partial_hit_reqs", None)
    if partial is not _MISSING and partials is not None and rid not in partials:
        idx, src = partial
        if blocks is not None and idx < len(blocks) and blocks[idx] is not src:
            # The copy-on-write of a partial prefix hit ran before the shortage;
            # it rewrote the block table in place, which cannot be undone here.
            raise RuntimeError(
                f"kvcached: a physical shortage hit request {rid} after a copy-on-write of its partial prefix "
                "hit; the allocation cannot be rolled back. Give the instance a higher limit (kvctl limit)"
            )
    if blocks is not None:
        keep = n_blocks or 0
        extra = blocks[keep:]
        del blocks[keep:]
        if extra:
            pool.free_blocks(reversed(extra))
        if n_blocks is None and not blocks:
            del m.req_to_blocks[rid]
    if n_cached is _MISSING:
        m.num_cached_block.pop(rid, None)
    else:
        m.num_cached_block[rid] = n_cached
    ids = getattr(m, "new_block_ids", None)
    if ids is not None:
        del ids[n_new_ids:]
    if partials is not None:
        if partial is _MISSING:
            partials.pop(rid, None)
        else:
            partials[rid] = partial
