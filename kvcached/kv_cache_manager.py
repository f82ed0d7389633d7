"""KVCacheManager: the block ledger of one KV cache over elastic kvcached pages.

The engine asks for blocks (vLLM) or token slots (SGLang) by id; this class
hands out ids whose memory is mapped, and returns a page's physical memory
when its last block is freed. It sits on the C++ ``PageAllocator`` (page ids,
mapped reserve, limits) and never maps anything itself: pages are mapped by
this process's data plane, or by the ``mapper`` it is given. Its parts:
``block_ledger.py`` (the state of every id), ``block_index.py`` (free blocks
by held page: placement), ``page_release.py`` (emptied pages: retired, parked
or released), ``manager_setup.py`` (building the mapper, limits and barrier).

Why this module is long: it is one class under one lock whose public methods
are the contract the engines call, each short and documented (the contract is
stated below); every part that stands on its own has moved to the modules
above, and splitting the rest would spread one lock's state over files.

Contract (the model is vLLM's ``BlockPool``):

* ``alloc(n)`` returns exactly ``n`` distinct ids whose pages are mapped in
  every layer and K/V buffer, or ``None`` when memory is short, with nothing
  changed. Ids already reserved by ``try_to_reserve`` are used first. Then,
  so that one request's blocks share pages: if held pages have enough free
  blocks, the smallest page that fits the whole run, else the page with the
  most free blocks, repeatedly; if not, the fewest fresh pages that make up
  the shortfall are mapped and take as much of the run as they hold, the
  remainder going to held pages as above. Fresh pages are acquired before any
  id is taken, so a failure (pressure, or a map error injected anywhere)
  leaves the ledger exactly as it was. Only ``OutOfMemoryError`` becomes
  ``None``; any other data-plane error is raised after the same rollback,
  because a driver fault or a broken layout must not look like a full pool.
* ``free(ids)`` validates every id first (never allocated, freed twice, the
  null block, a reserved id: ``InvalidArgumentError``, nothing changed), then
  returns them. A page whose last block is freed goes back to the page
  allocator (into the mapped reserve while it is below its cap, else it is
  unmapped) once its grace ends. With ``defer_physical_release`` an empty
  page stays mapped (and reusable) until ``release_retired_pages_through(marker)``
  is called with a marker captured after the page emptied: the engine's proof
  that no queued batch can still read it.
* Parked pages (without deferred release): up to ``MAX_PARKED_PAGES`` emptied
  pages stay held for one to two ``empty_page_grace_s`` (default
  ``EMPTY_PAGE_GRACE_S``), so a lone request that frees its only block and
  allocates again reuses the page without a C++ call. A helper thread ends
  the grace when no call comes; ``release_parked()`` and ``trim()`` end it at
  once, and so does a limit lowered below what is mapped (the record's
  ``InstanceLimits.reclaim_unused``, or ``set_mem_limit``). Parked blocks are
  free blocks on held pages (``available_size``, ``stats()``).
* ``available_size()`` is what ``alloc`` would give right now: reserved ids,
  free blocks on held pages, and blocks on pages that can be mapped now
  (within the resize target, the memory limit and the device's free memory),
  counting the emptiest pages that could be handed out. It never promises a
  block that cannot be mapped, and it is a snapshot: another process may take
  the memory before the next ``alloc``, which then returns ``None``.
* ``resize(bytes)`` grows at once and shrinks gradually: no block past the
  new target is handed out again, held pages past it are released as they
  drain, a page with a live block is never released.

All public methods are thread-safe (one lock). The allocation fast path
(a held page has a free block) is pure Python: no call into C++.
``check_invariants()`` verifies the whole state (tests call it).
"""

from __future__ import annotations

import logging
import math
import operator
import threading
import time
import weakref
from typing import Any, Dict, Iterable, List, Optional, Union

from kvcached import _C, config, naming, pool_registry
from kvcached.block_geometry import GOOD_UTILIZATION, BlockGeometry, better_page_size
from kvcached.block_index import BlockIndex
from kvcached.block_ledger import FREE, NULL, OUT, RESERVED, BlockLedger
from kvcached.errors import InvalidArgumentError, OutOfMemoryError, ShutdownError, StateConsistencyError, int_arg
from kvcached.limits.writer import write_limit
from kvcached.manager_setup import (
    AUTO,
    Barrier,
    LimitsFactory,
    MapFn,
    Mapper,
    auto_record,
    build_collaborators,
    check_tensors,
    reserve_bounds,
    resolve_page_size,
)
from kvcached.page_release import PageRelease
from kvcached.utils import KVCachedConfigError, configure_logging

