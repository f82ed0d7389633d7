"""KVCacheManager: the block ledger of one KV cache over elastic kvcached pages.

The engine asks for blocks (vLLM) or token slots (SGLang) by id; this class
hands out ids whose memory is mapped, and returns a page's physical memory
when its last block is freed. It sits on the C++ ``PageAllocator`` (page ids,
mapped reserve, limits) and never maps anything itself.

Contract (the model is vLLM's ``BlockPool``):

* ``alloc(n)`` returns exactly ``n`` distinct ids whose pages are mapped in
  every layer and K/V buffer, or ``None`` when memory is short, with nothing
  changed. Ids already reserved by ``try_to_reserve`` are used first. Then,
  so that one request's blocks share pages: if held pages have enough free
  blocks, the smallest page that fits the whole run, else the page with the
  most free blocks, repeatedly; if not, the fewest fresh pages that make up
  the shortfall are mapped and take as much of the run as they hold, the
  remainder going to held pages as above. Fresh pages are acquired before any id is taken,
  so a failure (pressure, or a map error injected anywhere) leaves the ledger
  exactly as it was. Only ``OutOfMemoryError`` becomes ``None``; any other
  data-plane error is raised after the same rollback, because a driver fault
  or a broken layout must not look like a full pool.
* ``free(ids)`` validates every id first (never allocated, freed twice, the
  null block, a reserved id: ``InvalidArgumentError``, nothing changed), then
  returns them. A page whose last block is freed goes back to the page
  allocator: into the mapped reserve while it is below its cap, else it is
  unmapped. With ``defer_physical_release`` an empty page stays mapped (and
  reusable) until ``release_retired_pages_through(marker)`` is called with a
  marker captured after the page emptied: the engine's proof that no queued
  batch can still read it.
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
"""

from __future__ import annotations

import logging
import math
import operator
import os
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, Iterable, List, Optional, Tuple, Union

from kvcached import _C, config
from kvcached.block_geometry import BlockGeometry
from kvcached.errors import InvalidArgumentError, OutOfMemoryError, ShutdownError

logger = logging.getLogger(__name__)

MapFn = Callable[[List[int]], None]

# Per-block ledger states in KVCacheManager._owned.
_FREE = 0  # not handed out (free on a held page, on an unheld page, or a hole)
_OUT = 1  # handed out by alloc; free() accepts it
_NULL = 2  # the reserved null block; never freed
_RESERVED = 3  # taken by try_to_reserve; handed out by the next alloc

_UNITS = {"b": 1, "bytes": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}


class _Page(list):
    """Free block ids of one page held by the manager (a stack; pop() yields the lowest).

    ``cap`` is the number of usable blocks on the page, so ``cap - len(page)``
    blocks are live. ``open`` is False for pages past the resize target: they
    hand out nothing and are released once they drain.
    """

    __slots__ = ("pid", "cap", "open")


def _count(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}") from None
    if v <= 0:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {v}")
    return v


