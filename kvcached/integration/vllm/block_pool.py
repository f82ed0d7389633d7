"""Scheduler seam: ``ElasticBlockPool``, vLLM's ``BlockPool`` over kvcached pages.

It keeps the whole BlockPool contract the rest of vLLM relies on (block
objects ``blocks[i].block_id == i``, the null block 0, ref counts, prefix-
cache hashes and both hash maps, KV events, ``touch``, ``evict_blocks``,
``reset_prefix_cache``, usage) and changes only where free blocks come from
and go to:

* a block nobody references and no hash names is *free in the kvcached
  ledger* (``KVCacheManager``): the manager picks ids page-affine and returns
  a page's memory when its last block is freed;
* a block nobody references but a prefix-cache hash names is *evictable*: it
  stays handed out (its page stays mapped, its data reusable) in the LRU
  queue ``free_block_queue``, exactly like vLLM's evictable blocks;
* ``get_num_free_blocks()`` = what the manager can hand out *now* (mapped
  free blocks plus pages the limit, the device budget and the device allow)
  + evictable blocks. It is vLLM's only question before allocating, so a
  physical shortage shows as fewer free blocks: ``allocate_slots`` returns
  None and the scheduler preempts, as with a full native pool.
* ``get_new_blocks`` takes from the manager first, then evicts LRU cached
  blocks (as vLLM prefers free over cached blocks). If another process took
  the memory between the count and the allocation (a snapshot, not a
  reservation), it undoes its own work and raises ``PoolShortage``, which the
  ``allocate_slots`` patch turns into None after rolling the call back.

A lowered limit is reached while the engine decodes: while the pages that
still hold blocks exceed it, ``get_num_free_blocks()`` is 0 (cached pages that
can empty are evicted first), so the next running request that needs a block
makes vLLM preempt its newest request, on vLLM's own path, until the rest fit.
Without that, requests that fit in the pages they hold would keep them until
they finish (seen on the H200: 9.9 s to reach a halved limit).

Memory return: the prefix cache is bounded by ``KVCACHED_MAX_CACHED_TOKENS``
(default: unbounded, like vLLM; ``kvcached.elastic.cache_bound``), and when
the instance maps more than its limit allows (``kvctl limit`` lowered it)
cached blocks are evicted. For both,
victims whose eviction empties a whole page go first: a page with one cached
block left cannot be unmapped, so evicting scattered blocks returns nothing.
A plain allocation shortage evicts pure LRU (the slots are reused at once).
With vLLM's host tier (``--kv-offloading-size``), give-back takes the pages whose
blocks the tier holds (or is storing) first (``host_tier.py``).
"""

from __future__ import annotations

import logging
import time
from types import MappingProxyType
from typing import Any, Dict, Iterable, List

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvcached import config, trace
from kvcached.elastic import GIVE_CHUNK_PAGES, IdleAction, cache_excess_tokens, give_chunks
from kvcached.elastic.cache_bound import max_cached_tokens
from kvcached.integration.vllm.backend import VllmBackend, take_pool_context

logger = logging.getLogger("vllm.kvcached")

# How often (at most) the pool looks for cached pages to give back while the
# instance maps more than its limit: a scan walks the evictable queue.
_RETURN_SCAN_INTERVAL_S = 0.1
# How long the manager's allocatable count is reused (see get_num_free_blocks):
# long while plenty is left, short when few blocks are.
_FREE_COUNT_TTL_S = 0.1
_FREE_COUNT_TTL_LOW_S = 0.002
_LOW_PAGES = 8


class PoolShortage(Exception):
    """Memory vanished between the free-block count and the allocation."""


# A block whose owning pool was garbage-collected (vLLM 0.34 keeps weak
# references): vLLM drops such blocks when they are freed.
GONE = object()


def owner_none(pool: BlockPool, block: KVCacheBlock) -> Any:
    """vLLM 0.26-0.29: a block does not name its pool; every block a pool frees is its own."""
    return None


def owner_by_reference(pool: BlockPool, block: KVCacheBlock) -> Any:
    """vLLM 0.30-0.33: ``block.pool`` is the owning pool itself. Returns the
    block's pool when it is another one, else None."""
    owner = block.pool
    return None if owner is None or owner is pool else owner


