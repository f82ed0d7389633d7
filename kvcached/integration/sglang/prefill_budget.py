"""Prefill budgets over physical capacity (SGLang 0.5.21+, where ``create_prefill_budget`` exists).

The elastic allocators' ``create_prefill_budget`` imports this module (SGLang's
``mem_cache/prefill_budget.py`` is new in 0.5.21; older releases are covered by
``admission.patch_prefill_adder``).
"""

from __future__ import annotations

from sglang.srt.mem_cache.prefill_budget import PrefillBudget, SWAPrefillBudget


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
