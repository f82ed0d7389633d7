"""The SWA composite allocator (hybrid sliding-window models) over two elastic pools.

Supported from SGLang 0.5.21 (``patches.SWA``): the composite's admission goes
through ``SWAPrefillBudget`` there; on older releases kvcached refuses hybrid
sliding-window models at start-up (``patches._check_built_allocator``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.utils import get_num_new_pages

from kvcached.integration.sglang import conflicts
from kvcached.integration.sglang.allocator import _ElasticAllocatorMixin, _kvcache_arg, evict_physical
from kvcached.integration.sglang.eviction import prefix_sharing
from kvcached.integration.sglang.pool import is_elastic_pool


class ElasticSWATokenToKVPoolAllocator(SWATokenToKVPoolAllocator):
    """SWATokenToKVPoolAllocator whose two sub-allocators are elastic.

    The sub-allocators come from the names ``TokenToKVPoolAllocator`` /
    ``PagedTokenToKVPoolAllocator`` of SGLang's ``swa`` module, which the
    ``sglang-swa-allocators`` patch points at the elastic classes. Here only
    capacity is changed: admission and the pre-checks of ``alloc*`` use what
    both sub-pools can map now, and a half-done ``alloc`` is rolled back.
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
                    "report this configuration (the sglang-swa-allocators patch did not take effect)",
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

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
        from kvcached.integration.sglang.prefill_budget import ElasticSWAPrefillBudget

        return ElasticSWAPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        if not prefix_sharing(tree_cache):
            return
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        full_short = max(0, num_tokens - self.full_physical_available_size())
        swa_short = 0 if self._swa_req_ring else max(0, num_tokens - self.swa_physical_available_size())
        if full_short or swa_short:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=full_short, swa_num_tokens=swa_short))
        evict_physical(self, tree_cache, num_tokens)

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests=None, spec_algorithm=None) -> bool:
        self.evict_to_free_tokens(tree_cache, num_tokens)
        # Both sides set aside (allocator.set_aside): one side's blocks left over go back at idle.
        if not self.full_attn_allocator.set_aside(num_tokens):
            return False
        return self._swa_req_ring or self.swa_attn_allocator.set_aside(num_tokens)

    def set_aside_admitted(self, num_tokens: int, *, swa_tokens: Optional[int] = None) -> bool:
        """Prefill admission: each side sets aside what it will allocate (``allocator.set_aside_admitted``)."""
        full = self.full_attn_allocator.set_aside_admitted(num_tokens)
        if self._swa_req_ring:
            return full
        swa = self.swa_attn_allocator.set_aside_admitted(num_tokens if swa_tokens is None else swa_tokens)
        return full and swa

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