def owner_by_weakref(pool: BlockPool, block: KVCacheBlock) -> Any:
    """vLLM 0.34: ``block.pool`` is ``weakref.ref(owner)`` (``BlockPool._weak_self``).
    Returns the block's pool when it is another one (``GONE`` if collected), else None."""
    ref = block.pool
    if ref is None or ref is pool._weak_self:  # type: ignore[attr-defined]
        return None
    owner = ref()
    return GONE if owner is None else owner


class ElasticBlockPool(BlockPool):
    """A BlockPool whose free blocks live in a kvcached ``KVCacheManager``.

    Built by vLLM's coordinator through the patched module name. Outside a
    scheduler being built by a kvcached-enabled EngineCore (another pool of
    the same coordinator class, e.g. a CPU offload pool) construction returns
    a native ``BlockPool``.
    """

    # How a block names its pool, per vLLM version (versions.py: block_owner_*).
    foreign_owner = staticmethod(owner_by_reference)

    def __new__(cls, *args: Any, **kwargs: Any) -> BlockPool:
        ctx = take_pool_context()
        if ctx is None:
            return BlockPool(*args, **kwargs)
        self = super().__new__(cls)
        self._kvcached_ctx = ctx
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The constructor's parameters differ between vLLM versions (0.33 adds
        # num_hash_lookahead_tokens): forward them untouched.
        super().__init__(*args, **kwargs)
        ctx = self.__dict__.pop("_kvcached_ctx")
        # Every block but the null one starts free in the ledger, so the
        # evictable queue starts empty (and unlinked from vLLM's full queue).
        for b in self.blocks:
            b.prev_free_block = b.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue([])
        self.backend = VllmBackend.create(ctx, self.num_gpu_blocks)
        self.manager = self.backend.manager
        self._n_out = 0  # blocks handed out by the manager (in use or evictable), null excluded
        self._shrinking = False  # over a lowered limit: preempt until the live pages fit (see module doc)
        self._max_cached = max_cached_tokens()
        self._block_tokens = max(1, int(getattr(self.backend.plan, "block_tokens", 1)))
        self._next_return_scan = 0.0
        self._avail = 0
        self._avail_until = 0.0  # perf_counter() until which _avail may be reused
        self._low_blocks = _LOW_PAGES * self.manager.geometry.max_blocks_per_page
        self._resetting = False  # inside reset_prefix_cache (see there)
        # Holds of the offloading connector's copy jobs (offload.attach), or None.
        self.transfers: Any = None
        # Its host tier's view (host_tier.HostTierView): give-back evicts what the tier keeps first.
        self.host_tier: Any = None

    # ------------------------------------------------------------ capacity

    def get_num_free_blocks(self) -> int:
        if self._resetting:
            # vLLM's own reset checks "every block but the null one is free",
            # which in its accounting means nothing is in use (checked before).
            return self.num_gpu_blocks - 1
        # vLLM asks once per running request per step, plus stats. The
        # manager's answer (which reads the device budget of every instance)
        # is kept and moved by this pool's own allocations and frees; what
        # other processes or a new limit change is picked up when it is
        # refreshed: every _FREE_COUNT_TTL_S, or _FREE_COUNT_TTL_LOW_S when
        # few blocks are left, where a stale count would matter. A count that
        # was too high ends as PoolShortage -> None, never a crash.
        now = time.perf_counter()
        if now >= self._avail_until:
            self._maybe_return_memory()
            self._avail = self.manager.available_size()
            # Invariant kept here: while over the limit, no block is handed out.
            self._shrinking = self.backend.pages_over_limit() > 0 and self.backend.live_pages_over_limit() > 0
            low = self._avail < self._low_blocks or self._shrinking
            self._avail_until = now + (_FREE_COUNT_TTL_LOW_S if low else _FREE_COUNT_TTL_S)
        if self._shrinking:
            return 0
        return self._avail + self.free_block_queue.num_free_blocks

    def num_in_use_blocks(self) -> int:
        """Blocks some request references (null excluded)."""
        return self._n_out - self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        # Fraction of what this instance could hold now: in use / (in use +
        # allocatable). The native formula divides by num_gpu_blocks, which
        # here is a virtual capacity other instances may be using.
        used = self.num_in_use_blocks()
        total = used + self.get_num_free_blocks()
        return used / total if total else 0.0

    # ---------------------------------------------------------- allocation

    def get_new_blocks(self, num_blocks: int) -> List[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        if num_blocks <= 0:
            return []
        ids: List[int] = []
        want = min(num_blocks, max(0, self._avail))  # the count just checked above
        for _ in range(2):  # once more with the manager's fresh count if it was overtaken
            if want <= 0:
                break
            got = self.manager.alloc(want)
            if got is not None:
                ids = got
                break
            self._avail = self.manager.available_size()
            self._avail_until = time.perf_counter() + _FREE_COUNT_TTL_LOW_S
            want = min(want, self._avail)
        self._n_out += len(ids)
        self._avail -= len(ids)
        ret = [self.blocks[i] for i in ids]
        rest = num_blocks - len(ret)
        if rest:
            q = self.free_block_queue
            if rest > q.num_free_blocks:
                self._give_back(ids)
                self._avail_until = 0.0  # the count was stale: ask the manager next time
                raise PoolShortage(
                    f"{num_blocks} blocks were free when counted but only {len(ret) + q.num_free_blocks} "
                    "can be had now (another instance took the memory, or the limit was lowered)"
                )
            ret.extend(q.popleft_n(rest))

        if self._reuse_watchers:
            self._notify_reuse(ret)
        caching = self.enable_caching
        mc = self.metrics_collector
        for block in ret:
            if caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if mc:
                mc.on_block_allocated(block)
        if trace.ON:
            self.backend.instance.traced_allocation(len(ret))
        return ret

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], evict_first: bool = False) -> None:
        """``evict_first`` (vLLM 0.34, blocks another tier already holds): freed
        cached blocks go to the front of the evictable queue instead of its tail."""
        to_ledger: List[int] = []
        to_cache: List[KVCacheBlock] = []
        other_pools: Dict[BlockPool, List[KVCacheBlock]] = {}
        caching = self.enable_caching
        foreign_owner = self.foreign_owner
        for block in ordered_blocks:
            owner = foreign_owner(self, block)
            if owner is not None:
                if owner is not GONE:
                    other_pools.setdefault(owner, []).append(block)
                continue
            if block.is_null:  # never pooled; its ref_cnt is not maintained
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not caching:
                    to_ledger.append(block.block_id)
                else:
                    to_cache.append(block)
        if to_cache:
            if evict_first:
                self.free_block_queue.prepend_n(to_cache)
            else:
                self.free_block_queue.append_n(to_cache)  # LRU tail: evicted last
        if to_ledger:
            self._give_back(to_ledger)
        if to_cache and self._max_cached is not None:
            self._bound_cache()
        if self._shrinking:
            # vLLM is preempting for us: evict the cached pages that emptied and
            # recount at the next question, so preemption stops once the rest fit.
            self._next_return_scan = 0.0
            self._avail_until = 0.0
        forward = {"evict_first": True} if evict_first else {}  # vLLM < 0.34 pools do not take it
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks, **forward)

    def evict_blocks(self, block_ids: set) -> None:
        super().evict_blocks(block_ids)
        # An evictable block that lost its hash holds nothing worth keeping.
        q = self.free_block_queue
        freed = []
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_cnt == 0 and not b.is_null and b.block_hash is None and b.prev_free_block is not None:
                q.remove(b)
                freed.append(bid)
        if freed:
            self._give_back(freed)

    def reset_prefix_cache(self) -> bool:
        in_use = self.num_in_use_blocks()
        if in_use:
            logger.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet", in_use)
            return False
        cached = self.free_block_queue.get_all_free_blocks()
        # vLLM's own reset of hashes, reuse watchers, metrics and events.
        self._resetting = True
        try:
            if not super().reset_prefix_cache():
                return False
        finally:
            self._resetting = False
        self.free_block_queue = FreeKVCacheBlockQueue([])
        for b in cached:
            b.prev_free_block = b.next_free_block = None
        self._give_back([b.block_id for b in cached])
        return True

    # ------------------------------------------------------ memory return

    def _give_back(self, ids: List[int]) -> None:
        """Returns ledger ids to the manager (pages may empty), then lets the
        execution fence release what no running step can read. With offloading,
        blocks an offload copy still holds wait for it (``offload.py``)."""
        if not ids:
            return
        self._n_out -= len(ids)
        if self.transfers is not None:
            ids = self.transfers.defer(ids)
        self._to_ledger(ids)

    def release_held(self, ids: List[int]) -> None:
        """Blocks freed while an offload copy held them, whose last copy finished: to the ledger now."""
        self._to_ledger(ids)

    def _to_ledger(self, ids: List[int]) -> None:
        if not ids:
            return
        self.manager.free(ids)
        self._avail += len(ids)
        self.backend.after_free()

    def _bound_cache(self) -> None:
        cached = self.free_block_queue.num_free_blocks * self._block_tokens
        excess = cache_excess_tokens(cached, cached, self._max_cached)
        if excess:
            self.evict_cached(-(-excess // self._block_tokens), whole_pages_first=True)

    def _maybe_return_memory(self) -> None:
        over = self.backend.pages_over_limit()
        if over <= 0 or not self.free_block_queue.num_free_blocks:
            return
        now = time.monotonic()
        if now < self._next_return_scan:
            return
        self._next_return_scan = now + _RETURN_SCAN_INTERVAL_S
        per_page = self.manager.geometry.max_blocks_per_page
        self.evict_cached(over * per_page, whole_pages_first=True, only_whole_pages=True)

    def evict_cached(self, n: int, whole_pages_first: bool = False, only_whole_pages: bool = False) -> int:
        """Evicts up to ``n`` evictable cached blocks; returns how many.

        LRU order, except with ``whole_pages_first``: first the blocks of
        pages where every live block is evictable (so the page empties and its
        memory can go), oldest page first; ``only_whole_pages`` stops there.
        """
        q = self.free_block_queue
        if n <= 0 or q.num_free_blocks == 0:
            return 0
        if not whole_pages_first:
            victims = q.popleft_n(min(n, q.num_free_blocks))
            self._evict(victims, queued=False)
            return len(victims)
        lru = q.get_all_free_blocks()  # oldest first
        victims = []
        for blocks in self._whole_pages(lru, partial=n < q.num_free_blocks):
            if len(victims) >= n:
                break
            victims.extend(blocks)
        if len(victims) < n and not only_whole_pages:
            chosen = {b.block_id for b in victims}
            for b in lru:
                if len(victims) >= n:
                    break
                if b.block_id not in chosen:
                    victims.append(b)
        self._evict(victims)
        return len(victims)

    def _whole_pages(self, lru: List[KVCacheBlock], partial: bool, null_page: bool = False) -> List[List[KVCacheBlock]]:
        """The cached blocks of each page whose every live block is evictable (so the page
        empties), the page holding the oldest block first; with ``partial`` (part of the
        cache goes) and a host tier, the pages it already holds first. With ``null_page``
        (an idle give-back, which releases the null block's page once nothing else is left)
        page 0 counts too when its cached blocks are all it holds beside the null block; it
        comes last: its memory goes only with everything else's."""
        page_of = self.manager.geometry.page_of
        by_page: Dict[int, List[KVCacheBlock]] = {}
        for b in lru:
            by_page.setdefault(page_of(b.block_id), []).append(b)
        occupancy = self.manager.get_page_occupancy(list(by_page))
        null = 0 if null_page and self.manager.null_block and not config.keep_null_page() else -1
        whole = [pid for pid, blocks in by_page.items() if len(blocks) == occupancy[pid] - (pid == null)]
        if self.host_tier is not None and partial:
            whole = self.host_tier.order_pages({pid: by_page[pid] for pid in whole})
        if null in whole:
            whole.remove(null)
            whole.append(null)
        return [by_page[pid] for pid in whole]

    def _evict(self, victims: List[KVCacheBlock], queued: bool = True) -> None:
        """Drops ``victims`` (still on the evictable queue when ``queued``) from the prefix
        cache and returns them to the ledger: emptied pages go back."""
        if queued:
            q = self.free_block_queue
            for b in victims:
                q.remove(b)
            if self.host_tier is not None:  # before their hashes go: what the host tier keeps of them
                self.host_tier.note_dropped(victims)
        for b in victims:
            self._maybe_evict_cached_block(b)
        self._give_back([b.block_id for b in victims])

    def _give_cache_to_peers(self) -> None:
        """Evicts every cached whole page for peers that want memory, in chunks
        (``give_chunks``: the pages they lack first), each chunk unmapped and its budget
        released before the next is evicted. The same memory goes as in one pass."""
        pages = self._whole_pages(self.free_block_queue.get_all_free_blocks(), partial=True, null_page=True)
        done = 0
        for size in give_chunks(self.backend.pool.pages_wanted_by_peers(), GIVE_CHUNK_PAGES):
            if done >= len(pages):
                break
            t0 = trace.start()
            victims = [b for blocks in pages[done : done + size] for b in blocks]
            self._evict(victims)
            trace.end("evicted", t0, self.backend.name, blocks=len(victims))
            self.backend.instance.give_back()  # unmaps what emptied, releases its budget
            done += size

    def idle_return_memory(self, act: IdleAction) -> None:
        """On the EngineCore thread while the engine is idle: evicts cached
        whole pages over the limit, or all of them (and the mapped reserve)
        when peers sharing the device budget want memory."""
        t0, name = trace.start(), self.backend.name
        trace.event("give_back_start", name, act=act.value, cached=self.free_block_queue.num_free_blocks)
        before = self.backend.pool.mapped_pages()
        if act & IdleAction.SHRINK_TO_LIMIT:
            self._next_return_scan = 0.0
            self._maybe_return_memory()
        if act & IdleAction.GIVE_TO_PEERS:
            self._give_cache_to_peers()
        self.backend.instance.give_back()
        given = before - self.backend.pool.mapped_pages()
        trace.end("give_back_end", t0, name, pages=given)
        if given > 0:
            why = "wanted by a peer" if act & IdleAction.GIVE_TO_PEERS else "over its limit"
            logger.info("kvcached: idle %s gave back %d of %d mapped pages (%s)", self.backend.name, given, before, why)
            if self.host_tier is not None:
                logger.info("kvcached: %s: cached blocks evicted so far, by host tier state: %s",
                            self.backend.name, dict(self.host_tier.dropped))  # fmt: skip
        self._avail_until = 0.0

    def close(self) -> None:
        """Closes the kvcached side (record, connections); the engine is shutting down."""
        self.backend.close()


def patch_coordinator_module(module: Any) -> None:
    """``vllm.v1.core.kv_cache_coordinator.BlockPool`` -> ElasticBlockPool."""
    cur = module.BlockPool
    if cur is ElasticBlockPool:
        return
    if cur is not BlockPool:
        raise TypeError(
            f"vllm.v1.core.kv_cache_coordinator.BlockPool is {cur!r}, not vLLM's BlockPool: "
            "another plugin replaced it; kvcached cannot combine with it"
        )
    module.BlockPool = ElasticBlockPool


def use_weak_block_owners(module: Any) -> None:
    """vLLM 0.34: blocks name their pool by ``weakref.ref`` (``block_owner_weakref``)."""
    ElasticBlockPool.foreign_owner = staticmethod(owner_by_weakref)


def use_unowned_blocks(module: Any) -> None:
    """vLLM 0.26-0.29: blocks have no ``pool`` field (``block_owner_none_0_29``)."""
    ElasticBlockPool.foreign_owner = staticmethod(owner_none)


def use_no_reuse_watchers(module: Any) -> None:
    """vLLM 0.26-0.29: ``BlockPool`` has no ``_reuse_watchers`` (no ``unpin_blocks``, so
    nobody waits for a block's reuse): ``get_new_blocks`` reads an empty, read-only one."""
    ElasticBlockPool._reuse_watchers = MappingProxyType({})  # type: ignore[attr-defined]


def use_block_owners_by_reference(module: Any) -> None:
    """vLLM 0.30-0.33: blocks name their pool itself (``block_owner_by_reference``, the default)."""
    ElasticBlockPool.foreign_owner = staticmethod(owner_by_reference)
