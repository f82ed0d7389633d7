"""Upstream's ``KVCacheManager``: the ``BlockManager`` as upstream's callers build and read it.

What upstream's manager has and the core does not need lives here, over the
core (docs/COMPAT.md):

* the constructor: upstream's positions (``world_size``, ``pp_rank``,
  ``async_sched`` before ours) and shorthands, resolved into the core's
  collaborators by ``manager_args.build_collaborators``; a manager given no
  record gets upstream's always-present one (``manager_args.auto_record``);
* the revisioned limit (``set_memory_limit``, ``memory_limit_state``): the
  caller's revision orders its calls, the limit goes to the pool's record
  through the one writer (``kvcached.limits.writer``) or, without a record,
  to the page allocator's cap (``set_mem_limit``);
* the resize target (``resize``: grows at once, shrinks as pages drain; a
  page with a live block is never released), which the core's index keeps;
* the registry of live pools (``kvcached.pool_registry``: a manager is listed
  from construction to ``shutdown()``, tagged with its engine);
* the snapshots (``observability_snapshot``, ``_observability_counts``, read
  under one hold of the core's lock) and upstream's readers
  (``get_mapped_memory_size(unit)``, ``reserved_blocks``, ``in_shrink``,
  ``target_num_blocks``, ``_get_num_alloced_blocks``).

``kvcached.kv_cache_manager`` is upstream's import path of this class. The
engine adapters build it too (the interfaces, SGLang's pools, vLLM's backend),
so every pool of a process answers upstream's limit call
(``kvcached.control.set_instance_memory_limit`` without a name).
"""

from __future__ import annotations

import logging
import operator
import threading
from typing import Any, Dict, List, Optional, Union

from kvcached import pool_registry
from kvcached.block_manager import EMPTY_PAGE_GRACE_S, BlockManager
from kvcached.compat.manager_args import AUTO, MapFn, auto_record, build_collaborators
from kvcached.errors import InvalidArgumentError, int_arg
from kvcached.limits.writer import write_limit
from kvcached.manager_setup import Barrier, LimitsFactory, Mapper, default_device

logger = logging.getLogger(__name__)

_UNITS = {"b": 1, "bytes": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}


