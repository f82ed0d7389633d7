"""BlockManager: the block ledger of one KV cache over elastic kvcached pages.

Why this module is long: alloc(1)/free(1) inline BlockIndex.take_one/put_one (issue 30: 1.2x of BlockPool).

The engine asks for blocks (vLLM) or token slots (SGLang) by id; this class
hands out ids whose memory is mapped, and returns a page's physical memory
when its last block is freed. It maps nothing itself: this process's data
plane does, or the ``mapper`` it is handed. Its parts: ``block_ledger.py``
(the state of every id), ``block_index.py`` (free blocks by held page:
placement), ``page_supply.py`` (fresh pages: the C++ ``PageAllocator``, the
limits that admit them, what can be mapped now), ``page_release.py`` (emptied
pages: retired, parked or released), ``block_report.py`` (counters and
invariants). What it is handed is ``manager_setup.py``'s. Upstream's
``KVCacheManager`` is this class in upstream's constructor, with its limit and
snapshot calls (``kvcached.compat.upstream_manager``).

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
  returns them. A page whose last block is freed is retired (with
  ``defer_physical_release``: mapped and reusable until
  ``release_retired_pages_through(marker)`` passes a marker captured after it
  emptied, the engine's proof that no queued batch can still read it), parked
  (up to ``MAX_PARKED_PAGES`` for one to two ``empty_page_grace_s``, so a lone
  request freeing and allocating again needs no C++ call; ``release_parked()``,
  ``trim()`` and a limit lowered below what is mapped end the grace at once)
  or released to the page allocator: ``page_release.py``. Parked blocks are
  free blocks on held pages (``available_size``, ``stats()``).
* ``available_size()`` is what ``alloc`` would give right now: reserved ids,
  free blocks on held pages, and blocks on pages that can be mapped now
  (within the resize target, the memory limit and the device's free memory),
  counting the emptiest pages that could be handed out. It never promises a
  block that cannot be mapped, and it is a snapshot: another process may take
  the memory before the next ``alloc``, which then returns ``None``.
* The null block (``reserve_null_block``) is never handed out nor freed. Its
  page 0 stays mapped while anything else is held; ``release_null_page()``
  (an idle instance, no step in flight) unmaps it when nothing else is left,
  and the next ``alloc`` maps it again before any other page, or, refused,
  leaves it unmapped (``_alloc_after_null_release``).

All public methods are thread-safe (one lock, a ``kvcached.locks.TokenLock``:
alloc and free enter it by a list pop, the rest by ``with``). The allocation
fast path (a held page has a free block) is pure Python: no call into C++,
no Python function call (only list, dict and int methods). ``available_size`` takes no
lock while its kept count holds (see its doc).
``check_invariants()`` verifies the whole state (tests call it).
"""

from __future__ import annotations

import logging
import math
import operator
import weakref
from typing import Any, Dict, Iterable, List, Optional

from kvcached import _C, block_report, config, naming
from kvcached.block_index import BlockIndex
from kvcached.block_ledger import FREE, OUT, RESERVED, BlockLedger
from kvcached.errors import InvalidArgumentError, OutOfMemoryError, ShutdownError, int_arg
from kvcached.locks import TokenLock
from kvcached.manager_setup import (
    Barrier,
    LimitsFactory,
    Mapper,
    block_geometry,
    check_tensors,
    default_device,
    resolve_page_size,
)
from kvcached.page_release import PageRelease
from kvcached.page_supply import PageSupply
from kvcached.utils import configure_logging

logger = logging.getLogger(__name__)

# An emptied page stays held for one to two of these (seconds) before it goes
# back to the page allocator: well under a second, and long enough that a lone
# request freeing and allocating its only block never goes through C++.
EMPTY_PAGE_GRACE_S = 0.25
# At most this many emptied pages are parked at a time (the rest go at once).
MAX_PARKED_PAGES = 4


