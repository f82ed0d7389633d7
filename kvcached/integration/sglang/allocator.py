"""Elastic SGLang token-to-KV allocators over a KVCacheManager.

SGLang's allocators keep a tensor of free page ids; ours ask the pool's
``KVCacheManager`` instead, which hands out ids whose kvcached page is mapped
(placing one request's pages together) and unmaps a page when its last block is
freed (after the scheduler says no queued batch can read it).

Two counts, on purpose (SGLang 0.5.23):

* ``available_size()`` is the *logical* free count, exactly what SGLang's own
  allocator would report. The scheduler's strict idle leak check requires
  ``available + evictable + protected == max_total_num_tokens`` at every idle
  turn, whatever the memory limit is.
* ``physical_available_size()`` is what can be allocated right now: free slots
  on mapped pages plus pages that can still be mapped under the instance's
  limit (``kvctl limit``). A failed ``alloc`` crashes SGLang's scheduler
  (``RuntimeError("Out of memory")``), so the scheduler-facing capacity hooks
  (``create_prefill_budget``, ``check_decode_capacity``,
  ``evict_to_free_tokens``) answer with this count: admission waits, decode
  retracts and the prefix cache is evicted when a lowered limit is the
  constraint.

Release paths (0.5.23): ``free`` (page size 1, or any slots), ``free_segment(s)``
-> ``free_page_ids`` -> ``_release_page_ids`` (paged), free groups (deferred to
``free_group_end``), and ``clear`` (flush). All of them end in
``KVCacheManager.free``/``clear``. The classes dispatch on the pool: built over
a pool that is not elastic they construct SGLang's own allocator, so replacing
the class names in SGLang's modules changes nothing for other pools.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.allocator import paged as _paged
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.prefill_budget import PrefillBudget, SWAPrefillBudget
from sglang.srt.utils import get_num_new_pages, next_power_of_2

from kvcached.integration.sglang import conflicts
from kvcached.integration.sglang.pool import ElasticGroup, is_elastic_pool

_INT64 = torch.int64


def _kvcache_arg(args: tuple, kwargs: dict, index: int) -> Any:
    return kwargs["kvcache"] if "kvcache" in kwargs else (args[index] if len(args) > index else None)


def _evict_physical(allocator: Any, tree_cache: Any, num_tokens: int, available: Callable[[], int]) -> None:
    """Evicts unlocked prefix-cache entries until ``available() >= num_tokens`` or nothing is left.

    An evicted block frees a slot on a mapped page, so physical capacity grows
    with every eviction even when no page empties.
    """
    if tree_cache is None or not tree_cache.supports_prefix_sharing():
        return
    if available() >= num_tokens:
        return
    evictable = tree_cache.evictable_size()
    if evictable <= 0:
        return
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tree_cache.evict_for_alloc(
        EvictParams(num_tokens=evictable),
        allocation_reclaim_satisfied=lambda: available() >= num_tokens,
    )


class ElasticPrefillBudget(PrefillBudget):
    """PrefillBudget whose free space is what can be mapped now, not the logical count."""

    def _available_and_evictable(self) -> int:
        tc = self.tree_cache
        evictable = tc.full_evictable_size() if tc.supports_mamba() else tc.evictable_size()
        return self.allocator.physical_available_size() + evictable


class ElasticSWAPrefillBudget(SWAPrefillBudget):
    """SWAPrefillBudget over the physical capacity of both sub-pools."""

    def _available_and_evictable(self) -> int:
        a = self.allocator
        if self.all_swa:
            return a.swa_physical_available_size() + self.tree_cache.swa_evictable_size()
        return a.full_physical_available_size() + self.tree_cache.full_evictable_size()

    @property
    def remaining_swa(self) -> int:
        evictable = 0 if self.req_ring else self.tree_cache.swa_evictable_size()
        return self.allocator.swa_physical_available_size() + evictable - self.swa_offset


class _ElasticAllocatorMixin:
    """What the token and paged allocators share: the manager, counts, capacity hooks."""

    kvcached_group: ElasticGroup
    page_size: int
    device: Any

    def _kvcached_bind(self, kvcache: Any) -> None:
        grp = getattr(kvcache, "kvcached_group", None)
        if grp is None:
            # E.g. HybridLinearKVPool (Mamba/GDN hybrids): its full-attention
            # leaf is elastic, but the composite's state pools are not.
            raise conflicts.refuse(
                f"the {type(kvcache).__name__} KV pool (a hybrid other than sliding-window attention) is not "
                "supported by kvcached's SGLang integration",
                "use an MHA/GQA, MLA or sliding-window hybrid model",
            )
        self.kvcached_group = grp
        self._mgr = grp.manager
        self._holes = grp.holes

    # -- counts -------------------------------------------------------------
    def available_size(self) -> int:
        # Logical: blocks never handed out (holes included, so the idle
        # identity available + evictable + protected == size stays exact).
        return (self._mgr.logical_free_size() + self._holes) * self.page_size

    def physical_available_size(self) -> int:
        """Tokens allocatable right now (mapped free slots + mappable pages under the limit)."""
        return self._mgr.available_size() * self.page_size

    # -- scheduler-facing capacity hooks --------------------------------------
    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> PrefillBudget:
        return ElasticPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> Optional[bool]:
        _evict_physical(self, tree_cache, num_tokens, self.physical_available_size)
        return None

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests=None, spec_algorithm=None) -> bool:
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.physical_available_size() >= num_tokens

    # -- free-list helpers SGLang's base class would run on a tensor we do not keep
    def merge_and_sort_free(self) -> None:
        return None  # the manager keeps no staged list

    def get_all_free_pages(self) -> None:
        return None  # no free-page tensor (None: "no page free list", see the base class)

    def _ids_tensor(self, ids: List[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=_INT64, device=self.device)


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
        # scheduler releases them.
        self._mgr.clear()
        self._spare = self._spare[:0]
        self.free_group = None
        self.free_pages = None
        self.release_pages = None

    def drain_spare(self) -> int:
        """Hands every spare slot back to the manager; returns how many (syncs the device)."""
        n = self._spare.numel()
        if n:
            ids = self._spare.tolist()
            self._spare = self._spare[:0]
            self._mgr.free(ids)
        return n

    def available_size(self) -> int:
        return super().available_size() + self._spare.numel()

    def physical_available_size(self) -> int:
        return super().physical_available_size() + self._spare.numel()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size <= 0:
            return torch.empty((0,), dtype=_INT64, device=self.device)
        spare = self._spare
        k = spare.numel()
        if need_size <= k:
            self._spare = spare[need_size:]
            return spare[:need_size]
        ids = self._mgr.alloc(need_size - k)
        if ids is None:
            return None
        self._spare = spare[:0]
        fresh = self._ids_tensor(ids)
        return torch.cat((spare, fresh)) if k else fresh

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        spare = torch.cat((self._spare, free_index.to(_INT64)))
        over = spare.numel() - self._spare_cap
        if over > 0:
            # The oldest go back to the manager (their pages may empty).
            self._mgr.free(spare[:over].tolist())
            spare = spare[over:]
        self._spare = spare


class ElasticPagedTokenToKVPoolAllocator(_ElasticAllocatorMixin, PagedTokenToKVPoolAllocator):
    """PagedTokenToKVPoolAllocator over a KVCacheManager: one block per SGLang page.

    ``alloc_extend``/``alloc_decode`` take exactly the new pages the batch needs
    from the manager (the count is CPU arithmetic on the lens, as SGLang's own
    code does) and run SGLang's kernels (Triton, or the torch fallback) with
    them as the free list, so slot placement follows SGLang's rules exactly.
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

    def clear(self) -> None:
        self._mgr.clear()
        self.free_pages = None
        self.free_group = None
        self.free_page_ids_group = []
        self.staged_pages = []
        self.num_staged_pages = 0

    def _debug_check_no_duplicate_pages(self) -> None:
        return None  # the manager refuses a double free itself

    def _take_pages(self, n: int) -> Optional[torch.Tensor]:
        """``n`` new pages as a device tensor (a dummy page-0 row when n == 0)."""
        if n <= 0:
            return self._one_page
        ids = self._mgr.alloc(n)
        return None if ids is None else self._ids_tensor(ids)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        n = need_size // self.page_size
        if n <= 0:
            return torch.empty((0,), dtype=_INT64, device=self.device)
        pages = self._mgr.alloc(n)
        if pages is None:
            return None
        out = self._ids_tensor(pages)[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)
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
        if self.use_triton_kernels:
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
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        free_pages = self._take_pages(int(num_new_pages))
        if free_pages is None:
            return None
        bs = len(seq_lens)
        out = torch.empty((bs,), dtype=_INT64, device=self.device)
        if self.use_triton_kernels:
            _paged.alloc_decode_kernel[(bs,)](seq_lens, last_loc, free_pages, out, next_power_of_2(bs), self.page_size)
        else:
            _paged.alloc_decode_naive(seq_lens, last_loc, free_pages, out, self.page_size, int(num_new_pages))
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        self._release_page_ids(torch.unique(free_index // self.page_size))

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # Every paged release (free, free_segment(s), free_page_ids, the end of
        # a free group) lands here. No staging: PD disaggregation is refused.
        ids = page_ids[0] if len(page_ids) == 1 else torch.cat(page_ids)
        if ids.numel():
            self._mgr.free(ids.tolist())


class ElasticSWATokenToKVPoolAllocator(SWATokenToKVPoolAllocator):
    """SWATokenToKVPoolAllocator whose two sub-allocators are elastic.

    The sub-allocators come from the names ``TokenToKVPoolAllocator`` /
    ``PagedTokenToKVPoolAllocator`` of SGLang's ``swa`` module, which the
    ``swa-allocators`` patch points at the elastic classes. Here only capacity
    is changed: admission and the pre-checks of ``alloc*`` use what both
    sub-pools can map now, and a half-done ``alloc`` is rolled back.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        if not is_elastic_pool(_kvcache_arg(args, kwargs, 5)):
            return SWATokenToKVPoolAllocator(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for sub in (self.full_attn_allocator, self.swa_attn_allocator):
            if not isinstance(sub, _ElasticAllocatorMixin):
                raise conflicts.refuse(
                    f"the SWA allocator built a {type(sub).__name__} sub-allocator over an elastic pool",
                    "report this configuration (the swa-allocators patch did not take effect)",
                )

    def full_physical_available_size(self) -> int:
        return self.full_attn_allocator.physical_available_size()

    def swa_physical_available_size(self) -> int:
        if self._swa_req_ring:
            return self.swa_available_size()  # ring rows are preallocated per request slot
        return self.swa_attn_allocator.physical_available_size()

    def physical_available_size(self) -> int:
        if self._swa_req_ring:
            return self.full_physical_available_size()
        return min(self.full_physical_available_size(), self.swa_physical_available_size())

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> SWAPrefillBudget:
        return ElasticSWAPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        full_short = max(0, num_tokens - self.full_physical_available_size())
        swa_short = 0 if self._swa_req_ring else max(0, num_tokens - self.swa_physical_available_size())
        if full_short or swa_short:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=full_short, swa_num_tokens=swa_short))
        _evict_physical(self, tree_cache, num_tokens, self.physical_available_size)

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests=None, spec_algorithm=None) -> bool:
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.physical_available_size() >= num_tokens

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        ps = self.page_size
        if num_full_pages > self.full_physical_available_size() // ps:
            return False
        return self._swa_req_ring or num_swa_pages <= self.swa_physical_available_size() // ps

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        assert self.page_size == 1
        if need_size > self.physical_available_size():
            return None
        full = self.full_attn_allocator.alloc(need_size)
        if full is None:
            return None
        swa = self.swa_attn_allocator.alloc(need_size)
        if swa is None:
            self.full_attn_allocator.free(full)  # all or nothing
            return None
        self.set_full_to_swa_mapping(full, swa)
        return full

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor):
        n = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        # SGLang's composite has no pre-check here: one side could succeed and
        # leak its pages while the other fails.
        if not self.new_pages_available(n, n):
            return None
        return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
