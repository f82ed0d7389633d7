"""Elastic SGLang token-to-KV allocators over a KVCacheManager (every SGLang 0.5.15-0.5.23).

SGLang's allocators keep a tensor of free page ids; ours ask the pool's
``KVCacheManager`` instead, which hands out ids whose kvcached page is mapped
(placing one request's pages together) and unmaps a page when its last block is
freed (after the scheduler says no queued batch can read it).

Two counts, on purpose:

* ``available_size()`` is the *logical* free count, exactly what SGLang's own
  allocator would report. The scheduler's strict idle leak check requires
  ``available + evictable + protected == max_total_num_tokens`` at every idle
  turn, whatever the memory limit is.
* ``physical_available_size()`` is what can be allocated right now: free slots
  on mapped pages plus pages that can still be mapped under the instance's
  limit (``kvctl limit``). A failed ``alloc`` crashes SGLang's scheduler
  (``RuntimeError("Out of memory")``), so admission uses this count: the
  allocator hooks below where SGLang calls them (``check_decode_capacity`` and
  ``evict_to_free_tokens`` from 0.5.19, ``create_prefill_budget`` from 0.5.21),
  the ``admission`` patches on older releases. Should an allocation still come
  up short (the device budget is shared), the allocator evicts unlocked prefix
  cache entries itself and tries once more before it reports ``None``.

The release API changed over 0.5.15-0.5.23 (``free`` only; then
``free_segment(s)``, ``_release_page_ids``, ``free_page_ids``; free groups as a
flag + list, then a list or None). These classes own every entry point and
their free groups, so SGLang's version only decides which of them it calls;
all of them end in ``KVCacheManager.free``/``clear``. The classes dispatch on
the pool: built over a pool that is not elastic they construct SGLang's own
allocator, so replacing the class names in SGLang's modules changes nothing for
other pools.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.allocator import paged as _paged
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.utils import get_num_new_pages, next_power_of_2

from kvcached.integration import families
from kvcached.integration.sglang import conflicts
from kvcached.integration.sglang.eviction import evict_until
from kvcached.integration.sglang.hicache import wait_transfers
from kvcached.integration.sglang.pool import ElasticGroup, group_of, is_elastic_pool
from kvcached.integration.sglang.step_timing import step_timer

_INT64 = torch.int64
logger = logging.getLogger("kvcached.integration.sglang")


def _kvcache_arg(args: tuple, kwargs: dict, index: int) -> Any:
    return kwargs["kvcache"] if "kvcache" in kwargs else (args[index] if len(args) > index else None)


def evict_physical(allocator: Any, tree_cache: Any, num_tokens: int) -> int:
    """Evicts unlocked prefix-cache entries until ``allocator.physical_available_size() >= num_tokens``
    or nothing is left; returns tokens evicted.

    An evicted block frees a slot on a mapped page, so physical capacity grows
    with every eviction even when no page empties.
    """
    available = allocator.physical_available_size
    return evict_until(tree_cache, lambda: available() >= num_tokens, lambda: num_tokens - available())


def decode_slots_naive(
    seq_lens: torch.Tensor, last_loc: torch.Tensor, pages: torch.Tensor, out: torch.Tensor, page_size: int
) -> None:
    """One decode slot per request without Triton: the next slot of its last page, or the
    first slot of the next new page when the new token starts a page (what SGLang's
    ``alloc_decode_kernel`` computes; 0.5.22+ ships the same as ``alloc_decode_naive``)."""
    need = ((seq_lens - 1) % page_size == 0).to(_INT64)
    if pages.numel() == 0:
        out.copy_(last_loc + 1)
        return
    rank = (torch.cumsum(need, 0) - need).clamp_(max=pages.numel() - 1)
    out.copy_(torch.where(need.bool(), pages[rank] * page_size, last_loc + 1))


class _ElasticAllocatorMixin:
    """What the token and paged allocators share: the manager, counts, capacity hooks, free groups."""

    kvcached_group: ElasticGroup
    page_size: int
    device: Any

    def _kvcached_bind(self, kvcache: Any) -> None:
        grp = group_of(kvcache)
        if grp is None:
            # __new__ builds SGLang's own allocator for a pool that is not elastic;
            # only a subclass or a direct call gets here.
            raise conflicts.refuse(
                f"SGLang's {type(kvcache).__name__} KV pool is not one kvcached makes elastic",
                f"use a model whose pool is one kvcached backs ({', '.join(families.sglang_pools())})",
            )
        self.kvcached_group = grp
        self._mgr = grp.manager
        self._holes = grp.holes
        grp.drains.append(self.drop_set_aside)
        # Frees held until free_group_end (None: not in a group).
        self._kv_pending: Optional[List[torch.Tensor]] = None
        # The scheduler's prefix cache (scheduler_hooks.after_init): evicted from when an
        # allocation comes up short.
        self.kvcached_tree_cache: Any = None
        self._kvcached_shrinking = False  # over a lowered limit (see shrinking), for one log line per episode
        # The hierarchical cache's copies in flight (hicache.HiCacheFence), once its controller is built.
        self.kvcached_transfers: Any = None

    # -- counts -------------------------------------------------------------
    def available_size(self) -> int:
        # Logical: blocks never handed out (holes, and blocks a host copy holds after SGLang
        # freed them, included: the idle identity available + evictable + protected == size).
        held = self.kvcached_transfers.deferred() if self.kvcached_transfers is not None else 0
        return (self._mgr.logical_free_size() + self._holes + held) * self.page_size

    def physical_available_size(self) -> int:
        """Tokens allocatable right now (mapped free slots + mappable pages under the limit);
        0 while ``shrinking()``: nothing is admitted while the pool must give pages back."""
        if self.shrinking():
            return 0
        return self._mgr.available_size() * self.page_size + self._local_slots()

    def _local_slots(self) -> int:
        """Slots this allocator keeps itself (the token allocator's spare list)."""
        return 0

    def _drain_local(self) -> int:
        """Hands the slots this allocator keeps back to the manager; returns how many."""
        return 0

    # -- a lowered limit ------------------------------------------------------
    def shrinking(self) -> bool:
        """Pages holding live blocks exceed a lowered limit (``kvctl limit``) although the
        scheduler hooks evicted what the prefix cache could give: running requests hold
        them. Until they fit nothing is handed out to new work and decode retracts requests
        (``admission.patch_retract_to_limit``), as vLLM preempts under kvcached; waiting for
        the requests to finish would keep the pages for their whole length (seconds).
        Spare slots go back to the manager first: they may be all that keeps a page live.
        A limit under one page counts as one: the padding slot's page stays mapped."""
        g = self.kvcached_group
        if g.pages_over_limit() <= 0:
            self._kvcached_shrinking = False
            return False
        self._drain_local()
        # The page of block 0 (SGLang's padding slot) never empties: a limit under one page
        # cannot be met by retracting, and must not stop admission for good.
        over = g.live_pages() - max(1, g.limit_bytes() // g.bytes_per_page)
        if over > 0 and not self._kvcached_shrinking:
            logger.info(
                "kvcached: %s holds %d live pages over its limit: no admission, requests retracted until they fit",
                g.name,
                over,
            )
        self._kvcached_shrinking = over > 0
        return over > 0

    def withheld_tokens(self) -> int:
        """Free in SGLang's logical count but not allocatable now (the limit or the device budget)."""
        return max(0, self.available_size() - self.physical_available_size())

    # -- capacity hooks SGLang calls: check_decode_capacity and evict_to_free_tokens
    # from 0.5.19, create_prefill_budget from 0.5.21 (earlier: the admission patches).
    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
        from kvcached.integration.sglang.prefill_budget import ElasticPrefillBudget

        return ElasticPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> Optional[bool]:
        evict_physical(self, tree_cache, num_tokens)
        return None

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests=None, spec_algorithm=None) -> bool:
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.set_aside(num_tokens)

    def set_aside(self, num_tokens: int) -> bool:
        """Maps and sets aside (``KVCacheManager.try_to_reserve``) what an allocation of
        ``num_tokens`` will take, or answers False with nothing changed. A count read here
        and acted on later would race a limit lowered meanwhile (``kvctl limit``, a peer's
        want): the decode step's ``alloc`` would come up short and crash SGLang's scheduler.
        The next allocations take set-aside blocks first; what is left over goes back at
        idle (``drop_set_aside``)."""
        blocks = -(-self._tokens_beyond_local(num_tokens) // self.page_size)
        return blocks <= 0 or self._mgr.try_to_reserve(blocks)

    def set_aside_admitted(self, num_tokens: int) -> bool:
        """Prefill admission (``prefill_budget``, ``admission.patch_prefill_adder``): sets
        aside what the prefills admitted so far this turn will allocate, as far as it is
        free now; the rest comes from prefix-cache entries evicted at the alloc, blocks on
        pages already mapped, which no limit takes away. Admission counts physical capacity,
        and a limit lowered between that count and ``alloc_extend`` would otherwise fail the
        alloc. False (nothing changed) when the limit fell before this call."""
        return self.set_aside(min(num_tokens, self.physical_available_size()))

    def _tokens_beyond_local(self, num_tokens: int) -> int:
        """Tokens an allocation must take from the manager (the token allocator keeps spare slots)."""
        return num_tokens

    def drop_set_aside(self) -> int:
        """Idle: blocks set aside and not taken go back to the manager; returns 0 (no slots drained)."""
        self._mgr.free_reserved()
        return 0

    # -- free groups (process_batch_result frees a batch's requests inside one) ------
    def free_group_begin(self) -> None:
        self._kv_pending = []

    def free_group_end(self) -> None:
        pending, self._kv_pending = self._kv_pending, None
        if pending:
            self._kv_release_pending(torch.cat(pending))

    def _deferred_or_empty(self, ids: torch.Tensor, copy: bool = True) -> bool:
        """Whether a free of ``ids`` is done now: nothing to free, or inside a free group,
        which keeps them (int64; a copy unless ``copy`` is off: the caller may reuse its
        tensor before the group ends) and frees them at its end."""
        if ids.numel() == 0:
            return True
        if self._kv_pending is None:
            return False
        self._kv_pending.append(ids.to(_INT64, copy=copy))
        return True

    def _kv_release_pending(self, pending: torch.Tensor) -> None:
        raise NotImplementedError

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int = 0) -> None:
        # Every page a segment touches is freed (SGLang's contract); free() computes exactly that.
        self.free(free_index)

    # -- free-list helpers SGLang's base class would run on a tensor we do not keep
    def merge_and_sort_free(self) -> None:
        return None  # the manager keeps no staged list

    def get_all_free_pages(self) -> None:
        return None  # no free-page tensor (None: "no page free list", see the base class)

    def _debug_check_no_duplicate_pages(self) -> None:
        return None  # the manager refuses a double free itself

    def _timed_alloc(self, n: int) -> Optional[List[int]]:
        """``KVCacheManager.alloc`` (which maps pages when it must), timed for ``step_timing``."""
        with step_timer().part("alloc"):
            return self._mgr.alloc(n)

    # -- the manager's free, through the hierarchical cache's holds (hicache.py) -----
    def _to_manager(self, ids: List[int]) -> None:
        """Blocks back to the manager (pages may empty); those a host copy in flight holds wait for it."""
        if self.kvcached_transfers is not None:
            ids = self.kvcached_transfers.defer(ids)
        if ids:
            self._mgr.free(ids)

    def kvcached_release_held(self, ids: List[int]) -> None:
        """Blocks freed while a copy held them, whose last copy finished: to the manager now."""
        if ids:
            self._mgr.free(ids)

    def _ids_tensor(self, ids: List[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=_INT64, device=self.device)

    def _evict_for(self, num_tokens: int) -> bool:
        """An allocation came up short: evicts unlocked prefix-cache entries for it; True if any went."""
        return evict_physical(self, self.kvcached_tree_cache, num_tokens) > 0


class ElasticTokenToKVPoolAllocator(_ElasticAllocatorMixin, TokenToKVPoolAllocator):
    """TokenToKVPoolAllocator (page size 1) over a KVCacheManager: one block per token.

    At page size 1 every token is a manager block, and the manager's ledger
    work per block (a few microseconds of Python) would add up at every decode
    step. So, like SGLang's own allocator, freed slots first go to a local
    device tensor (the *spare* list) that later allocations take from with a
    tensor slice and no host sync. The manager still owns those slots (their
    pages stay mapped); the spare list is bounded (the tokens of the mapped
    reserve, at least 4 kvcached pages) and handed back to the manager, so
    that emptied pages can be unmapped, when it overflows, when the scheduler
    is idle, when a pool maps more than its limit, and on flush.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        if not is_elastic_pool(_kvcache_arg(args, kwargs, 3)):
            return TokenToKVPoolAllocator(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool) -> None:
        self._kvcached_bind(kvcache)
        self._spare = torch.empty((0,), dtype=_INT64, device=device)
        mgr = self._mgr
        from kvcached import config as _config

        tokens_per_page = max(1, mgr.page_size // mgr.block_mem_size)
        self._spare_cap = tokens_per_page * max(4, _config.max_reserved_pages())
        super().__init__(size, dtype, device, kvcache, need_sort)  # calls clear()
        self.kvcached_group.drains.append(self.drain_spare)

    def clear(self) -> None:
        # Flush (and construction): every slot back (the spare ones too: the
        # manager still counts them as handed out), pages retired until the
        # scheduler releases them. Copies in flight finish first.
        wait_transfers(self)
        self._mgr.clear()
        self._spare = self._spare[:0]
        self._kv_pending = None
        self.free_pages = None
        self.release_pages = None

    def drain_spare(self) -> int:
        """Hands every spare slot back to the manager; returns how many (syncs the device)."""
        n = self._spare.numel()
        if n:
            ids = self._spare.tolist()
            self._spare = self._spare[:0]
            self._to_manager(ids)
        return n

    def available_size(self) -> int:
        return super().available_size() + self._spare.numel()

    def _tokens_beyond_local(self, num_tokens: int) -> int:
        # Spare slots go first (alloc); nothing drains them between a check and its alloc.
        return num_tokens - self._spare.numel()

    def _local_slots(self) -> int:
        return self._spare.numel()

    def _drain_local(self) -> int:
        return self.drain_spare()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size <= 0:
            return torch.empty((0,), dtype=_INT64, device=self.device)
        out = self._alloc_now(need_size)
        if out is None and self._evict_for(need_size):
            out = self._alloc_now(need_size)
        return out

    def _alloc_now(self, need_size: int) -> Optional[torch.Tensor]:
        spare = self._spare
        k = spare.numel()
        if need_size <= k:
            self._spare = spare[need_size:]
            return spare[:need_size]
        ids = self._timed_alloc(need_size - k)
        if ids is None:
            return None
        self._spare = spare[:0]
        fresh = self._ids_tensor(ids)
        return torch.cat((spare, fresh)) if k else fresh

    def free(self, free_index: torch.Tensor) -> None:
        if self._deferred_or_empty(free_index):
            return
        spare = torch.cat((self._spare, free_index.to(_INT64)))
        over = spare.numel() - self._spare_cap
        if over > 0:
            # The oldest go back to the manager (their pages may empty).
            self._to_manager(spare[:over].tolist())
            spare = spare[over:]
        self._spare = spare

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        self.free(page_ids)  # page size 1: a page is a slot

    def _kv_release_pending(self, pending: torch.Tensor) -> None:
        self.free(pending)


class ElasticPagedTokenToKVPoolAllocator(_ElasticAllocatorMixin, PagedTokenToKVPoolAllocator):
    """PagedTokenToKVPoolAllocator over a KVCacheManager: one block per SGLang page.

    ``alloc_extend``/``alloc_decode`` take exactly the new pages the batch needs
    from the manager (the count is CPU arithmetic on the lens, as SGLang's own
    code does) and place the slots with SGLang's Triton kernels on a GPU, or
    without Triton on the CPU (SGLang before 0.5.22 has no CPU path here), so
    slot placement follows SGLang's rules exactly.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        if not is_elastic_pool(_kvcache_arg(args, kwargs, 4)):
            return PagedTokenToKVPoolAllocator(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool
    ) -> None:
        self._kvcached_bind(kvcache)
        if page_size != self.kvcached_group.page_tokens:
            raise conflicts.refuse(
                f"allocator page size {page_size} differs from its pool's {self.kvcached_group.page_tokens}",
                "report this configuration (decode context parallelism widens pages)",
            )
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)  # calls clear()
        self._one_page = torch.zeros((1,), dtype=_INT64, device=device)
        # SGLang 0.5.22+ decides (platform capabilities); before, it always used Triton.
        self._kv_triton = getattr(self, "use_triton_kernels", None)
        if self._kv_triton is None:
            self._kv_triton = torch.device(device).type == "cuda"

    def clear(self) -> None:
        wait_transfers(self)
        self._mgr.clear()
        self._kv_pending = None
        self.free_pages = None
        self.release_pages = None
        self.free_page_ids_group = []
        self.staged_pages = []
        self.num_staged_pages = 0

    def _take_pages(self, n: int) -> Optional[torch.Tensor]:
        """``n`` new pages as a device tensor (a dummy page-0 row when n == 0)."""
        if n <= 0:
            return self._one_page
        ids = self._timed_alloc(n)
        if ids is None and self._evict_for(n * self.page_size):
            ids = self._timed_alloc(n)
        return None if ids is None else self._ids_tensor(ids)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        n = need_size // self.page_size
        if n <= 0:
            return torch.empty((0,), dtype=_INT64, device=self.device)
        pages = self._take_pages(n)
        if pages is None:
            return None
        out = pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)
        return out.reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
            )
        free_pages = self._take_pages(int(num_new_pages))
        if free_pages is None:
            return None
        out = torch.empty((extend_num_tokens,), dtype=_INT64, device=self.device)
        if self._kv_triton:
            bs = len(prefix_lens)
            _paged.alloc_extend_kernel[(bs,)](
                prefix_lens, seq_lens, last_loc, free_pages, out, next_power_of_2(bs), self.page_size
            )
        else:
            pages = free_pages if num_new_pages > 0 else free_pages[:0]
            _paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, pages, out, self.page_size, self.device)
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> Optional[torch.Tensor]:
        num_new_pages = int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))
        free_pages = self._take_pages(num_new_pages)
        if free_pages is None:
            return None
        bs = len(seq_lens)
        out = torch.empty((bs,), dtype=_INT64, device=self.device)
        if self._kv_triton:
            _paged.alloc_decode_kernel[(bs,)](seq_lens, last_loc, free_pages, out, next_power_of_2(bs), self.page_size)
        else:
            decode_slots_naive(seq_lens, last_loc, free_pages[:num_new_pages], out, self.page_size)
        return out

    def free(self, free_index: torch.Tensor) -> None:
        pages = free_index // self.page_size
        if self._deferred_or_empty(pages, copy=False):  # a new tensor: safe to keep
            return
        self._release(torch.unique(pages))

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Exactly these pages (SGLang 0.5.20+)."""
        if not self._deferred_or_empty(page_ids):
            self._release(page_ids)

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # SGLang's own sink (0.5.18+): reached only from base-class code this
        # class does not override. No staging: PD disaggregation is refused.
        self._release(page_ids[0] if len(page_ids) == 1 else torch.cat(page_ids))

    def _kv_release_pending(self, pending: torch.Tensor) -> None:
        # One page may be named by several frees of a group (a request's tail
        # and its segments): once is enough.
        self._release(torch.unique(pending))

    def _release(self, page_ids: torch.Tensor) -> None:
        if page_ids.numel():
            self._to_manager(page_ids.tolist())