class BlockManager:
    """The block ledger of one KV cache (one KV group) over kvcached pages.

    Args:
        num_blocks: engine block ids are ``0 .. num_blocks - 1``.
        block_size: tokens per block.
        cell_size: bytes of one token in one K (or V) buffer of one layer.
        num_layers: layers whose buffers are mapped together.
        num_kv_buffers: 2 for separate K and V, 1 for MLA / packed KV.
        group_id: the KV tensor group (hybrid models have several).
        reserve_null_block: hold block 0 (SGLang's padding slot, vLLM's null
            block), never handed out nor freed; its page is mapped as soon as the
            KV tensors exist, and unmapped only by ``release_null_page`` (idle).
        defer_physical_release: keep emptied pages mapped until
            ``release_retired_pages_through`` passes a marker captured after
            they emptied.
        pool_name: name of this pool; default: its record's name, else
            ``kvcached.naming``'s name of the instance (``_g<group>`` for group > 0).
        page_size: bytes per page (default: the data plane's, else ``KVCACHED_PAGE_SIZE``).
        engine: the pool's engine tag (its default name).
        device: the pages' device (default: this process's data plane's).
        mapper: maps/unmaps page offsets in every process holding the tensors,
            all or nothing (``manager_setup.Mapper``, e.g. a ``TPCoordinator``);
            None: this process's data plane.
        limits: called once with this manager's PageAllocator before anything
            is mapped; returns the attached ``InstanceLimits`` that admits every
            fresh page (``manager_setup.limits_factory``); None: no record.
        release_barrier: called before empty pages are handed back, e.g.
            ``manager_setup.device_sync_barrier(device)``; None: none. It runs
            under the manager's lock (also on the grace thread), so it must not
            call the manager.
        empty_page_grace_s: the grace of parked pages; 0 disables parking.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cell_size: int,
        num_layers: int,
        *,
        num_kv_buffers: int = 2,
        group_id: int = 0,
        reserve_null_block: bool = False,
        defer_physical_release: bool = False,
        pool_name: Optional[str] = None,
        page_size: Optional[int] = None,
        engine: str = "kvcached",
        device: Optional[str] = None,
        mapper: Optional[Mapper] = None,
        limits: Optional[LimitsFactory] = None,
        release_barrier: Optional[Barrier] = None,
        empty_page_grace_s: float = EMPTY_PAGE_GRACE_S,
    ) -> None:
        configure_logging()
        self.num_layers = int_arg("num_layers", num_layers, minimum=1)
        self.num_kv_buffers = int_arg("num_kv_buffers", num_kv_buffers, minimum=1)
        self.group_id = operator.index(group_id)
        self.reserve_null_block = bool(reserve_null_block)
        self.defer_physical_release = bool(defer_physical_release)
        device = default_device(device)
        self.mapper = mapper
        self._local = mapper is None
        page_size = resolve_page_size(page_size, self._local)  # ShutdownError without a data plane here
        grace = float(empty_page_grace_s)
        if not 0 <= grace < math.inf:
            raise InvalidArgumentError(f"empty_page_grace_s must be a finite number >= 0, got {empty_page_grace_s!r}")

        self.geometry = geo = block_geometry(num_blocks, block_size, cell_size, page_size)
        self.num_blocks = geo.num_blocks
        self.block_size = geo.block_size
        self.cell_size = geo.cell_size
        self.block_mem_size = geo.block_mem_size
        self.page_size = geo.page_size
        # Bytes of one K (or V) buffer of one layer that this manager may map.
        self.mem_size = geo.num_pages * page_size

        self._supply = PageSupply(
            geo, self.mem_size, self.num_layers, self.num_kv_buffers, self.group_id, mapper, device
        )
        self.page_allocator = self._supply.allocator
        self.bytes_per_page = self._supply.bytes_per_page

        # alloc and free enter it by try_enter/leave (a list pop and append),
        # every other caller by ``with`` (``kvcached.locks.TokenLock``).
        self._lock = TokenLock()
        self._enter = self._lock.try_enter
        self._leave = self._lock.leave
        self._ledger = BlockLedger(geo.num_blocks)
        self._index = BlockIndex(geo)
        self._release = PageRelease(
            self._index, self.page_allocator, self._lock, defer=self.defer_physical_release, grace_s=grace,
            max_parked=MAX_PARKED_PAGES, barrier=release_barrier, name=f"g{self.group_id}",
        )  # fmt: skip
        self._release.on_release = self._supply.changed  # a released page changes what can be mapped
        # The fast paths' handles on the ledger and the index (bound once: a
        # pair of alloc(1)+free(1) is ~10 attribute loads, each one counts).
        # These objects are changed in place only, never replaced.
        self._states = self._ledger.states
        self._held = self._index.held
        self._buckets = self._index.buckets
        # The page of every block id (free's fast path: one subscript, no arithmetic);
        # one int object per page, shared: 8 bytes a block.
        B, P = geo.block_mem_size, geo.page_size
        pids = list(range((geo.num_blocks - 1) * B // P + 1))
        self._page_of: List[int] = [pids[b * B // P] for b in range(geo.num_blocks)]
        self.null_block: Optional[List[int]] = None
        self._started = False
        self._closed = False

        # The name given, else its record's (kvcached.naming), also when it has none.
        self.pool_name = pool_name or naming.group_name(naming.instance_name(engine), self.group_id)
        # The pool's record and limit enforcement (before anything is mapped).
        self.limits = None
        if limits is not None:
            self.limits = self._release.limits = self._supply.attach_limits(limits)
            self.pool_name = pool_name or self.limits.name
            # A lowered limit (or a peer short of budget) takes parked pages at once.
            ref = weakref.WeakMethod(self._reclaim_for_limits)
            self.limits.reclaim_unused = lambda: (ref() or int)()
        if not self._local or _C.kv_tensors_created(self.group_id):
            try:
                with self._lock:
                    self._start()
            except BaseException:
                self.shutdown()  # the record and the threads go with the failed construction
                raise
        if config.sanity_check():
            block_report.check_after_every_change(self)
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
        if self._null_pending and not self._take_null():
            return  # retried before the next page is acquired
        if self._supply.want_prealloc:
            self.page_allocator.start_prealloc_thread()
        self._started = True

    # ------------------------------------------------------ the null block's page
    # Page 0 holds the null block (vLLM's block 0, SGLang's padding slot): mapped from the start,
    # and kept while the instance works. An idle instance gives it back too (release_null_page);
    # the next allocation maps it again before anything else (_alloc_after_null_release).

    @property
    def _null_pending(self) -> bool:
        """A null block is reserved but page 0 is not held (not taken yet, or released while idle)."""
        return self.reserve_null_block and self.null_block is None

    def _take_null(self) -> bool:
        """Maps page 0 and holds block 0 on it: True, or False when memory is short."""
        if self._started:
            # Again after release_null_page: the allocator hands out its mapped reserve first
            # and its lowest free id only then, so the reserve goes (the pre-map thread is stopped).
            self.page_allocator.trim()
        if not self._supply.take_page_zero(strict=not self._started):
            return False
        self._ledger.hold_null(self._index)
        self.null_block = [0]
        self._supply.changed()  # page 0 is held now
        if self._started and self._supply.want_prealloc:
            self.page_allocator.start_prealloc_thread()
        return True

    def _put_null_back(self) -> None:
        """Block 0 free again and page 0 released at once (the caller checked it holds nothing else)."""
        if self._supply.want_prealloc:
            self.page_allocator.stop_prealloc_thread()  # it would map page 0 again, into the reserve
        self.null_block = None
        self._release.release(self._ledger.drop_null(self._index))
        self._supply.changed()

    def release_null_page(self) -> bool:
        """Unmaps page 0, the null block's, when it is the last page this pool holds and holds
        nothing but the null block (parked pages are released first): an idle instance's
        last page, one page of every layer's K and V (128 MiB for an 8B model), which a peer
        sharing the device budget may need. The next ``alloc`` maps it again before any other.

        The caller's proof that no step in flight reads or writes the null block: the engine
        is idle and its release fence drained (``ElasticInstance.give_back``). Returns whether
        the page was released; ``KVCACHED_KEEP_NULL_PAGE=true`` keeps it (False).
        """
        with self._lock:
            if self._closed or self.null_block is None or config.keep_null_page():
                return False  # none held (none reserved, or released already)
            self._release.release_parked()
            page = self._held.get(0)
            if page is None or len(self._held) != 1 or len(page) != page.cap - 1 or self._ledger.reserved:
                return False  # a live block, a reserved id or a retired page is left
            self._put_null_back()
            return True

    def _alloc_after_null_release(self, n: int) -> Optional[List[int]]:
        """``_alloc`` after release_null_page: page 0 and the null block first, given back
        again when the blocks cannot be had (a refused alloc changes nothing)."""
        try:
            if not self._take_null():
                return None
        except OutOfMemoryError:
            return None
        try:
            out = self._alloc_blocks(n)
        except BaseException:
            self._put_null_back()
            raise
        if out is None:
            self._put_null_back()
        return out

    # ------------------------------------------------------------- alloc / free

    def alloc(self, need_size: int) -> Optional[List[int]]:
        """Returns ``need_size`` block ids, or None (nothing changed) when short.

        Raises InvalidArgumentError for a size below 1, ShutdownError after
        shutdown(), and other data-plane errors (after a full rollback).
        """
        try:
            self._enter()
        except IndexError:  # another thread holds the lock: wait for it
            with self._lock:
                return self._alloc(need_size)
        try:
            if need_size.__class__ is int and need_size == 1 and not self._ledger.reserved:
                # Fast path: one block from the fullest open page that has a free one
                # (BlockIndex.take_one inlined: the call would cost a third of the pair).
                index = self._index
                m = index.mask
                if m:
                    k = (m & -m).bit_length() - 1
                    buckets = self._buckets
                    bucket = buckets[k]
                    pid, page = bucket.popitem()
                    if not bucket:
                        m ^= 1 << k
                    b = page.pop()
                    if k > 1:
                        buckets[k - 1][pid] = page
                        m |= 1 << (k - 1)
                    index.mask = m
                    index.nfree -= 1
                    self._states[b] = OUT
                    return [b]
            return self._alloc(need_size)
        finally:
            self._leave(True)

    def _alloc(self, need_size: int) -> Optional[List[int]]:
        n = int_arg("need_size", need_size, minimum=1)
        self._check_open()
        if not self._started:
            self._start()  # may take the null block: before counting free blocks
        elif self._null_pending:
            return self._alloc_after_null_release(n)
        return self._alloc_blocks(n)

    def _alloc_blocks(self, n: int) -> Optional[List[int]]:
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
        if from_reserved:
            self._supply.recount()
        out = ledger.take_reserved(from_reserved)
        if rest:
            taken = index.take_run(rest, fresh)
            ledger.mark(taken, OUT)
            out.extend(taken)
        return out

    def _acquire(self, need_blocks: int) -> List[int]:
        """Maps enough fresh pages for ``need_blocks`` blocks, all or none (``PageSupply.acquire``)."""
        self._start()
        if self._null_pending:
            raise OutOfMemoryError("no page can be mapped for the null block")
        return self._supply.acquire(need_blocks, self._index.caps)

    def free(self, indices: Iterable[int]) -> None:
        """Returns block ids to the pool (``indices``: upstream's name).

        Every id must be currently allocated (by alloc) and appear once;
        otherwise InvalidArgumentError is raised and nothing changes.
        """
        try:
            self._enter()
        except IndexError:  # another thread holds the lock: wait for it
            with self._lock:
                return self._free(indices)
        try:
            if indices.__class__ is list and len(indices) == 1:
                b = indices[0]
                states = self._states
                if b.__class__ is int and b >= 0 and b < self.num_blocks and states[b] == OUT:
                    # Fast path (BlockIndex.put_one inlined: the call would cost a third of the pair).
                    states[b] = FREE
                    page = self._held[self._page_of[b]]
                    k = len(page)
                    page.append(b)
                    if page.open:
                        index = self._index
                        pid = page.pid
                        buckets = self._buckets
                        if k:
                            bucket = buckets[k]
                            del bucket[pid]
                            if not bucket:
                                index.mask ^= 1 << k
                        k += 1
                        buckets[k][pid] = page
                        index.mask |= 1 << k
                        index.nfree += 1
                    else:
                        k += 1
                    if k == page.cap:
                        self._release.emptied_one(page)  # retired, parked or released
                    return
            self._free(indices)
        finally:
            self._leave(True)

    def _free(self, indices: Iterable[int]) -> None:
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
            self._supply.recount()
            return True

    def free_reserved(self) -> None:
        """Returns every block set aside by try_to_reserve."""
        with self._lock:
            self._check_open()
            ids = self._ledger.release_reserved()
            if ids:
                self._supply.recount()
                self._return(ids)

    # -------------------------------------------------------------- capacity

    def available_size(self) -> int:
        """Blocks that alloc would hand out right now (a snapshot, see the module doc).

        Called on every scheduling step, so it reads two counters, no lock:
        ``nfree`` (free blocks on held pages, kept by alloc and free) and the
        supply's ``rest`` (reserved blocks plus blocks on the pages that can be
        mapped now), which every change of this process clears before it
        releases the lock, and a timer clears one ``KVCACHED_CAPACITY_TTL_MS``
        after it was counted (``page_supply``'s module doc says why that is as
        fresh as reading the data plane on each call within the TTL). Read
        while another thread allocates, the sum is that of an instant before
        or after the allocation's counter update, or one page off in the
        instant between (a snapshot either way: alloc returns None when short).
        """
        rest = self._supply.rest
        if rest >= 0:
            return self._index.nfree + rest
        return self._count_available()

    def _count_available(self) -> int:
        """available_size counted under the lock (and the count kept, when it may be)."""
        with self._lock:
            if self._closed:
                return 0
            rest = len(self._ledger.reserved) + self._mappable_blocks()
            n = rest + self._index.nfree
            if self._null_pending:  # page 0 goes to the null block first: not kept
                return n - 1 if n else n
            self._supply.keep(rest)
            return n

    def _mappable_blocks(self) -> int:
        """Blocks on the pages an allocation could map now (the caller holds the lock)."""
        return self._index.mappable_blocks(
            self._supply.mappable_pages(self._release.version), self._supply.allocator.is_page_reserved
        )

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

    # ------------------------------------------------------------- pages

    def capacity_changed(self) -> None:
        """What can be mapped changed outside this manager (its cap, by a sleep or a wake):
        the next ``available_size`` asks the data plane instead of reusing its last count."""
        with self._lock:
            self._supply.changed()

    def trim(self) -> int:
        """Releases parked pages, then unmaps every page of the mapped reserve; returns how many it unmapped.

        Pages holding live blocks, and emptied pages waiting for a release
        marker, stay mapped. A running pre-map thread refills the reserve to
        its minimum.
        """
        with self._lock:
            self._check_open()
            self._release.release_parked()
            self._supply.changed()
            return self.page_allocator.trim()

    def release_parked(self) -> int:
        """Releases every parked page now (idle give-back, limit enforcement) to the
        page allocator, like any emptied page; returns how many."""
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
            self._supply.recount()
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

    def get_page_occupancy(self, page_ids: Optional[Iterable[int]] = None) -> Dict[int, int]:
        """Live blocks (allocated, reserved or null) per page; all held pages when page_ids is None."""
        with self._lock:
            return self._index.occupancy(page_ids)

    def get_page_id(self, block_id: int) -> int:
        """The page holding ``block_id``."""
        b = operator.index(block_id)
        if not self.geometry.is_usable(b):
            raise InvalidArgumentError(f"block id {b} is not a usable block of this pool")
        return self.geometry.page_of(b)

    def stats(self) -> Dict[str, int]:
        """Counters for tests, kvtop and debugging, of one instant (``block_report.stats``)."""
        with self._lock:
            return block_report.stats(self._index, self._ledger, self._release, self.page_allocator)

    def snapshot(self) -> Dict[str, Any]:
        """A deep copy of the ledger for tests and debugging (``block_report.snapshot``)."""
        with self._lock:
            return block_report.snapshot(self._index, self._ledger, self._release, self.page_allocator)

    def check_invariants(self) -> None:
        """Verifies the whole state; raises StateConsistencyError naming the broken
        invariant (``block_report.check``). A no-op after shutdown."""
        with self._lock:
            if not self._closed:
                block_report.check(self, self._index, self._ledger, self._release, self.page_allocator)

    # -------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stops pre-mapping and the grace thread, returns every page and the
        reserve, closes the limits (removes the record).

        Blocks still allocated are dropped (their tensors read the zero page).
        Later calls raise ShutdownError, except shutdown() itself.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._supply.close()
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
            self._supply.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise ShutdownError(f"KVCacheManager {self.pool_name} was shut down")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.pool_name}: {self.num_blocks} blocks x {self.block_mem_size} B, "
            f"{self.num_layers} layers x {self.num_kv_buffers} buffers, page {self.page_size} B)"
        )