class KVCacheManager(BlockManager):
    """Upstream's KVCacheManager over ``BlockManager`` (whose Args these are too).

    Args (upstream's, before the core's):
        world_size: processes holding this cache's tensors (TP x PP ranks
            driven by this scheduler); without a mapper and above 1, pages are
            mapped through the fan-out of ``kvcached.tp_ipc_util``.
        pp_rank: pipeline stage whose workers that fan-out drives (-1: all).
        async_sched: the engine queues batch N+1 while batch N runs (with
            ``release_barrier=AUTO``: a device sync before pages are released).
        pool_name: upstream's stable label of the pool and, with
            ``own_segment=True``, the name of its record.
        own_segment: True: shorthand for ``limits=limits_factory(engine=engine,
            device=device, name=pool_name, group_id=group_id)`` (a record in the
            device budget). None (default) with ``limits`` not given: a record
            named for the instance, outside any device budget, as upstream's
            manager always has (``kvctl list`` shows it, ``kvctl limit`` caps it;
            a name held by a live process gets upstream's ``_<k>`` suffix);
            skipped when the device is unknown. False: no record.
        map_fn, unmap_fn: shorthand for ``mapper=FunctionMapper(map_fn, unmap_fn)``.
        limits: as the core's; not given: see ``own_segment``.
        release_barrier: as the core's; AUTO: a device sync when async_sched,
            local CUDA, no deferred release.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cell_size: int,
        num_layers: int,
        world_size: int = 1,
        pp_rank: int = 0,
        async_sched: bool = False,
        reserve_null_block: bool = False,
        num_kv_buffers: int = 2,
        group_id: int = 0,
        pool_name: Optional[str] = None,
        defer_physical_release: bool = False,
        own_segment: Optional[bool] = None,
        *,
        map_fn: Optional[MapFn] = None,
        unmap_fn: Optional[MapFn] = None,
        page_size: Optional[int] = None,
        engine: str = "kvcached",
        device: Optional[str] = None,
        mapper: Optional[Mapper] = None,
        limits: Union[LimitsFactory, None, Any] = AUTO,
        release_barrier: Union[Barrier, None, Any] = AUTO,
        empty_page_grace_s: float = EMPTY_PAGE_GRACE_S,
    ) -> None:
        self.world_size = int_arg("world_size", world_size, minimum=1)
        self.pp_rank = operator.index(pp_rank)
        self.async_sched = bool(async_sched)
        # Upstream's revisioned limit (set_memory_limit): the last revision and bytes given.
        self._limit_lock = threading.Lock()
        self._limit_rev = -1
        self._limit_bytes: Optional[int] = None
        device = default_device(device)
        group = operator.index(group_id)
        wants_auto_record = limits is AUTO and own_segment is None
        mapper, limits, release_barrier = build_collaborators(
            world_size=self.world_size, pp_rank=self.pp_rank, group_id=group, async_sched=self.async_sched,
            defer_physical_release=bool(defer_physical_release), own_segment=bool(own_segment), map_fn=map_fn,
            unmap_fn=unmap_fn, engine=engine, device=device, pool_name=pool_name, mapper=mapper,
            limits=None if limits is AUTO else limits, release_barrier=release_barrier,
        )  # fmt: skip
        if wants_auto_record and device is not None:
            limits = auto_record(engine=engine, device=device, group_id=group)
        super().__init__(
            num_blocks, block_size, cell_size, num_layers, num_kv_buffers=num_kv_buffers, group_id=group,
            reserve_null_block=reserve_null_block, defer_physical_release=defer_physical_release,
            pool_name=pool_name, page_size=page_size, engine=engine, device=device, mapper=mapper, limits=limits,
            release_barrier=release_barrier, empty_page_grace_s=empty_page_grace_s,
        )  # fmt: skip
        # Upstream's registry of live pools (its snapshots and limit call read it), until shutdown().
        tag = engine if engine != "kvcached" else getattr(self.limits, "engine", None)
        self.integration = tag if tag in ("vllm", "sglang") else None
        pool_registry.register_kv_cache_pool(self, integration=self.integration)

    def shutdown(self) -> None:
        """Leaves upstream's pool registry, then shuts the core down (``BlockManager.shutdown``)."""
        pool_registry.unregister_kv_cache_pool(self)
        super().shutdown()

    # ------------------------------------------------ upstream's resize and cap

    def resize(self, new_mem_size: int) -> bool:
        """Sets the bytes of one K (or V) buffer of one layer this pool may use.

        Grows at once. Shrinks gradually: pages past the new target hand out
        no more blocks and are released as their blocks are freed. Returns
        True when the target is fully applied (no held page past it).
        Raises InvalidArgumentError below 0 or above the virtual capacity.
        """
        with self._lock:
            self._check_open()
            bad = f"new_mem_size must be an integer number of bytes, got {new_mem_size!r}"
            if isinstance(new_mem_size, bool):
                raise InvalidArgumentError(bad)
            try:
                size = operator.index(new_mem_size)
            except TypeError:
                raise InvalidArgumentError(bad) from None
            if size < 0:
                raise InvalidArgumentError(f"new_mem_size must be >= 0, got {size}")
            if size > self.mem_size:
                raise InvalidArgumentError(
                    f"new_mem_size {size} exceeds the virtual capacity of {self.mem_size} bytes per buffer"
                )
            target = size // self.page_size
            self.page_allocator.resize(target * self.page_size)
            self._supply.changed()
            old = self._index.target_pages
            closed_empty = self._index.set_target(target)
            if not self.defer_physical_release:
                self._release.release(closed_empty)  # retired ones wait for their marker
            if target != old:
                logger.info("KVCacheManager %s: resized to %d pages (was %d)", self.pool_name, target, old)
            return not any(pid >= target for pid in self._index.held)

    def set_mem_limit(self, limit_bytes: int) -> None:
        """Caps the physical bytes (all layers and buffers) this pool may map; < 0: no cap.

        For tests and tools: with a record (``limits``) the record's limit
        (kvctl) is applied by the pool's InstanceLimits instead. Parked pages
        go at once when what is mapped exceeds the new cap.
        """
        with self._lock:
            # The extension checks it (a bool, a float, beyond 64 bits: InvalidArgumentError naming it).
            self.page_allocator.set_mem_limit(limit_bytes)
            self._supply.changed()
            if not self._closed and self._release.over_cap():
                self._release.reclaim()

    # ------------------------------------------ upstream's limit and snapshot API

    def set_memory_limit(self, limit_bytes: int, *, revision: int, wait_s: float = 0.5) -> Dict[str, Any]:
        """Upstream's revisioned limit of this pool: bytes over all layers and buffers.

        ``revision`` orders the writers (caller-chosen, >= 0): older than the
        last one applied answers "stale", the same one with another limit
        "conflict" (the same limit again is a no-op), nothing changed in both
        cases. The limit goes where this pool's limits live: its record (as
        ``kvctl limit`` writes it; the owner's watcher applies it, waited for up
        to ``wait_s``) or, without one, the page allocator's cap. Pages holding
        live blocks are released only as they are freed ("deferred" until then).
        Returns ``memory_limit_state()`` with that status. Bad input raises
        InvalidArgumentError (a ValueError), nothing changed.
        """
        limit = int_arg("limit_bytes", limit_bytes)
        rev = int_arg("revision", revision)
        with self._limit_lock:  # not the manager's lock: the limits watcher takes that one
            self._check_open()
            if rev < self._limit_rev:
                return self.memory_limit_state(_status="stale")
            if rev == self._limit_rev:
                return self.memory_limit_state(_status=None if limit == self._limit_bytes else "conflict")
            bundle = self.bytes_per_page
            effective = min(limit, self.geometry.num_pages * bundle) // bundle * bundle
            pending = False
            if self.limits is not None:
                pending = not write_limit(self.limits.tracker, effective, wait_s=wait_s).acked
            else:
                self.set_mem_limit(effective)
            self._limit_rev, self._limit_bytes = rev, limit
            return self.memory_limit_state(_status="deferred" if pending else None)

    def memory_limit_state(self, *, _status: Optional[str] = None) -> Dict[str, Any]:
        """Upstream's limit state: status ("applied", or "deferred" while more is
        mapped than the limit allows), the limit and revision last given to
        ``set_memory_limit`` (limit None and revision -1 before), the effective
        limit in force (whole pages; None: no cap), mapped, remaining and
        overage bytes, and this pool's name and group."""
        bundle = self.bytes_per_page
        capacity = self.geometry.num_pages * bundle
        with self._lock:
            mapped = 0 if self._closed else self.page_allocator.get_num_mapped_pages() * bundle
            target = self._index.target_pages * bundle
            cap = self.limits.limit if self.limits is not None else self.page_allocator.mem_limit()
        effective = None if cap < 0 else min(int(cap), capacity) // bundle * bundle
        status = _status or ("deferred" if effective is not None and mapped > effective else "applied")
        return {
            "status": status,
            "pool_name": str(self.pool_name or ""),
            "group_id": self.group_id,
            "limit_bytes": self._limit_bytes,
            "effective_limit_bytes": effective,
            "current_capacity_bytes": target if effective is None else min(target, effective),
            "revision": self._limit_rev,
            "mapped_bytes": mapped,
            "remaining_bytes": None if effective is None else max(0, effective - mapped),
            "overage_bytes": 0 if effective is None else max(0, mapped - effective),
            "reason": {
                "deferred": "inuse_capacity_above_limit",
                "conflict": "revision_reused_with_different_limit",
            }.get(status, ""),
        }

    def observability_snapshot(self, *, integration: Optional[str] = None) -> Any:
        """A read-only ``kvcached.observability.KVCachePoolSnapshot`` of this pool, taken
        under one hold of the lock (``integration``: the tag to report)."""
        from kvcached.observability import pool_snapshot

        return pool_snapshot(self, integration=integration, **self._observability_counts())

    def observability_snapshot_dict(self, *, integration: Optional[str] = None) -> Dict[str, Any]:
        """``observability_snapshot`` as a JSON-serializable dict."""
        return self.observability_snapshot(integration=integration).to_dict()

    def _observability_counts(self) -> Dict[str, Any]:
        with self._lock:
            pa, index = self.page_allocator, self._index
            total = self.geometry.num_pages
            reserve = 0 if self._closed else pa.get_num_reserved_pages()
            phys = None
            if self._local and not self._closed:
                phys = self._supply.device_free_pages()
            shrinking = any(pid >= index.target_pages for pid in index.held)
            return {
                "pages": {
                    "total_pages": total,
                    "free_pages": 0 if self._closed else pa.get_num_free_pages(),
                    "inuse_pages": len(index.held),
                    "reserved_pages": reserve,
                    "available_physical_pages": phys,
                },
                "available_blocks": 0
                if self._closed
                else len(self._ledger.reserved) + index.nfree + self._mappable_blocks(),
                "allocated_blocks": index.live_blocks(),
                "reserved_blocks": len(self._ledger.reserved),
                "mapped_bytes": len(index.held) * self.bytes_per_page,
                "in_shrink": shrinking,
                "shrink_target_blocks": self._blocks_below(index.target_pages) if shrinking else None,
                "resize_target_bytes": index.target_pages * self.page_size,
            }

    def _blocks_below(self, pages: int) -> int:
        return sum(self._index.caps[pid] for pid in range(pages))

    def _get_num_alloced_blocks(self) -> int:
        """Blocks handed out (allocated, reserved and the null block): upstream's count."""
        with self._lock:
            return self._index.live_blocks()

    @property
    def reserved_blocks(self) -> List[int]:
        """The ids set aside by ``try_to_reserve`` (a copy)."""
        with self._lock:
            return list(self._ledger.reserved)

    @property
    def in_shrink(self) -> bool:
        """True while held pages lie past the resize target (they drain as blocks are freed)."""
        with self._lock:
            return any(pid >= self._index.target_pages for pid in self._index.held)

    @property
    def target_num_blocks(self) -> Optional[int]:
        """Blocks within the resize target while shrinking, else None (upstream's name)."""
        with self._lock:
            target = self._index.target_pages
            return self._blocks_below(target) if any(pid >= target for pid in self._index.held) else None

    def get_mapped_memory_size(self, unit: str = "bytes") -> Union[int, float]:
        """Physical memory mapped for this pool (held pages and reserve), all layers and buffers."""
        scale = _UNITS.get(str(unit).lower())
        if scale is None:
            raise InvalidArgumentError(f"unit {unit!r} is not one of {sorted(_UNITS)}")
        with self._lock:
            if self._closed:
                return 0
            nbytes = self.page_allocator.get_num_mapped_pages() * self.bytes_per_page
        return nbytes if scale == 1 else nbytes / scale