class KVCacheManager:
    """The block ledger of one KV cache (one KV group) over kvcached pages.

    Args:
        num_blocks: engine block ids are ``0 .. num_blocks - 1``.
        block_size: tokens per block.
        cell_size: bytes of one token in one K (or V) buffer of one layer.
        num_layers: layers whose buffers are mapped together.
        world_size: processes holding this cache's tensors (TP x PP ranks
            driven by this scheduler). Above 1 the pages are mapped through
            ``map_fn``/``unmap_fn``, by default the fan-out of
            ``kvcached.tp_ipc_util``.
        pp_rank: pipeline stage whose workers this manager drives (-1: all).
        async_sched: the engine queues batch N+1 while batch N runs. With a
            local CUDA device and no deferred release, the device is
            synchronised before a page is unmapped.
        reserve_null_block: hold block 0 forever (SGLang's padding slot, vLLM's
            null block); it is mapped as soon as the KV tensors exist.
        num_kv_buffers: 2 for separate K and V, 1 for MLA / packed KV.
        group_id: the KV tensor group (hybrid models have several).
        pool_name: name of this pool's record (with own_segment; default
            ``KVCACHED_IPC_NAME`` or ``kvcached_<engine>_<pgid>``, plus
            ``_g<group>`` for group_id > 0).
        defer_physical_release: keep emptied pages mapped until
            ``release_retired_pages_through`` passes a marker captured after
            they emptied.
        own_segment: create and own this pool's record in /dev/shm
            (``kvcached.limits.InstanceLimits``): ``kvctl`` shows and caps it,
            the device budget is shared with the other instances.
        map_fn, unmap_fn: map/unmap a list of page offsets in every process
            that holds the tensors (keyword only; default: this process).
        page_size: bytes per kvcached page (keyword only; default: the
            initialized data plane's, else ``KVCACHED_PAGE_SIZE``).
        engine: engine tag of the record (keyword only; "vllm", "sglang").
        device: the device the pages live on (keyword only; default: the
            data plane's in this process; needed for own_segment when this
            process maps through workers and has no data plane).
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
        own_segment: bool = False,
        *,
        map_fn: Optional[MapFn] = None,
        unmap_fn: Optional[MapFn] = None,
        page_size: Optional[int] = None,
        engine: str = "kvcached",
        device: Optional[str] = None,
    ) -> None:
        self.num_layers = _count("num_layers", num_layers)
        self.num_kv_buffers = _count("num_kv_buffers", num_kv_buffers)
        self.world_size = _count("world_size", world_size)
        self.pp_rank = operator.index(pp_rank)
        self.group_id = operator.index(group_id)
        self.async_sched = bool(async_sched)
        self.reserve_null_block = bool(reserve_null_block)
        self.defer_physical_release = bool(defer_physical_release)
        if (map_fn is None) != (unmap_fn is None):
            raise InvalidArgumentError("give both map_fn and unmap_fn, or neither")
        if map_fn is None and self.world_size > 1:
            map_fn, unmap_fn = _fanout_mappers(self.world_size, self.pp_rank, self.group_id)
        self._local = map_fn is None
        if self._local and not _C.is_initialized():
            raise ShutdownError(
                "kvcached is not initialized in this process: call init_kvcached(device) "
                "(kvcached.vmm_ops or the engine interface) before creating a KVCacheManager"
            )
        if device is None and _C.is_initialized():
            device = _C.config()["device"]
        self._device = device
        if page_size is None:
            page_size = _C.config()["page_size"] if _C.is_initialized() else config.page_size()
        page_size = _count("page_size", page_size)
        if self._local and page_size != _C.config()["page_size"]:
            raise InvalidArgumentError(
                f"page_size {page_size} differs from the data plane's {_C.config()['page_size']}; "
                "pass the page size given to init_kvcached"
            )

        self.geometry = BlockGeometry(num_blocks, block_size, cell_size, page_size)
        geo = self.geometry
        self.num_blocks = geo.num_blocks
        self.block_size = geo.block_size
        self.cell_size = geo.cell_size
        self.block_mem_size = geo.block_mem_size
        self.page_size = geo.page_size
        # Bytes of one K (or V) buffer of one layer that this manager may map.
        self.mem_size = geo.num_pages * page_size

        min_res, max_res = config.min_reserved_pages(), config.max_reserved_pages()
        if min_res < 0 or max_res < min_res:
            raise InvalidArgumentError(
                f"KVCACHED_MIN_RESERVED_PAGES={min_res} / KVCACHED_MAX_RESERVED_PAGES={max_res}: "
                "need 0 <= min <= max"
            )
        self._min_reserved = min_res
        self._want_prealloc = self._local and config.page_prealloc_enabled() and min_res > 0
        # Pre-mapping starts only after the null block took page 0 (the free set
        # hands out the lowest id first; a pre-mapped reserve would not).
        self.page_allocator = _C.PageAllocator(
            self.num_layers,
            self.mem_size,
            page_size,
            self.num_kv_buffers,
            self.group_id,
            min_res,
            max_res,
            False,
            map_fn,
            unmap_fn,
        )
        self._pa = self.page_allocator
        self.bytes_per_page = self._pa.bytes_per_page

        self._lock = threading.Lock()
        self._B = geo.block_mem_size
        self._P = page_size
        self._caps = geo.caps
        self._owned = bytearray(geo.num_blocks)
        self._held: Dict[int, _Page] = {}
        # _buckets[k]: open held pages with exactly k free blocks (k >= 1);
        # bit k of _mask is set iff _buckets[k] is non-empty, so "smallest
        # bucket >= n" and "largest bucket" are two integer operations.
        self._buckets: List[Dict[int, _Page]] = [dict() for _ in range(geo.max_blocks_per_page + 1)]
        self._mask = 0
        self._nfree = 0  # free blocks on open held pages
        self._reserved: List[int] = []
        self.null_block: Optional[List[int]] = None
        self._null_pending = self.reserve_null_block
        self._started = False
        self._closed = False
        self._target_pages = geo.num_pages

        # Unheld pages within the target, by capacity: available_size counts
        # the emptiest ones C++ could hand out.
        self._unheld_caps: Dict[int, int] = {}
        self._unheld_version = 0
        self._mappable_cache: Tuple[int, int, int] = (-1, -1, 0)  # (pages, version, blocks)
        self._recount_unheld()

        # Deferred release: pages retired at epoch E wait for a marker >= E.
        self._epoch = 0
        self._retired: Dict[int, int] = {}
        self._retired_q: Deque[Tuple[int, int]] = deque()

        # available_size reuses the data plane's free-page count until this
        # manager changes pages (then _cap_stamp is reset) or the TTL passes.
        self._cap_ttl = config.capacity_ttl_s()
        self._cap_stamp = -math.inf
        self._cap_pages = 0
        self._sync_before_release = (
            self.async_sched and not self.defer_physical_release and self._local and str(device).startswith("cuda")
        )

        self.pool_name = pool_name or f"kvcached_{os.getpid()}_g{self.group_id}"
        # The pool's record and limit enforcement (before anything is mapped).
        self.limits = None
        if own_segment:
            from kvcached.limits import InstanceLimits

            if self._device is None:
                raise InvalidArgumentError("own_segment needs device= when the data plane is not initialized here")
            self.limits = InstanceLimits.for_page_allocator(
                self._pa, engine=engine, device=self._device, name=pool_name, group_id=self.group_id
            )
            self.pool_name = self.limits.name

        if not self._local or _C.kv_tensors_created(self.group_id):
            with self._lock:
                self._start()
        logger.debug("KVCacheManager %s: %r, %d layers x %d buffers", self.pool_name, geo, self.num_layers, self.num_kv_buffers)

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        """Checks the tensors, takes the null block, starts pre-mapping (once)."""
        if self._started:
            return
        if self._local:
            if not _C.kv_tensors_created(self.group_id):
                raise InvalidArgumentError(
                    f"KV tensors of group {self.group_id} do not exist yet: create them "
                    "(alloc_kv_cache / create_kv_tensors) before allocating blocks"
                )
            info = _C.group_info(self.group_id)
            if (
                info["num_layers"] != self.num_layers
                or info["num_kv_buffers"] != self.num_kv_buffers
                or info["buffer_size"] < self.mem_size
            ):
                raise InvalidArgumentError(
                    f"KV tensors of group {self.group_id} ({info['num_layers']} layers x "
                    f"{info['num_kv_buffers']} buffers of {info['buffer_size']} bytes) do not match this manager "
                    f"({self.num_layers} layers x {self.num_kv_buffers} buffers of {self.mem_size} bytes for "
                    f"{self.num_blocks} blocks of {self.block_mem_size} bytes)"
                )
        if self._null_pending:
            try:
                if self.limits is not None:
                    self.limits.admit_pages(1)
                pids = self._pa.alloc_pages(1)
            except OutOfMemoryError:
                return  # retried before the next page is acquired
            pid = pids[0]
            if pid != 0:
                self._pa.free_pages(pids)
                raise InvalidArgumentError(
                    f"the null block needs page 0 first, but the page allocator gave page {pid}"
                )
            page = self._adopt(0)
            page.pop()  # block 0: pop() yields the lowest id
            self._owned[0] = _NULL
            self._shelve(page, len(page))
            self.null_block = [0]
            self._null_pending = False
        if self._want_prealloc:
            self._pa.start_prealloc_thread()
        self._started = True

    # ------------------------------------------------------------- allocation

    def alloc(self, need_size: int) -> Optional[List[int]]:
        """Returns ``need_size`` block ids, or None (nothing changed) when short.

        Raises InvalidArgumentError for a size below 1, ShutdownError after
        shutdown(), and other data-plane errors (after a full rollback).
        """
        with self._lock:
            m = self._mask
            if m and need_size.__class__ is int and need_size == 1 and not self._reserved:
                # Fast path: one block from the fullest page that has a free one.
                k = (m & -m).bit_length() - 1
                bucket = self._buckets[k]
                pid, page = bucket.popitem()
                if not bucket:
                    m ^= 1 << k
                b = page.pop()
                if k > 1:
                    self._buckets[k - 1][pid] = page
                    m |= 1 << (k - 1)
                self._mask = m
                self._nfree -= 1
                self._owned[b] = _OUT
                return [b]
            return self._alloc(need_size)

    def _alloc(self, need_size: int) -> Optional[List[int]]:
        n = _count("need_size", need_size)
        self._check_open()
        if not self._started:
            self._start()  # may take the null block: before counting free blocks
        reserved = self._reserved
        from_reserved = min(n, len(reserved))
        rest = n - from_reserved
        fresh: List[int] = []
        if rest > self._nfree:
            try:
                fresh = self._acquire(rest - self._nfree)
            except OutOfMemoryError:
                return None
        # Nothing below can fail: the ledger changes only now.
        out = reserved[:from_reserved]
        del reserved[:from_reserved]
        owned = self._owned
        for b in out:
            owned[b] = _OUT
        if rest:
            # Fresh pages are mapped anyway: put as much of the run as they hold
            # there (one request, few pages) and only the remainder on held pages.
            # The page count mapped is the same as filling held pages first.
            on_fresh = min(rest, sum(self._caps[pid] for pid in fresh))
            first_held = len(out)
            left = self._take_from_held(rest - on_fresh, out)
            assert left == 0, "held pages had fewer free blocks than counted"
            for b in out[first_held:]:
                owned[b] = _OUT
            for pid in fresh:
                page = self._adopt(pid)
                t = min(on_fresh, page.cap)
                k = len(page)
                chunk = page[k - t :]
                del page[k - t :]
                chunk.reverse()
                out.extend(chunk)
                for b in chunk:
                    owned[b] = _OUT
                on_fresh -= t
                self._shelve(page, len(page))
        return out

    def _take_from_held(self, rest: int, out: List[int]) -> int:
        """Takes up to ``rest`` blocks from open held pages; returns what is still missing."""
        buckets = self._buckets
        while rest and self._mask:
            m = self._mask
            hi = m >> rest
            k = rest + (hi & -hi).bit_length() - 1 if hi else m.bit_length() - 1
            bucket = buckets[k]
            pid, page = bucket.popitem()
            if not bucket:
                self._mask = m ^ (1 << k)
            t = k if k < rest else rest
            chunk = page[k - t :]
            del page[k - t :]
            chunk.reverse()
            out.extend(chunk)
            rest -= t
            self._nfree -= t
            if k > t:
                buckets[k - t][pid] = page
                self._mask |= 1 << (k - t)
        return rest

    def _acquire(self, need_blocks: int) -> List[int]:
        """Maps enough fresh pages for ``need_blocks`` blocks, all or none."""
        self._start()
        if self._null_pending:
            raise OutOfMemoryError("no page can be mapped for the null block")
        pids: List[int] = []
        got = 0
        per_page = self.geometry.max_blocks_per_page
        self._cap_stamp = -math.inf
        limits = self.limits
        try:
            while got < need_blocks:
                k = -(-(need_blocks - got) // per_page)
                if limits is not None:
                    limits.admit_pages(k)  # device budget; OutOfMemoryError when short
                new = self._pa.alloc_pages(k)
                pids.extend(new)
                for pid in new:
                    got += self._caps[pid]
        except BaseException:
            if pids:
                # Still empty: back to the reserve (or unmapped) as after a free.
                self._pa.free_pages(pids)
            raise
        return pids

    def _adopt(self, pid: int) -> _Page:
        """Registers a freshly acquired page with all its blocks free."""
        first, end = self.geometry.block_range(pid)
        page = _Page(range(end - 1, first - 1, -1))
        page.pid = pid
        page.cap = end - first
        page.open = pid < self._target_pages
        self._held[pid] = page
        if page.open:
            c = page.cap
            self._unheld_caps[c] -= 1
            self._unheld_version += 1
        return page

    def _shelve(self, page: _Page, k: int) -> None:
        """Files an open page with k free blocks into its bucket."""
        if page.open and k:
            self._buckets[k][page.pid] = page
            self._mask |= 1 << k
            self._nfree += k

    # ------------------------------------------------------------------- free

    def free(self, block_ids: Iterable[int]) -> None:
        """Returns block ids to the pool.

        Every id must be currently allocated (by alloc) and appear once;
        otherwise InvalidArgumentError is raised and nothing changes.
        """
        with self._lock:
            if block_ids.__class__ is list and len(block_ids) == 1:
                b = block_ids[0]
                owned = self._owned
                if b.__class__ is int and 0 <= b < self.num_blocks and owned[b] == _OUT:
                    owned[b] = _FREE
                    page = self._held[b * self._B // self._P]
                    k = len(page)
                    page.append(b)
                    if page.open:
                        pid = page.pid
                        if k:
                            bucket = self._buckets[k]
                            del bucket[pid]
                            if not bucket:
                                self._mask ^= 1 << k
                        k += 1
                        self._nfree += 1
                        self._buckets[k][pid] = page
                        self._mask |= 1 << k
                        if k == page.cap:
                            self._emptied([page])
                    elif k + 1 == page.cap:
                        self._emptied([page])
                    return
            self._free(block_ids)

    def _free(self, block_ids: Iterable[int]) -> None:
        self._check_open()
        ids = self._validate_free(block_ids)
        self._return(ids)

    def _validate_free(self, block_ids: Iterable[int]) -> List[int]:
        """Marks ids free if all are allocated; else restores them and raises."""
        if isinstance(block_ids, (str, bytes)):
            raise InvalidArgumentError(f"block ids must be integers, got {block_ids!r}")
        try:
            ids = [operator.index(b) for b in block_ids]
        except TypeError:
            raise InvalidArgumentError(f"block ids must be integers, got {block_ids!r}") from None
        owned = self._owned
        n = self.num_blocks
        done = 0
        try:
            for b in ids:
                if not 0 <= b < n:
                    raise InvalidArgumentError(f"block id {b} is out of range [0, {n})")
                s = owned[b]
                if s != _OUT:
                    if s == _NULL:
                        raise InvalidArgumentError(f"block {b} is the null block; it is never freed")
                    if s == _RESERVED:
                        raise InvalidArgumentError(
                            f"block {b} is reserved by try_to_reserve; release it with free_reserved()"
                        )
                    raise InvalidArgumentError(f"block {b} is not allocated (freed twice, or never allocated)")
                owned[b] = _FREE
                done += 1
        except InvalidArgumentError:
            for b in ids[:done]:
                owned[b] = _OUT
            raise
        return ids

    def _return(self, ids: List[int]) -> None:
        """Puts ledger-freed ids back on their pages and settles emptied pages."""
        held, B, P = self._held, self._B, self._P
        touched: Dict[int, int] = {}
        for b in ids:
            page = held[b * B // P]
            if page.pid not in touched:
                touched[page.pid] = len(page)
            page.append(b)
        buckets = self._buckets
        emptied = []
        for pid, k in touched.items():
            page = held[pid]
            k2 = len(page)
            if page.open:
                if k:
                    bucket = buckets[k]
                    del bucket[pid]
                    if not bucket:
                        self._mask ^= 1 << k
                self._nfree += k2 - k
                buckets[k2][pid] = page
                self._mask |= 1 << k2
                if k2 == page.cap:
                    emptied.append(page)
            elif k2 == page.cap:
                emptied.append(page)
        if emptied:
            self._emptied(emptied)

    def _emptied(self, pages: List[_Page]) -> None:
        """Pages whose last block was just freed (open ones are in bucket cap, counted in _nfree)."""
        if self.defer_physical_release:
            e = self._epoch
            for page in pages:
                self._retired[page.pid] = e
                self._retired_q.append((e, page.pid))
            return
        for page in pages:
            self._unshelve(page)
        self._release(pages)

    def _unshelve(self, page: _Page) -> None:
        """Takes an open page out of its bucket (and its free blocks out of _nfree)."""
        if not page.open:
            return
        k = len(page)
        bucket = self._buckets[k]
        if bucket.pop(page.pid, None) is not None:
            if not bucket:
                self._mask ^= 1 << k
            self._nfree -= k

    def _release(self, pages: List[_Page]) -> None:
        """Hands empty pages back to the page allocator (reserve, else unmap)."""
        pids = []
        for page in pages:
            del self._held[page.pid]
            self._retired.pop(page.pid, None)
            if page.pid < self._target_pages:
                c = page.cap
                self._unheld_caps[c] = self._unheld_caps.get(c, 0) + 1
            pids.append(page.pid)
        self._unheld_version += 1
        self._cap_stamp = -math.inf
        if self._sync_before_release:
            import torch

            torch.cuda.synchronize()  # queued kernels may still read these pages
        self._pa.free_pages(pids)
        if self.limits is not None:
            self.limits.on_free()  # gives unused device budget back to peers

    # ------------------------------------------------------------ reservation

    def try_to_reserve(self, need_size: int) -> bool:
        """Ensures at least ``need_size`` blocks are set aside for the next alloc calls.

        Returns False, with nothing changed, when they cannot be had now.
        Reserved blocks count in available_size() and are handed out first.
        """
        with self._lock:
            n = _count("need_size", need_size)
            self._check_open()
            kept = self._reserved
            more = n - len(kept)
            if more <= 0:
                return True
            self._reserved = []  # so that _alloc takes fresh blocks only
            try:
                got = self._alloc(more)
            finally:
                self._reserved = kept
            if got is None:
                return False
            owned = self._owned
            for b in got:
                owned[b] = _RESERVED
            kept.extend(got)
            return True

    def free_reserved(self) -> None:
        """Returns every block set aside by try_to_reserve."""
        with self._lock:
            self._check_open()
            ids = self._reserved
            if not ids:
                return
            self._reserved = []
            owned = self._owned
            for b in ids:
                owned[b] = _FREE
            self._return(ids)

    # ---------------------------------------------------------------- capacity

    def available_size(self) -> int:
        """Blocks that alloc would hand out right now (a snapshot, see the module doc)."""
        with self._lock:
            if self._closed:
                return 0
            n = len(self._reserved) + self._nfree + self._mappable_blocks()
            if self._null_pending and n:
                n -= 1
            return n

    def logical_free_size(self) -> int:
        """Blocks not handed out within the resize target, ignoring memory limits.

        This is the engine's logical view (what a leak check compares to
        the pool size at idle); available_size() is what can be had now.
        """
        with self._lock:
            if self._closed:
                return 0
            unheld = sum(cap * cnt for cap, cnt in self._unheld_caps.items())
            n = len(self._reserved) + self._nfree + unheld
            if self._null_pending and n:
                n -= 1
            return n

    def _mappable_pages(self) -> int:
        """Pages alloc could get from the data plane now: reserve, target, limit, device."""
        now = time.monotonic()
        if now - self._cap_stamp <= self._cap_ttl:
            return self._cap_pages
        pa = self._pa
        pages = self.limits.num_free_pages() if self.limits is not None else pa.get_num_free_pages()
        if self._local and pages:
            reserved = pa.get_num_reserved_pages()
            fresh = pages - reserved
            if fresh > 0:
                device_free = _C.backend_info(self._device)["free_bytes"] // self.bytes_per_page
                pages = reserved + min(fresh, device_free)
        self._cap_stamp, self._cap_pages = now, pages
        return pages

    def _mappable_blocks(self) -> int:
        pages = self._mappable_pages()
        cached_pages, version, blocks = self._mappable_cache
        if cached_pages == pages and version == self._unheld_version:
            return blocks
        # Worst case: the data plane hands out the unheld pages with the fewest blocks.
        blocks, left = 0, pages
        for cap in sorted(self._unheld_caps):
            cnt = self._unheld_caps[cap]
            if cnt <= 0:
                continue
            take = cnt if cnt < left else left
            blocks += take * cap
            left -= take
            if not left:
                break
        self._mappable_cache = (pages, self._unheld_version, blocks)
        return blocks

    def set_mem_limit(self, limit_bytes: int) -> None:
        """Caps the physical bytes (all layers and buffers) this pool may map; < 0: no cap.

        For tests and tools: with own_segment the record's limit (kvctl) is
        applied by the pool's InstanceLimits instead.
        """
        with self._lock:
            self._pa.set_mem_limit(operator.index(limit_bytes))
            self._cap_stamp = -math.inf

    def _recount_unheld(self) -> None:
        caps: Dict[int, int] = {}
        held = self._held
        for pid in range(self._target_pages):
            if pid not in held:
                c = self._caps[pid]
                caps[c] = caps.get(c, 0) + 1
        self._unheld_caps = caps
        self._unheld_version += 1

    # ------------------------------------------------------------------ resize

    def resize(self, new_mem_size: int) -> bool:
        """Sets the bytes of one K (or V) buffer of one layer this pool may use.

        Grows at once. Shrinks gradually: pages past the new target hand out
        no more blocks and are released as their blocks are freed. Returns
        True when the target is fully applied (no held page past it).
        Raises InvalidArgumentError below 0 or above the virtual capacity.
        """
        with self._lock:
            self._check_open()
            if isinstance(new_mem_size, bool):
                raise InvalidArgumentError(f"new_mem_size must be an integer number of bytes, got {new_mem_size!r}")
            try:
                size = operator.index(new_mem_size)
            except TypeError:
                raise InvalidArgumentError(
                    f"new_mem_size must be an integer number of bytes, got {new_mem_size!r}"
                ) from None
            if size < 0:
                raise InvalidArgumentError(f"new_mem_size must be >= 0, got {size}")
            if size > self.mem_size:
                raise InvalidArgumentError(
                    f"new_mem_size {size} exceeds the virtual capacity of {self.mem_size} bytes per buffer"
                )
            target = size // self._P
            self._pa.resize(target * self._P)
            self._cap_stamp = -math.inf
            old = self._target_pages
            self._target_pages = target
            to_release = []
            for pid, page in self._held.items():
                if pid >= target and page.open:
                    self._unshelve(page)
                    page.open = False
                    if len(page) == page.cap and not self.defer_physical_release:
                        to_release.append(page)
                elif pid < target and not page.open:
                    page.open = True
                    self._shelve(page, len(page))
            self._recount_unheld()
            if to_release:
                self._release(to_release)
            if target != old:
                logger.info("KVCacheManager %s: resized to %d pages (was %d)", self.pool_name, target, old)
            return not any(pid >= target for pid in self._held)

    def trim(self) -> int:
        """Unmaps every page of the mapped reserve; returns how many.

        Pages holding live blocks, and emptied pages waiting for a release
        marker, stay mapped. A running pre-map thread refills the reserve to
        its minimum.
        """
        with self._lock:
            self._check_open()
            self._cap_stamp = -math.inf
            return self._pa.trim()

    def clear(self) -> None:
        """Frees every allocated and reserved block (not the null block)."""
        with self._lock:
            self._check_open()
            owned = self._owned
            ids = []
            for page in self._held.values():
                first, end = self.geometry.block_range(page.pid)
                for b in range(first, end):
                    if owned[b] == _OUT or owned[b] == _RESERVED:
                        owned[b] = _FREE
                        ids.append(b)
            self._reserved = []
            if ids:
                self._return(ids)

    # ------------------------------------------------------- deferred release

    def capture_physical_release_marker(self) -> int:
        """Returns a marker covering every page emptied so far.

        Pages emptied after this call get a later epoch. Once every batch
        submitted before the call has finished on every worker, pass the
        marker to release_retired_pages_through.
        """
        with self._lock:
            marker = self._epoch
            self._epoch += 1
            return marker

    def release_retired_pages_through(self, marker: int) -> int:
        """Releases emptied pages retired at or before ``marker``; returns how many.

        A retired page that was reused since is kept; if it empties again it
        waits for a later marker.
        """
        with self._lock:
            self._check_open()
            marker = operator.index(marker)
            if marker >= self._epoch:
                raise InvalidArgumentError(
                    f"marker {marker} was not captured yet (next is {self._epoch}); "
                    "use the value returned by capture_physical_release_marker()"
                )
            q = self._retired_q
            ready = []
            while q and q[0][0] <= marker:
                e, pid = q.popleft()
                if self._retired.get(pid) != e:
                    continue  # reused and emptied again later: a newer entry covers it
                page = self._held[pid]
                del self._retired[pid]
                if len(page) == page.cap:
                    ready.append(page)
            for page in ready:
                self._unshelve(page)
            if ready:
                self._release(ready)
            return len(ready)

    # -------------------------------------------------------------- reporting

    def get_mapped_memory_size(self, unit: str = "bytes") -> Union[int, float]:
        """Physical memory mapped for this pool (held pages and reserve), all layers and buffers."""
        scale = _UNITS.get(str(unit).lower())
        if scale is None:
            raise InvalidArgumentError(f"unit {unit!r} is not one of {sorted(_UNITS)}")
        with self._lock:
            if self._closed:
                return 0
            nbytes = self._pa.get_num_mapped_pages() * self.bytes_per_page
        return nbytes if scale == 1 else nbytes / scale

    def get_page_occupancy(self, page_ids: Optional[Iterable[int]] = None) -> Dict[int, int]:
        """Live blocks (allocated, reserved or null) per page; all held pages when page_ids is None."""
        with self._lock:
            if page_ids is None:
                return {pid: p.cap - len(p) for pid, p in self._held.items()}
            out = {}
            for pid in page_ids:
                pid = operator.index(pid)
                if not 0 <= pid < self.geometry.num_pages:
                    raise InvalidArgumentError(f"page id {pid} is out of range [0, {self.geometry.num_pages})")
                p = self._held.get(pid)
                out[pid] = p.cap - len(p) if p is not None else 0
            return out

    def get_page_id(self, block_id: int) -> int:
        """The page holding ``block_id``."""
        b = operator.index(block_id)
        if not self.geometry.is_usable(b):
            raise InvalidArgumentError(f"block id {b} is not a usable block of this pool")
        return self.geometry.page_of(b)

    @property
    def num_free_blocks_on_held_pages(self) -> int:
        return self._nfree

    def stats(self) -> Dict[str, int]:
        """Counters for tests, kvtop and debugging (one consistent snapshot)."""
        with self._lock:
            pa = self._pa
            live = sum(p.cap - len(p) for p in self._held.values())
            return {
                "held_pages": len(self._held),
                "open_free_blocks": self._nfree,
                "live_blocks": live,
                "reserved_blocks": len(self._reserved),
                "retired_pages": len(self._retired),
                "target_pages": self._target_pages,
                "mapped_pages": pa.get_num_mapped_pages(),
                "reserve_pages": pa.get_num_reserved_pages(),
                "inuse_pages": pa.get_num_inuse_pages(),
            }

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stops pre-mapping, returns every page and the reserve, removes own records.

        Blocks still allocated are dropped (their tensors read the zero page).
        Later calls raise ShutdownError, except shutdown() itself.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pa = self._pa
            try:
                pa.stop_prealloc_thread()
                pids = list(self._held)
                self._held.clear()
                for b in self._buckets:
                    b.clear()
                self._mask = 0
                self._nfree = 0
                self._reserved = []
                self._retired.clear()
                self._retired_q.clear()
                # Stale ids then fail validation and reach the ShutdownError check.
                self._owned = bytearray(self.num_blocks)
                if pids:
                    pa.free_pages(pids)
                pa.trim()
            finally:
                if self.limits is not None:
                    self.limits.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ShutdownError(f"KVCacheManager {self.pool_name} was shut down")

    def __repr__(self) -> str:
        return (
            f"KVCacheManager({self.pool_name}: {self.num_blocks} blocks x {self.block_mem_size} B, "
            f"{self.num_layers} layers x {self.num_kv_buffers} buffers, page {self.page_size} B)"
        )


def _fanout_mappers(world_size: int, pp_rank: int, group_id: int) -> Tuple[MapFn, MapFn]:
    """Map/unmap through the worker fan-out of kvcached.tp_ipc_util (one
    coordinator per instance, stage set and group; created on first use)."""
    try:
        from kvcached.tp_ipc_util import get_coordinator
    except ImportError as e:
        raise InvalidArgumentError(
            f"world_size={world_size} needs the worker fan-out (kvcached.tp_ipc_util), which failed to import: {e}; "
            "or pass map_fn/unmap_fn"
        ) from None
    coord = get_coordinator(world_size, pp_rank, group_id)
    return coord.map, coord.unmap