logger = logging.getLogger(__name__)

_UNITS = {"b": 1, "bytes": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}

# An emptied page stays held for one to two of these (seconds) before it goes
# back to the page allocator: well under a second, and long enough that a lone
# request freeing and allocating its only block never goes through C++.
EMPTY_PAGE_GRACE_S = 0.25
# At most this many emptied pages are parked at a time (the rest go at once).
MAX_PARKED_PAGES = 4


class KVCacheManager:
    """The block ledger of one KV cache (one KV group) over kvcached pages.

    Args:
        num_blocks: engine block ids are ``0 .. num_blocks - 1``.
        block_size: tokens per block.
        cell_size: bytes of one token in one K (or V) buffer of one layer.
        num_layers: layers whose buffers are mapped together.
        world_size: processes holding this cache's tensors (TP x PP ranks
            driven by this scheduler); without a mapper and above 1, pages are
            mapped through the fan-out of ``kvcached.tp_ipc_util``.
        pp_rank: pipeline stage whose workers that fan-out drives (-1: all).
        async_sched: the engine queues batch N+1 while batch N runs (with
            ``release_barrier=AUTO``: a device sync before pages are released).
        reserve_null_block: hold block 0 forever (SGLang's padding slot, vLLM's
            null block); it is mapped as soon as the KV tensors exist.
        num_kv_buffers: 2 for separate K and V, 1 for MLA / packed KV.
        group_id: the KV tensor group (hybrid models have several).
        pool_name: name of this pool (upstream's stable label) and, with
            ``own_segment=True``, of its record; default: the record's name, else
            ``kvcached.naming``'s ``KVCACHED_IPC_NAME`` or ``kvcached_<engine>_<pid>``
            (``_g<group>`` for group > 0).
        defer_physical_release: keep emptied pages mapped until
            ``release_retired_pages_through`` passes a marker captured after
            they emptied.
        own_segment: True: shorthand for ``limits=limits_factory(engine=engine,
            device=device, name=pool_name, group_id=group_id)`` (a record in the
            device budget). None (default) with ``limits`` not given: a record
            named for the instance, outside any device budget, as upstream's
            manager always has (``kvctl list`` shows it, ``kvctl limit`` caps it;
            a name held by a live process gets upstream's ``_<k>`` suffix);
            skipped when the device is unknown. False: no record.
        map_fn, unmap_fn: shorthand for ``mapper=FunctionMapper(map_fn, unmap_fn)``.
        page_size: bytes per kvcached page (default: the initialized data
            plane's, else ``KVCACHED_PAGE_SIZE``).
        engine: engine tag of the record made by ``own_segment``.
        device: the device the pages live on (default: the data plane's in
            this process; needed for a record when this process has none).
        mapper: maps/unmaps page offsets in every process holding the tensors,
            all or nothing (``.map(offsets)``/``.unmap(offsets)``, e.g. a
            ``TPCoordinator``); None: this process's data plane.
        limits: called once with this manager's PageAllocator before anything
            is mapped; returns the attached ``InstanceLimits`` that admits every
            fresh page (``manager_setup.limits_factory``); None: no record;
            not given: see ``own_segment``.
        release_barrier: called before empty pages are handed back, e.g.
            ``manager_setup.device_sync_barrier(device)``; None: none; AUTO:
            a device sync when async_sched, local CUDA, no deferred release.
            It runs under the manager's lock (also on the grace thread), so
            it must not call the manager.
        empty_page_grace_s: the grace of parked pages; 0 disables parking.

    The shorthands (world_size fan-out, map_fn/unmap_fn, own_segment + engine,
    async_sched) are resolved by ``manager_setup.build_collaborators``.
    Every manager is listed in ``kvcached.pool_registry`` until ``shutdown()``.
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
        configure_logging()
        self.num_layers = int_arg("num_layers", num_layers, minimum=1)
        self.num_kv_buffers = int_arg("num_kv_buffers", num_kv_buffers, minimum=1)
        self.world_size = int_arg("world_size", world_size, minimum=1)
        self.pp_rank = operator.index(pp_rank)
        self.group_id = operator.index(group_id)
        self.async_sched = bool(async_sched)
        self.reserve_null_block = bool(reserve_null_block)
        self.defer_physical_release = bool(defer_physical_release)
        if device is None and _C.is_initialized():
            device = _C.config()["device"]
        self._device = device
        wants_auto_record = limits is AUTO and own_segment is None
        mapper, limits, release_barrier = build_collaborators(
            world_size=self.world_size, pp_rank=self.pp_rank, group_id=self.group_id, async_sched=self.async_sched,
            defer_physical_release=self.defer_physical_release, own_segment=bool(own_segment), map_fn=map_fn,
            unmap_fn=unmap_fn, engine=engine, device=device, pool_name=pool_name, mapper=mapper,
            limits=None if limits is AUTO else limits, release_barrier=release_barrier,
        )  # fmt: skip
        if wants_auto_record and device is not None:
            limits = auto_record(engine=engine, device=device, group_id=self.group_id)
        self.mapper = mapper
        self._local = mapper is None
        if self._local and not _C.is_initialized():
            raise ShutdownError(
                "kvcached is not initialized in this process: call init_kvcached(device) "
                "(kvcached.vmm_ops or the engine interface) before creating a KVCacheManager"
            )
        page_size = resolve_page_size(page_size, self._local)
        grace = float(empty_page_grace_s)
        if not 0 <= grace < math.inf:
            raise InvalidArgumentError(f"empty_page_grace_s must be a finite number >= 0, got {empty_page_grace_s!r}")

        try:
            self.geometry = geo = BlockGeometry(num_blocks, block_size, cell_size, page_size)
        except InvalidArgumentError as e:
            raise KVCachedConfigError(str(e)) from None  # upstream's type for a block that cannot sit on pages
        if geo.utilization < GOOD_UTILIZATION:
            size, used = better_page_size(geo.block_mem_size, page_size)
            logger.warning(
                "kvcached: blocks of %d B fill %.0f%% of each %d KiB page (a block straddling a page boundary is "
                "never used); KVCACHED_PAGE_SIZE=%d would fill %.0f%%",
                geo.block_mem_size,
                100 * geo.utilization,
                page_size >> 10,
                size,
                100 * used,
            )
        self.num_blocks = geo.num_blocks
        self.block_size = geo.block_size
        self.cell_size = geo.cell_size
        self.block_mem_size = geo.block_mem_size
        self.page_size = geo.page_size
        # Bytes of one K (or V) buffer of one layer that this manager may map.
        self.mem_size = geo.num_pages * page_size

        min_res, max_res = reserve_bounds()
        # Pre-mapping starts only after the null block took page 0 (the free set
        # hands out the lowest id first; a pre-mapped reserve would not).
        self._want_prealloc = self._local and config.page_prealloc_enabled() and min_res > 0
        self.page_allocator = _C.PageAllocator(
            self.num_layers, self.mem_size, page_size, self.num_kv_buffers, self.group_id, min_res, max_res, False,
            None if mapper is None else mapper.map, None if mapper is None else mapper.unmap,
        )  # fmt: skip
        self.bytes_per_page = self.page_allocator.bytes_per_page

        self._lock = threading.Lock()
        self._ledger = BlockLedger(geo.num_blocks)
        self._index = BlockIndex(geo)
        self._release = PageRelease(
            self._index, self.page_allocator, self._lock, defer=self.defer_physical_release, grace_s=grace,
            max_parked=MAX_PARKED_PAGES, barrier=release_barrier, name=f"g{self.group_id}",
        )  # fmt: skip
        # The fast paths' handles on the ledger and the index (bound once: a
        # pair of alloc(1)+free(1) is ~10 attribute loads, each one counts).
        self._states = self._ledger.states
        self._take_one = self._index.take_one
        self._put_one = self._index.put_one
        self.null_block: Optional[List[int]] = None
        self._null_pending = self.reserve_null_block
        self._started = False
        self._closed = False

        # available_size reuses the data plane's free-page count until this
        # manager changes pages (a map: _cap_stamp reset; a release:
        # PageRelease.version) or the TTL passes.
        self._cap_ttl = config.capacity_ttl_s()
        self._cap_stamp = -math.inf
        self._cap_version = 0
        self._cap_pages = 0

        # The name given, else its record's (kvcached.naming), also when it has none.
        self.pool_name = pool_name or naming.group_name(naming.instance_name(engine), self.group_id)
        # The pool's record and limit enforcement (before anything is mapped).
        self.limits = None
        if limits is not None:
            self.limits = self._release.limits = limits(self.page_allocator)
            self.pool_name = pool_name or self.limits.name
            # A lowered limit (or a peer short of budget) takes parked pages at once.
            ref = weakref.WeakMethod(self._reclaim_for_limits)
            self.limits.reclaim_unused = lambda: (ref() or int)()
        # Upstream's revisioned limit (set_memory_limit): last revision and bytes given.
        self._limit_lock = threading.Lock()
        self._limit_rev = -1
        self._limit_bytes: Optional[int] = None
        tag = engine if engine != "kvcached" else getattr(self.limits, "engine", None)
        self.integration = tag if tag in ("vllm", "sglang") else None
        if not self._local or _C.kv_tensors_created(self.group_id):
            try:
                with self._lock:
                    self._start()
            except BaseException:
                self.shutdown()  # the record and the threads go with the failed construction
                raise
        pool_registry.register_kv_cache_pool(self, integration=self.integration)
        if config.sanity_check():
            self._check_after_every_change()
        logger.debug(
            "KVCacheManager %s: %r, %d layers x %d buffers", self.pool_name, geo, self.num_layers, self.num_kv_buffers
        )

    def _start(self) -> None:
        """Checks the tensors, takes the null block, starts pre-mapping (once)."""
        if self._started:
            return
        if self._local:
            what = f"{self.num_blocks} blocks of {self.block_mem_size} bytes"
            check_tensors(self.group_id, self.num_layers, self.num_kv_buffers, self.mem_size, what)
        if self._null_pending:
            pa = self.page_allocator
            try:
                if self.limits is not None:
                    self.limits.admit_pages(1)
                pids = pa.alloc_pages(1)
            except OutOfMemoryError:
                return  # retried before the next page is acquired
            if pids[0] != 0:
                pa.free_pages(pids)
                raise InvalidArgumentError(
                    f"the null block needs page 0 first, but the page allocator gave page {pids[0]}"
                )
            page = self._index.adopt(0)
            page.pop()  # block 0: pop() yields the lowest id
            self._ledger.states[0] = NULL
            self._index.shelve(page)
            self.null_block = [0]
            self._null_pending = False
        if self._want_prealloc:
            self.page_allocator.start_prealloc_thread()
        self._started = True

    # ------------------------------------------------------------- alloc / free

    def alloc(self, need_size: int) -> Optional[List[int]]:
        """Returns ``need_size`` block ids, or None (nothing changed) when short.

        Raises InvalidArgumentError for a size below 1, ShutdownError after
        shutdown(), and other data-plane errors (after a full rollback).
        """
        with self._lock:
            if need_size.__class__ is int and need_size == 1 and not self._ledger.reserved:
                # Fast path: one block from the fullest page that has a free one.
                b = self._take_one()
                if b >= 0:
                    self._states[b] = OUT
                    return [b]
            return self._alloc(need_size)

    def _alloc(self, need_size: int) -> Optional[List[int]]:
        n = int_arg("need_size", need_size, minimum=1)
        self._check_open()
        if not self._started:
            self._start()  # may take the null block: before counting free blocks
        index, ledger = self._index, self._ledger
        from_reserved = min(n, len(ledger.reserved))
        rest = n - from_reserved
        fresh: List[int] = []
        if rest > index.nfree:
            try:
                fresh = self._acquire(rest - index.nfree)
            except OutOfMemoryError:
                return None
        # Nothing below can fail: the ledger changes only now.
        out = ledger.take_reserved(from_reserved)
        if rest:
            # Fresh pages are mapped anyway: put as much of the run as they hold
            # there (one request, few pages) and only the remainder on held pages.
            # The page count mapped is the same as filling held pages first.
            taken: List[int] = []
            on_fresh = min(rest, sum(index.caps[pid] for pid in fresh))
            if index.take(rest - on_fresh, taken):
                raise StateConsistencyError("KVCacheManager: held pages had fewer free blocks than counted")
            for pid in fresh:
                page = index.adopt(pid)
                t = min(on_fresh, page.cap)
                index.take_from(page, t, taken)
                on_fresh -= t
                index.shelve(page)
            ledger.mark(taken, OUT)
            out.extend(taken)
        return out

    def _acquire(self, need_blocks: int) -> List[int]:
        """Maps enough fresh pages for ``need_blocks`` blocks, all or none."""
        self._start()
        if self._null_pending:
            raise OutOfMemoryError("no page can be mapped for the null block")
        pids: List[int] = []
        got = 0
        per_page = self.geometry.max_blocks_per_page
        caps = self._index.caps
        self._cap_stamp = -math.inf
        limits, pa = self.limits, self.page_allocator
        try:
            while got < need_blocks:
                k = -(-(need_blocks - got) // per_page)
                if limits is not None:
                    limits.admit_pages(k)  # device budget; OutOfMemoryError when short
                new = pa.alloc_pages(k)
                pids.extend(new)
                for pid in new:
                    got += caps[pid]
        except BaseException:
            if pids:
                pa.free_pages(pids)  # still empty: back to the reserve (or unmapped) as after a free
            raise
        return pids

    def free(self, indices: Iterable[int]) -> None:
        """Returns block ids to the pool (``indices``: upstream's name).

        Every id must be currently allocated (by alloc) and appear once;
        otherwise InvalidArgumentError is raised and nothing changes.
        """
        with self._lock:
            if indices.__class__ is list and len(indices) == 1:
                b = indices[0]
                states = self._states
                if b.__class__ is int and 0 <= b < self.num_blocks and states[b] == OUT:
                    states[b] = FREE
                    page = self._put_one(b)
                    if page is not None:
                        self._release.emptied_one(page)  # retired, parked or released
                    return
            self._check_open()
            self._return(self._ledger.validate_free(indices))

    def _return(self, ids: List[int]) -> None:
        """Puts ledger-freed ids back on their pages and settles emptied pages."""
        emptied = self._index.put(ids)
        if emptied:
            self._release.emptied(emptied)

    # ----------------------------------------------------------- reservation

    def try_to_reserve(self, need_size: int) -> bool:
        """Ensures at least ``need_size`` blocks are set aside for the next alloc calls.

        Returns False, with nothing changed, when they cannot be had now.
        Reserved blocks count in available_size() and are handed out first.
        """
        with self._lock:
            n = int_arg("need_size", need_size, minimum=1)
            self._check_open()
            ledger = self._ledger
            kept = ledger.reserved
            more = n - len(kept)
            if more <= 0:
                return True
            ledger.reserved = []  # so that _alloc takes fresh blocks only
            try:
                got = self._alloc(more)
            finally:
                ledger.reserved = kept
            if got is None:
                return False
            ledger.mark(got, RESERVED)
            kept.extend(got)
            return True

    def free_reserved(self) -> None:
        """Returns every block set aside by try_to_reserve."""
        with self._lock:
            self._check_open()
            ids = self._ledger.release_reserved()
            if ids:
                self._return(ids)

    # -------------------------------------------------------------- capacity

    def available_size(self) -> int:
        """Blocks that alloc would hand out right now (a snapshot, see the module doc)."""
        with self._lock:
            if self._closed:
                return 0
            index = self._index
            n = len(self._ledger.reserved) + index.nfree + index.mappable_blocks(self._mappable_pages())
            return n - 1 if self._null_pending and n else n

    def logical_free_size(self) -> int:
        """Blocks not handed out within the resize target, ignoring memory limits.

        This is the engine's logical view (what a leak check compares to
        the pool size at idle); available_size() is what can be had now.
        """
        with self._lock:
            if self._closed:
                return 0
            n = len(self._ledger.reserved) + self._index.nfree + self._index.unheld_blocks()
            return n - 1 if self._null_pending and n else n

    def _mappable_pages(self) -> int:
        """Pages alloc could get from the data plane now: reserve, target, limit, device."""
        now = time.monotonic()
        if now - self._cap_stamp <= self._cap_ttl and self._cap_version == self._release.version:
            return self._cap_pages
        self._cap_version = self._release.version
        pa = self.page_allocator
        pages = self.limits.num_free_pages() if self.limits is not None else pa.get_num_free_pages()
        if self._local and pages:
            reserved = pa.get_num_reserved_pages()
            fresh = pages - reserved
            if fresh > 0:
                device_free = _C.backend_info(self._device)["free_bytes"] // self.bytes_per_page
                pages = reserved + min(fresh, device_free)
        self._cap_stamp, self._cap_pages = now, pages
        return pages

    def set_mem_limit(self, limit_bytes: int) -> None:
        """Caps the physical bytes (all layers and buffers) this pool may map; < 0: no cap.

        For tests and tools: with a record (``limits``) the record's limit
        (kvctl) is applied by the pool's InstanceLimits instead. Parked pages
        go at once when what is mapped exceeds the new cap.
        """
        with self._lock:
            # The extension checks it (a bool, a float, beyond 64 bits: InvalidArgumentError naming it).
            self.page_allocator.set_mem_limit(limit_bytes)
            self._cap_stamp = -math.inf
            if not self._closed and self._release.over_cap():
                self._release.reclaim()

    # ------------------------------------------------------- resize / trim

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
            self._cap_stamp = -math.inf
            old = self._index.target_pages
            closed_empty = self._index.set_target(target)
            if not self.defer_physical_release:
                self._release.release(closed_empty)  # retired ones wait for their marker
            if target != old:
                logger.info("KVCacheManager %s: resized to %d pages (was %d)", self.pool_name, target, old)
            return not any(pid >= target for pid in self._index.held)

    def trim(self) -> int:
        """Releases parked pages, then unmaps every page of the mapped reserve; returns how many it unmapped.

        Pages holding live blocks, and emptied pages waiting for a release
        marker, stay mapped. A running pre-map thread refills the reserve to
        its minimum.
        """
        with self._lock:
            self._check_open()
            self._release.release_parked()
            self._cap_stamp = -math.inf
            return self.page_allocator.trim()

    def release_parked(self) -> int:
        """Releases every parked page now (idle give-back, limit enforcement); returns how many.

        They go to the page allocator like any emptied page (into the mapped
        reserve while below its cap, else unmapped); ``trim()`` does this and
        then unmaps the reserve.
        """
        with self._lock:
            return 0 if self._closed else self._release.release_parked()

    def _reclaim_for_limits(self) -> int:
        """InstanceLimits.reclaim_unused (its watcher thread, no limits lock held)."""
        with self._lock:
            return 0 if self._closed else self._release.reclaim()

    def clear(self) -> None:
        """Frees every allocated and reserved block (not the null block)."""
        with self._lock:
            self._check_open()
            ids = self._ledger.free_all_on(self._index)
            if ids:
                self._return(ids)

    # ------------------------------------------------------ deferred release

    def capture_physical_release_marker(self) -> int:
        """Returns a marker covering every page emptied so far.

        Pages emptied after this call get a later epoch. Once every batch
        submitted before the call has finished on every worker, pass the
        marker to release_retired_pages_through.
        """
        with self._lock:
            return self._release.capture_marker()

    def release_retired_pages_through(self, marker: int) -> int:
        """Releases emptied pages retired at or before ``marker``; returns how many.

        A retired page that was reused since is kept; if it empties again it
        waits for a later marker.
        """
        with self._lock:
            self._check_open()
            return self._release.release_through(operator.index(marker))

    # ------------------------------------------------------------- reporting

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

    def get_page_occupancy(self, page_ids: Optional[Iterable[int]] = None) -> Dict[int, int]:
        """Live blocks (allocated, reserved or null) per page; all held pages when page_ids is None."""
        with self._lock:
            held = self._index.held
            if page_ids is None:
                return {pid: p.cap - len(p) for pid, p in held.items()}
            out = {}
            for pid in page_ids:
                pid = operator.index(pid)
                if not 0 <= pid < self.geometry.num_pages:
                    raise InvalidArgumentError(f"page id {pid} is out of range [0, {self.geometry.num_pages})")
                p = held.get(pid)
                out[pid] = p.cap - len(p) if p is not None else 0
            return out

    def get_page_id(self, block_id: int) -> int:
        """The page holding ``block_id``."""
        b = operator.index(block_id)
        if not self.geometry.is_usable(b):
            raise InvalidArgumentError(f"block id {b} is not a usable block of this pool")
        return self.geometry.page_of(b)

    def stats(self) -> Dict[str, int]:
        """Counters for tests, kvtop and debugging (one consistent snapshot).

        ``held_pages`` includes ``parked_pages`` (held, empty, in their grace),
        whose blocks ``open_free_blocks`` counts as free.
        """
        with self._lock:
            pa, index = self.page_allocator, self._index
            return {
                "held_pages": len(index.held),
                "parked_pages": len(self._release.parked_pids()),
                "open_free_blocks": index.nfree,
                "live_blocks": index.live_blocks(),
                "reserved_blocks": len(self._ledger.reserved),
                "retired_pages": len(self._release.retired),
                "target_pages": index.target_pages,
                "mapped_pages": pa.get_num_mapped_pages(),
                "reserve_pages": pa.get_num_reserved_pages(),
                "inuse_pages": pa.get_num_inuse_pages(),
            }

    def snapshot(self) -> Dict[str, Any]:
        """A deep copy of the ledger for tests and debugging. Equal snapshots mean the
        same ids out ("allocated", "reserved" in hand-out order, "null"), the same free
        blocks on the same held pages ("free_by_page"), and the same retired and
        parked pages, target and pages in use."""
        with self._lock:
            return {
                **self._ledger.snapshot(),
                "free_by_page": {pid: sorted(p) for pid, p in self._index.held.items()},
                "retired": dict(self._release.retired),
                "parked": self._release.parked_pids(),
                "open_free_blocks": self._index.nfree,
                "target_pages": self._index.target_pages,
                "inuse_pages": self.page_allocator.get_num_inuse_pages(),
            }

    def check_invariants(self) -> None:
        """Verifies the whole state; raises StateConsistencyError naming the broken invariant.

        I1-I5 of the block index (``BlockIndex.check``), L1-L4 of the ledger
        against it (``BlockLedger.check``), then: P1 the page allocator holds
        exactly the held pages in use and maps held + reserve pages; P2 every
        parked page is held; P3 (this process maps) the data plane maps as many
        pages as the allocator, every held page among them. A no-op after shutdown.
        """

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise StateConsistencyError(f"KVCacheManager {self.pool_name} invariant broken: {what}")

        with self._lock:
            if self._closed:
                return
            index, pa = self._index, self.page_allocator
            index.check()
            self._ledger.check(index, self._release.may_keep_empty)
            inuse, mapped, reserve = pa.get_num_inuse_pages(), pa.get_num_mapped_pages(), pa.get_num_reserved_pages()
            need(inuse == len(index.held), f"P1 pages: the allocator has {inuse} in use, {len(index.held)} held")
            need(
                mapped == len(index.held) + reserve, f"P1 pages: {mapped} mapped != {len(index.held)} held + {reserve}"
            )
            need(all(pid in index.held for pid in self._release.parked), "P2 parked: a parked page is not held")
            if self._local:
                plane = _C.group_info(self.group_id)["mapped_pages"]
                need(plane == mapped, f"P3 mapped: the data plane maps {plane} pages, the allocator {mapped}")
                offsets = set(_C.mapped_offsets(self.group_id))
                need({pid * self.page_size for pid in index.held} <= offsets, "P3 mapped: a held page is not mapped")

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
                phys = int(_C.backend_info(self._device)["free_bytes"]) // self.bytes_per_page
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
                else len(self._ledger.reserved) + index.nfree + index.mappable_blocks(self._mappable_pages()),
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

    def _check_after_every_change(self) -> None:
        """KVCACHED_SANITY_CHECK: wraps the state-changing calls of this instance with
        ``check_invariants()`` (the class stays untouched: no cost when it is off)."""

        def checked(fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                self.check_invariants()
                return out

            return call

        for name in ("alloc", "free", "try_to_reserve", "free_reserved", "resize", "trim", "clear"):
            setattr(self, name, checked(getattr(self, name)))

    # -------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stops pre-mapping and the grace thread, returns every page and the
        reserve, closes the limits (removes the record).

        Blocks still allocated are dropped (their tensors read the zero page).
        Later calls raise ShutdownError, except shutdown() itself.
        """
        pool_registry.unregister_kv_cache_pool(self)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pa = self.page_allocator
            try:
                pa.stop_prealloc_thread()
                self._release.close()
                self._ledger.reset()  # stale ids then fail validation and reach the ShutdownError check
                pids = self._index.clear()
                if pids:
                    pa.free_pages(pids)
                pa.trim()
            finally:
                limits = self.limits
        # Outside the lock: the limits watcher and the grace thread may be
        # waiting for it (they then see _closed and end).
        try:
            if limits is not None:
                limits.close()
        finally:
            self._release.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise ShutdownError(f"KVCacheManager {self.pool_name} was shut down")

    def __repr__(self) -> str:
        return (
            f"KVCacheManager({self.pool_name}: {self.num_blocks} blocks x {self.block_mem_size} B, "
            f"{self.num_layers} layers x {self.num_kv_buffers} buffers, page {self.page_size} B)"
        )
